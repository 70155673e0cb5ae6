#include "dbuf/ipc/ring.hpp"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>
#include <iterator>
#include <limits>
#include <thread>

namespace dbuf::ipc {
namespace {

constexpr std::size_t kLine = 64;

struct SegmentHeader {
  std::uint32_t magic = 0;
  std::uint32_t version = 0;
  std::uint32_t capacity = 0;
  std::uint32_t message_bytes = 0;
  std::uint64_t segment_bytes = 0;
};
static_assert(sizeof(SegmentHeader) <= kLine);

// Offsets of the index and doorbell lines: each index sits alone on its line
// so producer and consumer never share one. The client doorbell and the
// client's waiting flag share a line: both are touched only on the sleeping
// path.
constexpr std::size_t kSubmitHead = 1 * kLine;         // client writes
constexpr std::size_t kSubmitTail = 2 * kLine;         // daemon writes
constexpr std::size_t kCompleteHead = 3 * kLine;       // daemon writes
constexpr std::size_t kCompleteTail = 4 * kLine;       // client writes
constexpr std::size_t kDaemonSleeping = 5 * kLine;     // daemon writes (u32)
constexpr std::size_t kClientSpin = 5 * kLine + 4;     // daemon writes (u32, microseconds)
constexpr std::size_t kClientDoorbell = 6 * kLine;     // daemon writes (u32 futex word)
constexpr std::size_t kClientWaiting = 6 * kLine + 4;  // client writes (u32)
constexpr std::size_t kEntriesStart = 7 * kLine;

std::size_t submissionsOffset() noexcept {
  return kEntriesStart;
}
std::size_t completionsOffset(std::uint32_t capacity) noexcept {
  return kEntriesStart + std::size_t{capacity} * kRingEntryBytes;
}
std::size_t messagesOffset(std::uint32_t capacity) noexcept {
  return kEntriesStart + 2 * std::size_t{capacity} * kRingEntryBytes;
}

std::atomic_ref<std::uint64_t> index64(std::byte* base, std::size_t offset) noexcept {
  return std::atomic_ref<std::uint64_t>(*reinterpret_cast<std::uint64_t*>(base + offset));
}
std::atomic_ref<std::uint32_t> word32(std::byte* base, std::size_t offset) noexcept {
  return std::atomic_ref<std::uint32_t>(*reinterpret_cast<std::uint32_t*>(base + offset));
}

bool validCapacity(std::uint32_t capacity) noexcept {
  return capacity >= kMinRingCapacity && capacity <= kMaxRingCapacity && (capacity & (capacity - 1)) == 0;
}

void cpuRelax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

/// FUTEX_WAIT on a word shared between processes (hence not FUTEX_PRIVATE).
void futexWait(std::uint32_t* word, std::uint32_t expected, std::chrono::nanoseconds timeout) noexcept {
  timespec relative{};
  relative.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  relative.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  ::syscall(SYS_futex, word, FUTEX_WAIT, expected, &relative, nullptr, 0);
}

void futexWakeAll(std::uint32_t* word) noexcept {
  ::syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace

std::string_view toString(OpCode op) noexcept {
  switch (op) {
    case OpCode::kNoop:
      return "noop";
    case OpCode::kBarrier:
      return "barrier";
    case OpCode::kAllGather:
      return "allGather";
    case OpCode::kReduceScatter:
      return "reduceScatter";
    case OpCode::kAllReduce:
      return "allReduce";
    case OpCode::kBroadcast:
      return "broadcast";
  }
  return "unknown";
}

bool opCodeFrom(std::uint8_t raw, OpCode& op) noexcept {
  if (raw < static_cast<std::uint8_t>(OpCode::kNoop) || raw > static_cast<std::uint8_t>(OpCode::kBroadcast)) {
    return false;
  }
  op = static_cast<OpCode>(raw);
  return true;
}

void setCompletionRanks(Completion& entry, std::span<const std::uint32_t> ranks) noexcept {
  constexpr std::size_t kMaxCount = std::numeric_limits<std::uint16_t>::max();
  entry.rank_count = static_cast<std::uint16_t>(std::min(ranks.size(), kMaxCount));
  const std::size_t inline_count = std::min(ranks.size(), kCompletionRanks);
  std::copy_n(ranks.begin(), inline_count, std::begin(entry.ranks));
  std::fill(std::begin(entry.ranks) + static_cast<std::ptrdiff_t>(inline_count), std::end(entry.ranks), 0U);
}

std::vector<std::uint32_t> completionRanks(const Completion& entry) {
  const std::size_t inline_count = std::min<std::size_t>(entry.rank_count, kCompletionRanks);
  return {std::begin(entry.ranks), std::begin(entry.ranks) + static_cast<std::ptrdiff_t>(inline_count)};
}

std::size_t streamCountersOffset(std::uint32_t capacity) noexcept {
  const std::size_t messages_end = messagesOffset(capacity) + std::size_t{capacity} * kCompletionMessageBytes;
  return (messages_end + kStreamCountersBytes - 1) / kStreamCountersBytes * kStreamCountersBytes;
}

std::size_t segmentBytes(std::uint32_t capacity) noexcept {
  return streamCountersOffset(capacity) + kStreamCountersBytes;
}

StreamCounters& DaemonRings::streamCounters() const noexcept {
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): a fixed place in the shared segment
  return *reinterpret_cast<StreamCounters*>(base_ + streamCountersOffset(capacity_));
}

StreamCounters& ClientRings::streamCounters() const noexcept {
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): a fixed place in the shared segment
  return *reinterpret_cast<StreamCounters*>(base_ + streamCountersOffset(capacity_));
}

// ----------------------------------------------------------------- daemon side

Result<DaemonRings> DaemonRings::format(std::span<std::byte> memory, std::uint32_t capacity) {
  if (!validCapacity(capacity)) {
    return makeError(ErrorCode::kInvalidArgument,
                     "ring capacity " + std::to_string(capacity) + " is not a power of two in [16, 65536]");
  }
  if (memory.size() < segmentBytes(capacity) || reinterpret_cast<std::uintptr_t>(memory.data()) % kLine != 0) {
    return makeError(ErrorCode::kInvalidArgument, "session segment too small or misaligned");
  }
  SegmentHeader header;
  header.magic = kSegmentMagic;
  header.version = kSegmentVersion;
  header.capacity = capacity;
  header.message_bytes = kCompletionMessageBytes;
  header.segment_bytes = segmentBytes(capacity);
  std::memcpy(memory.data(), &header, sizeof(header));
  DaemonRings rings;
  rings.base_ = memory.data();
  rings.capacity_ = capacity;
  return rings;
}

TakeResult DaemonRings::take(Submission& out) noexcept {
  const std::uint64_t head = index64(base_, kSubmitHead).load(std::memory_order_acquire);
  if (head == submit_tail_) return TakeResult::kEmpty;
  if (head - submit_tail_ > capacity_) return TakeResult::kCorrupt;  // also catches head "behind" tail
  const std::byte* entry = base_ + submissionsOffset() + (submit_tail_ % capacity_) * kRingEntryBytes;
  std::memcpy(&out, entry, sizeof(out));  // one copy: the client may rewrite the entry meanwhile
  ++submit_tail_;
  index64(base_, kSubmitTail).store(submit_tail_, std::memory_order_release);
  return TakeResult::kTaken;
}

bool DaemonRings::hasSubmission() const noexcept {
  return index64(base_, kSubmitHead).load(std::memory_order_seq_cst) != submit_tail_;
}

std::uint32_t DaemonRings::completionSpace() const noexcept {
  const std::uint64_t tail = index64(base_, kCompleteTail).load(std::memory_order_acquire);
  const std::uint64_t used = complete_head_ - tail;
  if (used > capacity_) return 0;  // an impossible tail: the client only hurts itself
  return static_cast<std::uint32_t>(capacity_ - used);
}

void DaemonRings::complete(Completion entry, std::string_view message) noexcept {
  const std::size_t slot = complete_head_ % capacity_;
  std::byte* text = base_ + messagesOffset(capacity_) + slot * kCompletionMessageBytes;
  const std::size_t length = std::min(message.size(), kCompletionMessageBytes);
  if (length > 0) std::memcpy(text, message.data(), length);  // (an empty view's data() may be null)
  if (message.size() > kCompletionMessageBytes) {
    // Cut: say so, so that nobody mistakes the rest for the whole story.
    constexpr std::string_view kCut = " [...]";
    std::memcpy(text + length - kCut.size(), kCut.data(), kCut.size());
  }
  entry.message_bytes = static_cast<std::uint32_t>(length);
  std::memcpy(base_ + completionsOffset(capacity_) + slot * kRingEntryBytes, &entry, sizeof(entry));
  ++complete_head_;
  index64(base_, kCompleteHead).store(complete_head_, std::memory_order_seq_cst);
}

void DaemonRings::wakeClient() noexcept {
  if (word32(base_, kClientWaiting).load(std::memory_order_seq_cst) == 0) return;
  word32(base_, kClientDoorbell).fetch_add(1, std::memory_order_seq_cst);
  futexWakeAll(reinterpret_cast<std::uint32_t*>(base_ + kClientDoorbell));
}

void DaemonRings::setSleeping(bool sleeping) noexcept {
  word32(base_, kDaemonSleeping).store(sleeping ? 1 : 0, std::memory_order_seq_cst);
}

void DaemonRings::adviseClientSpin(std::chrono::microseconds spin) noexcept {
  const auto us = std::clamp<std::int64_t>(spin.count(), 0, std::numeric_limits<std::uint32_t>::max());
  word32(base_, kClientSpin).store(static_cast<std::uint32_t>(us), std::memory_order_relaxed);
}

// ----------------------------------------------------------------- client side

Result<ClientRings> ClientRings::attach(std::span<std::byte> memory) {
  SegmentHeader header;
  if (memory.size() < kEntriesStart) return makeError(ErrorCode::kInternal, "dbufd sent a session segment too small");
  std::memcpy(&header, memory.data(), sizeof(header));
  if (header.magic != kSegmentMagic || header.version != kSegmentVersion || !validCapacity(header.capacity) ||
      header.message_bytes != kCompletionMessageBytes || header.segment_bytes != segmentBytes(header.capacity) ||
      memory.size() < header.segment_bytes) {
    return makeError(ErrorCode::kInternal, "dbufd sent a session segment this libdbuf cannot read");
  }
  ClientRings rings;
  rings.base_ = memory.data();
  rings.capacity_ = header.capacity;
  rings.submit_head_ = index64(rings.base_, kSubmitHead).load(std::memory_order_acquire);
  rings.complete_tail_ = index64(rings.base_, kCompleteTail).load(std::memory_order_acquire);
  return rings;
}

bool ClientRings::trySubmit(const Submission& entry) noexcept {
  const std::uint64_t tail = index64(base_, kSubmitTail).load(std::memory_order_acquire);
  if (submit_head_ - tail >= capacity_) return false;
  std::memcpy(base_ + submissionsOffset() + (submit_head_ % capacity_) * kRingEntryBytes, &entry, sizeof(entry));
  ++submit_head_;
  index64(base_, kSubmitHead).store(submit_head_, std::memory_order_seq_cst);
  return true;
}

void ClientRings::wakeDaemon(int eventfd) noexcept {
  if (word32(base_, kDaemonSleeping).load(std::memory_order_seq_cst) == 0) return;
  const std::uint64_t one = 1;
  // A full eventfd counter (EAGAIN) already means "wake up".
  [[maybe_unused]] const auto written = ::write(eventfd, &one, sizeof(one));
}

bool ClientRings::hasCompletion() const noexcept {
  // seq_cst: after setting client_waiting, this load must not move before it.
  return index64(base_, kCompleteHead).load(std::memory_order_seq_cst) != complete_tail_;
}

bool ClientRings::tryReap(Completion& out, std::span<char> message, std::size_t& message_bytes) noexcept {
  if (!hasCompletion()) return false;
  const std::size_t slot = complete_tail_ % capacity_;
  std::memcpy(&out, base_ + completionsOffset(capacity_) + slot * kRingEntryBytes, sizeof(out));
  message_bytes = std::min({static_cast<std::size_t>(out.message_bytes), message.size(), kCompletionMessageBytes});
  if (message_bytes > 0) {  // (an empty span's data() may be null)
    std::memcpy(message.data(), base_ + messagesOffset(capacity_) + slot * kCompletionMessageBytes, message_bytes);
  }
  ++complete_tail_;
  index64(base_, kCompleteTail).store(complete_tail_, std::memory_order_release);
  return true;
}

void ClientRings::interruptWait() noexcept {
  word32(base_, kClientDoorbell).fetch_add(1, std::memory_order_seq_cst);
  futexWakeAll(reinterpret_cast<std::uint32_t*>(base_ + kClientDoorbell));
}

bool ClientRings::waitForCompletion(std::chrono::steady_clock::time_point deadline,
                                    std::chrono::microseconds busy_poll) noexcept {
  using Clock = std::chrono::steady_clock;
  const std::chrono::microseconds advised{word32(base_, kClientSpin).load(std::memory_order_relaxed)};
  const auto spin_until = std::min(deadline, Clock::now() + std::min(busy_poll, advised));
  for (unsigned spins = 0;; ++spins) {
    if (hasCompletion()) return true;
    // Read the clock every 64 spins only: it costs more than the check.
    if (spins % 64 == 63 && Clock::now() >= spin_until) break;
    cpuRelax();
  }
  auto waiting = word32(base_, kClientWaiting);
  auto doorbell = word32(base_, kClientDoorbell);
  waiting.store(1, std::memory_order_seq_cst);
  bool available = false;
  while (true) {
    const std::uint32_t seen = doorbell.load(std::memory_order_seq_cst);
    if (hasCompletion()) {
      available = true;
      break;
    }
    const auto now = Clock::now();
    if (now >= deadline) break;
    futexWait(reinterpret_cast<std::uint32_t*>(base_ + kClientDoorbell), seen, deadline - now);
    // The daemon rings only after publishing a completion: a ring without
    // one is interruptWait(), and the caller must look at why.
    if (doorbell.load(std::memory_order_seq_cst) != seen && !hasCompletion()) break;
  }
  waiting.store(0, std::memory_order_relaxed);
  return available;
}

}  // namespace dbuf::ipc
