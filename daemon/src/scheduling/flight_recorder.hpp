#pragma once
// A job's last collectives, in the manner of PyTorch's Flight Recorder: what
// each was, when each of this node's ranks submitted it, when it ran, how it
// ended. A ring of fixed entries, filled as each op ends (DataPlane::finish):
// no allocation per op, but a failure's message. Read by `dbufctl trace` and
// dumped into the log when an op times out or a rank dies.

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "dbuf/common/result.hpp"
#include "dbuf/ipc/ring.hpp"

namespace dbuf::daemon {

struct OpRecord {
  using Clock = std::chrono::steady_clock;
  std::uint64_t sequence = 0;
  ipc::OpCode op = ipc::OpCode::kNoop;
  std::uint32_t group_id = 0;
  std::uint64_t unsharded_bytes = 0;  ///< a rank's unsharded copy of the group (0: a barrier)
  /// Per local rank: when it submitted the op; Clock::time_point{} when it had not.
  std::vector<Clock::time_point> submitted;
  Clock::time_point started;  ///< matched: every rank had submitted it (or it failed then)
  Clock::time_point ended;
  bool ok = true;
  ErrorCode code = ErrorCode::kInternal;  ///< when !ok
  std::string error;                      ///< when !ok
};

class FlightRecorder {
 public:
  static constexpr std::size_t kCapacity = 64;

  /// Makes room for `local_ranks` ranks' submit times in every entry.
  explicit FlightRecorder(std::uint32_t local_ranks = 0) : entries_(kCapacity) {
    for (OpRecord& entry : entries_) entry.submitted.resize(local_ranks);
  }

  /// The entry for the op that just ended (the oldest is overwritten); its
  /// submitted times are to be filled in, all of them.
  OpRecord& next() {
    OpRecord& entry = entries_[next_ % kCapacity];
    ++next_;
    return entry;
  }

  /// Oldest first.
  [[nodiscard]] std::vector<const OpRecord*> records() const {
    std::vector<const OpRecord*> out;
    const std::uint64_t first = next_ > kCapacity ? next_ - kCapacity : 0;
    for (std::uint64_t i = first; i < next_; ++i) out.push_back(&entries_[i % kCapacity]);
    return out;
  }

 private:
  std::vector<OpRecord> entries_;
  std::uint64_t next_ = 0;  ///< entries ever recorded
};

}  // namespace dbuf::daemon
