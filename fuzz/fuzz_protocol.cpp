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
#include "samples.hpp"

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

/// One seed per sample message of the protocol tests (tests/ipc/samples.hpp):
/// every type, with edge values (longest strings, huge and negative dims).
void writeSeeds(const std::string& dir) {
  const std::vector<Message> samples = dbuf::ipc::testing::sampleMessages();
  for (std::size_t i = 0; i < samples.size(); ++i) {
    auto frame = encodeFrame(samples[i], 1);
    check(frame.ok(), "a seed encodes");
    dbuf::fuzz::writeSeed(dir, "sample-" + std::to_string(i) + "-type-" +
                                   std::to_string(static_cast<unsigned>(typeOf(samples[i]))), *frame);
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
