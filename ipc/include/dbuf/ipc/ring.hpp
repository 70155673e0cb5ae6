#pragma once
/// \file
/// The data plane's session segment: one shared-memory file per session
/// holding a submission ring (trainer -> daemon), a completion ring
/// (daemon -> trainer), their doorbell words and one error-message slot per
/// completion entry. Both rings are single-producer single-consumer with
/// fixed 64-byte entries; indices are free-running 64-bit counters (entry i
/// lives at i % capacity), each on its own cache line.
///
/// Layout (byte offsets, every part 64-byte aligned):
///   0                  SegmentHeader (written once by the daemon)
///   64 .. 448          six index / doorbell lines (see Indices)
///   submissions        capacity * 64
///   completions        capacity * 64
///   messages           capacity * kCompletionMessageBytes (slot i belongs to
///                      completion entry i % capacity)
///   stream counters    kStreamCountersBytes, page-aligned (StreamCounters:
///                      its own page, so that each process can register just
///                      it for GPU access)
///
/// Trust: the daemon never trusts anything a client can write. It keeps its
/// own copies of the indices it owns, copies an entry out before looking at
/// it, and reports a client index that is impossible (more entries than the
/// ring holds) as kCorrupt. The client checks the header against the file.
///
/// Waiting: each side spins for a while, then sleeps. The daemon sleeps on an
/// eventfd per session (it sets `daemon_sleeping` first; a client that sees it
/// after publishing writes the eventfd). A client sleeps on a futex on
/// `client_doorbell` (it sets `client_waiting` first; the daemon bumps the
/// doorbell and wakes it after publishing). How long a client spins is the
/// shorter of its own setting and `client_spin`, which the daemon keeps up
/// to date: zero while the node has more ranks than CPUs, where a spinning
/// waiter takes the core from a rank that has work. Every flag and index
/// access is sequentially consistent where a lost wake-up would otherwise be
/// possible.
///
/// Hot path: no allocation, no lock, no system call unless the peer sleeps.
/// Thread safety: one thread per side (one producer, one consumer per ring).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "dbuf/common/result.hpp"

namespace dbuf::ipc {

inline constexpr std::size_t kRingEntryBytes = 64;
inline constexpr std::size_t kCompletionMessageBytes = 512;
inline constexpr std::uint32_t kSegmentMagic = 0x474E4952;  // "RING"
inline constexpr std::uint32_t kSegmentVersion = 4;         // 2: the stream counters page;
                                                            // 3: an error's ranks in the completion;
                                                            // 4: the daemon's spin advice

/// What a submission asks for. Raw values travel in shared memory; the
/// daemon validates them with `opCodeFrom`.
enum class OpCode : std::uint8_t {
  kNoop = 1,           ///< completes at once, not a collective (round-trip probe)
  kBarrier = 2,        ///< every rank of the job
  kAllGather = 3,      ///< group: every rank's shard -> every rank's unsharded params
  kReduceScatter = 4,  ///< group: every rank's unsharded grads -> each rank's sharded grad
  kAllReduce = 5,      ///< group: every rank's unsharded grads -> their reduction, in place
  kBroadcast = 6,      ///< group: root's unsharded params -> every rank's
};
[[nodiscard]] std::string_view toString(OpCode op) noexcept;
/// Valid codes only; anything else is nullopt-like (returns false).
[[nodiscard]] bool opCodeFrom(std::uint8_t raw, OpCode& op) noexcept;

enum class ReduceMode : std::uint8_t { kSum = 0, kAvg = 1 };

/// Submission flags.
inline constexpr std::uint8_t kFlagAccumulate = 1U << 0;  ///< reduce-scatter adds into the sharded gradient
/// Ordered on the trainer's CUDA stream (GPU memory only): the daemon starts
/// the op once StreamCounters::ready >= the submission's ticket and its
/// stream sets StreamCounters::done = ticket after the op. Per rank (ranks
/// of one op may differ in it).
inline constexpr std::uint8_t kFlagStreamOrdered = 1U << 1;

/// One submission entry, exactly 64 bytes. Scales apply to reductions:
/// result = post * sum_r(pre * x_r), rounded once per step; avg divides post by the world size.
struct Submission {
  std::uint64_t handle = 0;  ///< the client's, echoed in the completion
  std::uint32_t group_id = 0;
  std::uint8_t op = 0;      ///< OpCode
  std::uint8_t reduce = 0;  ///< ReduceMode
  std::uint8_t flags = 0;
  std::uint8_t reserved0 = 0;
  std::uint32_t root = 0;  ///< broadcast source rank
  float pre_scale = 1.0F;
  float post_scale = 1.0F;
  std::uint32_t reserved1 = 0;
  std::uint64_t ticket = 0;  ///< kFlagStreamOrdered: this op's value of the session's stream counters
  std::uint8_t reserved[24] = {};
};
static_assert(sizeof(Submission) == kRingEntryBytes);

/// Ranks a completion carries inline (Completion::ranks).
inline constexpr std::size_t kCompletionRanks = 6;

/// One completion entry, exactly 64 bytes. status 0 is success, otherwise a
/// WireError value with a message of message_bytes bytes in the entry's slot,
/// and the ranks the error names (Error::ranks: missing, gone or disagreeing
/// ranks, ascending): rank_count of them (saturated at 65535), of which the
/// first min(rank_count, kCompletionRanks) are in `ranks`. The message names
/// them all (as far as its slot holds).
struct Completion {
  std::uint64_t handle = 0;
  std::uint64_t sequence = 0;  ///< the op's index among the job's collectives (noop: 0)
  std::uint16_t status = 0;
  std::uint16_t rank_count = 0;
  std::uint32_t message_bytes = 0;
  std::uint64_t wait_ns = 0;  ///< from this rank's submission to the last rank's arrival
  std::uint64_t run_ns = 0;   ///< time the daemon spent executing it
  std::uint32_t ranks[kCompletionRanks] = {};
};
static_assert(sizeof(Completion) == kRingEntryBytes);
static_assert(offsetof(Completion, ranks) + sizeof(Completion::ranks) == kRingEntryBytes);

/// Puts `ranks` into `entry` (rank_count saturating, the first
/// kCompletionRanks inline). Pure.
void setCompletionRanks(Completion& entry, std::span<const std::uint32_t> ranks) noexcept;
/// The ranks `entry` carries inline: at most kCompletionRanks of its
/// rank_count (the daemon is trusted not to lie; a count over the inline
/// room reads as the inline ones).
[[nodiscard]] std::vector<std::uint32_t> completionRanks(const Completion& entry);

/// Capacity limits (a power of two in between).
inline constexpr std::uint32_t kMinRingCapacity = 16;
inline constexpr std::uint32_t kMaxRingCapacity = 65536;

/// Bytes of a segment for `capacity` entries per ring.
[[nodiscard]] std::size_t segmentBytes(std::uint32_t capacity) noexcept;

/// A session's stream-ordering counters (dbuf/common/stream_counter_word.hpp),
/// each on its own cache line of the segment's last page. Tickets count the
/// session's stream-ordered ops from 1.
///   ready  the trainer's stream sets it to an op's ticket once the work
///          queued before the op has run; the daemon's host reads it before
///          starting the op (it never makes a GPU stream of its own wait on
///          memory a client writes).
///   done   the daemon's stream sets it to the ticket once the op has run;
///          the trainer's stream waits for it. The daemon's host poisons it
///          when a stream-ordered op of the session fails, which releases the
///          trainer's stream for good (the session's stream ordering is over).
struct StreamCounters {
  alignas(64) std::uint64_t ready;
  alignas(64) std::uint64_t done;
};
inline constexpr std::size_t kStreamCountersBytes = 4096;
static_assert(sizeof(StreamCounters) <= kStreamCountersBytes);
/// Where a segment's StreamCounters page starts (a multiple of 4096).
[[nodiscard]] std::size_t streamCountersOffset(std::uint32_t capacity) noexcept;

enum class TakeResult : std::uint8_t { kEmpty, kTaken, kCorrupt };

/// The daemon's side of one segment: consumes submissions, produces
/// completions. `format` initialises a freshly created (zeroed) segment.
class DaemonRings {
 public:
  DaemonRings() = default;
  /// Writes the header into `memory` (segmentBytes(capacity) bytes, zeroed).
  [[nodiscard]] static Result<DaemonRings> format(std::span<std::byte> memory, std::uint32_t capacity);

  [[nodiscard]] std::uint32_t capacity() const noexcept { return capacity_; }

  /// Copies the next submission out. kCorrupt: the client's head index is
  /// impossible (the session should be closed).
  [[nodiscard]] TakeResult take(Submission& out) noexcept;
  /// True if a submission is waiting (does not consume; kCorrupt reads as true
  /// so that the caller goes on to take() and sees it).
  [[nodiscard]] bool hasSubmission() const noexcept;

  /// Free completion entries, as far as the client's tail says (0 if the
  /// client's tail is impossible).
  [[nodiscard]] std::uint32_t completionSpace() const noexcept;
  /// Submissions taken and not completed yet.
  [[nodiscard]] std::uint64_t inFlight() const noexcept { return submit_tail_ - complete_head_; }
  /// True if one more submission can be taken with a completion entry kept
  /// for it: taking only then means a completion never has to wait.
  [[nodiscard]] bool roomToAnswer() const noexcept { return inFlight() < completionSpace(); }
  /// Publishes a completion (the caller checked completionSpace() > 0);
  /// `message` (cut to kCompletionMessageBytes) goes in the entry's slot.
  void complete(Completion entry, std::string_view message = {}) noexcept;
  /// Wakes the client if it sleeps (after one or more complete() calls).
  void wakeClient() noexcept;

  /// Sleeping protocol: set before sleeping, then re-check hasSubmission().
  void setSleeping(bool sleeping) noexcept;
  /// The longest a client should spin before it sleeps (0 until set: a
  /// client of a segment never advised sleeps at once).
  void adviseClientSpin(std::chrono::microseconds spin) noexcept;

  /// The session's stream counters (client-writable memory: read, not trusted).
  [[nodiscard]] StreamCounters& streamCounters() const noexcept;

 private:
  std::byte* base_ = nullptr;
  std::uint32_t capacity_ = 0;
  std::uint64_t submit_tail_ = 0;    // ours: next submission to take
  std::uint64_t complete_head_ = 0;  // ours: next completion to publish
};

/// The client's side: produces submissions, consumes completions.
class ClientRings {
 public:
  ClientRings() = default;
  /// Checks the header the daemon wrote against the mapped size.
  [[nodiscard]] static Result<ClientRings> attach(std::span<std::byte> memory);

  [[nodiscard]] std::uint32_t capacity() const noexcept { return capacity_; }

  /// False when the submission ring is full (back-pressure: reap completions).
  [[nodiscard]] bool trySubmit(const Submission& entry) noexcept;
  /// Writes the daemon's eventfd if the daemon sleeps; call after trySubmit.
  void wakeDaemon(int eventfd) noexcept;

  /// Copies the next completion and its message (if any, into `message`,
  /// truncated to its size; `message_bytes` is set to the copied length).
  [[nodiscard]] bool tryReap(Completion& out, std::span<char> message, std::size_t& message_bytes) noexcept;
  [[nodiscard]] bool hasCompletion() const noexcept;

  /// Spins up to `busy_poll`, then sleeps on the doorbell futex until a
  /// completion is available, `deadline` passes or interruptWait() is
  /// called. True if one is available.
  [[nodiscard]] bool waitForCompletion(std::chrono::steady_clock::time_point deadline,
                                       std::chrono::microseconds busy_poll) noexcept;
  /// Ends a waitForCompletion() sleeping on another thread now (it returns
  /// false unless a completion is there): the daemon is gone.
  void interruptWait() noexcept;

  [[nodiscard]] StreamCounters& streamCounters() const noexcept;

 private:
  std::byte* base_ = nullptr;
  std::uint32_t capacity_ = 0;
  std::uint64_t submit_head_ = 0;    // ours
  std::uint64_t complete_tail_ = 0;  // ours
};

}  // namespace dbuf::ipc
