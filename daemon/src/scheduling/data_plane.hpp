#pragma once
// The data plane: every session's rings, the per-rank queues of submitted
// collectives, matching of the k-th op of every rank of a job, timeouts,
// dead ranks, and fair execution of matched ops across jobs. Runs on the
// server's loop thread, between control-plane events (Server::run polls it).
//
// Hot path (a submission, its match, its completion): no allocation, no lock,
// no system call unless a client sleeps. Errors allocate their messages.

#include <asio.hpp>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dbuf/common/shared_memory.hpp"
#include "dbuf/common/unique_fd.hpp"
#include "dbuf/daemon/config.hpp"
#include "dbuf/ipc/ring.hpp"
#include "executor.hpp"
#include "flight_recorder.hpp"
#include "op_stats.hpp"
#include "placement.hpp"

namespace dbuf::daemon {


using SteadyClock = std::chrono::steady_clock;

/// A session's end of the rings: its segment and the eventfd its client
/// writes when the daemon sleeps.
struct SessionPlane {
  SessionPlane() = default;
  SessionPlane(const SessionPlane&) = delete;
  SessionPlane& operator=(const SessionPlane&) = delete;
  /// Closes the doorbell: a wake-up already queued for it finds it closed.
  /// Poisons the stream counters if the session ordered ops on a stream.
  ~SessionPlane();

  UniqueFd segment_fd;
  Mapping segment;
  ipc::DaemonRings rings;
  /// Owns the eventfd. Shared with its pending wait's handler, which may run
  /// after the plane is gone (a doorbell and the session's EOF in one batch).
  std::shared_ptr<asio::posix::stream_descriptor> doorbell;

  // Stream-ordered ops (GPU memory): the session's counters as the job's
  // executor writes them (made at its first such op; destroyed before the
  // segment); the last ticket taken (tickets only grow); whether the
  // ordering is over (an op failed and done was poisoned).
  std::unique_ptr<SessionCounters> counters;
  std::uint64_t last_ticket = 0;
  bool stream_order_over = false;
};

struct PendingOp {
  ipc::Submission submission;
  SteadyClock::time_point submitted;
};

/// A fixed-capacity FIFO of one rank's collectives waiting for the others
/// (capacity = the ring's: it can never overflow, since a submission is taken
/// only while the rank has completion room for it).
class OpQueue {
 public:
  void reset(std::uint32_t capacity) {
    entries_.assign(capacity, PendingOp{});
    head_ = 0;
    size_ = 0;
  }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] const PendingOp& front() const noexcept { return entries_[head_]; }
  [[nodiscard]] bool push(const PendingOp& op) noexcept {
    if (size_ == entries_.size()) return false;
    entries_[(head_ + size_) % entries_.size()] = op;
    ++size_;
    return true;
  }
  void pop() noexcept {
    head_ = (head_ + 1) % entries_.size();
    --size_;
  }
  template <typename Predicate>
  [[nodiscard]] bool any(Predicate predicate) const {
    for (std::size_t i = 0; i < size_; ++i) {
      if (predicate(entries_[(head_ + i) % entries_.size()])) return true;
    }
    return false;
  }
  void clear() noexcept {
    head_ = 0;
    size_ = 0;
  }

 private:
  std::vector<PendingOp> entries_;
  std::size_t head_ = 0;
  std::size_t size_ = 0;
};

/// A job's collective state.
struct JobCollectives {
  std::uint64_t next_sequence = 0;  ///< index of the next collective to match
  bool validated = false;           ///< the ranks' next ops agree and can run (they may wait for streams)
  bool running = false;             ///< the op is executing
  bool draining = false;            ///< the op is all queued; waiting for the executor to finish it
  /// Where the job's collectives run (host, one GPU, or a GPU per rank);
  /// null until the job's placement is known (one rank per GPU: every rank
  /// has attached).
  std::unique_ptr<Executor> executor;
  CollectiveArgs args;
  std::uint32_t group_id = 0;
  SteadyClock::time_point matched;
  SteadyClock::time_point finished;  ///< when the previous collective ended (timeouts count from it)
  std::vector<RankBuffers> buffers;  ///< world entries, reused by every op
};

/// A rank's part in its job's collectives.
struct RankSchedule {
  std::unique_ptr<SessionPlane> plane;  ///< its session's rings; null while it is detached
  OpQueue ops;                          ///< collectives waiting for the other ranks
  /// Collectives this rank missed (they timed out without it): its next
  /// submissions fail with these errors, so its k-th op stays the others' k-th.
  std::deque<Error> owed;
  /// Its rings are full (see OpStats::ring_full): counted once per filling.
  bool rings_full = false;
};

/// A job as the data plane schedules it: its node's ranks' rings and queues,
/// the state of its next collective and where its collectives run. The job
/// registry's Job (jobs.hpp) is one, and answers for the job's groups; the
/// data plane sees nothing else of it (tests make their own).
struct JobSchedule {
  JobSchedule() = default;
  virtual ~JobSchedule() = default;
  JobSchedule(const JobSchedule&) = delete;
  JobSchedule& operator=(const JobSchedule&) = delete;
  JobSchedule(JobSchedule&&) noexcept = default;
  JobSchedule& operator=(JobSchedule&&) noexcept = default;

  std::string id;
  std::uint32_t world_size = 1;  ///< ranks of the job on every node
  /// The job's ranks on this node are first_rank .. first_rank + ranks.size()
  /// - 1 (contiguous, as torchrun numbers them); `ranks` and everything
  /// indexed like it hold this node's ranks only, by local index. Messages
  /// and errors name global ranks.
  std::uint32_t first_rank = 0;
  Placement placement = Placement::kHost;
  std::vector<RankSchedule> ranks;
  JobCollectives collectives;
  /// Ranks (global) whose connection ended while others of the job stayed
  /// attached, and that have not attached again: no collective (nor a group
  /// registration, the registry's) can complete without them, so they fail
  /// at once, naming them. Cleared when every rank is gone (a restart of the
  /// whole job then attaches in any order).
  std::set<std::uint32_t> gone;
  /// Its last collectives, as they ended.
  FlightRecorder recorder;
  /// Its collectives counted, since it began (the metrics endpoint's).
  OpStats stats;

  [[nodiscard]] std::uint32_t localCount() const noexcept { return static_cast<std::uint32_t>(ranks.size()); }
  [[nodiscard]] std::uint32_t globalRank(std::uint32_t local) const noexcept { return first_rank + local; }
  /// Whether some of the job's ranks are on other nodes.
  [[nodiscard]] bool acrossNodes() const noexcept { return localCount() < world_size; }

  /// The geometry of group `group_id`, or null when the job has no such group.
  [[nodiscard]] virtual const GroupGeometry* groupGeometry(std::uint32_t group_id) const = 0;
  /// The name of group `group_id`, or null when the job has no such group.
  [[nodiscard]] virtual const std::string* groupName(std::uint32_t group_id) const = 0;
  /// Points collectives.buffers at group `group_id`'s memory on every rank, or
  /// kConflict: "ranks 1, 3 hold no unsharded slot for the group ..." with
  /// those ranks.
  [[nodiscard]] virtual Result<void> bindGroup(std::uint32_t group_id) = 0;
};

/// What DataPlane::poll() found besides the work it did: a rank whose ring
/// is corrupt (the registry closes its session).
struct CorruptRing {
  JobSchedule* job = nullptr;
  std::uint32_t rank = 0;  ///< local index
  Error why;
};

/// How a rank left its job.
enum class RankEnd {
  kDetached,  ///< it asked to (ipc::Detach): an orderly end
  kLost,      ///< its connection closed without asking (the process died, or closed its socket)
};

class DataPlane {
 public:
  /// Bytes a job may write per turn before the next job's turn.
  static constexpr std::uint64_t kTurnBytes = std::uint64_t{16} << 20;

  DataPlane(asio::io_context& io, const Config& config);

  /// A new session's segment and doorbell (armed: a ring of the doorbell
  /// wakes the loop); `label` names the memfd.
  [[nodiscard]] Result<std::unique_ptr<SessionPlane>> openSession(const std::string& label);

  /// One pass over every job: takes the ranks' submissions, then progresses
  /// the jobs' collectives in turn, one turn (up to kTurnBytes) each,
  /// starting one job further each pass, so that a job with a long op cannot
  /// starve another one's. Returns the work done; a rank whose ring is
  /// corrupt ends the pass early, in `corrupt`.
  std::size_t poll(std::span<JobSchedule* const> jobs, SteadyClock::time_point now, std::optional<CorruptRing>& corrupt);
  /// Takes what `rank` submitted (while it has completion room). Returns the
  /// number of entries taken; kCorrupt rings come back as an error (the
  /// caller closes the session).
  [[nodiscard]] Result<std::size_t> takeSubmissions(JobSchedule& job, std::uint32_t rank, SteadyClock::time_point now);
  /// Matches, runs one step of, or times out the job's next collective.
  /// Returns the amount of work done (0: nothing could progress).
  std::size_t progress(JobSchedule& job, SteadyClock::time_point now);
  /// `rank` of `job` is gone: its queue is dropped, and every op of the other
  /// ranks that needs it fails now, naming it. The job's flight recorder is
  /// logged when ops fail or the rank was lost, not after an orderly detach.
  void rankGone(JobSchedule& job, std::uint32_t rank, RankEnd end);

  /// Before sleeping: flags every ring so clients ring the doorbell; false if
  /// something is already waiting (do not sleep). Arms the timeout timer.
  [[nodiscard]] bool prepareSleep(std::span<JobSchedule* const> jobs);
  void endSleep(std::span<JobSchedule* const> jobs);
  /// Cancels the timeout timer (shutdown: nothing may keep the loop alive).
  void stop();

 private:
  static void armDoorbell(const std::shared_ptr<asio::posix::stream_descriptor>& doorbell);
  void enqueue(JobSchedule& job, std::uint32_t rank, const ipc::Submission& submission, SteadyClock::time_point now);
  /// Checks the ranks' next ops (failing them, or finishing a barrier, at
  /// once); true when they can run.
  bool match(JobSchedule& job, SteadyClock::time_point now);
  /// Whether every stream-ordered rank's stream has reached the op.
  [[nodiscard]] static bool streamsReady(const JobSchedule& job);
  /// Fails the op if a rank's stream did not reach it within the collective
  /// timeout; true if it did.
  bool checkStreamTimeout(JobSchedule& job, SteadyClock::time_point now);
  /// Starts the matched op on the job's executor (or fails it); false when
  /// the executor is not ready for it yet (it stays matched, and waits like
  /// an op waiting for a GPU).
  bool start(JobSchedule& job);
  /// Fails the op if the executor was not ready within the collective
  /// timeout of the match; true if it did.
  bool executorTimeout(JobSchedule& job);
  /// "collective #N <op> timed out after T ms: <why>".
  [[nodiscard]] std::string timedOut(const JobSchedule& job, const ipc::Submission& op, const std::string& why) const;
  /// The op's last step is queued: the stream-ordered ranks' done counters
  /// after it, then the executor's completion mark.
  [[nodiscard]] static Result<void> markQueued(JobSchedule& job);
  /// Completes the front op of every rank that has one: with `error` (its
  /// code, message and ranks), or successfully when it is null.
  /// A failure that leaves the executor unavailable fails every queued op
  /// too.
  void finish(JobSchedule& job, const Error* error, SteadyClock::time_point now);
  /// Records the op ending now (the fronts', `error` or success) in the
  /// job's flight recorder and counts it in its stats.
  static void record(JobSchedule& job, const Error* error, SteadyClock::time_point now);
  /// Logs the job's last collectives (after a timeout or a dead rank).
  static void logRecent(const JobSchedule& job);
  /// Fails the front op of every rank that has one, with `error`.
  void failFronts(JobSchedule& job, const Error& error);
  /// Fails every queued op of every rank with `error` (none of them can
  /// run); they were never matched, so they take no sequence.
  void failQueued(JobSchedule& job, const Error& error);
  /// The running op failed (in a step, or on the GPU): waits out its queued
  /// work, fails it on every rank. Returns the work done (1).
  std::size_t failRunning(JobSchedule& job, const Error& error);
  /// Fails the waiting ranks' next op if it waited too long; true if it did.
  bool checkTimeout(JobSchedule& job, SteadyClock::time_point now);
  /// Why the matched fronts cannot run (kConflict, naming the ranks whose op
  /// differs from rank 0's or that hold no slot), or nothing; fills
  /// job.collectives.
  [[nodiscard]] Result<void> validateFronts(JobSchedule& job);
  /// Answers `submission` of `rank`. A failed stream-ordered op poisons the
  /// session's done counter (its trainer's stream must not wait forever).
  static void completeOne(JobSchedule& job, std::uint32_t rank, const ipc::Submission& submission,
                          const ipc::Completion& completion, std::string_view message);
  /// Fails `submission` of `rank` alone with `error` (code, message, ranks).
  static void failOne(JobSchedule& job, std::uint32_t rank, const ipc::Submission& submission, const Error& error);
  /// Why `rank` cannot submit this stream-ordered op, or empty.
  [[nodiscard]] static std::string streamOrderProblem(const JobSchedule& job, std::uint32_t rank,
                                                      const ipc::Submission& submission);
  [[nodiscard]] static std::string describe(const JobSchedule& job, const ipc::Submission& submission);
  [[nodiscard]] static std::string mismatchMessage(const JobSchedule& job);

  asio::io_context& io_;
  const Config& config_;
  asio::steady_timer timeout_timer_;
  SteadyClock::time_point armed_deadline_ = SteadyClock::time_point::max();
  // Wakes the loop while an op waits for a GPU (its streams, or its work to
  // finish): nothing rings a doorbell when a GPU writes a counter.
  asio::steady_timer gpu_poll_timer_;
  bool gpu_poll_armed_ = false;
  std::size_t next_job_turn_ = 0;  // poll(): the job that goes first
};

}  // namespace dbuf::daemon
