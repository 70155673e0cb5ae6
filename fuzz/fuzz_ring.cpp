// Fuzzes the daemon's side of a session segment (ipc/include/dbuf/ipc/ring.hpp)
// against a client that writes anything into the parts it can write.
//
// A segment is formatted as dbufd formats it (DaemonRings::format); then the
// input is a script of steps, each one byte of opcode and its operands:
// the client writes its submission head, its completion tail, raw bytes
// into the submission entries, its waiting flag or the stream counters; the
// daemon takes a submission (only while roomToAnswer(), as
// DataPlane::takeSubmissions does), completes the oldest one in flight with
// a message of fuzz length (as DataPlane::completeOne does, without
// checking completionSpace()), wakes the client, reads the counters. At most
// kMaxSteps steps.
//
// Properties: nothing the client writes makes the daemon read or write
// outside the segment (ASan: the segment is a heap block of exactly
// segmentBytes()), or take more than it can answer: in flight <= capacity,
// completionSpace() <= capacity, take() kCorrupt for an impossible head.
//
// `fuzz_ring --write-seeds DIR` writes scripts of a client that behaves.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "dbuf/ipc/ring.hpp"
#include "fuzz_util.hpp"

namespace {

using namespace dbuf::ipc;  // NOLINT(google-build-using-namespace)
using dbuf::fuzz::check;

// Offsets of the client-written words: ring.hpp's layout (64-byte lines
// after the header: submit head, submit tail, complete head, complete tail,
// daemon sleeping, client doorbell + client waiting), entries from line 7.
constexpr std::size_t kSubmitHead = 64;
constexpr std::size_t kCompleteTail = 4 * 64;
constexpr std::size_t kClientWaiting = 6 * 64 + 4;
constexpr std::size_t kEntriesStart = 7 * 64;
constexpr int kMaxSteps = 512;

enum Step : std::uint8_t {
  kSetSubmitHead,    // u64
  kBumpSubmitHead,   // u8: head += n (a client that submits n entries)
  kSetCompleteTail,  // u64
  kReapAll,          // tail = what the daemon completed so far (read from its index)
  kWriteEntry,       // u16 entry index, 64 bytes
  kSetWaiting,       // u8
  kSetCounters,      // u64 ready, u64 done
  kTake,             // while roomToAnswer(): take()
  kComplete,         // u16 message length, u8 fill
  kWake,             //
  kSleep,            // u8 flag
  kStepCount,
};

struct AlignedFree {
  void operator()(std::byte* p) const noexcept { ::operator delete[](p, std::align_val_t{64}); }
};

void store64(std::byte* at, std::uint64_t value) {
  std::memcpy(at, &value, sizeof(value));
}

void run(const std::uint8_t* data, std::size_t size) {
  dbuf::fuzz::Bytes in(data, size);
  const std::uint32_t capacity = kMinRingCapacity << (in.take<std::uint8_t>() % 3);  // 16, 32 or 64
  const std::size_t bytes = segmentBytes(capacity);
  const std::unique_ptr<std::byte[], AlignedFree> memory(new (std::align_val_t{64}) std::byte[bytes]());
  auto formatted = DaemonRings::format({memory.get(), bytes}, capacity);
  check(formatted.ok(), "format accepts a zeroed segment of segmentBytes()");
  DaemonRings rings = std::move(*formatted);
  std::byte* base = memory.get();
  std::uint64_t client_head = 0;  // what a well-behaved client would have written
  std::uint64_t completed = 0;    // completions the daemon published
  std::uint64_t taken = 0;
  bool corrupt = false;

  for (int step = 0; step < kMaxSteps && !in.empty() && !corrupt; ++step) {
    switch (in.take<std::uint8_t>() % kStepCount) {
      case kSetSubmitHead:
        client_head = in.take<std::uint64_t>();
        store64(base + kSubmitHead, client_head);
        break;
      case kBumpSubmitHead:
        client_head += in.take<std::uint8_t>() % (capacity + 2);
        store64(base + kSubmitHead, client_head);
        break;
      case kSetCompleteTail:
        store64(base + kCompleteTail, in.take<std::uint64_t>());
        break;
      case kReapAll:
        store64(base + kCompleteTail, completed);
        break;
      case kWriteEntry: {
        const std::size_t index = in.take<std::uint16_t>() % capacity;
        const auto raw = in.span(kRingEntryBytes);
        std::memcpy(base + kEntriesStart + index * kRingEntryBytes, raw.data(), raw.size());
        break;
      }
      case kSetWaiting: {
        const std::uint32_t waiting = in.take<std::uint8_t>() % 2;
        std::memcpy(base + kClientWaiting, &waiting, sizeof(waiting));
        break;
      }
      case kSetCounters: {
        StreamCounters& counters = rings.streamCounters();
        counters.ready = in.take<std::uint64_t>();
        counters.done = in.take<std::uint64_t>();
        break;
      }
      case kTake:
        while (rings.roomToAnswer()) {
          Submission submission;
          const TakeResult result = rings.take(submission);
          if (result == TakeResult::kEmpty) {
            check(!rings.hasSubmission(), "take() empty means no submission waits");
            break;
          }
          check(rings.hasSubmission() || result == TakeResult::kTaken, "kCorrupt reads as a waiting submission");
          if (result == TakeResult::kCorrupt) {
            corrupt = true;  // dbufd closes the session
            break;
          }
          ++taken;
          OpCode op{};
          if (opCodeFrom(submission.op, op)) check(!toString(op).empty(), "a valid op has a name");
          check(rings.inFlight() <= capacity, "no more in flight than the ring holds");
        }
        break;
      case kComplete: {
        const std::size_t length = in.take<std::uint16_t>() % (kCompletionMessageBytes + 64);
        const char fill = static_cast<char>(in.take<std::uint8_t>());
        if (rings.inFlight() == 0) break;  // the daemon answers only what it took
        Completion completion;
        completion.handle = completed;
        completion.status = length == 0 ? 0 : 9;
        const std::vector<std::uint32_t> ranks(length % 9, 3);
        setCompletionRanks(completion, ranks);
        check(completionRanks(completion).size() == std::min<std::size_t>(ranks.size(), kCompletionRanks),
              "a completion carries its first ranks inline");
        rings.complete(completion, std::string(length, fill));
        ++completed;
        break;
      }
      case kWake:
        rings.wakeClient();
        break;
      case kSleep:
        rings.setSleeping(in.take<std::uint8_t>() % 2 == 1);
        break;
      default:
        break;
    }
    check(rings.completionSpace() <= capacity, "completionSpace() never exceeds the capacity");
    check(rings.inFlight() == taken - completed, "in flight = taken - completed");
    (void)rings.hasSubmission();
  }
}

/// A script byte by byte (the harness reads operands little-endian).
struct Script {
  std::vector<std::uint8_t> bytes;
  Script& op(Step step) {
    bytes.push_back(step);
    return *this;
  }
  Script& u8(std::uint8_t value) {
    bytes.push_back(value);
    return *this;
  }
  Script& u16(std::uint16_t value) {
    return u8(static_cast<std::uint8_t>(value)).u8(static_cast<std::uint8_t>(value >> 8U));
  }
  Script& u64(std::uint64_t value) {
    for (int i = 0; i < 8; ++i) u8(static_cast<std::uint8_t>(value >> (8U * static_cast<unsigned>(i))));
    return *this;
  }
  Script& entry(std::uint16_t index, std::uint8_t op_code, std::uint8_t flags, std::uint64_t ticket) {
    Submission submission;
    submission.handle = index + 100U;
    submission.group_id = 1;
    submission.op = op_code;
    submission.flags = flags;
    submission.ticket = ticket;
    std::uint8_t raw[sizeof(Submission)];
    std::memcpy(raw, &submission, sizeof(raw));
    op(kWriteEntry).u16(index);
    for (const std::uint8_t b : raw) u8(b);
    return *this;
  }
};

void writeSeeds(const std::string& dir) {
  const auto write = [&](const std::string& name, const Script& script) {
    dbuf::fuzz::writeSeed(dir, name, std::as_bytes(std::span(script.bytes)));
  };
  Script one;
  one.u8(0).entry(0, static_cast<std::uint8_t>(OpCode::kNoop), 0, 0).op(kBumpSubmitHead).u8(1).op(kTake);
  one.op(kComplete).u16(0).u8(0).op(kReapAll).op(kSetWaiting).u8(1).op(kWake);
  write("noop", one);

  Script full;
  full.u8(0);
  for (std::uint16_t i = 0; i < 16; ++i) full.entry(i, static_cast<std::uint8_t>(1 + i % 6), i % 3, i);
  full.op(kBumpSubmitHead).u8(16).op(kTake);
  for (int i = 0; i < 16; ++i) full.op(kComplete).u16(static_cast<std::uint16_t>(i * 40)).u8('x');
  full.op(kReapAll).op(kBumpSubmitHead).u8(3).op(kTake).op(kComplete).u16(600).u8('y');
  write("full-ring", full);

  Script wrap;
  wrap.u8(1).op(kSetCounters).u64(5).u64(4);
  for (int round = 0; round < 5; ++round) {
    wrap.entry(static_cast<std::uint16_t>(round * 7), static_cast<std::uint8_t>(OpCode::kAllGather), 2,
               static_cast<std::uint64_t>(round + 1));
    wrap.op(kBumpSubmitHead).u8(7).op(kTake);
    for (int i = 0; i < 7; ++i) wrap.op(kComplete).u16(1).u8('e');
    wrap.op(kReapAll).op(kSleep).u8(1).op(kSleep).u8(0);
  }
  write("wrap-around", wrap);

  Script bad;
  bad.u8(2).op(kSetCompleteTail).u64(~std::uint64_t{0}).op(kBumpSubmitHead).u8(2).op(kTake);
  bad.op(kComplete).u16(5).u8('z').op(kSetSubmitHead).u64(1000).op(kTake);
  write("corrupt-indices", bad);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  dbuf::fuzz::seedMode(argc, argv, writeSeeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  run(data, size);
  return 0;
}
