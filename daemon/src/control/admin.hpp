#pragma once
// Operators' requests (dbufctl; docs/operations.md): what a request asks,
// who may ask it, and the answer as JSON, over a snapshot of the daemon's
// state (DaemonView). Pure functions over value types: the server takes the
// snapshot and answers on its loop; the fuzz harness feeds them its own.
// Nothing here changes the daemon: the server carries out a drain.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dbuf/common/result.hpp"
#include "dbuf/daemon/config.hpp"
#include "dbuf/ipc/protocol.hpp"
#include "dbuf/ipc/socket.hpp"
#include "op_stats.hpp"

namespace dbuf::daemon::admin {

// ---------------------------------------------------------- the snapshot

struct RankView {
  std::uint32_t rank = 0;  ///< global
  bool attached = false;
  bool gone = false;  ///< its connection ended while others of the job stayed
  std::uint64_t session = 0;  ///< 0 while detached
  std::int32_t pid = 0;
  std::uint32_t uid = 0;
  std::int32_t device = -1;       ///< cuda backend: the GPU of its memory
  std::uint64_t queued_ops = 0;   ///< collectives it submitted that wait for the others
  std::uint64_t owed_errors = 0;  ///< collectives it missed (they timed out without it)
  std::uint64_t slot_bytes = 0;   ///< its unsharded slots
};

struct GroupView {
  std::string name;
  std::uint32_t id = 0;
  std::uint32_t devices = 0;
  std::uint64_t tensors = 0;
  std::int64_t numel = 0;        ///< elements of its tensors together
  std::int64_t shard_elems = 0;  ///< per rank, padding included
  std::string sharded_dtype;
  std::string unsharded_dtype;
  std::uint64_t shard_bytes = 0;  ///< per rank: its shard and sharded gradient
  std::uint64_t slot_bytes = 0;   ///< an unsharded slot holding it
};

/// A group registration some ranks have made and the others have not yet.
struct RegistrationView {
  std::string group;
  std::vector<std::uint32_t> registered;   ///< global ranks
  std::vector<std::uint32_t> waiting_for;  ///< global ranks of this node still to register
};

/// The job's next collective, when some rank has submitted it.
struct OpView {
  std::uint64_t sequence = 0;
  std::string op;     ///< "allGather", ...
  std::string group;  ///< empty for a barrier
  std::string state;  ///< "waiting for ranks", "waiting for streams", "running"
  double waiting_s = 0;  ///< since the first rank submitted it
  std::vector<std::uint32_t> submitted;    ///< global ranks of this node
  std::vector<std::uint32_t> waiting_for;  ///< global ranks of this node that have not
};

struct JobView {
  std::string id;
  std::size_t tenant = 0;  ///< index into DaemonView::tenants
  std::uint32_t world_size = 0;
  std::uint32_t first_rank = 0;  ///< this node's ranks are first_rank .. + ranks.size() - 1
  std::string placement;
  bool persistent = false;
  std::uint64_t memory_bytes = 0;  ///< charged to its tenant
  std::uint64_t collectives_completed = 0;
  std::vector<RankView> ranks;  ///< this node's
  std::vector<GroupView> groups;
  std::vector<RegistrationView> registrations;
  std::optional<OpView> current;
  OpStats op_stats;  ///< its collectives counted (the metrics endpoint's)

  /// "running" (every rank attached), "attaching", "rank lost", "detached".
  [[nodiscard]] std::string state() const;
  [[nodiscard]] std::size_t attachedRanks() const;
};

/// One collective of a job's flight recorder, as it ended.
struct TraceEntry {
  std::uint64_t sequence = 0;
  std::string op;
  std::string group;  ///< empty for a barrier
  std::uint64_t unsharded_bytes = 0;
  /// Per rank of this node (JobView::first_rank + i): when it submitted the
  /// op, in seconds since the daemon started; nullopt when it had not.
  std::vector<std::optional<double>> submitted_s;
  double start_s = 0;  ///< every rank had submitted it (or it failed then)
  double end_s = 0;
  std::string result;  ///< "ok", or the error's code ("timeout", "conflict", ...)
  std::string error;
};

struct TenantView {
  std::string name;
  std::uint64_t memory_quota_bytes = 0;
  std::uint64_t memory_used_bytes = 0;
  std::uint32_t max_jobs = 0;
};

struct SessionView {
  std::uint64_t id = 0;
  ipc::PeerCredentials peer;
  std::optional<std::size_t> tenant;  ///< its peer's (index into DaemonView::tenants)
  std::string kind;  ///< "rank", "operator", "handshake" (neither yet)
  std::string job;   ///< a rank's
  std::uint32_t rank = 0;
  double age_s = 0;
};

struct DaemonView {
  std::uint64_t instance_id = 0;
  std::int32_t pid = 0;
  std::uint32_t uid = 0;  ///< the daemon's
  std::string socket;
  std::string backend;
  std::string version;  ///< the build's (dbuf::buildInfo())
  std::string commit;   ///< the git commit it was built from
  double uptime_s = 0;
  double started_unix_s = 0;  ///< when it started, in seconds since the epoch
  double loop_busy_s = 0;     ///< time its loop spent doing work (not waiting) since it started
  /// "http://HOST:PORT/metrics"; empty when it serves no metrics (see metrics_error).
  std::string metrics_url;
  std::string metrics_error;  ///< why not, when [metrics] listen names an address it could not take
  std::uint64_t memory_limit_bytes = 0;
  std::uint64_t memory_used_bytes = 0;
  bool draining = false;
  std::vector<TenantView> tenants;
  std::vector<JobView> jobs;
  std::vector<SessionView> sessions;
  /// Verb::kPlan only: the planner's report of the asked group
  /// (docs/plan-json.md); nullopt when the job has no such group.
  std::optional<std::string> plan_report;
  /// Verb::kTrace only: the asked job's flight recorder, oldest first.
  std::vector<TraceEntry> trace;
};

// ---------------------------------------------------------- requests

enum class Verb : std::uint8_t { kStatus, kJobs, kJob, kSessions, kPlan, kTrace, kDrain };

struct Query {
  Verb verb = Verb::kStatus;
  std::string job;    ///< kJob, kPlan, kTrace
  std::string group;  ///< kPlan
};

/// The query an AdminRequest makes, or kInvalidArgument naming what is wrong
/// (an unknown verb, missing or extra arguments, a malformed job id).
[[nodiscard]] Result<Query> parseRequest(const ipc::AdminRequest& request);

/// What a peer may see: everything (root, the daemon's uid, [admin] uids and
/// gids), or its own tenant's jobs and sessions.
struct Access {
  bool everything = false;
  std::optional<std::size_t> tenant;  ///< the peer's tenant, if any
};

/// The access of a peer, or kPermissionDenied when it is neither an
/// administrator nor a tenant's user. `groups`: its supplementary groups.
[[nodiscard]] Result<Access> authorize(const Config& config, std::uint32_t daemon_uid, const ipc::PeerCredentials& peer,
                                       std::span<const std::uint32_t> groups);

/// The answer to `query` as JSON (at most ipc::kMaxAdminReplyBytes), showing
/// only what `access` allows: another tenant's job is "not found", as a job
/// that does not exist. A drain needs the administrator's access (the caller
/// starts it before answering: the answer lists the jobs it waits for).
/// Errors: kNotFound, kPermissionDenied, kInfeasible (an answer too large
/// for one reply).
[[nodiscard]] Result<std::string> answer(const Query& query, const Access& access, const DaemonView& view);

}  // namespace dbuf::daemon::admin
