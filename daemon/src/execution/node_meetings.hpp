#pragma once
// A job's link to its other nodes, meeting after meeting (host and nccl
// executors across nodes): made when the executor is, lost when an exchange
// fails or a rank goes, made again once this node has all its ranks and the
// lost link's steps have ended. Each meeting has its own link, its own
// staging memory (what Gloo still holds of a lost link's exchanges may land
// in the old one yet) and its own count of ops: the k-th op since the
// nodes met must match on every node.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>

#include "dbuf/common/result.hpp"
#include "node_link.hpp"
#include "node_transfer.hpp"

namespace dbuf::daemon {

class NodeMeetings {
 public:
  /// Meets the other nodes now, while the ranks register their groups.
  NodeMeetings(const NodeJob& job, const ClusterContext& cluster);

  [[nodiscard]] NodeLink& link() noexcept { return *link_; }
  [[nodiscard]] const NodeLayout& layout() const { return link_->layout(); }
  [[nodiscard]] const std::shared_ptr<Staging>& staging() const noexcept { return staging_; }
  [[nodiscard]] bool up() const noexcept { return state_ == State::kUp; }
  [[nodiscard]] bool lost() const noexcept { return state_ == State::kLost; }

  /// Whether an op can begin now: true once the link is up and idle (an
  /// earlier op's rounds have ended); false while the nodes meet (a first
  /// meeting that failed before every node came is tried again); the error
  /// when that meeting failed after they came (the link is then lost).
  [[nodiscard]] Result<bool> readyForAnOp();
  /// Why the job's ops cannot run now (null while the link is up). Moves the
  /// meetings on: a link made becomes up, a lost one is met again when it can.
  [[nodiscard]] const Error* unavailable();

  /// The link cannot be used any more, because of `why`: no later step of
  /// it runs, and the job's ops fail until its nodes meet again.
  void lose(const Error& why);
  /// A rank of this node went: no meeting until it is back.
  void rankMissing() noexcept { whole_ = false; }
  /// Every rank of this node is attached (again).
  void ranksAttached();
  /// `lost` runs (on the loop's thread) each time the link is lost.
  void whenLost(std::function<void()> lost) { when_lost_ = std::move(lost); }

  /// The number of the data plane's collective `sequence` among the ops
  /// since the nodes last met: the first one asked about is 0.
  [[nodiscard]] std::uint64_t sinceMeeting(std::uint64_t sequence);
  /// Op `sequence` sent its round 0 (its header) on this meeting's link:
  /// it then fails, if it does, on every node alike.
  void commit(std::uint64_t sequence) noexcept { committed_ = sequence; }
  [[nodiscard]] std::optional<std::uint64_t> committed() const noexcept { return committed_; }

 private:
  enum class State : std::uint8_t { kUp, kLost, kMeeting };

  /// Posts the step that makes the link (it runs before any other).
  void meet();
  /// lose() for a link already broken.
  void markLost(const Error& why);
  /// A new meeting, once the lost link is done with and every rank of this
  /// node is attached. The other nodes lose their link too (from this
  /// node's failure header, or their own timeout) and come.
  void meetAgainIfReady();

  NodeJob job_;  // with the current meeting's number
  ClusterContext cluster_;
  std::unique_ptr<NodeLink> link_;
  std::shared_ptr<Staging> staging_;
  State state_ = State::kUp;  // up, or being made the first time: ops wait for it
  std::optional<Error> lost_;  // why, while the link is not up: the job's ops fail with it
  bool whole_ = true;          // every rank of this node is attached
  std::function<void()> when_lost_;
  std::optional<std::uint64_t> first_sequence_;  // of the ops since the nodes met
  std::optional<std::uint64_t> committed_;
};

}  // namespace dbuf::daemon
