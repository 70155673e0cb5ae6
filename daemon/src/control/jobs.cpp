#include "jobs.hpp"

#include <sched.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <iterator>
#include <limits>

#include "backend.hpp"
#include "dbuf/common/shared_memory.hpp"
#include "group_layout.hpp"
#include "node_executor.hpp"
#include "rank_text.hpp"

namespace dbuf::daemon {
namespace {

// A reduction sums every rank in one kernel call.
constexpr std::uint32_t kMaxWorldSize = kernels::kMaxReduceSources;
constexpr std::uint32_t kMaxPrefetchDepth = 16;
constexpr std::size_t kMaxGroupName = 128;
constexpr std::size_t kMaxGroupsPerJob = 4096;

/// The CPUs this process may run on (its affinity); at least 1.
unsigned cpusWeMayRunOn() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return static_cast<unsigned>(std::max(CPU_COUNT(&set), 1));
}

/// The first of the job's ranks on the rank's node. On one node local_rank
/// says nothing (clients have long sent any value there).
std::uint32_t nodeFirstRank(const ipc::Hello& hello) {
  return ranksOnThisNode(hello) < hello.world_size ? hello.rank - hello.local_rank : 0;
}

/// The node layout a Hello gives: across nodes, its node's ranks are
/// contiguous and inside the job, and it names a store.
Result<void> checkNodeLayout(const ipc::Hello& hello) {
  const std::uint32_t local = ranksOnThisNode(hello);
  if (local < hello.world_size && (hello.local_rank >= local || hello.local_rank > hello.rank ||
                                   hello.rank - hello.local_rank + local > hello.world_size)) {
    return makeError(ErrorCode::kInvalidArgument,
                     "local rank " + std::to_string(hello.local_rank) + " of " + std::to_string(local) +
                         " ranks on this node does not fit rank " + std::to_string(hello.rank) + " of world size " +
                         std::to_string(hello.world_size) + " (a node's ranks are contiguous in the job)");
  }
  if (local < hello.world_size && hello.store.empty()) {
    return makeError(ErrorCode::kInvalidArgument, "a job across nodes (" + std::to_string(local) + " of " +
                                                      std::to_string(hello.world_size) +
                                                      " ranks on this node) needs a store its daemons meet in");
  }
  if (local == hello.world_size && !hello.store.empty()) {
    return makeError(ErrorCode::kInvalidArgument, "a store is for jobs across nodes; every rank of this one is here");
  }
  return {};
}

}  // namespace

GroupState* Job::groupById(std::uint32_t group_id) const {
  return group_id >= 1 && group_id <= groups_by_id.size() ? groups_by_id[group_id - 1] : nullptr;
}

const GroupGeometry* Job::groupGeometry(std::uint32_t group_id) const {
  const GroupState* group = groupById(group_id);
  return group != nullptr ? &group->geometry : nullptr;
}

const std::string* Job::groupName(std::uint32_t group_id) const {
  const GroupState* group = groupById(group_id);
  return group != nullptr ? &group->spec.name : nullptr;
}

Result<void> Job::bindGroup(std::uint32_t group_id) {
  const GroupState* found = groupById(group_id);
  if (found == nullptr) return makeError(ErrorCode::kNotFound, "no group " + std::to_string(group_id));
  const GroupState& group = *found;
  std::vector<std::uint32_t> without_slot;
  for (std::uint32_t r = 0; r < localCount(); ++r) {
    const std::vector<Slot>& slots = members[r].slots;
    const auto slot = std::find_if(slots.begin(), slots.end(), [&](const Slot& s) { return s.group == group.id; });
    if (slot == slots.end()) {
      without_slot.push_back(globalRank(r));
      continue;
    }
    const SlotLayout& layout = group.slot_layout;
    RankBuffers& buffers = collectives.buffers[r];
    buffers.shard = group.shards[r]->data() + group.reply.sharded.offset;
    buffers.shard_grad = group.shards[r]->data() + group.reply.sharded_grad.offset;
    buffers.params = slot->memory->data() + layout.params.offset;
    buffers.grads = slot->memory->data() + layout.grads.offset;
    buffers.scales = reinterpret_cast<float*>(slot->memory->data() + layout.scales.offset);
  }
  if (without_slot.empty()) return {};
  std::string message = ranksPhrase(without_slot) + " hold no unsharded slot for the group (unshard() or acquireSlot() first)";
  return Error{ErrorCode::kConflict, std::move(message), std::move(without_slot)};
}

JobTable::JobTable(asio::io_context& io, const Config& config, std::uint64_t instance_id)
    : io_(io),
      config_(config),
      instance_id_(instance_id),
      budget_(config.tenants, config.memory_limit_bytes),
      allocator_(hostAllocator()),
      host_scratch_(new float[LocalCollective::kStepElements]),  // NOLINT(cppcoreguidelines-owning-memory)
      gpu_offer_{config.backend == Backend::kCuda, config.virtual_ranks,
                 config.backend == Backend::kCuda ? visibleGpus() : std::vector<GpuUuid>{}},
      cluster_{&config, instance_id, std::make_shared<CommunicatorCache>(), std::make_shared<IdleCommunicators>(),
               std::make_shared<Waker>([&io] { asio::post(io, [] {}); })},
      data_plane_(io, config),
      cpus_(cpusWeMayRunOn()) {
  adviseSpin();
  if (!config.cluster_address.empty()) {
    spdlog::info("jobs across nodes: Gloo connections at {} ({} Redis store{} allowed)", config.cluster_address,
                 config.cluster_store_hosts.size(), config.cluster_store_hosts.size() == 1 ? "" : "s");
  }
}

JobTable::~JobTable() {
  cluster_.waker->close();
}

Result<void> JobTable::acceptAcrossNodes(const ipc::Hello& hello, Placement placement,
                                         const ipc::PeerCredentials& peer) const {
  const std::string what = "job '" + hello.job_id + "' spans nodes";
  if (config_.cluster_address.empty()) {
    return makeError(ErrorCode::kUnavailable, what + ", and this dbufd takes no such jobs ([cluster] address is not set)");
  }
  if (placement == Placement::kSharedGpu) {
    return makeError(ErrorCode::kUnavailable,
                     what + ": on GPUs, a job across nodes needs a GPU per rank (dbufd's virtual ranks share one "
                            "GPU of one node; start dbufd with --virtual-ranks 0 and give each rank its GPU)");
  }
  auto store = parseStoreSpec(hello.store);
  if (!store) return std::move(store).error();
  return checkStoreAllowed(*store, config_, peer.uid);
}

NodeJob JobTable::nodeJob(const Job& job) {
  NodeJob node;
  node.job_id = job.id;
  node.store = *parseStoreSpec(job.store);
  node.world_size = job.world_size;
  node.first_rank = job.first_rank;
  node.local_count = job.localCount();
  return node;
}

JobTable::Attachment* JobTable::attachmentOf(const Session& session) {
  const auto found = attachments_.find(session.id());
  return found == attachments_.end() ? nullptr : &found->second;
}

void JobTable::onMessage(const std::shared_ptr<Session>& session, const ipc::FrameHeader& header,
                         ipc::Message message) {
  const std::uint64_t request = header.request_id;
  if (const auto* hello = std::get_if<ipc::Hello>(&message)) {
    handleHello(session, request, *hello);
    return;
  }
  if (!session->attached()) {
    session->sendError(ipc::WireError::kBadRequest, "the first message must be Hello", request);
    session->closeAfterSending();
    return;
  }
  if (const auto* spec = std::get_if<ipc::RegisterGroup>(&message)) {
    handleRegister(session, request, *spec);
  } else if (const auto* acquire = std::get_if<ipc::AcquireSlot>(&message)) {
    handleAcquire(session, request, *acquire);
  } else if (const auto* release = std::get_if<ipc::ReleaseSlot>(&message)) {
    handleRelease(session, request, release->group_id);
  } else if (const auto* unregister = std::get_if<ipc::UnregisterGroup>(&message)) {
    handleUnregister(session, request, unregister->group_id);
  } else if (std::holds_alternative<ipc::Detach>(message)) {
    session->markDetaching();
    session->send(ipc::Detached{}, request);
    session->closeAfterSending();
  } else {
    session->sendError(ipc::WireError::kBadRequest, "not a request a client may send", request);
  }
}

std::optional<std::size_t> JobTable::tenantOf(const ipc::PeerCredentials& peer) const {
  return findTenant(config_.tenants, peer.uid, peer.gid);
}

std::vector<Tenant> JobTable::retenant(std::vector<Tenant> fresh) {
  std::vector<std::size_t> new_index(config_.tenants.size(), MemoryBudget::kDropped);
  for (std::size_t t = 0; t < config_.tenants.size(); ++t) {
    const Tenant& old = config_.tenants[t];
    auto same = std::find_if(fresh.begin(), fresh.end(), [&](const Tenant& f) { return f.name == old.name; });
    if (same == fresh.end()) {
      const std::size_t jobs = jobsOfTenant(t);
      if (jobs == 0) continue;
      spdlog::warn("tenant '{}' is no longer configured: its {} job(s) keep their memory; no rank may attach to them",
                   old.name, jobs);
      Tenant retired = old;
      retired.uids.clear();
      retired.gids.clear();
      fresh.push_back(std::move(retired));
      same = std::prev(fresh.end());
    }
    new_index[t] = static_cast<std::size_t>(same - fresh.begin());
  }
  for (auto& [id, job] : jobs_) job.tenant = new_index[job.tenant];
  budget_.remap(new_index, fresh.size());
  for (std::size_t t = 0; t < fresh.size(); ++t) {
    if (budget_.used(t) > fresh[t].memory_quota_bytes) {
      spdlog::warn("tenant '{}' uses {} bytes, more than its new quota of {}: nothing is taken back; it gets no more "
                   "memory until it is under",
                   fresh[t].name, budget_.used(t), fresh[t].memory_quota_bytes);
    }
  }
  return fresh;
}

std::size_t JobTable::jobsOfTenant(std::size_t tenant) const {
  return static_cast<std::size_t>(
      std::count_if(jobs_.begin(), jobs_.end(), [&](const auto& entry) { return entry.second.tenant == tenant; }));
}

void JobTable::handleHello(const std::shared_ptr<Session>& session, std::uint64_t request, const ipc::Hello& hello) {
  const auto refuse = [&](ipc::WireError code, const std::string& why) {
    session->sendError(code, why, request);
    session->closeAfterSending();
  };
  if (session->attached()) return refuse(ipc::WireError::kBadRequest, "this connection is already attached");
  if (hello.protocol_version != ipc::kProtocolVersion) {
    return refuse(ipc::WireError::kVersionMismatch, "protocol version " + std::to_string(hello.protocol_version) +
                                                        " is not supported (daemon speaks " +
                                                        std::to_string(ipc::kProtocolVersion) + ")");
  }
  if (hello.world_size == 0 || hello.world_size > kMaxWorldSize || hello.rank >= hello.world_size ||
      hello.prefetch_depth > kMaxPrefetchDepth) {
    return refuse(ipc::WireError::kBadRequest, "rank " + std::to_string(hello.rank) + " of world size " +
                                                   std::to_string(hello.world_size) + " (prefetch depth " +
                                                   std::to_string(hello.prefetch_depth) + ") is out of range");
  }
  if (auto layout = checkNodeLayout(hello); !layout) return refuse(ipc::WireError::kBadRequest, layout.error().message);
  const auto tenant = tenantOf(session->peer());
  if (!tenant) {
    return refuse(ipc::WireError::kPermissionDenied, "uid " + std::to_string(session->peer().uid) + " / gid " +
                                                         std::to_string(session->peer().gid) +
                                                         " belongs to no tenant of this daemon");
  }
  const auto refuse_with = [&](const Error& error) {
    session->sendError(error, request);
    session->closeAfterSending();
  };
  auto plane = data_plane_.openSession("dbuf:" + hello.job_id + ":session:" + std::to_string(hello.rank));
  if (!plane) return refuse_with(std::move(plane).error().withContext("cannot create the session's rings"));
  // The rank's GPU as dbufd numbers it (the trainer may see its GPUs otherwise).
  ipc::Hello placed = hello;
  if (config_.backend == Backend::kCuda) {
    auto device = daemonDevice(hello, gpu_offer_.gpus);
    if (!device) return refuse_with(device.error());
    placed.device = *device;
  }
  auto job = attachTo(placed, session->peer(), *tenant);
  if (!job) return refuse_with(job.error());
  Job& attached = **job;
  const bool reattached = !attached.groups.empty();
  const std::uint32_t local = hello.rank - attached.first_rank;
  RankMembership& member = attached.members[local];
  member.session = session;
  RankSchedule& rank = attached.ranks[local];
  rank.plane = std::move(*plane);
  // `owed` stays: ops this rank missed before attaching (its job-mates' k-th
  // op timed out without it) fail first, so its k-th op stays theirs.
  rank.ops.reset(config_.ring_entries);
  attachments_[session->id()] = {attached.id, local};
  adviseSpin();
  session->markAttached();
  ipc::Welcome welcome;
  welcome.nonce = hello.nonce;
  welcome.daemon_instance_id = instance_id_;
  welcome.session_id = session->id();
  welcome.memory_quota_bytes = config_.tenants[attached.tenant].memory_quota_bytes;
  welcome.memory_used_bytes = budget_.used(attached.tenant);
  welcome.reattached = reattached;
  welcome.ring_capacity = config_.ring_entries;
  welcome.segment_bytes = ipc::segmentBytes(config_.ring_entries);
  welcome.busy_poll_us = static_cast<std::uint32_t>(config_.busy_poll.count());
  welcome.memory_kind = config_.backend == Backend::kCuda ? ipc::MemoryKind::kCuda : ipc::MemoryKind::kHost;
  welcome.device = member.device;
  session->send(welcome, request, {rank.plane->segment_fd.get(), rank.plane->doorbell->native_handle()});
  spdlog::info("job {} rank {}/{} attached (pid {}, uid {}){}", attached.id, hello.rank, attached.world_size,
               session->peer().pid, session->peer().uid, reattached ? ", reattached" : "");
  const bool whole = std::all_of(attached.members.begin(), attached.members.end(),
                                 [](const RankMembership& m) { return m.session != nullptr; });
  if (whole && attached.collectives.executor) attached.collectives.executor->ranksAttached();
}

Result<Job*> JobTable::attachTo(const ipc::Hello& hello, const ipc::PeerCredentials& peer, std::size_t tenant) {
  const auto found = jobs_.find(hello.job_id);
  if (found == jobs_.end()) {
    if (refuse_new_jobs_) {
      return makeError(ErrorCode::kUnavailable, "dbufd is draining: it takes no new jobs (job '" + hello.job_id + "')");
    }
    if (jobsOfTenant(tenant) >= config_.tenants[tenant].max_jobs) {
      return makeError(ErrorCode::kInfeasible, "tenant '" + config_.tenants[tenant].name + "' already runs " +
                                                   std::to_string(config_.tenants[tenant].max_jobs) + " jobs");
    }
    auto placement = placeJob(hello, gpu_offer_);
    if (!placement) return std::move(placement).error();
    const std::uint32_t local_count = ranksOnThisNode(hello);
    if (local_count < hello.world_size) {
      if (auto allowed = acceptAcrossNodes(hello, *placement, peer); !allowed) return std::move(allowed).error();
    }
    Job job;
    job.id = hello.job_id;
    job.tenant = tenant;
    job.placement = *placement;
    job.world_size = hello.world_size;
    job.first_rank = nodeFirstRank(hello);
    job.store = hello.store;
    job.persistent = hello.persistent;
    job.ranks.resize(local_count);
    job.recorder = FlightRecorder(local_count);
    job.members.resize(local_count);
    job.prefetch_depth = hello.prefetch_depth;
    for (RankMembership& member : job.members) member.slots.resize(job.poolSlots());
    job.collectives.buffers.resize(local_count);
    if (auto placed = placeRank(job, hello); !placed) return std::move(placed).error();
    Job* created = &jobs_.emplace(job.id, std::move(job)).first->second;
    job_order_.push_back(created);
    return created;
  }
  Job& job = found->second;
  if (job.tenant != tenant) {
    // Say no more about another tenant's job than that it is not yours.
    return makeError(ErrorCode::kPermissionDenied, "job '" + hello.job_id + "' belongs to another tenant (uid " +
                                                       std::to_string(peer.uid) + " is not allowed)");
  }
  if (job.persistent != hello.persistent || job.prefetch_depth != hello.prefetch_depth) {
    return makeError(ErrorCode::kConflict, "job '" + job.id +
                                               "' was attached with persistent=" + (job.persistent ? "true" : "false") +
                                               " and prefetch depth " + std::to_string(job.prefetch_depth) +
                                               ", not persistent=" + (hello.persistent ? "true" : "false") +
                                               " and prefetch depth " + std::to_string(hello.prefetch_depth));
  }
  if (job.world_size != hello.world_size) {
    return makeError(ErrorCode::kConflict, "job '" + job.id + "' has world size " + std::to_string(job.world_size) +
                                               ", not " + std::to_string(hello.world_size));
  }
  const bool nobody_attached = std::none_of(job.members.begin(), job.members.end(),
                                            [](const RankMembership& m) { return m.session != nullptr; });
  if (job.store != hello.store && nobody_attached && job.first_rank == nodeFirstRank(hello) &&
      job.localCount() == ranksOnThisNode(hello)) {
    // The whole job restarted (a persistent one, kept), as a new run with
    // keys of its own (torchrun's restart count): its nodes meet anew there.
    if (job.acrossNodes()) {
      if (auto allowed = acceptAcrossNodes(hello, job.placement, peer); !allowed) return std::move(allowed).error();
    }
    spdlog::info("job {}: restarted with store '{}' (was '{}')", job.id, hello.store, job.store);
    job.store = hello.store;
    job.collectives.executor.reset();  // made again by placeRank
  }
  if (job.first_rank != nodeFirstRank(hello) || job.localCount() != ranksOnThisNode(hello) ||
      job.store != hello.store) {
    return makeError(ErrorCode::kConflict,
                     "rank " + std::to_string(hello.rank) + " places job '" + job.id + "''s ranks " +
                         rankSpan(nodeFirstRank(hello), ranksOnThisNode(hello)) + " on this node with store '" +
                         hello.store + "', but its other ranks here said ranks " +
                         rankSpan(job.first_rank, job.localCount()) + " with store '" + job.store + "'");
  }
  const RankMembership& member = job.members[hello.rank - job.first_rank];
  if (member.session) {
    return makeError(ErrorCode::kConflict, "rank " + std::to_string(hello.rank) + " of job '" + job.id +
                                               "' is already attached (pid " +
                                               std::to_string(member.session->peer().pid) + ")");
  }
  if (auto placed = placeRank(job, hello); !placed) return std::move(placed).error();
  if (job.grace_timer) {
    job.grace_timer->cancel();
    job.grace_timer.reset();
  }
  job.gone.erase(hello.rank);
  return &job;
}

Result<void> JobTable::placeRank(Job& job, const ipc::Hello& hello) {
  std::vector<std::int32_t> devices;
  for (const RankMembership& member : job.members) devices.push_back(member.device);
  auto fits = checkRankDevice(job.placement, devices, job.first_rank, hello, gpu_offer_.gpuCount());
  if (!fits) return fits;
  if (!job.collectives.executor) {
    auto executor = executorFor(job, hello);
    if (!executor) return std::move(executor).error();
    job.collectives.executor = std::move(*executor);
  }
  job.members[hello.rank - job.first_rank].device = hello.device;
  return {};
}

Result<std::unique_ptr<Executor>> JobTable::executorFor(const Job& job, const ipc::Hello& hello) const {
  switch (job.placement) {
    case Placement::kHost:
      if (job.acrossNodes()) return nodeExecutor(nodeJob(job), cluster_);
      return hostExecutor({host_scratch_.get(), LocalCollective::kStepElements});
#if defined(DBUF_WITH_CUDA)
    case Placement::kSharedGpu:
      return cudaExecutor(hello.device);
    case Placement::kGpuPerRank: {
      std::vector<int> devices;
      for (std::uint32_t r = 0; r < job.localCount(); ++r) {
        devices.push_back(job.globalRank(r) == hello.rank ? hello.device : job.members[r].device);
      }
      if (std::find(devices.begin(), devices.end(), -1) != devices.end()) {
        return std::unique_ptr<Executor>();  // ranks still to come
      }
      if (job.acrossNodes()) return ncclNodeExecutor(std::move(devices), nodeJob(job), cluster_);
      return ncclExecutor(std::move(devices));
    }
#endif
    default:
      break;
  }
  static_cast<void>(hello);
  return makeError(ErrorCode::kInternal, "dbufd: a GPU placement in a build without CUDA (a bug)");
}

DbufferAllocator& JobTable::allocatorFor(const Job& job, std::uint32_t rank) {
#if defined(DBUF_WITH_CUDA)
  if (job.placement != Placement::kHost) {
    const std::int32_t device = job.members[rank].device;
    std::unique_ptr<DbufferAllocator>& allocator = gpu_allocators_[device];
    if (!allocator) allocator = cudaAllocator(device);
    return *allocator;
  }
#endif
  static_cast<void>(job);
  static_cast<void>(rank);
  return *allocator_;
}

void JobTable::handleRegister(const std::shared_ptr<Session>& session, std::uint64_t request,
                              const ipc::RegisterGroup& spec) {
  Attachment* attachment = attachmentOf(*session);
  Job& job = jobs_.at(attachment->job);
  const std::uint32_t rank = attachment->local;
  if (spec.name.empty() || spec.name.size() > kMaxGroupName || spec.tensors.empty()) {
    session->sendError(ipc::WireError::kBadRequest, "a group needs a name (1-128 bytes) and at least one tensor",
                       request);
    return;
  }
  if (const auto existing = job.groups.find(spec.name); existing != job.groups.end()) {
    // Registered before (a reattaching rank, or a repeat): same spec, same memory.
    if (const auto difference = specDifference(existing->second.spec, spec)) {
      session->sendError(ipc::WireError::kConflict,
                         "group '" + spec.name + "' is registered with a different spec: " + *difference, request);
      return;
    }
    existing->second.unregistered.erase(rank);  // a rank that unregistered it and registers it again keeps it
    replyGroup(existing->second, rank, session, request);
    return;
  }
  if (job.groups.size() + job.pending.size() >= kMaxGroupsPerJob) {
    session->sendError(ipc::WireError::kQuotaExceeded,
                       "job " + job.id + " already has " + std::to_string(kMaxGroupsPerJob) + " groups", request);
    return;
  }
  if (reportEarlierMismatch(job, rank, spec.name, session, request)) return;
  if (!job.gone.empty()) {
    std::vector<std::uint32_t> gone(job.gone.begin(), job.gone.end());
    std::string why = "group '" + spec.name + "' cannot be registered: " + goneRanksText(gone, job.id);
    session->sendError(Error{ErrorCode::kConflict, std::move(why), std::move(gone)}, request);
    return;
  }
  auto [entry, created] = job.pending.try_emplace(spec.name);
  PendingGroup& pending = entry->second;
  if (created) {
    pending.spec = spec;
    pending.first_rank = rank;
    pending.timer = std::make_unique<asio::steady_timer>(io_, config_.register_timeout);
    pending.timer->async_wait([this, id = job.id, name = spec.name](const asio::error_code& error) {
      if (error) return;
      const auto job_entry = jobs_.find(id);
      if (job_entry == jobs_.end()) return;
      const auto waiting = job_entry->second.pending.find(name);
      if (waiting == job_entry->second.pending.end()) return;
      std::vector<std::uint32_t> missing;
      for (std::uint32_t r = 0; r < job_entry->second.localCount(); ++r) {
        if (!waiting->second.waiters.contains(r)) missing.push_back(job_entry->second.globalRank(r));
      }
      std::string why = "group '" + name + "': ranks " + rankList(missing) + " did not register within " +
                        std::to_string(config_.register_timeout.count()) + " ms";
      failPending(job_entry->second, name, Error{ErrorCode::kTimeout, std::move(why), std::move(missing)});
    });
  } else if (pending.waiters.contains(rank)) {
    session->sendError(ipc::WireError::kConflict,
                       "rank " + std::to_string(job.globalRank(rank)) + " is already registering '" + spec.name + "'",
                       request);
    return;
  } else if (const auto difference = specDifference(pending.spec, spec)) {
    pending.waiters[rank] = {session, request};
    const std::uint32_t first = job.globalRank(pending.first_rank);
    const std::uint32_t late = job.globalRank(rank);
    const Error why{ErrorCode::kConflict,
                    "group '" + spec.name + "': rank " + std::to_string(late) + " and rank " + std::to_string(first) +
                        " disagree: " + *difference,
                    {std::min(late, first), std::max(late, first)}};
    auto& failure = job.failed[spec.name];
    failure.why = why;
    for (const auto& [waiting, waiter] : pending.waiters) failure.told.insert(waiting);
    failPending(job, spec.name, why);
    return;
  }
  pending.waiters[rank] = {session, request};
  if (pending.waiters.size() == job.localCount()) completeRegistration(job, spec.name);
}

bool JobTable::reportEarlierMismatch(Job& job, std::uint32_t rank, const std::string& name,
                                     const std::shared_ptr<Session>& session, std::uint64_t request) {
  const auto failure = job.failed.find(name);
  if (failure == job.failed.end()) return false;
  if (failure->second.told.contains(rank)) {
    job.failed.erase(failure);  // this rank heard it and tries again: a new registration
    return false;
  }
  session->sendError(failure->second.why, request);
  failure->second.told.insert(rank);
  if (failure->second.told.size() == job.localCount()) job.failed.erase(failure);
  return true;
}

void JobTable::failPending(Job& job, const std::string& name, const Error& why) {
  const auto found = job.pending.find(name);
  if (found == job.pending.end()) return;
  spdlog::warn("job {}: {}", job.id, why.message);
  PendingGroup pending = std::move(found->second);
  job.pending.erase(found);
  if (pending.timer) pending.timer->cancel();
  for (auto& [rank, waiter] : pending.waiters) waiter.session->sendError(why, waiter.request_id);
}

Result<GroupState> JobTable::buildGroup(Job& job, const ipc::RegisterGroup& spec) {
  // A group whose smallest possible shards could not be charged is refused
  // before planning: the plan runs on the daemon's loop, and a huge group
  // would hold every other job up while it is planned.
  constexpr std::uint64_t kMaxBytes = std::numeric_limits<std::uint64_t>::max();
  const std::uint64_t least = leastShardFileBytes(spec, job.world_size);
  const std::uint64_t least_here = least > kMaxBytes / job.localCount() ? kMaxBytes : least * job.localCount();
  if (auto fits = budget_.check(job.tenant, least_here, "group '" + spec.name + "'"); !fits) {
    return std::move(fits).error();
  }
  auto plan = planGroup(spec, job.world_size);
  if (!plan) return std::move(plan).error().withContext("group '" + spec.name + "'");
  GroupState group;
  group.id = job.next_group_id;
  group.spec = spec;
  group.reply = describeGroup(spec, *plan, group.id);
  // Announced and charged as the memory really is (GPU allocations are
  // rounded up to their granularity).
  // (Every rank's GPU rounds the same way in practice; the largest counts.)
  for (std::uint32_t rank = 0; rank < job.localCount(); ++rank) {
    auto rounded = allocatorFor(job, rank).roundedSize(group.reply.shard_file_bytes);
    if (!rounded) return std::move(rounded).error();
    group.reply.shard_file_bytes = *rounded;
  }
  const std::uint64_t bytes = group.reply.shard_file_bytes * job.localCount();
  if (auto charged = budget_.charge(job.tenant, bytes, "group '" + spec.name + "'"); !charged) {
    return std::move(charged).error();
  }
  job.charged += bytes;
  for (std::uint32_t rank = 0; rank < job.localCount(); ++rank) {
    auto memory = allocatorFor(job, rank).allocate(
        "dbuf:" + job.id + ":" + spec.name + ":" + std::to_string(job.globalRank(rank)),
                                                   group.reply.shard_file_bytes);
    if (!memory) {
      budget_.release(job.tenant, bytes);
      job.charged -= bytes;
      return std::move(memory).error();
    }
    group.shards.push_back(std::move(*memory));
  }
  group.geometry = groupGeometry(group.reply);
  group.slot_layout = slotLayout(group.reply);
  group.plan = std::move(*plan);
  ++job.next_group_id;
  return group;
}

void JobTable::completeRegistration(Job& job, const std::string& name) {
  PendingGroup& pending = job.pending.at(name);
  auto group = buildGroup(job, pending.spec);
  if (!group) {
    failPending(job, name, group.error());
    return;
  }
  pending.timer->cancel();
  auto waiters = std::move(pending.waiters);
  job.pending.erase(name);
  GroupState& stored = job.groups.emplace(name, std::move(*group)).first->second;
  job.groups_by_id.push_back(&stored);  // ids are handed out in order from 1
  spdlog::info("job {}: group '{}' planned: {} tensors, S = {} elements, {} bytes per rank", job.id, name,
               stored.reply.tensors.size(), stored.reply.shard_elems, stored.reply.shard_file_bytes);
  for (auto& [rank, waiter] : waiters) replyGroup(stored, rank, waiter.session, waiter.request_id);
}

void JobTable::replyGroup(const GroupState& group, std::uint32_t rank, const std::shared_ptr<Session>& session,
                          std::uint64_t request) {
  session->send(group.reply, request, {group.shards[rank]->fd()});
}

void JobTable::handleAcquire(const std::shared_ptr<Session>& session, std::uint64_t request,
                             const ipc::AcquireSlot& acquire) {
  const std::uint32_t group_id = acquire.group_id;
  const Attachment* attachment = attachmentOf(*session);
  Job& job = jobs_.at(attachment->job);
  const auto group = std::find_if(job.groups.begin(), job.groups.end(),
                                  [&](const auto& entry) { return entry.second.id == group_id; });
  if (group == job.groups.end()) {
    session->sendError(ipc::WireError::kNotFound, "no group " + std::to_string(group_id) + " in job " + job.id,
                       request);
    return;
  }
  if (group->second.unregistered.contains(attachment->local)) {
    session->sendError(ipc::WireError::kNotFound,
                       "rank " + std::to_string(job.globalRank(attachment->local)) + " unregistered group '" +
                           group->first + "'",
                       request);
    return;
  }
  const SlotLayout& layout = group->second.slot_layout;
  RankMembership& rank = job.members[attachment->local];
  auto slot = std::find_if(rank.slots.begin(), rank.slots.end(), [&](const Slot& s) { return s.group == group_id; });
  if (slot == rank.slots.end()) slot = freeSlotFor(rank, group_id);
  if (slot == rank.slots.end() && acquire.grow) {
    // A group holds one slot at most, so the pool grows to the job's group count at most; the quota bounds
    // the memory (growSlot charges it).
    slot = rank.slots.emplace(rank.slots.end());
  }
  if (slot == rank.slots.end()) {
    session->sendError(ipc::WireError::kConflict,
                       "all " + std::to_string(rank.slots.size()) + " unsharded slots of rank " +
                           std::to_string(job.globalRank(attachment->local)) + " are in use (prefetch depth " +
                           std::to_string(job.prefetch_depth) + "); reshard a group first",
                       request);
    return;
  }
  if (auto sized = growSlot(job, *slot, layout.file_bytes, attachment->local, group->first); !sized) {
    session->sendError(sized.error(), request);
    return;
  }
  slot->group = group_id;
  slot->last_group = group_id;
  ipc::SlotGranted granted;
  granted.group_id = group_id;
  granted.slot_index = static_cast<std::uint32_t>(slot - rank.slots.begin());
  granted.slot_file_bytes = slot->bytes();
  granted.params = layout.params;
  granted.grads = layout.grads;
  granted.scales = layout.scales;
  session->send(granted, request, {slot->memory->fd()});
}

std::vector<Slot>::iterator JobTable::freeSlotFor(RankMembership& rank, std::uint32_t group_id) {
  // The one this group held last (the trainer may still have it mapped), else
  // one that no group held yet, else the first free one.
  const auto free_where = [&](auto&& also) {
    return std::find_if(rank.slots.begin(), rank.slots.end(),
                        [&](const Slot& s) { return !s.group.has_value() && also(s); });
  };
  auto slot = free_where([&](const Slot& s) { return s.last_group == group_id; });
  if (slot == rank.slots.end()) slot = free_where([](const Slot& s) { return !s.last_group.has_value(); });
  if (slot == rank.slots.end()) slot = free_where([](const Slot&) { return true; });
  return slot;
}

Result<void> JobTable::growSlot(Job& job, Slot& slot, std::uint64_t bytes, std::uint32_t rank,
                                const std::string& group) {
  if (slot.bytes() >= bytes) return {};
  // First use, or a larger group than before: replace the slot's file. A slot
  // file is sealed against resizing, so it cannot grow in place. Charged as
  // the memory really is (GPU allocations are rounded up).
  auto rounded = allocatorFor(job, rank).roundedSize(bytes);
  if (!rounded) return std::move(rounded).error();
  if (auto charged = budget_.charge(job.tenant, *rounded, "unsharded slot for group '" + group + "'"); !charged) {
    return charged;
  }
  auto memory =
      allocatorFor(job, rank).allocate("dbuf:" + job.id + ":slot:" + std::to_string(job.globalRank(rank)), bytes);
  if (!memory) {
    budget_.release(job.tenant, *rounded);
    return std::move(memory).error();
  }
  budget_.release(job.tenant, slot.bytes());
  job.charged += *rounded - slot.bytes();
  slot.memory = std::move(*memory);  // of *rounded bytes
  return {};
}

void JobTable::handleRelease(const std::shared_ptr<Session>& session, std::uint64_t request, std::uint32_t group_id) {
  const Attachment* attachment = attachmentOf(*session);
  Job& job = jobs_.at(attachment->job);
  RankMembership& rank = job.members[attachment->local];
  const auto slot =
      std::find_if(rank.slots.begin(), rank.slots.end(), [&](const Slot& s) { return s.group == group_id; });
  if (slot == rank.slots.end()) {
    session->sendError(ipc::WireError::kNotFound, "group " + std::to_string(group_id) + " holds no slot", request);
    return;
  }
  if (job.ranks[attachment->local].ops.any([&](const PendingOp& op) { return op.submission.group_id == group_id; })) {
    // A queued or running collective of this group may still read or write the slot.
    session->sendError(ipc::WireError::kConflict,
                       "rank " + std::to_string(job.globalRank(attachment->local)) + " has collectives of group " +
                           std::to_string(group_id) + " in flight; wait for them first",
                       request);
    return;
  }
  // The slot goes back to the rank's pool with its pages: the pool, not the
  // page cache, is what bounds unsharded memory, and the next all-gather
  // into freshly punched pages would run at a fifth of memcpy speed, page
  // faults and zero-filling included (docs/collectives.md, Performance). The
  // pages are given back with the slot file when the rank goes. A slot
  // beyond the pool (AcquireSlot::grow) gives its memory back now.
  slot->group.reset();
  if (static_cast<std::size_t>(slot - rank.slots.begin()) >= job.poolSlots()) {
    budget_.release(job.tenant, slot->bytes());
    job.charged -= slot->bytes();
    slot->memory.reset();
  }
  session->send(ipc::SlotReleased{group_id}, request);
}

void JobTable::handleUnregister(const std::shared_ptr<Session>& session, std::uint64_t request,
                                std::uint32_t group_id) {
  const Attachment* attachment = attachmentOf(*session);
  Job& job = jobs_.at(attachment->job);
  const std::uint32_t local = attachment->local;
  GroupState* group = job.groupById(group_id);
  if (group == nullptr || group->unregistered.contains(local)) {
    session->sendError(ipc::WireError::kNotFound, "no group " + std::to_string(group_id) + " in job " + job.id,
                       request);
    return;
  }
  const std::vector<Slot>& slots = job.members[local].slots;
  if (std::any_of(slots.begin(), slots.end(), [&](const Slot& s) { return s.group == group_id; })) {
    session->sendError(ipc::WireError::kConflict,
                       "rank " + std::to_string(job.globalRank(local)) + " holds a slot of group '" + group->spec.name +
                           "'; reshard it first",
                       request);
    return;
  }
  if (job.ranks[local].ops.any([&](const PendingOp& op) { return op.submission.group_id == group_id; })) {
    session->sendError(ipc::WireError::kConflict,
                       "rank " + std::to_string(job.globalRank(local)) + " has collectives of group '" +
                           group->spec.name + "' in flight; wait for them first",
                       request);
    return;
  }
  group->unregistered.insert(local);
  if (group->unregistered.size() == job.localCount()) freeGroup(job, *group);
  session->send(ipc::GroupUnregistered{group_id}, request);
}

void JobTable::freeGroup(Job& job, GroupState& group) {
  // As buildGroup charged it. No slot of it is held and no collective of it is queued: each rank checked its own
  // when it unregistered, and an unregistered rank may acquire none.
  const std::uint64_t bytes = group.reply.shard_file_bytes * job.localCount();
  budget_.release(job.tenant, bytes);
  job.charged -= bytes;
  spdlog::info("job {}: group '{}' unregistered by every rank: {} bytes freed", job.id, group.spec.name, bytes);
  job.groups_by_id[group.id - 1] = nullptr;
  job.groups.erase(group.spec.name);  // (its shards' memory goes with it)
}

void JobTable::onClosed(const std::shared_ptr<Session>& session) {
  const auto found = attachments_.find(session->id());
  if (found == attachments_.end()) return;
  const Attachment attachment = found->second;
  attachments_.erase(found);
  adviseSpin();
  const auto job = jobs_.find(attachment.job);
  if (job == jobs_.end()) return;
  spdlog::info("job {} rank {} detached", attachment.job, job->second.globalRank(attachment.local));
  releaseRank(job->second, attachment.local, session->detaching() ? RankEnd::kDetached : RankEnd::kLost);
  const bool anyone_left = std::any_of(job->second.members.begin(), job->second.members.end(),
                                       [](const RankMembership& member) { return member.session != nullptr; });
  if (!anyone_left) jobLostAllRanks(job->second);
}

void JobTable::releaseRank(Job& job, std::uint32_t rank, RankEnd end) {
  RankMembership& state = job.members[rank];
  data_plane_.rankGone(job, rank, end);  // stops any op touching its memory, fails the others' ops
  state.session.reset();
  // Unsharded slots hold nothing worth keeping: give their memory back now.
  for (Slot& slot : state.slots) {
    budget_.release(job.tenant, slot.bytes());
    job.charged -= slot.bytes();
    slot = Slot{};
  }
  // No registration of the job can complete without this rank, whether it
  // had joined it yet or not: fail them all now, naming it, rather than let
  // the others wait for register_ms.
  std::vector<std::string> broken;
  for (const auto& [name, pending] : job.pending) broken.push_back(name);
  for (const std::string& name : broken) {
    const bool joined = job.pending.at(name).waiters.erase(rank) > 0;
    failPending(job, name,
                Error{ErrorCode::kConflict,
                      "group '" + name + "': rank " + std::to_string(job.globalRank(rank)) + " disconnected" +
                          (joined ? " while registering" : " before registering"),
                      {job.globalRank(rank)}});
  }
  job.gone.insert(job.globalRank(rank));  // cleared by jobLostAllRanks when nobody is left
}

void JobTable::jobLostAllRanks(Job& job) {
  job.gone.clear();  // a restart of the whole job attaches in any order
  if (!job.persistent || job.groups.empty()) {
    freeJob(job.id);
    return;
  }
  spdlog::info("job {}: every rank is gone; keeping its memory for {} s", job.id, config_.persistence_grace.count());
  job.grace_timer = std::make_unique<asio::steady_timer>(io_, config_.persistence_grace);
  job.grace_timer->async_wait([this, id = job.id](const asio::error_code& error) {
    if (!error) freeJob(id);
  });
}

void JobTable::freeJob(const std::string& id) {
  const auto found = jobs_.find(id);
  if (found == jobs_.end()) return;
  Job& job = found->second;
  for (auto& [name, pending] : job.pending) {
    if (pending.timer) pending.timer->cancel();
  }
  if (job.grace_timer) job.grace_timer->cancel();
  budget_.release(job.tenant, job.charged);
  spdlog::info("job {} freed ({} bytes)", id, job.charged);
  std::erase(job_order_, &job);
  jobs_.erase(found);  // closes every memfd of the job
}

void JobTable::clear() {
  std::vector<std::string> ids;
  for (const auto& [id, job] : jobs_) ids.push_back(id);
  for (const std::string& id : ids) freeJob(id);
  attachments_.clear();
  data_plane_.stop();
}

std::size_t JobTable::pollDataPlane() {
  std::optional<CorruptRing> corrupt;
  const std::size_t work = data_plane_.poll(job_order_, SteadyClock::now(), corrupt);
  if (!corrupt) return work;
  Job& job = static_cast<Job&>(*corrupt->job);  // every scheduled job is one of ours
  spdlog::warn("job {} rank {}: {}; closing its session", job.id, job.globalRank(corrupt->rank), corrupt->why.message);
  // onClosed releases the rank; the job list may change.
  if (const auto session = job.members[corrupt->rank].session) session->close();
  return work + 1;
}

bool JobTable::prepareSleep() {
  return data_plane_.prepareSleep(job_order_);
}

void JobTable::endSleep() {
  data_plane_.endSleep(job_order_);
}

void JobTable::adviseSpin() {
  const bool oversubscribed = attachments_.size() + 1 > cpus_;
  const std::chrono::microseconds spin = oversubscribed ? std::chrono::microseconds{0} : config_.busy_poll;
  if (spin != spin_) {
    spdlog::info("{} ranks attached on {} CPUs: waiters spin {} us before they sleep", attachments_.size(), cpus_,
                 spin.count());
  }
  spin_ = spin;
  for (auto& [id, job] : jobs_) {
    for (RankSchedule& rank : job.ranks) {
      if (rank.plane) rank.plane->rings.adviseClientSpin(spin_);
    }
  }
}

JobTable::Counts JobTable::counts() const {
  Counts stats;
  stats.sessions = attachments_.size();
  stats.jobs = jobs_.size();
  stats.bytes_in_use = budget_.total();
  for (const auto& [id, job] : jobs_) {
    for (const auto& [name, group] : job.groups) stats.memfds += group.shards.size();
    for (const RankMembership& member : job.members) {
      stats.memfds += static_cast<std::size_t>(std::count_if(member.slots.begin(), member.slots.end(),
                                                             [](const Slot& slot) { return slot.memory != nullptr; }));
    }
    for (const RankSchedule& rank : job.ranks) {
      if (rank.plane) ++stats.memfds;  // the session segment
    }
  }
  return stats;
}

}  // namespace dbuf::daemon
