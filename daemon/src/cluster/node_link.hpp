#pragma once
// A job's link to its other nodes: a thread of its own that meets the other
// nodes' daemons through the job's store, takes (or makes) the communicator
// between them, and then runs the job's inter-node steps in order, one at a
// time. Gloo's calls block, so none of this runs on the daemon's loop: the
// executor posts a step and polls its ticket; the thread wakes the loop when
// a step ends.
//
// Steps touch only memory the daemon owns and shares with them (never a
// rank's), so a step may finish after the op that posted it was failed, or
// after the job is gone (its thread is then left to end on its own, bounded
// by the link's watchdog).

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cluster.hpp"
#include "dbuf/common/result.hpp"

namespace dbuf::daemon {

/// Where a job's ranks are: its nodes in rank order (each node's ranks are
/// contiguous), and which node is this daemon's.
struct NodeLayout {
  std::vector<std::uint32_t> first_ranks;  ///< nodes + 1 entries: node n has ranks [first_ranks[n], first_ranks[n+1])
  std::uint32_t node = 0;

  [[nodiscard]] std::uint32_t nodes() const noexcept {
    return static_cast<std::uint32_t>(first_ranks.size()) - 1;
  }
  [[nodiscard]] std::uint32_t firstRank(std::uint32_t n) const noexcept { return first_ranks[n]; }
  [[nodiscard]] std::uint32_t rankCount(std::uint32_t n) const noexcept {
    return first_ranks[n + 1] - first_ranks[n];
  }
  /// "node 1 (ranks 2-3)".
  [[nodiscard]] std::string describeNode(std::uint32_t n) const;
  /// The ranks of node n.
  [[nodiscard]] std::vector<std::uint32_t> ranksOf(std::uint32_t n) const;
};

/// What a job tells its link about itself.
struct NodeJob {
  std::string job_id;
  StoreSpec store;
  std::uint32_t world_size = 1;
  std::uint32_t first_rank = 0;   ///< this node's first rank
  std::uint32_t local_count = 1;  ///< this node's ranks
  /// How many times the job's nodes met before (each lost link ends one):
  /// every meeting has keys of its own. A meeting that fails before every
  /// node has come is tried again: the first by the job's next op, a later
  /// one until the other nodes come (the job's ops fail meanwhile, and
  /// nothing else retries). One that fails after breaks the link.
  std::uint32_t meeting = 0;
  /// What the nodes have when they have met.
  struct Meeting {
    gloo::rendezvous::Store& keys;  ///< the meeting's own
    const NodeLayout& layout;
    const std::string& daemons;  ///< the key of their Gloo communicator: the ordered daemon identities
    std::uint32_t number;
  };
  /// Run on the link thread at every meeting, once the nodes are found and
  /// agree on the Gloo communicator: what else the job's daemons must set
  /// up together (the NCCL communicator of a job on GPUs). The link is made
  /// once it succeeds.
  using AfterMeeting = std::function<Result<void>(const Meeting& meeting)>;
  AfterMeeting after_meeting;
};

/// At a meeting (in an after_meeting): the communicator of `kind` ("nccl")
/// the nodes use. Each node's daemon takes its idle one for `key` from
/// `idle` and says which it holds; the same one on every node is used
/// again. Else `make(id)` makes a new one, with the id node 0's daemon
/// proposed (`proposal`; the others pass 0), and an idle one taken goes
/// back. Gloo's store errors are thrown, as in an after_meeting.
[[nodiscard]] Result<IdleCommunicators::Entry> idleOrNew(
    const NodeJob::Meeting& meeting, const std::string& kind, IdleCommunicators& idle, const std::string& key,
    std::uint64_t proposal, std::chrono::milliseconds timeout,
    const std::function<Result<std::shared_ptr<void>>(std::uint64_t id)>& make);

/// Thrown by a step whose wait the watchdog ended: the job's exchange is
/// over (its tag may still hold a late message), the communicator is fine.
class LinkTimeout : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Ends a link thread's waits in Gloo at dbufd's deadline. Gloo's own
/// timeout would close every connection of the context, failing every job
/// that shares it; an aborted wait ends only the waiting job's exchange.
/// Its own thread; arm() and disarm() are called by the link thread.
class Watchdog {
 public:
  Watchdog();
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  /// At `deadline`, aborts the waits on `buffers` (alive until disarm()).
  void arm(std::vector<gloo::transport::UnboundBuffer*> buffers, std::chrono::steady_clock::time_point deadline);
  /// Stops watching; whether the deadline came first (the waits were aborted).
  bool disarm();

 private:
  void run();
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<gloo::transport::UnboundBuffer*> buffers_;
  std::chrono::steady_clock::time_point deadline_ = std::chrono::steady_clock::time_point::max();
  bool fired_ = false;
  bool stopping_ = false;
  std::thread thread_;
};

/// What a step runs with: the communicator (its context, and where an
/// exchange that timed out leaves what Gloo still holds), the job's tag on
/// it, the layout, and the watchdog of the link's waits.
struct LinkChannel {
  std::shared_ptr<gloo::Context> context;
  Communicator& communicator;
  std::uint32_t tag;
  std::chrono::milliseconds timeout;  ///< for data transfers
  const NodeLayout& layout;
  Watchdog& watchdog;
};

class NodeLink {
 public:
  using Step = std::function<Result<void>(const LinkChannel&)>;
  /// A posted step's outcome: `result` is valid once `done` is true.
  struct Ticket {
    std::atomic<bool> done{false};
    Result<void> result;
  };

  NodeLink(NodeJob job, ClusterContext cluster);
  /// Stops the thread: joined if it is idle, else left to finish its step.
  ~NodeLink();
  NodeLink(const NodeLink&) = delete;
  NodeLink& operator=(const NodeLink&) = delete;

  /// Queues `step` after those posted before it (the first one also waits
  /// for the link to be made).
  [[nodiscard]] std::shared_ptr<Ticket> post(Step step);
  /// Whether every step posted so far has ended.
  [[nodiscard]] bool idle() const;
  /// Whether the link is made (layout() is then valid, and stays so).
  [[nodiscard]] bool connected() const noexcept;
  /// Why no later step runs, if none does: the steps reached a breakLink()
  /// marker, one of them ended the job's use of the connections (a timeout,
  /// a transport error), or the meeting failed once every node had come to
  /// it (its keys are spent: the nodes meet again under the next one's).
  [[nodiscard]] std::optional<Error> broken() const;
  [[nodiscard]] const NodeLayout& layout() const;
  /// Once the steps posted so far have run, every later one fails with `why`
  /// (a fatal error, on this node or another: the job cannot run collectives
  /// across nodes any more).
  void breakLink(const Error& why);

 private:
  struct State;
  std::shared_ptr<State> state_;
  std::thread thread_;
};

}  // namespace dbuf::daemon
