#include "admin.hpp"

#include <algorithm>
#include <array>
#include <nlohmann/json.hpp>

namespace dbuf::daemon::admin {
namespace {

using nlohmann::json;

Error invalid(std::string message) {
  return makeError(ErrorCode::kInvalidArgument, std::move(message));
}

bool contains(std::span<const std::uint32_t> ids, std::uint32_t id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

/// Tenant `index`'s name; "?" for an index the view does not hold (a daemon
/// bug, which must not end the daemon).
std::string tenantName(const DaemonView& view, std::optional<std::size_t> index) {
  return index && *index < view.tenants.size() ? view.tenants[*index].name : std::string("?");
}

/// "everything", or "tenant NAME" (what the peer sees, named in every answer).
std::string scopeOf(const Access& access, const DaemonView& view) {
  if (access.everything) return "everything";
  return "tenant " + tenantName(view, access.tenant);
}

bool visible(const Access& access, const JobView& job) {
  return access.everything || access.tenant == job.tenant;
}

const JobView* findVisibleJob(const Access& access, const DaemonView& view, const std::string& id) {
  const auto found = std::find_if(view.jobs.begin(), view.jobs.end(), [&](const JobView& j) { return j.id == id; });
  return found != view.jobs.end() && visible(access, *found) ? &*found : nullptr;
}

json opJson(const OpView& op) {
  return {{"sequence", op.sequence},       {"op", op.op},
          {"group", op.group},             {"state", op.state},
          {"waiting_seconds", op.waiting_s}, {"submitted", op.submitted},
          {"waiting_for", op.waiting_for}};
}

json traceJson(const TraceEntry& entry, std::uint32_t first_rank) {
  json ranks = json::array();
  for (std::size_t i = 0; i < entry.submitted_s.size(); ++i) {
    const auto& submitted = entry.submitted_s[i];
    ranks.push_back({{"rank", first_rank + i}, {"submitted_seconds", submitted ? json(*submitted) : json(nullptr)}});
  }
  return {{"sequence", entry.sequence},   {"op", entry.op},
          {"group", entry.group},         {"unsharded_bytes", entry.unsharded_bytes},
          {"ranks", std::move(ranks)},    {"start_seconds", entry.start_s},
          {"end_seconds", entry.end_s},   {"result", entry.result},
          {"error", entry.error}};
}

json jobSummaryJson(const JobView& job, const DaemonView& view) {
  return {{"id", job.id},
          {"tenant", tenantName(view, job.tenant)},
          {"state", job.state()},
          {"world_size", job.world_size},
          {"local_ranks", job.ranks.size()},
          {"attached_ranks", job.attachedRanks()},
          {"groups", job.groups.size()},
          {"memory_bytes", job.memory_bytes},
          {"collectives_completed", job.collectives_completed},
          {"current_op", job.current ? opJson(*job.current) : json(nullptr)}};
}

json rankJson(const RankView& rank) {
  return {{"rank", rank.rank},
          {"attached", rank.attached},
          {"gone", rank.gone},
          {"session", rank.session},
          {"pid", rank.pid},
          {"uid", rank.uid},
          {"device", rank.device},
          {"queued_ops", rank.queued_ops},
          {"owed_errors", rank.owed_errors},
          {"slot_bytes", rank.slot_bytes}};
}

json groupJson(const GroupView& group) {
  return {{"name", group.name},
          {"id", group.id},
          {"devices", group.devices},
          {"tensors", group.tensors},
          {"numel", group.numel},
          {"shard_elems", group.shard_elems},
          {"padding_elems", std::int64_t{group.devices} * group.shard_elems - group.numel},
          {"sharded_dtype", group.sharded_dtype},
          {"unsharded_dtype", group.unsharded_dtype},
          {"shard_bytes", group.shard_bytes},
          {"slot_bytes", group.slot_bytes}};
}

json jobJson(const JobView& job, const DaemonView& view) {
  json out = jobSummaryJson(job, view);
  out["first_rank"] = job.first_rank;
  out["placement"] = job.placement;
  out["persistent"] = job.persistent;
  out["ranks"] = json::array();
  for (const RankView& rank : job.ranks) out["ranks"].push_back(rankJson(rank));
  out["groups"] = json::array();
  for (const GroupView& group : job.groups) out["groups"].push_back(groupJson(group));
  out["registrations"] = json::array();
  for (const RegistrationView& r : job.registrations) {
    out["registrations"].push_back({{"group", r.group}, {"registered", r.registered}, {"waiting_for", r.waiting_for}});
  }
  return out;
}

json daemonJson(const DaemonView& view) {
  return {{"instance_id", view.instance_id},
          {"pid", view.pid},
          {"uid", view.uid},
          {"socket", view.socket},
          {"backend", view.backend},
          {"version", view.version},
          {"commit", view.commit},
          {"protocol_version", ipc::kProtocolVersion},
          {"uptime_seconds", view.uptime_s},
          {"memory_limit_bytes", view.memory_limit_bytes},
          {"memory_used_bytes", view.memory_used_bytes},
          {"metrics_url", view.metrics_url},
          {"metrics_error", view.metrics_error},
          {"draining", view.draining}};
}

/// A tenant's user sees the connections of its tenant's users: its ranks,
/// and its operators' (a rank's tenant is its job's).
bool sessionVisible(const Access& access, const SessionView& session) {
  return access.everything || (session.tenant && session.tenant == access.tenant);
}

json sessionJson(const SessionView& session) {
  json out = {{"id", session.id},     {"pid", session.peer.pid}, {"uid", session.peer.uid},
              {"gid", session.peer.gid}, {"kind", session.kind},  {"age_seconds", session.age_s}};
  if (session.kind == "rank") {
    out["job"] = session.job;
    out["rank"] = session.rank;
  }
  return out;
}

json statusJson(const Access& access, const DaemonView& view) {
  json tenants = json::array();
  for (std::size_t t = 0; t < view.tenants.size(); ++t) {
    if (!access.everything && access.tenant != t) continue;
    const TenantView& tenant = view.tenants[t];
    const auto jobs = std::count_if(view.jobs.begin(), view.jobs.end(), [&](const JobView& j) { return j.tenant == t; });
    tenants.push_back({{"name", tenant.name},
                       {"memory_quota_bytes", tenant.memory_quota_bytes},
                       {"memory_used_bytes", tenant.memory_used_bytes},
                       {"jobs", jobs},
                       {"max_jobs", tenant.max_jobs}});
  }
  json states = json::object();
  std::size_t jobs = 0;
  for (const JobView& job : view.jobs) {
    if (!visible(access, job)) continue;
    ++jobs;
    const std::string state = job.state();
    states[state] = states.value(state, 0) + 1;
  }
  const auto sessions = std::count_if(view.sessions.begin(), view.sessions.end(),
                                      [&](const SessionView& session) { return sessionVisible(access, session); });
  json daemon = daemonJson(view);
  if (!access.everything) daemon.erase("memory_used_bytes");  // other tenants' use, together
  return {{"scope", scopeOf(access, view)},
          {"daemon", std::move(daemon)},
          {"tenants", std::move(tenants)},
          {"jobs", {{"count", jobs}, {"by_state", std::move(states)}}},
          {"sessions", sessions}};
}

Result<json> answerJson(const Query& query, const Access& access, const DaemonView& view) {
  switch (query.verb) {
    case Verb::kStatus:
      return statusJson(access, view);
    case Verb::kJobs: {
      json jobs = json::array();
      for (const JobView& job : view.jobs) {
        if (visible(access, job)) jobs.push_back(jobSummaryJson(job, view));
      }
      return json{{"scope", scopeOf(access, view)}, {"jobs", std::move(jobs)}};
    }
    case Verb::kJob: {
      const JobView* job = findVisibleJob(access, view, query.job);
      // Another tenant's job is not found either: say nothing of it.
      if (job == nullptr) return makeError(ErrorCode::kNotFound, "no job '" + query.job + "' on this daemon");
      return json{{"scope", scopeOf(access, view)}, {"job", jobJson(*job, view)}};
    }
    case Verb::kSessions: {
      json sessions = json::array();
      for (const SessionView& session : view.sessions) {
        if (sessionVisible(access, session)) sessions.push_back(sessionJson(session));
      }
      return json{{"scope", scopeOf(access, view)}, {"sessions", std::move(sessions)}};
    }
    case Verb::kPlan: {
      if (findVisibleJob(access, view, query.job) == nullptr) {
        return makeError(ErrorCode::kNotFound, "no job '" + query.job + "' on this daemon");
      }
      if (!view.plan_report) {
        return makeError(ErrorCode::kNotFound, "job '" + query.job + "' has no group '" + query.group + "'");
      }
      json plan = json::parse(*view.plan_report, nullptr, /*allow_exceptions=*/false);
      if (plan.is_discarded()) return makeError(ErrorCode::kInternal, "the plan report is not JSON");
      return json{{"scope", scopeOf(access, view)}, {"job", query.job}, {"group", query.group}, {"plan", plan}};
    }
    case Verb::kTrace: {
      const JobView* job = findVisibleJob(access, view, query.job);
      if (job == nullptr) return makeError(ErrorCode::kNotFound, "no job '" + query.job + "' on this daemon");
      json ops = json::array();
      for (const TraceEntry& entry : view.trace) ops.push_back(traceJson(entry, job->first_rank));
      return json{{"scope", scopeOf(access, view)}, {"job", query.job}, {"ops", std::move(ops)}};
    }
    case Verb::kDrain: {
      if (!access.everything) {
        return makeError(ErrorCode::kPermissionDenied, "only an administrator of dbufd may drain it");
      }
      json waiting = json::array();
      for (const JobView& job : view.jobs) {
        if (job.attachedRanks() > 0) waiting.push_back(job.id);
      }
      return json{{"scope", scopeOf(access, view)}, {"draining", view.draining}, {"waiting_for_jobs", waiting}};
    }
  }
  return makeError(ErrorCode::kInternal, "unknown admin verb");
}

}  // namespace

std::size_t JobView::attachedRanks() const {
  return static_cast<std::size_t>(std::count_if(ranks.begin(), ranks.end(), [](const RankView& r) { return r.attached; }));
}

std::string JobView::state() const {
  const std::size_t attached = attachedRanks();
  if (attached == ranks.size()) return "running";
  if (attached == 0) return "detached";
  const bool lost = std::any_of(ranks.begin(), ranks.end(), [](const RankView& r) { return r.gone; });
  return lost ? "rank lost" : "attaching";
}

Result<Query> parseRequest(const ipc::AdminRequest& request) {
  struct Spec {
    std::string_view name;
    Verb verb;
    std::size_t args;
  };
  constexpr std::array<Spec, 7> kVerbs{{{"status", Verb::kStatus, 0},
                                        {"jobs", Verb::kJobs, 0},
                                        {"job", Verb::kJob, 1},
                                        {"sessions", Verb::kSessions, 0},
                                        {"plan", Verb::kPlan, 2},
                                        {"trace", Verb::kTrace, 1},
                                        {"drain", Verb::kDrain, 0}}};
  const auto spec = std::find_if(kVerbs.begin(), kVerbs.end(), [&](const Spec& s) { return s.name == request.verb; });
  if (spec == kVerbs.end()) {
    return invalid("unknown request '" + request.verb + "' (known: status, jobs, job, sessions, plan, trace, drain)");
  }
  if (request.args.size() != spec->args) {
    return invalid("'" + request.verb + "' takes " + std::to_string(spec->args) + " argument(s), not " +
                   std::to_string(request.args.size()));
  }
  Query query{spec->verb, {}, {}};
  if (query.verb == Verb::kJob || query.verb == Verb::kPlan || query.verb == Verb::kTrace) {
    if (auto valid = ipc::validateJobId(request.args[0]); !valid) return std::move(valid).error();
    query.job = request.args[0];
  }
  if (query.verb == Verb::kPlan) query.group = request.args[1];
  return query;
}

Result<Access> authorize(const Config& config, std::uint32_t daemon_uid, const ipc::PeerCredentials& peer,
                         std::span<const std::uint32_t> groups) {
  Access access;
  access.tenant = findTenant(config.tenants, peer.uid, peer.gid);
  access.everything = peer.uid == 0 || peer.uid == daemon_uid || contains(config.admin_uids, peer.uid) ||
                      contains(config.admin_gids, peer.gid) ||
                      std::any_of(groups.begin(), groups.end(), [&](std::uint32_t g) { return contains(config.admin_gids, g); });
  if (!access.everything && !access.tenant) {
    return makeError(ErrorCode::kPermissionDenied, "uid " + std::to_string(peer.uid) + " / gid " +
                                                       std::to_string(peer.gid) +
                                                       " is neither an administrator of dbufd nor in one of its tenants");
  }
  return access;
}

Result<std::string> answer(const Query& query, const Access& access, const DaemonView& view) {
  auto document = answerJson(query, access, view);
  if (!document) return std::move(document).error();
  // Names come from clients (job and group ids are checked; a tensor name is
  // any string): never let one make dump() throw.
  std::string text = document->dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > ipc::kMaxAdminReplyBytes) {
    return makeError(ErrorCode::kInfeasible, "the answer is " + std::to_string(text.size()) +
                                                 " bytes, more than one reply holds (" +
                                                 std::to_string(ipc::kMaxAdminReplyBytes) + "); ask about one job");
  }
  return text;
}

}  // namespace dbuf::daemon::admin
