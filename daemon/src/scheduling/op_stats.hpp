#pragma once
// A job's collectives counted for the metrics endpoint (metrics.hpp): how
// many ended, by op and result, the bytes they moved, how long they waited
// for their ranks and ran, and the job's ring-full events and lost ranks.
// Plain counters kept by the data plane on the loop thread (no atomics, no
// allocation: an op's end adds to fixed arrays); the endpoint reads a copy.

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>

#include "dbuf/common/result.hpp"
#include "dbuf/ipc/ring.hpp"

namespace dbuf::daemon {

/// Counts of observations at or below each of kBounds, in seconds (the
/// Prometheus histogram's `le` buckets; +Inf is `count`).
struct DurationHistogram {
  /// 10 us .. 100 s in steps of about 3x: a collective of a small group on
  /// one node takes tens of microseconds; one waiting for a straggler, up to
  /// the collective timeout.
  static constexpr std::array<double, 15> kBounds = {1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2,
                                                     0.1,  0.3,  1.0,  3.0,  10.0, 30.0, 100.0};
  /// The same in nanoseconds: an op's end compares integers.
  static constexpr std::array<std::int64_t, 15> kBoundsNs = {
      10'000,        30'000,        100'000,        300'000,        1'000'000,
      3'000'000,     10'000'000,    30'000'000,     100'000'000,    300'000'000,
      1'000'000'000, 3'000'000'000, 10'000'000'000, 30'000'000'000, 100'000'000'000};
  std::array<std::uint64_t, kBounds.size()> buckets{};  ///< non-cumulative: bucket i is (bound i-1, bound i]
  std::uint64_t count = 0;
  std::int64_t sum_ns = 0;

  void observe(std::chrono::nanoseconds duration) noexcept {
    const std::int64_t ns = duration.count();
    ++count;
    sum_ns += ns;
    for (std::size_t i = 0; i < kBoundsNs.size(); ++i) {
      if (ns <= kBoundsNs[i]) {
        ++buckets[i];
        return;
      }
    }
  }
  [[nodiscard]] double sumSeconds() const noexcept { return static_cast<double>(sum_ns) / 1e9; }
};

struct OpStats {
  /// Indexed by the raw OpCode (kNoop .. kBroadcast; noops are not counted).
  static constexpr std::size_t kOpCodes = static_cast<std::size_t>(ipc::OpCode::kBroadcast) + 1;
  /// Index 0: ok; 1 + the ErrorCode otherwise.
  static constexpr std::size_t kResults = static_cast<std::size_t>(ErrorCode::kCancelled) + 2;

  struct PerOp {
    std::array<std::uint64_t, kResults> ended{};
    std::uint64_t bytes = 0;  ///< of the ops that succeeded: a rank's unsharded copy of the group each
    /// The first of this node's ranks submitting it (or the job's previous op
    /// ending, when later) .. the last submitting it (the match).
    DurationHistogram wait;
    DurationHistogram run;  ///< the match .. its end
  };
  std::array<PerOp, kOpCodes> ops{};
  /// Times a rank's rings filled: as many of its ops outstanding (queued for
  /// the other ranks, running, or answered and not reaped) as its rings hold,
  /// so that its next submit waits (or fails with kWouldBlock).
  std::uint64_t ring_full = 0;
  /// Ranks whose connection ended while collectives of the job were queued
  /// or running (they failed for it).
  std::uint64_t ranks_lost = 0;

  /// An op that ended; `error` null when it succeeded.
  void ended(ipc::OpCode op, const ErrorCode* error, std::uint64_t bytes, std::chrono::nanoseconds waited,
             std::chrono::nanoseconds ran) noexcept {
    PerOp& per_op = ops[static_cast<std::size_t>(op)];
    ++per_op.ended[error == nullptr ? 0 : 1 + static_cast<std::size_t>(*error)];
    if (error == nullptr) per_op.bytes += bytes;
    per_op.wait.observe(waited);
    per_op.run.observe(ran);
  }
};

}  // namespace dbuf::daemon
