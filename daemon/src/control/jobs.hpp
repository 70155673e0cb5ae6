#pragma once
// Jobs, ranks, groups and their shared memory: the daemon's state and the
// handling of every client request. Runs on the server's loop thread only;
// nothing here blocks.

#include <asio.hpp>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "admin.hpp"
#include "cluster.hpp"
#include "data_plane.hpp"
#include "dbuf/common/unique_fd.hpp"
#include "dbuf/daemon/config.hpp"
#include "dbuf/ipc/protocol.hpp"
#include "dbuf/planner/unit_plan.hpp"
#include "dbuffer_memory.hpp"
#include "group_layout.hpp"
#include "memory_budget.hpp"
#include "node_link.hpp"
#include "placement.hpp"
#include "session.hpp"

namespace dbuf::daemon {

struct GroupState {
  std::uint32_t id = 0;
  ipc::RegisterGroup spec;
  ipc::GroupReady reply;  // the same for every rank, fd aside
  /// Per rank: its shard and sharded gradient (sent to the rank, read and
  /// written by the data plane).
  std::vector<std::unique_ptr<DbufferMemory>> shards;
  GroupGeometry geometry;
  SlotLayout slot_layout;
  planner::UnitPlan plan;  ///< as the planner made it (dbufctl plan)
  /// Local indices of the ranks done with it (UnregisterGroup): the group is freed when every rank is.
  std::set<std::uint32_t> unregistered;
};

/// A registration waiting for every rank of the job.
struct PendingGroup {
  ipc::RegisterGroup spec;
  std::uint32_t first_rank = 0;  ///< local index of the rank that registered first
  struct Waiter {
    std::shared_ptr<Session> session;
    std::uint64_t request_id = 0;
  };
  std::map<std::uint32_t, Waiter> waiters;  ///< by local index
  std::unique_ptr<asio::steady_timer> timer;
};

/// One unsharded slot of a rank's pool: mapped by the trainer while a group
/// holds it; released slots keep their memory for the next group.
struct Slot {
  std::unique_ptr<DbufferMemory> memory;  // null until first used
  std::optional<std::uint32_t> group;
  /// The group that held it last: a trainer that keeps slots mapped after
  /// reshard (ClientOptions::keep_slot_mappings) maps nothing when its group
  /// gets that slot back, so AcquireSlot prefers it.
  std::optional<std::uint32_t> last_group;
  /// What the slot takes, and is charged to the tenant.
  [[nodiscard]] std::uint64_t bytes() const noexcept { return memory ? memory->bytes() : 0; }
};

/// What the registry keeps of a rank (its collectives are the data plane's:
/// JobSchedule::ranks).
struct RankMembership {
  /// cuda backend: the GPU the rank's memory is on, from its first Hello
  /// (kept while it is detached: a re-attach must come back to it); -1 before.
  std::int32_t device = -1;
  std::shared_ptr<Session> session;  // null while detached
  /// The pool (prefetch_depth + 1, kept with their pages), then slots
  /// beyond it that AcquireSlot::grow asked for (their memory goes back at
  /// their release).
  std::vector<Slot> slots;
};

/// A job: what the data plane schedules (JobSchedule: id, world, this node's
/// ranks, collectives) and what the registry keeps (tenant, members,
/// groups, registrations, memory charged).
struct Job final : JobSchedule {
  std::size_t tenant = 0;
  std::string store;  ///< where the job's daemons meet (jobs across nodes)
  bool persistent = false;
  std::vector<RankMembership> members;       // like JobSchedule::ranks, by local index
  std::map<std::string, GroupState> groups;  // by name
  std::vector<GroupState*> groups_by_id;     // [id - 1]; map nodes never move
  std::map<std::string, PendingGroup> pending;
  std::uint64_t charged = 0;  // bytes charged to the tenant for this job
  std::uint32_t next_group_id = 1;
  std::unique_ptr<asio::steady_timer> grace_timer;
  /// Registrations that failed on a spec mismatch, kept until every rank has
  /// heard why: a rank that arrives later gets the same error at once instead
  /// of starting a registration the others already abandoned.
  struct FailedRegistration {
    Error why;  ///< kConflict naming the two ranks that disagree
    std::set<std::uint32_t> told;  ///< local indices
  };
  std::map<std::string, FailedRegistration> failed;

  /// Every rank's pool is prefetch_depth + 1 slots.
  std::uint32_t prefetch_depth = 0;
  [[nodiscard]] std::size_t poolSlots() const { return prefetch_depth + 1; }

  /// The group of an id, or null (never registered, or unregistered by every rank).
  [[nodiscard]] GroupState* groupById(std::uint32_t group_id) const;
  [[nodiscard]] const GroupGeometry* groupGeometry(std::uint32_t group_id) const override;
  [[nodiscard]] const std::string* groupName(std::uint32_t group_id) const override;
  [[nodiscard]] Result<void> bindGroup(std::uint32_t group_id) override;
};

class JobTable {
 public:
  JobTable(asio::io_context& io, const Config& config, std::uint64_t instance_id);
  /// Jobs' link threads that outlive it no longer wake the loop.
  ~JobTable();
  JobTable(const JobTable&) = delete;
  JobTable& operator=(const JobTable&) = delete;

  void onMessage(const std::shared_ptr<Session>& session, const ipc::FrameHeader& header, ipc::Message message);
  void onClosed(const std::shared_ptr<Session>& session);
  /// One pass of the data plane over every job (DataPlane::poll). Returns
  /// the work done.
  std::size_t pollDataPlane();
  /// See DataPlane::prepareSleep / endSleep.
  [[nodiscard]] bool prepareSleep();
  void endSleep();
  /// Frees every job (daemon shutdown).
  void clear();
  /// What the daemon holds now (Server::stats()).
  struct Counts {
    std::size_t sessions = 0;        ///< attached connections
    std::size_t jobs = 0;            ///< live or persisting jobs
    std::size_t memfds = 0;          ///< shared-memory files held open
    std::uint64_t bytes_in_use = 0;  ///< charged against the memory limit
  };
  [[nodiscard]] Counts counts() const;

  /// Fills in the tenants, the jobs and the memory used (jobs_view.cpp).
  void describe(admin::DaemonView& view, SteadyClock::time_point now) const;
  /// Fills in what a rank's session is attached to (nothing for another).
  void describe(const Session& session, admin::SessionView& view) const;
  /// The planner's report (docs/plan-json.md) of group `group` of job `job`,
  /// or nullopt when there is no such job or group.
  [[nodiscard]] std::optional<std::string> planReport(const std::string& job, const std::string& group) const;
  /// Job `job`'s flight recorder, oldest first, times in seconds since
  /// `epoch` (empty when there is no such job).
  [[nodiscard]] std::vector<admin::TraceEntry> trace(const std::string& job, SteadyClock::time_point epoch) const;
  /// Jobs with at least one rank attached (a drain waits for them).
  [[nodiscard]] std::size_t jobsWithRanks() const;
  /// How long the server loop spins after its last piece of work, and the
  /// ranks after a wait begins, before they sleep: rings.busy_poll_us while
  /// the CPUs dbufd may run on outnumber the attached ranks (one CPU left
  /// for dbufd), else 0. On an oversubscribed node a spinning waiter holds a
  /// core that a rank with work to do is queued for.
  [[nodiscard]] std::chrono::microseconds spin() const noexcept { return spin_; }
  /// A reload (SIGHUP): `fresh` is to replace the tenants (who belongs,
  /// quotas, job limits). Jobs and their charges follow their tenant by name;
  /// a tenant `fresh` no longer names stays while it has jobs, admitting
  /// nobody. Returns the list to install as the config's tenants, at once.
  [[nodiscard]] std::vector<Tenant> retenant(std::vector<Tenant> fresh);
  /// Draining (dbufctl drain): no new job may attach (the ranks of those here
  /// still may); the server stops once no job has a rank attached.
  void refuseNewJobs() { refuse_new_jobs_ = true; }
  [[nodiscard]] bool refusesNewJobs() const noexcept { return refuse_new_jobs_; }

 private:
  struct Attachment {
    std::string job;
    std::uint32_t local = 0;  ///< the rank's local index in its job
  };

  void handleHello(const std::shared_ptr<Session>& session, std::uint64_t request, const ipc::Hello& hello);
  void handleRegister(const std::shared_ptr<Session>& session, std::uint64_t request, const ipc::RegisterGroup& spec);
  void handleUnregister(const std::shared_ptr<Session>& session, std::uint64_t request, std::uint32_t group_id);
  /// A group every rank unregistered: its memory back to the tenant, its name free again.
  void freeGroup(Job& job, GroupState& group);
  void handleAcquire(const std::shared_ptr<Session>& session, std::uint64_t request, const ipc::AcquireSlot& acquire);
  /// A free slot of `rank`'s for `group_id` (see Slot::last_group); end() if none.
  static std::vector<Slot>::iterator freeSlotFor(RankMembership& rank, std::uint32_t group_id);
  /// Makes `slot` at least `bytes` long (charging the tenant); errors are
  /// kInfeasible when over quota.
  Result<void> growSlot(Job& job, Slot& slot, std::uint64_t bytes, std::uint32_t rank, const std::string& group);
  void handleRelease(const std::shared_ptr<Session>& session, std::uint64_t request, std::uint32_t group_id);

  Result<Job*> attachTo(const ipc::Hello& hello, const ipc::PeerCredentials& peer, std::size_t tenant);
  /// Whether this daemon takes a new job whose ranks span nodes: its
  /// [cluster] address is set, the job is on the host backend and its store
  /// is one the job's user may have the daemon use.
  [[nodiscard]] Result<void> acceptAcrossNodes(const ipc::Hello& hello, Placement placement,
                                               const ipc::PeerCredentials& peer) const;
  [[nodiscard]] static NodeJob nodeJob(const Job& job);
  /// Checks the rank's GPU (checkRankDevice) and records it; makes the job's
  /// executor once its placement is complete (host, one GPU: at the first
  /// rank; a GPU per rank: once every rank's GPU is known).
  [[nodiscard]] Result<void> placeRank(Job& job, const ipc::Hello& hello);
  /// The job's executor, given the rank attaching now; null while the
  /// placement is incomplete (a GPU per rank: ranks still to come).
  [[nodiscard]] Result<std::unique_ptr<Executor>> executorFor(const Job& job, const ipc::Hello& hello) const;
  /// Where rank `rank`'s shards and slots are made: host memory, or its GPU's.
  DbufferAllocator& allocatorFor(const Job& job, std::uint32_t rank);
  void completeRegistration(Job& job, const std::string& name);
  Result<GroupState> buildGroup(Job& job, const ipc::RegisterGroup& spec);
  /// True (and the rank is told) if `name` failed on a spec mismatch this
  /// rank has not heard about yet.
  bool reportEarlierMismatch(Job& job, std::uint32_t rank, const std::string& name,
                             const std::shared_ptr<Session>& session, std::uint64_t request);
  /// Fails registration `name` for every rank waiting in it with `why`.
  void failPending(Job& job, const std::string& name, const Error& why);
  static void replyGroup(const GroupState& group, std::uint32_t rank, const std::shared_ptr<Session>& session,
                         std::uint64_t request);
  /// Sets spin() from the ranks attached now and advises every attached
  /// rank's ring of it (after a rank attached or left).
  void adviseSpin();
  void releaseRank(Job& job, std::uint32_t rank, RankEnd end);
  void jobLostAllRanks(Job& job);
  void freeJob(const std::string& id);

  [[nodiscard]] std::optional<std::size_t> tenantOf(const ipc::PeerCredentials& peer) const;
  [[nodiscard]] std::size_t jobsOfTenant(std::size_t tenant) const;
  Attachment* attachmentOf(const Session& session);
  [[nodiscard]] admin::JobView describe(const Job& job, SteadyClock::time_point now) const;

  asio::io_context& io_;
  const Config& config_;
  std::uint64_t instance_id_;
  MemoryBudget budget_;
  std::unique_ptr<DbufferAllocator> allocator_;  // host memory (the host backend)
  // The host executors' shared all-reduce scratch (fp32, or half as many
  // fp64; the data plane runs one step at a time), left uninitialised so its
  // pages cost nothing until an all-reduce touches them.
  std::unique_ptr<float[]> host_scratch_;
  std::map<std::int32_t, std::unique_ptr<DbufferAllocator>> gpu_allocators_;  // cuda backend: per GPU
  GpuOffer gpu_offer_;
  ClusterContext cluster_;
  DataPlane data_plane_;
  std::vector<JobSchedule*> job_order_;  // every job, in the order the data plane serves them
  std::map<std::string, Job> jobs_;
  std::unordered_map<std::uint64_t, Attachment> attachments_;  // by session id
  bool refuse_new_jobs_ = false;
  unsigned cpus_ = 1;  // the CPUs dbufd may run on (its affinity at start)
  std::chrono::microseconds spin_{};
};

}  // namespace dbuf::daemon
