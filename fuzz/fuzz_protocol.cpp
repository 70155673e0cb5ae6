// Fuzzes the wire protocol (ipc/include/dbuf/ipc/protocol.hpp) as dbufd and
// libdbuf read it: a frame header, then the payload of its message type.
//
// Input: a frame, 24 header bytes then the payload. The header goes through
// decodeHeader; the payload through decodePayload of the header's type (of
// the type bytes 6..7 folded into the known types when the header is bad,
// so every type is reached whatever the magic says). Inputs shorter than a
// header: byte 0 picks the type, the rest is the payload.
//
// Properties: bad input is an error value, never a crash; a header that
// decodes encodes back to the same 24 bytes; a payload that decodes encodes
// (encodePayload) back to the same bytes, which decode to the same message.
//
// `fuzz_protocol --write-seeds DIR` writes the seed corpus: valid frames of
// every message type.

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dbuf/ipc/protocol.hpp"
#include "fuzz_util.hpp"

namespace {

using namespace dbuf::ipc;  // NOLINT(google-build-using-namespace)
using dbuf::fuzz::check;

constexpr std::uint16_t kTypes = static_cast<std::uint16_t>(MessageType::kShutdown);

MessageType foldType(std::uint16_t raw) {
  if (raw >= 1 && raw <= kTypes) return static_cast<MessageType>(raw);
  return static_cast<MessageType>(raw % kTypes + 1);
}

void checkPayload(MessageType type, std::span<const std::byte> payload) {
  auto decoded = decodePayload(type, payload);
  if (!decoded) {
    check(!decoded.error().message.empty(), "a decode error has a message");
    return;
  }
  check(typeOf(*decoded) == type, "the decoded message has the frame's type");
  auto encoded = encodePayload(*decoded);
  check(encoded.ok(), "a payload that decodes encodes again");
  check(std::equal(encoded->begin(), encoded->end(), payload.begin(), payload.end()),
        "a decoded payload encodes back to the same bytes");
  auto again = decodePayload(type, *encoded);
  check(again.ok(), "a re-encoded payload decodes");
  check(*again == *decoded, "a re-encoded payload decodes to the same message");
  auto frame = encodeFrame(*decoded, 42);
  check(frame.ok(), "a decoded message encodes as a frame");
  const std::span<const std::byte, kHeaderBytes> head(frame->data(), kHeaderBytes);
  auto header = decodeHeader(head);
  check(header.ok() && header->type == type && header->payload_bytes == payload.size() && header->request_id == 42,
        "an encoded frame's header decodes to its type, length and request id");
}

void writeSeeds(const std::string& dir) {
  Hello hello;
  hello.job_id = "job-1";
  hello.rank = 1;
  hello.world_size = 4;
  hello.local_rank = 1;
  hello.local_world_size = 2;
  hello.store = "file:/tmp/store#run.1";
  hello.device = 0;
  hello.gpu_uuid.high = 0x0123456789abcdefULL;
  hello.gpu_uuid.low = 0xfedcba9876543210ULL;
  hello.nonce = 7;
  hello.persistent = true;
  hello.prefetch_depth = 2;
  Hello plain;
  plain.job_id = "j";

  Welcome welcome;
  welcome.nonce = 7;
  welcome.daemon_instance_id = 99;
  welcome.session_id = 3;
  welcome.memory_quota_bytes = std::uint64_t{16} << 30;
  welcome.memory_used_bytes = 4096;
  welcome.reattached = true;
  welcome.ring_capacity = 1024;
  welcome.segment_bytes = 1 << 20;
  welcome.busy_poll_us = 50;
  welcome.memory_kind = MemoryKind::kCuda;
  welcome.device = 1;

  ErrorReply error{WireError::kTimeout, "collective #3 timed out: ranks 1, 2 did not arrive", {1, 2}};
  ErrorReply bare{WireError::kVersionMismatch, "unsupported protocol version 6", {}};

  RegisterGroup group;
  group.name = "layers.0";
  group.granularity = "rows:32";
  group.align_bytes = 256;
  group.tensors = {TensorDecl{"wq", {4096, 4096}, "", -1}, TensorDecl{"norm", {4096}, "element", -1},
                   TensorDecl{"w1", {8, 14336, 4096}, "block:128x128", 1}};

  GroupReady ready;
  ready.group_id = 5;
  ready.devices = 4;
  ready.shard_elems = 1 << 20;
  ready.sharded_dtype = "fp32";
  ready.unsharded_dtype = "bf16";
  ready.tensors = {PlacedTensorWire{"wq", {1024, 1024}, 0, 1 << 20, 1024},
                   PlacedTensorWire{"norm", {1024}, 1 << 20, 1024, 1}};
  ready.shard_file_bytes = 8 << 20;
  ready.sharded = Region{0, 4 << 20};
  ready.sharded_grad = Region{4 << 20, 4 << 20};
  ready.slot_bytes = 16 << 20;

  SlotGranted slot{5, 1, 32 << 20, Region{0, 8 << 20}, Region{8 << 20, 8 << 20}, Region{16 << 20, 4096}};

  const std::vector<std::pair<std::string, Message>> seeds = {
      {"hello", hello},
      {"hello-plain", plain},
      {"welcome", welcome},
      {"error", error},
      {"error-bare", bare},
      {"register-group", group},
      {"register-group-empty", RegisterGroup{}},
      {"group-ready", ready},
      {"acquire-slot", AcquireSlot{5}},
      {"slot-granted", slot},
      {"release-slot", ReleaseSlot{5}},
      {"slot-released", SlotReleased{5}},
      {"detach", Detach{}},
      {"detached", Detached{}},
      {"shutdown", Shutdown{"dbufd is stopping (SIGTERM)"}},
  };
  for (const auto& [name, message] : seeds) {
    auto frame = encodeFrame(message, 1);
    check(frame.ok(), "a seed encodes");
    dbuf::fuzz::writeSeed(dir, name, *frame);
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  dbuf::fuzz::seedMode(argc, argv, writeSeeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> input(reinterpret_cast<const std::byte*>(data), size);  // NOLINT
  if (size < kHeaderBytes) {
    if (size == 0) return 0;
    checkPayload(foldType(data[0]), input.subspan(1));
    return 0;
  }
  const std::span<const std::byte, kHeaderBytes> head(input.data(), kHeaderBytes);
  auto header = decodeHeader(head);
  MessageType type{};
  if (header) {
    const auto encoded = encodeHeader(*header);
    check(std::equal(encoded.begin(), encoded.end(), head.begin()), "a decoded header encodes back to its bytes");
    check(header->payload_bytes <= kMaxPayloadBytes, "a decoded header's length is within the maximum");
    type = header->type;
  } else {
    check(!header.error().message.empty(), "a header error has a message");
    type = foldType(static_cast<std::uint16_t>(data[6] | (data[7] << 8U)));
  }
  checkPayload(type, input.subspan(kHeaderBytes));
  return 0;
}
