#pragma once
/// \file
/// What one rank process of dbuf-soak tells the supervisor: counters in a
/// small file the supervisor creates and the rank maps shared. They survive
/// the rank's SIGKILL (the supervisor reads them after it reaped the process)
/// and need no pipe the supervisor would have to drain.

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <string>

namespace dbuf::soak {

/// The ops a rank counts (a barrier only ever resynchronises the job).
enum class OpKind : std::uint32_t { kAllGather, kReduceScatter, kAllReduce, kBroadcast, kBarrier, kCount };
inline constexpr std::uint32_t kOpKinds = static_cast<std::uint32_t>(OpKind::kCount);
[[nodiscard]] const char* opKindName(OpKind kind) noexcept;

/// How a rank process ended (or that it has not).
enum class RankEnd : std::uint32_t {
  kRunning,          ///< alive, or killed by the chaos (the supervisor knows which)
  kStopped,          ///< the supervisor's SIGTERM, at the end of the run
  kJobLostRank,      ///< a job that does not restart its ranks lost one: the others end cleanly
  kDaemonGone,       ///< dbufd died (a call returned kUnavailable)
  kWrongResult,      ///< an op succeeded with a result that differs from the reference
  kFailed,           ///< an error no chaos explains (the rank's log says which)
  kStuck,            ///< the job did not resynchronise within the recovery deadline
};
[[nodiscard]] const char* rankEndName(RankEnd end) noexcept;

/// ErrorCode values are small (common/result.hpp); room for all of them.
inline constexpr std::uint32_t kErrorCodes = 16;

/// Counters of one rank process. Only that process writes them; the
/// supervisor reads them at any time (relaxed atomics: each value is
/// whole, and none depends on another).
struct RankStats {
  std::atomic<std::uint64_t> ops[kOpKinds];          ///< ops that succeeded and matched the reference
  std::atomic<std::uint64_t> bytes;                  ///< bytes of those ops' results checked
  std::atomic<std::uint64_t> errors[kErrorCodes];    ///< failed ops (and attaches, registrations) by code
  std::atomic<std::uint64_t> shutdown_errors;        ///< failures after the supervisor's SIGTERM
  std::atomic<std::uint64_t> resyncs;                ///< barriers that brought the job back in step
  std::atomic<std::uint64_t> reattached;             ///< attaches that found the job's memory kept
  std::atomic<std::uint32_t> end;                    ///< a RankEnd
  /// The first call that returned kUnavailable: when it started and when it
  /// returned (CLOCK_MONOTONIC, ns; 0: none).
  std::atomic<std::int64_t> unavailable_call_ns;
  std::atomic<std::int64_t> unavailable_return_ns;
};

/// Maps `path` (created and sized by the supervisor when `create`) shared;
/// throws std::runtime_error when it cannot.
[[nodiscard]] RankStats* mapStats(const std::string& path, bool create);
void unmapStats(RankStats* stats) noexcept;

/// CLOCK_MONOTONIC in nanoseconds: the same clock in every process.
[[nodiscard]] std::int64_t monotonicNs() noexcept;

}  // namespace dbuf::soak
