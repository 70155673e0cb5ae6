// The session segment's rings over real shared memory (a memfd mapped with
// dbuf::Mapping): format / attach checks, FIFO order and content over many
// wrap-arounds (one process, then a client child and a daemon parent, each
// with its own mapping), back-pressure against a model, impossible client
// indices, completion messages, and both sleeping paths (futex doorbell,
// eventfd) across processes. Children report through their exit code; no
// sleeps for synchronisation except where a peer must be seen asleep first.

#include "dbuf/ipc/ring.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "dbuf/common/shared_memory.hpp"
#include "dbuf/common/stream_counter_word.hpp"
#include "support/thread_cpu_time.hpp"

namespace dbuf::ipc {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Byte offsets inside the segment, as laid out in ring.cpp (kept in sync by
// hand; RingSegmentLayout below checks them against segmentBytes()).
constexpr std::size_t kLine = 64;
constexpr std::size_t kMagicAt = 0;
constexpr std::size_t kVersionAt = 4;
constexpr std::size_t kCapacityAt = 8;
constexpr std::size_t kMessageBytesAt = 12;
constexpr std::size_t kSegmentBytesAt = 16;
constexpr std::size_t kSubmitHeadAt = 1 * kLine;
constexpr std::size_t kSubmitTailAt = 2 * kLine;
constexpr std::size_t kCompleteHeadAt = 3 * kLine;
constexpr std::size_t kCompleteTailAt = 4 * kLine;
constexpr std::size_t kDaemonSleepingAt = 5 * kLine;
constexpr std::size_t kClientDoorbellAt = 6 * kLine;
constexpr std::size_t kClientWaitingAt = 6 * kLine + 4;
constexpr std::size_t kEntriesAt = 7 * kLine;

constexpr std::size_t completionAt(std::uint32_t capacity, std::uint64_t index) {
  return kEntriesAt + std::size_t{capacity} * kRingEntryBytes + (index % capacity) * kRingEntryBytes;
}

/// A zeroed memfd of segmentBytes(capacity) (or `bytes`) bytes, mapped once.
struct Segment {
  UniqueFd fd;
  Mapping map;
  std::size_t bytes = 0;

  explicit Segment(std::uint32_t capacity) : Segment(capacity, segmentBytes(capacity)) {}
  Segment(std::uint32_t capacity, std::size_t size) : bytes(size) {
    auto file = createMemfd("dbuf-ring-test-" + std::to_string(capacity), size);
    if (!file.ok()) throw std::runtime_error(file.error().message);
    fd = std::move(*file);
    auto mapping = Mapping::map(fd.get(), size);
    if (!mapping.ok()) throw std::runtime_error(mapping.error().message);
    map = std::move(*mapping);
  }
  [[nodiscard]] std::span<std::byte> memory() const { return {map.data(), bytes}; }

  template <typename T>
  [[nodiscard]] T read(std::size_t offset) const {
    T value;
    std::memcpy(&value, map.data() + offset, sizeof(T));
    return value;
  }
  template <typename T>
  void write(std::size_t offset, T value) const {
    std::memcpy(map.data() + offset, &value, sizeof(T));
  }
  /// An atomic view of a shared word (for the words the other process polls).
  [[nodiscard]] std::uint32_t load32(std::size_t offset) const {
    return std::atomic_ref<std::uint32_t>(*reinterpret_cast<std::uint32_t*>(map.data() + offset))
        .load(std::memory_order_seq_cst);
  }
};

struct Pair {
  DaemonRings daemon;
  ClientRings client;
};

Pair formatAndAttach(const Segment& segment, std::uint32_t capacity) {
  auto daemon = DaemonRings::format(segment.memory(), capacity);
  EXPECT_TRUE(daemon.ok()) << daemon.error().message;
  auto client = ClientRings::attach(segment.memory());
  EXPECT_TRUE(client.ok()) << client.error().message;
  if (!daemon.ok() || !client.ok()) throw std::runtime_error("format / attach failed");
  return Pair{*daemon, *client};
}

/// Deterministic content for submission `i`: every field and reserved byte
/// depends on i, so a mixed-up or torn entry shows.
Submission submissionFor(std::uint64_t i) {
  Submission s;
  s.handle = i;
  s.group_id = static_cast<std::uint32_t>(i * 2654435761U);
  s.op = static_cast<std::uint8_t>(1 + i % 6);
  s.reduce = static_cast<std::uint8_t>(i % 2);
  s.flags = static_cast<std::uint8_t>(i % 3);
  s.root = static_cast<std::uint32_t>(i % 1000);
  s.pre_scale = static_cast<float>(i % 97) * 0.5F;
  s.post_scale = static_cast<float>(i % 89) * 0.25F;
  for (std::size_t b = 0; b < sizeof(s.reserved); ++b) s.reserved[b] = static_cast<std::uint8_t>((i >> (b % 8)) + b);
  return s;
}

Completion completionFor(std::uint64_t i) {
  Completion c;
  c.handle = i;
  c.sequence = i * 3 + 1;
  c.status = static_cast<std::uint16_t>(i % 7);
  c.rank_count = static_cast<std::uint16_t>(i % 9);
  c.wait_ns = i * 11;
  c.run_ns = i * 13;
  for (std::size_t r = 0; r < kCompletionRanks; ++r) c.ranks[r] = static_cast<std::uint32_t>(i * 7 + r);
  return c;
}

std::string messageFor(std::uint64_t i) {
  if (i % 5 == 0) return {};
  return "entry " + std::to_string(i) + std::string(i % 40, static_cast<char>('a' + i % 26));
}

/// Byte-exact equality: the ring copies entries as bytes, so any difference
/// (a float's sign bit included) is a bug.
bool sameBytes(const auto& a, const auto& b) {
  static_assert(sizeof(a) == sizeof(b));
  return std::memcmp(&a, &b, sizeof(a)) == 0;  // NOLINT(bugprone-suspicious-memory-comparison)
}

// Entries as the receiver sees them (message_bytes is the ring's to set).
Completion expectedCompletion(std::uint64_t i) {
  Completion c = completionFor(i);
  c.message_bytes = static_cast<std::uint32_t>(messageFor(i).size());
  return c;
}

/// fork(); the child runs `body` and _exits with its return value (97 if it
/// throws). Children must not use gtest assertions.
template <typename Fn>
pid_t forkChild(Fn&& body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    int code = 97;
    try {
      code = body();
    } catch (...) {
    }
    ::_exit(code);
  }
  return pid;
}

/// The child's exit code; -1 if it died otherwise, -2 if it outlived
/// `timeout` (then it is killed by its pid and reaped).
int waitChild(pid_t pid, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  int status = 0;
  while (true) {
    const pid_t done = ::waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (done < 0) return -3;
    if (Clock::now() >= deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -2;
    }
    std::this_thread::sleep_for(1ms);
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/// True once `pid` has ended (it is left for waitChild to reap).
bool childEnded(pid_t pid) {
  siginfo_t info{};
  return ::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid != 0;
}

/// One step of waiting for the peer (`idle` counts steps since the last
/// progress): spin a little, then sleep briefly. Sleeping rather than
/// yielding keeps the two processes taking turns quickly when other tests keep
/// every core busy (a yield may hand the core to a CPU hog for a whole slice).
void backOff(unsigned& idle) {
  if (++idle < 128) return;
  std::this_thread::sleep_for(10us);
}

/// Scheduler state letter of `pid` ('R', 'S', ...), or '?'.
char processState(pid_t pid) {
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  const UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return '?';
  std::array<char, 512> text{};
  const ssize_t n = ::read(fd.get(), text.data(), text.size() - 1);
  if (n <= 0) return '?';
  const std::string_view stat(text.data(), static_cast<std::size_t>(n));
  const auto paren = stat.rfind(')');  // the command name may hold spaces
  return paren == std::string_view::npos || paren + 2 >= stat.size() ? '?' : stat[paren + 2];
}

UniqueFd makeEventfd() {
  const int fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  EXPECT_GE(fd, 0) << std::strerror(errno);
  return UniqueFd(fd);
}

bool readable(int fd, int timeout_ms) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, timeout_ms) == 1 && (p.revents & POLLIN) != 0;
}

// ------------------------------------------------------------ format / attach

TEST(RingSegmentLayout, BytesAreHeaderIndicesEntriesMessageSlotsThenTheStreamCountersPage) {
  EXPECT_EQ(streamCountersOffset(16), 12288U);  // 448 + 16 * 64 * 2 + 16 * 512 = 10688, up to a page
  EXPECT_EQ(segmentBytes(16), 12288U + 4096U);
  for (std::uint32_t capacity = kMinRingCapacity; capacity <= kMaxRingCapacity; capacity *= 2) {
    const std::size_t messages_end =
        kEntriesAt + std::size_t{capacity} * (2 * kRingEntryBytes + kCompletionMessageBytes);
    EXPECT_GE(streamCountersOffset(capacity), messages_end) << capacity;
    EXPECT_LT(streamCountersOffset(capacity), messages_end + 4096) << capacity;
    EXPECT_EQ(streamCountersOffset(capacity) % 4096, 0U) << capacity;
    EXPECT_EQ(segmentBytes(capacity), streamCountersOffset(capacity) + kStreamCountersBytes) << capacity;
  }
  EXPECT_EQ(segmentBytes(kMaxRingCapacity), 448U + 65536U * 640U + 3648U + 4096U);
}

TEST(RingSegmentLayout, BothSidesSeeOneStreamCountersPageWithItsWordsOnSeparateLines) {
  const Segment segment(64);
  auto daemon = DaemonRings::format(segment.memory(), 64);
  ASSERT_TRUE(daemon);
  auto client = ClientRings::attach(segment.memory());
  ASSERT_TRUE(client);
  StreamCounters& mine = client->streamCounters();
  StreamCounters& theirs = daemon->streamCounters();
  EXPECT_EQ(&mine, &theirs);
  EXPECT_EQ(reinterpret_cast<std::byte*>(&mine), segment.memory().data() + streamCountersOffset(64));
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(&mine.done) - reinterpret_cast<std::uintptr_t>(&mine.ready), 64U);
  publishCounter(mine.ready, 7);  // the trainer's stream, here from the host
  EXPECT_EQ(counterValue(theirs.ready), 7U);
  publishCounter(theirs.done, 7);
  poisonCounter(theirs.done);  // an op failed: the trainer's waits are released for good
  poisonCounter(theirs.done);
  EXPECT_TRUE(isPoisoned(counterValue(mine.done)));
  EXPECT_EQ(counterValue(mine.done), 7U + kPoisonOffset);
}

TEST(RingFormat, RejectsCapacityOutsidePowersOfTwoInRange) {
  const Segment segment(kMaxRingCapacity);
  for (const std::uint32_t bad : {0U, 1U, 2U, 8U, 15U, 17U, 24U, 48U, 100U, 1000U, 65535U, 65537U, 131072U,
                                  std::numeric_limits<std::uint32_t>::max()}) {
    auto rings = DaemonRings::format(segment.memory(), bad);
    ASSERT_FALSE(rings.ok()) << bad;
    EXPECT_EQ(rings.error().code, ErrorCode::kInvalidArgument) << bad;
  }
  for (std::uint32_t good = kMinRingCapacity; good <= kMaxRingCapacity; good *= 2) {
    auto rings = DaemonRings::format(segment.memory(), good);
    ASSERT_TRUE(rings.ok()) << good << ": " << rings.error().message;
    EXPECT_EQ(rings->capacity(), good);
  }
}

TEST(RingFormat, RejectsTooSmallOrMisalignedMemory) {
  const Segment segment(64);
  auto too_small = DaemonRings::format(segment.memory().first(segmentBytes(64) - 1), 64);
  ASSERT_FALSE(too_small.ok());
  EXPECT_EQ(too_small.error().code, ErrorCode::kInvalidArgument);
  // Enough bytes for 32 entries but not for 64.
  EXPECT_FALSE(DaemonRings::format(segment.memory().first(segmentBytes(32)), 64).ok());
  EXPECT_TRUE(DaemonRings::format(segment.memory().first(segmentBytes(32)), 32).ok());
  EXPECT_FALSE(DaemonRings::format(segment.memory().subspan(8), 16).ok());  // not 64-byte aligned
  EXPECT_FALSE(DaemonRings::format({}, 16).ok());
  // Nothing was written by the failed attempts before the successful one.
  EXPECT_EQ(segment.read<std::uint32_t>(kCapacityAt), 32U);
}

TEST(RingFormat, WritesTheHeader) {
  const Segment segment(256);
  ASSERT_TRUE(DaemonRings::format(segment.memory(), 256).ok());
  EXPECT_EQ(segment.read<std::uint32_t>(kMagicAt), kSegmentMagic);
  EXPECT_EQ(segment.read<std::uint32_t>(kVersionAt), kSegmentVersion);
  EXPECT_EQ(segment.read<std::uint32_t>(kCapacityAt), 256U);
  EXPECT_EQ(segment.read<std::uint32_t>(kMessageBytesAt), kCompletionMessageBytes);
  EXPECT_EQ(segment.read<std::uint64_t>(kSegmentBytesAt), segmentBytes(256));
  EXPECT_EQ(std::memcmp(segment.map.data(), "RING", 4), 0);
}

TEST(RingAttach, AcceptsAFormattedSegment) {
  const Segment segment(128);
  ASSERT_TRUE(DaemonRings::format(segment.memory(), 128).ok());
  auto client = ClientRings::attach(segment.memory());
  ASSERT_TRUE(client.ok()) << client.error().message;
  EXPECT_EQ(client->capacity(), 128U);
  // A mapping larger than the segment is fine too.
  const Segment bigger(128, segmentBytes(128) + 4096);
  ASSERT_TRUE(DaemonRings::format(bigger.memory(), 128).ok());
  EXPECT_TRUE(ClientRings::attach(bigger.memory()).ok());
}

TEST(RingAttach, RejectsAZeroedOrTooSmallSegment) {
  const Segment segment(16);
  EXPECT_FALSE(ClientRings::attach(segment.memory()).ok());  // never formatted
  ASSERT_TRUE(DaemonRings::format(segment.memory(), 16).ok());
  EXPECT_FALSE(ClientRings::attach(segment.memory().first(segmentBytes(16) - 1)).ok());
  EXPECT_FALSE(ClientRings::attach(segment.memory().first(kEntriesAt - 1)).ok());
  EXPECT_FALSE(ClientRings::attach(segment.memory().first(8)).ok());
  EXPECT_FALSE(ClientRings::attach({}).ok());
  EXPECT_TRUE(ClientRings::attach(segment.memory()).ok());
}

TEST(RingAttach, RejectsEveryCorruptHeaderByte) {
  const Segment segment(16);
  ASSERT_TRUE(DaemonRings::format(segment.memory(), 16).ok());
  // Every byte of magic, version, capacity, message_bytes and segment_bytes.
  for (std::size_t at = 0; at < kSegmentBytesAt + 8; ++at) {
    const auto original = segment.read<std::uint8_t>(at);
    for (const std::uint8_t flip : {std::uint8_t{0x01}, std::uint8_t{0x80}, std::uint8_t{0xFF}}) {
      segment.write<std::uint8_t>(at, static_cast<std::uint8_t>(original ^ flip));
      auto client = ClientRings::attach(segment.memory());
      EXPECT_FALSE(client.ok()) << "byte " << at << " ^ " << int{flip};
      if (!client.ok()) {
        EXPECT_EQ(client.error().code, ErrorCode::kInternal);
      }
    }
    segment.write<std::uint8_t>(at, original);
  }
  EXPECT_TRUE(ClientRings::attach(segment.memory()).ok());
  // A consistent header for another capacity is still wrong for this file.
  segment.write<std::uint32_t>(kCapacityAt, 32);
  segment.write<std::uint64_t>(kSegmentBytesAt, segmentBytes(32));
  EXPECT_FALSE(ClientRings::attach(segment.memory()).ok());
  segment.write<std::uint32_t>(kVersionAt, kSegmentVersion + 1);
  segment.write<std::uint32_t>(kCapacityAt, 16);
  segment.write<std::uint64_t>(kSegmentBytesAt, segmentBytes(16));
  EXPECT_FALSE(ClientRings::attach(segment.memory()).ok());
}

// ------------------------------------------------------------------- FIFO

TEST(RingFifo, OrderAndContentOverManyWrapArounds) {
  constexpr std::uint32_t kCapacity = 16;
  constexpr std::uint64_t kCount = 100000;
  const Segment segment(kCapacity);
  auto [daemon, client] = formatAndAttach(segment, kCapacity);
  std::mt19937 random(7);
  std::uint64_t submitted = 0;
  std::uint64_t taken = 0;
  std::uint64_t completed = 0;
  std::uint64_t reaped = 0;
  std::vector<char> message(kCompletionMessageBytes);
  std::size_t mismatches = 0;
  while (reaped < kCount) {
    // Random batch sizes so the four indices drift apart and wrap at
    // different slots.
    for (auto n = random() % (kCapacity + 1); n > 0 && submitted < kCount; --n) {
      if (!client.trySubmit(submissionFor(submitted))) break;
      ++submitted;
    }
    for (auto n = random() % (kCapacity + 1); n > 0 && daemon.completionSpace() > 0; --n) {
      Submission s;
      const TakeResult result = daemon.take(s);
      if (result == TakeResult::kEmpty) break;
      ASSERT_EQ(result, TakeResult::kTaken);
      if (!sameBytes(s, submissionFor(taken))) ++mismatches;
      daemon.complete(completionFor(s.handle), messageFor(s.handle));
      ++taken;
      ++completed;
    }
    for (auto n = random() % (kCapacity + 1); n > 0; --n) {
      Completion c;
      std::size_t bytes = 999;
      if (!client.tryReap(c, message, bytes)) break;
      if (!sameBytes(c, expectedCompletion(reaped)) || std::string(message.data(), bytes) != messageFor(reaped)) {
        ++mismatches;
      }
      ++reaped;
    }
    ASSERT_LE(reaped, completed);
    ASSERT_LE(completed, taken);
    ASSERT_LE(taken, submitted);
  }
  EXPECT_EQ(mismatches, 0U);
  EXPECT_EQ(submitted, kCount);
  Submission s;
  EXPECT_EQ(daemon.take(s), TakeResult::kEmpty);
  EXPECT_FALSE(client.hasCompletion());
  EXPECT_EQ(segment.read<std::uint64_t>(kSubmitHeadAt), kCount);
  EXPECT_EQ(segment.read<std::uint64_t>(kSubmitTailAt), kCount);
  EXPECT_EQ(segment.read<std::uint64_t>(kCompleteHeadAt), kCount);
  EXPECT_EQ(segment.read<std::uint64_t>(kCompleteTailAt), kCount);
}

TEST(RingFifo, ClientChildAndDaemonParentAcrossProcesses) {
  constexpr std::uint32_t kCapacity = 16;
  constexpr std::uint64_t kCount = 100000;
  const Segment segment(kCapacity);
  auto daemon_or = DaemonRings::format(segment.memory(), kCapacity);
  ASSERT_TRUE(daemon_or.ok());
  DaemonRings daemon = *daemon_or;

  const pid_t child = forkChild([&]() -> int {
    // The client maps the file itself (another address, as a trainer would).
    auto mapping = Mapping::map(segment.fd.get(), segment.bytes);
    if (!mapping.ok()) return 10;
    auto client_or = ClientRings::attach({mapping->data(), mapping->size()});
    if (!client_or.ok()) return 11;
    ClientRings client = *client_or;
    std::vector<char> message(kCompletionMessageBytes);
    std::uint64_t submitted = 0;
    std::uint64_t reaped = 0;
    const auto deadline = Clock::now() + 20s;
    unsigned idle = 0;
    while (reaped < kCount) {
      bool progress = false;
      while (submitted < kCount && client.trySubmit(submissionFor(submitted))) {
        ++submitted;
        progress = true;
      }
      Completion c;
      std::size_t bytes = 0;
      while (client.tryReap(c, message, bytes)) {
        if (!sameBytes(c, expectedCompletion(reaped))) return 20;
        if (std::string(message.data(), bytes) != messageFor(reaped)) return 21;
        ++reaped;
        progress = true;
      }
      if (reaped > submitted) return 22;
      if (progress) {
        idle = 0;
      } else {
        if (Clock::now() > deadline) return 23;
        backOff(idle);
      }
    }
    return 0;
  });
  ASSERT_GT(child, 0);

  std::uint64_t taken = 0;
  std::uint64_t checksum = 0;
  std::uint64_t expected_checksum = 0;
  std::size_t mismatches = 0;
  const auto deadline = Clock::now() + 20s;
  unsigned idle = 0;
  while (taken < kCount && Clock::now() < deadline) {
    Submission s;
    const TakeResult result = daemon.take(s);
    if (result == TakeResult::kCorrupt) break;
    if (result == TakeResult::kEmpty) {
      if (idle % 256 == 255 && childEnded(child)) break;  // the client gave up: see its exit code
      backOff(idle);
      continue;
    }
    idle = 0;
    const Submission expected = submissionFor(taken);
    if (!sameBytes(s, expected)) ++mismatches;
    const auto* bytes = reinterpret_cast<const unsigned char*>(&s);
    const auto* want = reinterpret_cast<const unsigned char*>(&expected);
    for (std::size_t b = 0; b < sizeof(s); ++b) {
      checksum = checksum * 1099511628211ULL + bytes[b];
      expected_checksum = expected_checksum * 1099511628211ULL + want[b];
    }
    while (daemon.completionSpace() == 0) {
      if (Clock::now() >= deadline || (idle % 256 == 255 && childEnded(child))) break;
      backOff(idle);
    }
    idle = 0;
    if (daemon.completionSpace() == 0) break;  // the client stopped reaping
    daemon.complete(completionFor(s.handle), messageFor(s.handle));
    ++taken;
  }
  EXPECT_EQ(waitChild(child, 25s), 0);
  EXPECT_EQ(taken, kCount);
  EXPECT_EQ(mismatches, 0U);
  EXPECT_EQ(checksum, expected_checksum);
  Submission s;
  EXPECT_EQ(daemon.take(s), TakeResult::kEmpty);
  EXPECT_EQ(daemon.completionSpace(), kCapacity);  // the child reaped every one
}

// ------------------------------------------------------------ back-pressure

TEST(RingBackPressure, SubmitFailsExactlyWhenCapacityEntriesAreUnconsumed) {
  constexpr std::uint32_t kCapacity = 16;
  const Segment segment(kCapacity);
  auto [daemon, client] = formatAndAttach(segment, kCapacity);
  for (std::uint64_t i = 0; i < kCapacity; ++i) ASSERT_TRUE(client.trySubmit(submissionFor(i))) << i;
  EXPECT_FALSE(client.trySubmit(submissionFor(kCapacity)));
  EXPECT_FALSE(client.trySubmit(submissionFor(kCapacity)));
  EXPECT_EQ(segment.read<std::uint64_t>(kSubmitHeadAt), kCapacity);  // the refusals wrote nothing
  Submission s;
  ASSERT_EQ(daemon.take(s), TakeResult::kTaken);
  EXPECT_EQ(s.handle, 0U);
  EXPECT_TRUE(client.trySubmit(submissionFor(kCapacity)));
  EXPECT_FALSE(client.trySubmit(submissionFor(kCapacity + 1)));
  // Unreaped completions do not hold back submissions.
  for (std::uint64_t i = 1; i <= kCapacity; ++i) {
    ASSERT_EQ(daemon.take(s), TakeResult::kTaken);
    EXPECT_EQ(s.handle, i);
  }
  EXPECT_EQ(daemon.take(s), TakeResult::kEmpty);
  for (std::uint64_t i = 0; i < kCapacity; ++i) EXPECT_TRUE(client.trySubmit(submissionFor(100 + i)));
  EXPECT_FALSE(client.trySubmit(submissionFor(200)));
}

TEST(RingBackPressure, CompletionSpaceCountsUnreapedEntries) {
  constexpr std::uint32_t kCapacity = 32;
  const Segment segment(kCapacity);
  auto [daemon, client] = formatAndAttach(segment, kCapacity);
  EXPECT_EQ(daemon.completionSpace(), 32U);
  for (std::uint64_t i = 0; i < 5; ++i) daemon.complete(completionFor(i));
  EXPECT_EQ(daemon.completionSpace(), 27U);
  Completion c;
  std::size_t bytes = 0;
  ASSERT_TRUE(client.tryReap(c, {}, bytes));
  ASSERT_TRUE(client.tryReap(c, {}, bytes));
  EXPECT_EQ(c.handle, 1U);
  EXPECT_EQ(daemon.completionSpace(), 29U);
  for (std::uint64_t i = 5; daemon.completionSpace() > 0; ++i) daemon.complete(completionFor(i));
  EXPECT_EQ(daemon.completionSpace(), 0U);
  EXPECT_EQ(segment.read<std::uint64_t>(kCompleteHeadAt), 34U);  // 2 reaped + 32 outstanding
  std::uint64_t expected = 2;
  while (client.tryReap(c, {}, bytes)) EXPECT_EQ(c.handle, expected++);
  EXPECT_EQ(expected, 34U);
  EXPECT_EQ(daemon.completionSpace(), 32U);
}

TEST(RingBackPressure, RandomOperationsMatchAQueueModel) {
  constexpr std::uint32_t kCapacity = 16;
  const Segment segment(kCapacity);
  auto [daemon, client] = formatAndAttach(segment, kCapacity);
  std::deque<std::uint64_t> submissions;  // submitted, not taken
  std::deque<std::uint64_t> completions;  // completed, not reaped
  std::uint64_t next = 0;
  std::mt19937 random(42);
  for (int step = 0; step < 200000; ++step) {
    switch (random() % 3) {
      case 0: {
        const bool accepted = client.trySubmit(submissionFor(next));
        ASSERT_EQ(accepted, submissions.size() < kCapacity) << step;
        if (accepted) submissions.push_back(next++);
        break;
      }
      case 1: {
        ASSERT_EQ(daemon.completionSpace(), kCapacity - completions.size()) << step;
        ASSERT_EQ(daemon.hasSubmission(), !submissions.empty()) << step;
        if (daemon.completionSpace() == 0) break;
        Submission s;
        const TakeResult result = daemon.take(s);
        if (submissions.empty()) {
          ASSERT_EQ(result, TakeResult::kEmpty) << step;
          break;
        }
        ASSERT_EQ(result, TakeResult::kTaken) << step;
        ASSERT_EQ(s.handle, submissions.front()) << step;
        submissions.pop_front();
        daemon.complete(completionFor(s.handle));
        completions.push_back(s.handle);
        break;
      }
      default: {
        ASSERT_EQ(client.hasCompletion(), !completions.empty()) << step;
        Completion c;
        std::size_t bytes = 0;
        const bool reaped = client.tryReap(c, {}, bytes);
        ASSERT_EQ(reaped, !completions.empty()) << step;
        if (!reaped) break;
        ASSERT_EQ(c.handle, completions.front()) << step;
        completions.pop_front();
        break;
      }
    }
  }
  EXPECT_GT(next, 30000U);  // the walk did go round the ring many times
}

// --------------------------------------------------------- corrupt indices

TEST(RingCorruptIndices, ImpossibleSubmissionHeadIsCorrupt) {
  constexpr std::uint32_t kCapacity = 16;
  const Segment segment(kCapacity);
  Pair rings = formatAndAttach(segment, kCapacity);
  DaemonRings& daemon = rings.daemon;
  for (std::uint64_t i = 0; i < 3; ++i) ASSERT_TRUE(rings.client.trySubmit(submissionFor(i)));
  Submission s;
  ASSERT_EQ(daemon.take(s), TakeResult::kTaken);  // the daemon's tail is now 1
  const std::uint64_t tail = 1;

  const auto take_with_head = [&](std::uint64_t head) {
    segment.write<std::uint64_t>(kSubmitHeadAt, head);
    Submission out;
    return daemon.take(out);
  };
  EXPECT_EQ(take_with_head(tail + kCapacity + 1), TakeResult::kCorrupt);
  EXPECT_TRUE(daemon.hasSubmission());  // reads as "go and take it"
  EXPECT_EQ(take_with_head(tail + 1000), TakeResult::kCorrupt);
  EXPECT_EQ(take_with_head(tail - 1), TakeResult::kCorrupt);  // behind the tail
  EXPECT_EQ(take_with_head(std::numeric_limits<std::uint64_t>::max()), TakeResult::kCorrupt);
  EXPECT_EQ(take_with_head(tail), TakeResult::kEmpty);
  // Nothing was consumed by the refusals: the daemon's tail is still 1.
  EXPECT_EQ(segment.read<std::uint64_t>(kSubmitTailAt), tail);
  // A full ring (head = tail + capacity) is possible, not corrupt.
  Submission full;
  EXPECT_EQ(take_with_head(tail + kCapacity), TakeResult::kTaken);
  EXPECT_EQ(segment.read<std::uint64_t>(kSubmitTailAt), tail + 1);
  // Back to the honest head: the next entry is the client's second.
  segment.write<std::uint64_t>(kSubmitHeadAt, 3);
  ASSERT_EQ(daemon.take(full), TakeResult::kTaken);
  EXPECT_TRUE(sameBytes(full, submissionFor(2)));
}

TEST(RingCorruptIndices, ImpossibleCompletionTailLeavesNoSpace) {
  constexpr std::uint32_t kCapacity = 16;
  const Segment segment(kCapacity);
  auto [daemon, client] = formatAndAttach(segment, kCapacity);
  Completion c;
  std::size_t bytes = 0;
  for (std::uint64_t i = 0; i < kCapacity; ++i) daemon.complete(completionFor(i));
  while (client.tryReap(c, {}, bytes)) {
  }
  for (std::uint64_t i = 0; i < 4; ++i) daemon.complete(completionFor(kCapacity + i));
  const std::uint64_t head = kCapacity + 4;  // 20 published, 16 reaped
  ASSERT_EQ(daemon.completionSpace(), kCapacity - 4);

  segment.write<std::uint64_t>(kCompleteTailAt, head + 1);  // ahead of the head
  EXPECT_EQ(daemon.completionSpace(), 0U);
  segment.write<std::uint64_t>(kCompleteTailAt, head + 100000);
  EXPECT_EQ(daemon.completionSpace(), 0U);
  segment.write<std::uint64_t>(kCompleteTailAt, head - kCapacity - 1);  // more outstanding than fit
  EXPECT_EQ(daemon.completionSpace(), 0U);
  segment.write<std::uint64_t>(kCompleteTailAt, 0);
  EXPECT_EQ(daemon.completionSpace(), 0U);
  segment.write<std::uint64_t>(kCompleteTailAt, head - kCapacity);  // full, but possible
  EXPECT_EQ(daemon.completionSpace(), 0U);
  segment.write<std::uint64_t>(kCompleteTailAt, head);  // everything reaped
  EXPECT_EQ(daemon.completionSpace(), kCapacity);
  segment.write<std::uint64_t>(kCompleteTailAt, head - 3);
  EXPECT_EQ(daemon.completionSpace(), kCapacity - 3);
}

// ---------------------------------------------------------------- messages

TEST(RingMessages, LongMessageIsCutToTheSlot) {
  constexpr std::uint32_t kCapacity = 16;
  const Segment segment(kCapacity);
  auto [daemon, client] = formatAndAttach(segment, kCapacity);
  std::string long_message(kCompletionMessageBytes + 100, '?');
  for (std::size_t i = 0; i < long_message.size(); ++i) long_message[i] = static_cast<char>('A' + i % 26);
  Completion entry = completionFor(1);
  entry.message_bytes = 7;  // the daemon's ring sets it, not the caller
  daemon.complete(entry, long_message);

  std::vector<char> buffer(2048, '#');
  Completion c;
  std::size_t bytes = 0;
  ASSERT_TRUE(client.tryReap(c, buffer, bytes));
  EXPECT_EQ(bytes, kCompletionMessageBytes);
  EXPECT_EQ(c.message_bytes, kCompletionMessageBytes);
  // The slot's end says it was cut.
  const std::string cut = " [...]";
  EXPECT_EQ(std::string(buffer.data(), bytes), long_message.substr(0, kCompletionMessageBytes - cut.size()) + cut);
  EXPECT_EQ(buffer[kCompletionMessageBytes], '#');  // nothing past the slot
  // The next slot was not touched by the overlong message.
  daemon.complete(completionFor(2), "x");
  ASSERT_TRUE(client.tryReap(c, buffer, bytes));
  EXPECT_EQ(bytes, 1U);
  EXPECT_EQ(buffer[0], 'x');
}

TEST(RingMessages, SmallBufferTruncatesAndLeavesTheRestAlone) {
  constexpr std::uint32_t kCapacity = 16;
  const Segment segment(kCapacity);
  auto [daemon, client] = formatAndAttach(segment, kCapacity);
  daemon.complete(completionFor(1), "group 7 is not registered");
  std::vector<char> buffer(64, '#');  // room past the span, to see an overrun
  Completion c;
  std::size_t bytes = 0;
  ASSERT_TRUE(client.tryReap(c, std::span<char>(buffer).first(10), bytes));
  EXPECT_EQ(bytes, 10U);
  EXPECT_EQ(c.message_bytes, 25U);  // the entry still says how long the message was
  EXPECT_EQ(std::string(buffer.data(), 10), "group 7 is");
  EXPECT_EQ(std::string(buffer.data() + 10, 54), std::string(54, '#'));
  // No buffer at all: the entry is still reaped.
  daemon.complete(completionFor(2), "another message");
  ASSERT_TRUE(client.tryReap(c, {}, bytes));
  EXPECT_EQ(bytes, 0U);
  EXPECT_EQ(c.handle, 2U);
  EXPECT_FALSE(client.hasCompletion());
}

TEST(RingMessages, EmptyAndBinaryMessagesAndStaleSlots) {
  constexpr std::uint32_t kCapacity = 16;
  const Segment segment(kCapacity);
  auto [daemon, client] = formatAndAttach(segment, kCapacity);
  std::vector<char> buffer(kCompletionMessageBytes, '#');
  Completion c;
  std::size_t bytes = 99;
  daemon.complete(completionFor(1));
  ASSERT_TRUE(client.tryReap(c, buffer, bytes));
  EXPECT_EQ(bytes, 0U);
  EXPECT_EQ(c.message_bytes, 0U);
  EXPECT_EQ(buffer[0], '#');

  const std::string binary("a\0b\0\xff", 5);
  daemon.complete(completionFor(2), binary);
  ASSERT_TRUE(client.tryReap(c, buffer, bytes));
  EXPECT_EQ(std::string(buffer.data(), bytes), binary);

  // Slot 0 held a long message once; when the ring comes round to it again
  // with an empty message, nothing of the old one is reported.
  for (std::uint64_t i = 3; i < 3 + kCapacity; ++i) {
    daemon.complete(completionFor(i), i % kCapacity == 0 ? std::string(300, 'z') : std::string());
    ASSERT_TRUE(client.tryReap(c, buffer, bytes));
  }
  daemon.complete(completionFor(100), "");
  ASSERT_TRUE(client.tryReap(c, buffer, bytes));
  EXPECT_EQ(c.handle, 100U);
  EXPECT_EQ(bytes, 0U);
}

TEST(RingMessages, ClientClampsAnOverlongLengthInTheEntry) {
  constexpr std::uint32_t kCapacity = 16;
  const Segment segment(kCapacity);
  auto [daemon, client] = formatAndAttach(segment, kCapacity);
  daemon.complete(completionFor(1), "short");
  segment.write<std::uint32_t>(completionAt(kCapacity, 0) + offsetof(Completion, message_bytes), 1U << 30);
  std::vector<char> buffer(4096);
  Completion c;
  std::size_t bytes = 0;
  ASSERT_TRUE(client.tryReap(c, buffer, bytes));
  EXPECT_EQ(bytes, kCompletionMessageBytes);  // never past the slot
  EXPECT_EQ(std::string(buffer.data(), 5), "short");
}

// ---------------------------------------------------------- error ranks

TEST(RingErrorRanks, TheCompletionLayoutKeepsItsFieldsAndCarriesSixRanksInline) {
  EXPECT_EQ(offsetof(Completion, status), 16U);
  EXPECT_EQ(offsetof(Completion, rank_count), 18U);  // where reserved0 was
  EXPECT_EQ(offsetof(Completion, message_bytes), 20U);
  EXPECT_EQ(offsetof(Completion, run_ns), 32U);
  EXPECT_EQ(offsetof(Completion, ranks), 40U);  // where reserved[24] was
  EXPECT_EQ(sizeof(Completion::ranks), kCompletionRanks * sizeof(std::uint32_t));
  EXPECT_EQ(kCompletionRanks, 6U);
}

TEST(RingErrorRanks, SetAndReadBackFewerThanSixMoreThanSixAndMoreThanACountHolds) {
  Completion entry = completionFor(5);  // stale ranks in every inline place
  const std::vector<std::uint32_t> two{1, 3};
  setCompletionRanks(entry, two);
  EXPECT_EQ(entry.rank_count, 2U);
  EXPECT_EQ(completionRanks(entry), two);
  for (std::size_t r = 2; r < kCompletionRanks; ++r) EXPECT_EQ(entry.ranks[r], 0U) << "slot " << r << " was cleared";

  const std::vector<std::uint32_t> seven{1, 2, 3, 4, 5, 6, 7};
  setCompletionRanks(entry, seven);
  EXPECT_EQ(entry.rank_count, 7U) << "the count says how many the error names";
  EXPECT_EQ(completionRanks(entry), (std::vector<std::uint32_t>{1, 2, 3, 4, 5, 6}));

  std::vector<std::uint32_t> many(70000);
  for (std::size_t r = 0; r < many.size(); ++r) many[r] = static_cast<std::uint32_t>(r);
  setCompletionRanks(entry, many);
  EXPECT_EQ(entry.rank_count, 65535U) << "saturated, not wrapped";
  EXPECT_EQ(completionRanks(entry).size(), kCompletionRanks);

  setCompletionRanks(entry, {});
  EXPECT_EQ(entry.rank_count, 0U);
  EXPECT_TRUE(completionRanks(entry).empty());
}

TEST(RingErrorRanks, RanksTravelThroughTheRingWithTheirEntry) {
  constexpr std::uint32_t kCapacity = 16;
  const Segment segment(kCapacity);
  auto [daemon, client] = formatAndAttach(segment, kCapacity);
  Completion failed;
  failed.handle = 9;
  failed.status = 6;
  setCompletionRanks(failed, std::vector<std::uint32_t>{1, 3});
  daemon.complete(failed, "ranks 1, 3 of job j have not submitted it");
  Completion ok;
  ok.handle = 10;
  daemon.complete(ok);

  std::vector<char> buffer(kCompletionMessageBytes);
  Completion c;
  std::size_t bytes = 0;
  ASSERT_TRUE(client.tryReap(c, buffer, bytes));
  EXPECT_EQ(c.handle, 9U);
  EXPECT_EQ(completionRanks(c), (std::vector<std::uint32_t>{1, 3}));
  EXPECT_EQ(segment.read<std::uint16_t>(completionAt(kCapacity, 0) + 18), 2U) << "rank_count at byte 18";
  EXPECT_EQ(segment.read<std::uint32_t>(completionAt(kCapacity, 0) + 44), 3U) << "the second rank at byte 44";
  ASSERT_TRUE(client.tryReap(c, buffer, bytes));
  EXPECT_EQ(c.handle, 10U);
  EXPECT_TRUE(completionRanks(c).empty());
}

// ---------------------------------------------------------- sleeping paths

TEST(RingSleeping, ClientAsleepInAnotherProcessIsWokenByTheDaemon) {
  constexpr std::uint32_t kCapacity = 16;
  const Segment segment(kCapacity);
  auto daemon_or = DaemonRings::format(segment.memory(), kCapacity);
  ASSERT_TRUE(daemon_or.ok());
  DaemonRings daemon = *daemon_or;
  // The child reports how long it waited (ns) through a pipe.
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  const UniqueFd read_end(pipe_fds[0]);
  UniqueFd write_end(pipe_fds[1]);

  const pid_t child = forkChild([&]() -> int {
    auto mapping = Mapping::map(segment.fd.get(), segment.bytes);
    if (!mapping.ok()) return 10;
    auto client_or = ClientRings::attach({mapping->data(), mapping->size()});
    if (!client_or.ok()) return 11;
    ClientRings client = *client_or;
    const auto start = Clock::now();
    const bool available = client.waitForCompletion(start + 1500ms, 0us);
    const auto waited = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
    if (!available) return 20;
    Completion c;
    std::size_t bytes = 0;
    std::array<char, 64> message{};
    if (!client.tryReap(c, message, bytes)) return 21;
    if (c.handle != 77 || std::string(message.data(), bytes) != "done") return 22;
    const std::int64_t value = waited;
    if (::write(write_end.get(), &value, sizeof(value)) != sizeof(value)) return 23;
    return 0;
  });
  ASSERT_GT(child, 0);
  write_end.reset();

  // Wait until the child has announced it waits and is asleep in the kernel
  // (not spinning), then complete and ring.
  const auto give_up = Clock::now() + 1s;
  while (Clock::now() < give_up && !(segment.load32(kClientWaitingAt) == 1 && processState(child) == 'S')) {
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_EQ(segment.load32(kClientWaitingAt), 1U);
  EXPECT_EQ(processState(child), 'S');
  std::this_thread::sleep_for(20ms);  // the child has been asleep a while
  const auto woken_at = Clock::now();
  ASSERT_EQ(daemon.completionSpace(), kCapacity);
  daemon.complete(completionFor(77), "done");
  daemon.wakeClient();
  EXPECT_EQ(segment.load32(kClientDoorbellAt), 1U);  // bumped for the sleeper

  std::int64_t waited_ns = -1;
  EXPECT_EQ(::read(read_end.get(), &waited_ns, sizeof(waited_ns)), static_cast<ssize_t>(sizeof(waited_ns)));
  const auto woken_after = Clock::now() - woken_at;
  EXPECT_EQ(waitChild(child, 3s), 0);
  // Woken by the doorbell, not by its 1.5 s deadline.
  EXPECT_GT(waited_ns, 20'000'000);
  EXPECT_LT(waited_ns, 1'000'000'000);
  EXPECT_LT(woken_after, 500ms);
  EXPECT_EQ(segment.load32(kClientWaitingAt), 0U);  // cleared on the way out
}

TEST(RingSleeping, WakeClientDoesNothingWhenNoClientWaits) {
  const Segment segment(16);
  auto [daemon, client] = formatAndAttach(segment, 16);
  daemon.complete(completionFor(1));
  daemon.wakeClient();
  EXPECT_EQ(segment.load32(kClientDoorbellAt), 0U);
  // A completion already there: no sleeping, no waiting flag left behind,
  // even with the deadline already past.
  EXPECT_TRUE(client.waitForCompletion(Clock::now() - 1s, 0us));
  EXPECT_EQ(segment.load32(kClientWaitingAt), 0U);
}

TEST(RingSleeping, WaitReturnsFalseAtTheDeadline) {
  const Segment segment(16);
  auto [daemon, client] = formatAndAttach(segment, 16);
  auto start = Clock::now();
  EXPECT_FALSE(client.waitForCompletion(start + 100ms, 0us));
  auto elapsed = Clock::now() - start;
  EXPECT_GE(elapsed, 100ms);
  EXPECT_LT(elapsed, 400ms);
  EXPECT_EQ(segment.load32(kClientWaitingAt), 0U);
  // A busy-poll longer than the deadline is cut to it.
  start = Clock::now();
  EXPECT_FALSE(client.waitForCompletion(start + 50ms, 10s));
  elapsed = Clock::now() - start;
  EXPECT_GE(elapsed, 50ms);
  EXPECT_LT(elapsed, 350ms);
  // A deadline already past returns at once.
  start = Clock::now();
  EXPECT_FALSE(client.waitForCompletion(start - 1ms, 1s));
  EXPECT_LT(Clock::now() - start, 50ms);
}

using dbuf::testing::threadCpuTime;

TEST(RingSleeping, AClientSpinsNoLongerThanTheDaemonAdvises) {
  // The client's own busy-poll is 10 s; the daemon's advice caps it. Spinning
  // shows as the waiting thread's CPU time, sleeping as none.
  const Segment segment(16);
  auto [daemon, client] = formatAndAttach(segment, 16);
  const auto cpu_of_wait = [&client] {
    const auto before = threadCpuTime();
    EXPECT_FALSE(client.waitForCompletion(Clock::now() + 100ms, 10s));
    return threadCpuTime() - before;
  };
  EXPECT_LT(cpu_of_wait(), 10ms) << "a segment never advised: no spin";
  daemon.adviseClientSpin(10s);
  EXPECT_GT(cpu_of_wait(), 20ms) << "advised to spin: it spins until the deadline";
  daemon.adviseClientSpin(0us);
  EXPECT_LT(cpu_of_wait(), 10ms) << "advised not to spin (an oversubscribed node)";
}

TEST(RingSleeping, InterruptWaitEndsASleepingWaitAtOnceWithoutACompletion) {
  const Segment segment(16);
  auto [daemon, client] = formatAndAttach(segment, 16);
  std::atomic<bool> returned{false};
  std::atomic<bool> available{true};
  std::thread waiter([&, &ring = client] {
    available = ring.waitForCompletion(Clock::now() + 10s, 0us);
    returned = true;
  });
  const auto give_up = Clock::now() + 2s;
  while (Clock::now() < give_up && segment.load32(kClientWaitingAt) != 1) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(20ms);  // asleep in the kernel by now
  EXPECT_FALSE(returned);
  const auto interrupted_at = Clock::now();
  client.interruptWait();
  waiter.join();
  EXPECT_LT(Clock::now() - interrupted_at, 1s);  // not its 10 s deadline
  EXPECT_FALSE(available);
  EXPECT_EQ(segment.load32(kClientWaitingAt), 0U);
  // A completion that is there still counts: an interrupt never hides one.
  daemon.complete(completionFor(5));
  client.interruptWait();
  EXPECT_TRUE(client.waitForCompletion(Clock::now() + 1s, 0us));
}

TEST(RingSleeping, WakeDaemonWritesTheEventfdOnlyWhenTheDaemonSleeps) {
  const Segment segment(16);
  auto [daemon, client] = formatAndAttach(segment, 16);
  const UniqueFd efd = makeEventfd();
  ASSERT_TRUE(efd.valid());

  ASSERT_TRUE(client.trySubmit(submissionFor(0)));
  client.wakeDaemon(efd.get());
  EXPECT_FALSE(readable(efd.get(), 0));  // awake daemon: no system call

  daemon.setSleeping(true);
  EXPECT_EQ(segment.load32(kDaemonSleepingAt), 1U);
  ASSERT_TRUE(client.trySubmit(submissionFor(1)));
  client.wakeDaemon(efd.get());
  ASSERT_TRUE(readable(efd.get(), 0));
  std::uint64_t count = 0;
  ASSERT_EQ(::read(efd.get(), &count, sizeof(count)), static_cast<ssize_t>(sizeof(count)));
  EXPECT_EQ(count, 1U);
  daemon.setSleeping(false);
  EXPECT_EQ(segment.load32(kDaemonSleepingAt), 0U);

  ASSERT_TRUE(client.trySubmit(submissionFor(2)));
  client.wakeDaemon(efd.get());
  EXPECT_FALSE(readable(efd.get(), 0));
  Submission s;
  for (std::uint64_t i = 0; i < 3; ++i) {
    ASSERT_EQ(daemon.take(s), TakeResult::kTaken);
    EXPECT_EQ(s.handle, i);
  }
}

TEST(RingSleeping, BothSidesSleepingPingPongAcrossProcessesLosesNoWakeUp) {
  // A client child that always sleeps (busy_poll 0) and a daemon parent that
  // always sleeps on the eventfd: any lost wake-up shows as a timeout.
  constexpr std::uint32_t kCapacity = 16;
  constexpr std::uint64_t kRounds = 2000;
  const Segment segment(kCapacity);
  auto daemon_or = DaemonRings::format(segment.memory(), kCapacity);
  ASSERT_TRUE(daemon_or.ok());
  DaemonRings daemon = *daemon_or;
  const UniqueFd efd = makeEventfd();
  ASSERT_TRUE(efd.valid());

  const pid_t child = forkChild([&]() -> int {
    auto mapping = Mapping::map(segment.fd.get(), segment.bytes);
    if (!mapping.ok()) return 10;
    auto client_or = ClientRings::attach({mapping->data(), mapping->size()});
    if (!client_or.ok()) return 11;
    ClientRings client = *client_or;
    for (std::uint64_t i = 0; i < kRounds; ++i) {
      if (!client.trySubmit(submissionFor(i))) return 20;
      client.wakeDaemon(efd.get());
      if (!client.waitForCompletion(Clock::now() + 2s, 0us)) return 21;
      Completion c;
      std::size_t bytes = 0;
      if (!client.tryReap(c, {}, bytes) || c.handle != i) return 22;
    }
    return 0;
  });
  ASSERT_GT(child, 0);

  std::uint64_t served = 0;
  std::uint64_t slept = 0;
  bool timed_out = false;
  while (served < kRounds && !timed_out) {
    Submission s;
    const TakeResult result = daemon.take(s);
    ASSERT_NE(result, TakeResult::kCorrupt);
    if (result == TakeResult::kTaken) {
      ASSERT_EQ(s.handle, served);
      ASSERT_GT(daemon.completionSpace(), 0U);
      daemon.complete(completionFor(s.handle));
      daemon.wakeClient();
      ++served;
      continue;
    }
    daemon.setSleeping(true);
    if (!daemon.hasSubmission()) {
      timed_out = !readable(efd.get(), 2000);
      ++slept;
    }
    daemon.setSleeping(false);
    std::uint64_t drained = 0;
    [[maybe_unused]] const auto n = ::read(efd.get(), &drained, sizeof(drained));
  }
  EXPECT_FALSE(timed_out);
  EXPECT_EQ(served, kRounds);
  EXPECT_EQ(waitChild(child, 5s), 0);
  EXPECT_GT(slept, 0U);                              // the eventfd path was exercised
  EXPECT_GT(segment.load32(kClientDoorbellAt), 0U);  // and the futex path
}

}  // namespace
}  // namespace dbuf::ipc
