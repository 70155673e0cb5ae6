// What the job table shows an operator (admin.hpp's DaemonView): a copy of
// its state, taken on the loop thread.
#include <algorithm>

#include "dbuf/plan_io/report.hpp"
#include "jobs.hpp"

namespace dbuf::daemon {
namespace {

std::string_view placementName(Placement placement) {
  switch (placement) {
    case Placement::kHost:
      return "host";
    case Placement::kSharedGpu:
      return "shared gpu";
    case Placement::kGpuPerRank:
      return "gpu per rank";
  }
  return "unknown";
}

double secondsSince(SteadyClock::time_point then, SteadyClock::time_point now) {
  return std::chrono::duration<double>(now - then).count();
}

/// The job's next collective, as far as some rank of this node submitted it.
std::optional<admin::OpView> currentOp(const JobSchedule& job, SteadyClock::time_point now) {
  const ipc::Submission* front = nullptr;
  SteadyClock::time_point first = SteadyClock::time_point::max();
  admin::OpView op;
  for (std::uint32_t local = 0; local < job.localCount(); ++local) {
    const OpQueue& queue = job.ranks[local].ops;
    if (queue.empty()) {
      op.waiting_for.push_back(job.globalRank(local));
      continue;
    }
    op.submitted.push_back(job.globalRank(local));
    if (front == nullptr) front = &queue.front().submission;
    first = std::min(first, queue.front().submitted);
  }
  if (front == nullptr) return std::nullopt;
  const JobCollectives& collectives = job.collectives;
  op.sequence = collectives.next_sequence;
  ipc::OpCode code{};
  op.op = ipc::opCodeFrom(front->op, code) ? std::string(ipc::toString(code)) : "unknown";
  if (const std::string* group = job.groupName(front->group_id); group != nullptr && code != ipc::OpCode::kBarrier) {
    op.group = *group;
  }
  op.state = collectives.running || collectives.draining ? "running"
             : collectives.validated                     ? "waiting for streams"
                                                         : "waiting for ranks";
  op.waiting_s = secondsSince(first, now);
  return op;
}

admin::GroupView groupView(const GroupState& group) {
  admin::GroupView view;
  view.name = group.spec.name;
  view.id = group.id;
  view.devices = group.reply.devices;
  view.tensors = group.reply.tensors.size();
  for (const ipc::PlacedTensorWire& tensor : group.reply.tensors) view.numel += tensor.numel;
  view.shard_elems = group.reply.shard_elems;
  view.sharded_dtype = group.reply.sharded_dtype;
  view.unsharded_dtype = group.reply.unsharded_dtype;
  view.shard_bytes = group.reply.sharded.bytes + group.reply.sharded_grad.bytes;
  view.slot_bytes = group.reply.slot_bytes;
  return view;
}

}  // namespace

void JobTable::describe(admin::DaemonView& view, SteadyClock::time_point now) const {
  view.memory_used_bytes = budget_.total();
  for (std::size_t t = 0; t < config_.tenants.size(); ++t) {
    const Tenant& tenant = config_.tenants[t];
    view.tenants.push_back({tenant.name, tenant.memory_quota_bytes, budget_.used(t), tenant.max_jobs});
  }
  for (const auto& [id, job] : jobs_) view.jobs.push_back(describe(job, now));
}

admin::JobView JobTable::describe(const Job& job, SteadyClock::time_point now) const {
  admin::JobView view;
  view.id = job.id;
  view.tenant = job.tenant;
  view.world_size = job.world_size;
  view.first_rank = job.first_rank;
  view.placement = placementName(job.placement);
  view.persistent = job.persistent;
  view.memory_bytes = job.charged;
  view.collectives_completed = job.collectives.next_sequence;
  for (std::uint32_t local = 0; local < job.localCount(); ++local) {
    const RankMembership& member = job.members[local];
    admin::RankView rank;
    rank.rank = job.globalRank(local);
    rank.attached = member.session != nullptr;
    rank.gone = job.gone.contains(rank.rank);
    if (member.session) {
      rank.session = member.session->id();
      rank.pid = member.session->peer().pid;
      rank.uid = member.session->peer().uid;
    }
    rank.device = member.device;
    rank.queued_ops = job.ranks[local].ops.size();
    rank.owed_errors = job.ranks[local].owed.size();
    for (const Slot& slot : member.slots) rank.slot_bytes += slot.bytes();
    view.ranks.push_back(rank);
  }
  for (const auto& [name, group] : job.groups) view.groups.push_back(groupView(group));
  for (const auto& [name, pending] : job.pending) {
    admin::RegistrationView registration;
    registration.group = name;
    for (std::uint32_t local = 0; local < job.localCount(); ++local) {
      auto& list = pending.waiters.contains(local) ? registration.registered : registration.waiting_for;
      list.push_back(job.globalRank(local));
    }
    view.registrations.push_back(std::move(registration));
  }
  view.current = currentOp(job, now);
  view.op_stats = job.stats;
  return view;
}

void JobTable::describe(const Session& session, admin::SessionView& view) const {
  const auto found = attachments_.find(session.id());
  if (found == attachments_.end()) return;
  const auto job_found = jobs_.find(found->second.job);
  if (job_found == jobs_.end()) return;  // (an attachment outlives no job)
  const Job& job = job_found->second;
  view.kind = "rank";
  view.job = job.id;
  view.rank = job.globalRank(found->second.local);
  view.tenant = job.tenant;
}

std::optional<std::string> JobTable::planReport(const std::string& job, const std::string& group) const {
  const auto found = jobs_.find(job);
  if (found == jobs_.end()) return std::nullopt;
  const auto state = found->second.groups.find(group);
  if (state == found->second.groups.end()) return std::nullopt;
  plan_io::ReportOptions options;
  options.model = job;
  options.granularity = state->second.spec.granularity;
  options.align_bytes = state->second.spec.align_bytes;
  auto report = plan_io::makeReport(planner::ModelPlan{{state->second.plan}, state->second.plan.plan_us / 1000}, options);
  if (!report) return std::nullopt;  // only an `only_unit` naming no unit fails
  return plan_io::writePlanJson(*report);
}

std::vector<admin::TraceEntry> JobTable::trace(const std::string& job, SteadyClock::time_point epoch) const {
  std::vector<admin::TraceEntry> out;
  const auto found = jobs_.find(job);
  if (found == jobs_.end()) return out;
  const auto since = [&](SteadyClock::time_point t) { return std::chrono::duration<double>(t - epoch).count(); };
  for (const OpRecord* record : found->second.recorder.records()) {
    admin::TraceEntry entry;
    entry.sequence = record->sequence;
    entry.op = std::string(ipc::toString(record->op));
    if (const std::string* group = found->second.groupName(record->group_id);
        group != nullptr && record->op != ipc::OpCode::kBarrier) {
      entry.group = *group;
    }
    entry.unsharded_bytes = record->unsharded_bytes;
    for (const SteadyClock::time_point submitted : record->submitted) {
      entry.submitted_s.push_back(submitted == SteadyClock::time_point{} ? std::nullopt
                                                                         : std::optional<double>(since(submitted)));
    }
    entry.start_s = since(record->started);
    entry.end_s = since(record->ended);
    entry.result = record->ok ? "ok" : std::string(toString(record->code));
    entry.error = record->error;
    out.push_back(std::move(entry));
  }
  return out;
}

std::size_t JobTable::jobsWithRanks() const {
  return static_cast<std::size_t>(std::count_if(jobs_.begin(), jobs_.end(), [](const auto& entry) {
    const auto& members = entry.second.members;
    return std::any_of(members.begin(), members.end(), [](const RankMembership& m) { return m.session != nullptr; });
  }));
}

}  // namespace dbuf::daemon
