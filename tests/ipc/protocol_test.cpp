// Wire protocol codec without a socket: round trips of every message type,
// rejection of every kind of malformed header and payload, and a fuzz-style
// loop over random and mutated payloads (fixed seeds).

#include "dbuf/ipc/protocol.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <set>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "samples.hpp"

namespace dbuf::ipc {
namespace {

using testing::sampleGroupReady;
using testing::sampleHello;
using testing::sampleMessages;
using testing::sampleRegisterGroup;
using testing::sampleWelcome;
using testing::tensorDecl;

/// Little-endian payload builder for hand-made (often malformed) payloads.
class Bytes {
 public:
  Bytes& u8(std::uint8_t value) {
    bytes_.push_back(static_cast<std::byte>(value));
    return *this;
  }
  Bytes& u16(std::uint16_t value) { return le(value, 2); }
  Bytes& u32(std::uint32_t value) { return le(value, 4); }
  Bytes& u64(std::uint64_t value) { return le(value, 8); }
  Bytes& i32(std::int32_t value) { return le(static_cast<std::uint32_t>(value), 4); }
  Bytes& i64(std::int64_t value) { return le(static_cast<std::uint64_t>(value), 8); }
  Bytes& str(const std::string& value) {
    u32(static_cast<std::uint32_t>(value.size()));
    for (const char c : value) bytes_.push_back(static_cast<std::byte>(c));
    return *this;
  }
  [[nodiscard]] const std::vector<std::byte>& get() const { return bytes_; }

 private:
  Bytes& le(std::uint64_t value, int width) {
    for (int i = 0; i < width; ++i) {
      bytes_.push_back(static_cast<std::byte>(value & 0xFFU));
      value >>= 8U;
    }
    return *this;
  }
  std::vector<std::byte> bytes_;
};

std::vector<std::byte> payloadOf(const Message& message) {
  auto payload = encodePayload(message);
  EXPECT_TRUE(payload.ok()) << payload.error().message;
  return payload.ok() ? *payload : std::vector<std::byte>{};
}

std::string decodeError(MessageType type, std::span<const std::byte> payload) {
  auto decoded = decodePayload(type, payload);
  if (decoded.ok()) return "<decoded fine>";
  EXPECT_EQ(decoded.error().code, ErrorCode::kInvalidArgument);
  return decoded.error().message;
}

std::string encodeError(const Message& message) {
  auto encoded = encodePayload(message);
  if (encoded.ok()) return "<encoded fine>";
  EXPECT_EQ(encoded.error().code, ErrorCode::kInvalidArgument);
  return encoded.error().message;
}

std::array<std::byte, kHeaderBytes> validHeaderBytes() {
  FrameHeader header;
  header.type = MessageType::kHello;
  header.payload_bytes = 100;
  header.request_id = 7;
  return encodeHeader(header);
}

const std::vector<MessageType>& allTypes() {
  static const std::vector<MessageType> types = [] {
    std::vector<MessageType> out;
    for (auto raw = static_cast<std::uint16_t>(MessageType::kHello);
         raw <= static_cast<std::uint16_t>(MessageType::kGroupUnregistered); ++raw) {
      out.push_back(static_cast<MessageType>(raw));
    }
    return out;
  }();
  return types;
}

// ---------------------------------------------------------------- round trips

TEST(ProtocolRoundTrip, EveryMessageTypeDecodesToWhatWasEncoded) {
  std::set<MessageType> seen;
  for (const Message& message : sampleMessages()) {
    const MessageType type = typeOf(message);
    seen.insert(type);
    const auto payload = payloadOf(message);
    auto decoded = decodePayload(type, payload);
    ASSERT_TRUE(decoded.ok()) << decoded.error().message;
    EXPECT_EQ(*decoded, message) << "type " << static_cast<int>(type);
    EXPECT_EQ(typeOf(*decoded), type);
  }
  EXPECT_EQ(seen.size(), allTypes().size()) << "every message type has a sample";
}

TEST(ProtocolRoundTrip, TypeOfFollowsTheVariantOrder) {
  EXPECT_EQ(typeOf(Hello{}), MessageType::kHello);
  EXPECT_EQ(typeOf(Welcome{}), MessageType::kWelcome);
  EXPECT_EQ(typeOf(ErrorReply{}), MessageType::kError);
  EXPECT_EQ(typeOf(RegisterGroup{}), MessageType::kRegisterGroup);
  EXPECT_EQ(typeOf(GroupReady{}), MessageType::kGroupReady);
  EXPECT_EQ(typeOf(AcquireSlot{}), MessageType::kAcquireSlot);
  EXPECT_EQ(typeOf(SlotGranted{}), MessageType::kSlotGranted);
  EXPECT_EQ(typeOf(ReleaseSlot{}), MessageType::kReleaseSlot);
  EXPECT_EQ(typeOf(SlotReleased{}), MessageType::kSlotReleased);
  EXPECT_EQ(typeOf(Detach{}), MessageType::kDetach);
  EXPECT_EQ(typeOf(Detached{}), MessageType::kDetached);
  EXPECT_EQ(typeOf(Shutdown{}), MessageType::kShutdown);
  EXPECT_EQ(typeOf(AdminRequest{}), MessageType::kAdminRequest);
  EXPECT_EQ(typeOf(AdminReply{}), MessageType::kAdminReply);
  EXPECT_EQ(typeOf(UnregisterGroup{}), MessageType::kUnregisterGroup);
  EXPECT_EQ(typeOf(GroupUnregistered{}), MessageType::kGroupUnregistered);
}

TEST(ProtocolRoundTrip, WholeFrameThroughHeaderAndPayload) {
  for (const Message& message : sampleMessages()) {
    auto frame = encodeFrame(message, 0x1122334455667788ULL);
    ASSERT_TRUE(frame.ok()) << frame.error().message;
    ASSERT_GE(frame->size(), kHeaderBytes);
    auto header = decodeHeader(std::span<const std::byte, kHeaderBytes>(frame->data(), kHeaderBytes));
    ASSERT_TRUE(header.ok()) << header.error().message;
    EXPECT_EQ(header->magic, kMagic);
    EXPECT_EQ(header->version, kProtocolVersion);
    EXPECT_EQ(header->type, typeOf(message));
    EXPECT_EQ(header->request_id, 0x1122334455667788ULL);
    ASSERT_EQ(header->payload_bytes, frame->size() - kHeaderBytes);
    auto decoded = decodePayload(header->type, std::span(*frame).subspan(kHeaderBytes));
    ASSERT_TRUE(decoded.ok()) << decoded.error().message;
    EXPECT_EQ(*decoded, message);
  }
}

TEST(ProtocolRoundTrip, HeaderLayoutIsLittleEndianAtFixedOffsets) {
  FrameHeader header;
  header.type = MessageType::kGroupReady;
  header.payload_bytes = 0x00010203;
  header.request_id = 0x0807060504030201ULL;
  const auto bytes = encodeHeader(header);
  const std::vector<std::uint8_t> expected = {
      0x44, 0x42, 0x55, 0x46,                          // magic "DBUF"
      0x09, 0x00,                                      // version 9 (AcquireSlot::grow)
      0x05, 0x00,                                      // type GroupReady
      0x03, 0x02, 0x01, 0x00,                          // payload length
      0x00, 0x00, 0x00, 0x00,                          // reserved
      0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08,  // request id
  };
  ASSERT_EQ(expected.size(), kHeaderBytes);
  static_assert(kProtocolVersion == 9, "update the expected header bytes with the version");
  for (std::size_t i = 0; i < kHeaderBytes; ++i) {
    EXPECT_EQ(static_cast<std::uint8_t>(bytes[i]), expected[i]) << "byte " << i;
  }
  auto decoded = decodeHeader(bytes);
  ASSERT_TRUE(decoded.ok()) << decoded.error().message;
  EXPECT_EQ(decoded->type, header.type);
  EXPECT_EQ(decoded->payload_bytes, header.payload_bytes);
  EXPECT_EQ(decoded->request_id, header.request_id);
}

TEST(ProtocolRoundTrip, PayloadLayoutOfAcquireSlotAndHello) {
  const auto slot = payloadOf(AcquireSlot{0x04030201, true});
  EXPECT_EQ(slot, Bytes().u32(0x04030201).u8(1).get());

  Hello hello;
  hello.job_id = "ab";
  hello.rank = 1;
  hello.world_size = 2;
  hello.local_rank = 3;
  hello.local_world_size = 5;
  hello.store = "file:/s";
  hello.device = -1;
  hello.gpu_uuid = {0x1122334455667788ULL, 0x99aabbccddeeff00ULL};
  hello.nonce = 9;
  hello.persistent = true;
  hello.prefetch_depth = 4;
  const auto expected = Bytes()
                            .u16(kProtocolVersion)
                            .str("ab")
                            .u32(1)
                            .u32(2)
                            .u32(3)
                            .u32(5)
                            .str("file:/s")
                            .i32(-1)
                            .u64(0x1122334455667788ULL)
                            .u64(0x99aabbccddeeff00ULL)
                            .u64(9)
                            .u8(1)
                            .u32(4)
                            .get();
  EXPECT_EQ(payloadOf(hello), expected);
}

TEST(ProtocolRoundTrip, PayloadLayoutOfWelcome) {
  // Protocol 2 put the data-plane fields before `reattached`; protocol 3
  // appended the memory kind and the device.
  Welcome welcome;
  welcome.nonce = 0x1111111111111111ULL;
  welcome.daemon_instance_id = 0x2222222222222222ULL;
  welcome.session_id = 3;
  welcome.memory_quota_bytes = 4;
  welcome.memory_used_bytes = 5;
  welcome.ring_capacity = 0x01020304U;
  welcome.segment_bytes = 0x0A0B0C0D0E0F1011ULL;
  welcome.busy_poll_us = 0x21222324U;
  welcome.reattached = true;
  welcome.memory_kind = MemoryKind::kCuda;
  welcome.device = 0x31323334;
  const auto expected = Bytes()
                            .u64(0x1111111111111111ULL)
                            .u64(0x2222222222222222ULL)
                            .u64(3)
                            .u64(4)
                            .u64(5)
                            .u32(0x01020304U)
                            .u64(0x0A0B0C0D0E0F1011ULL)
                            .u32(0x21222324U)
                            .u8(1)
                            .u8(1)
                            .u32(0x31323334U)
                            .get();
  EXPECT_EQ(payloadOf(welcome), expected);
  auto decoded = decodePayload(MessageType::kWelcome, expected);
  ASSERT_TRUE(decoded.ok()) << decoded.error().message;
  EXPECT_EQ(*decoded, Message(welcome));
}

TEST(ProtocolRoundTrip, WelcomeDataPlaneFieldsRoundTripEachOnItsOwn) {
  // One new field at a time at its extreme, every other field default: a
  // field encoded into its neighbour's place cannot pass.
  for (int field = 0; field < 3; ++field) {
    Welcome welcome;
    if (field == 0) welcome.ring_capacity = 0xFFFFFFFFU;
    if (field == 1) welcome.segment_bytes = 0xFFFFFFFFFFFFFFFFULL;
    if (field == 2) welcome.busy_poll_us = 0xFFFFFFFFU;
    auto decoded = decodePayload(MessageType::kWelcome, payloadOf(welcome));
    ASSERT_TRUE(decoded.ok()) << decoded.error().message;
    ASSERT_TRUE(std::holds_alternative<Welcome>(*decoded));
    const auto& back = std::get<Welcome>(*decoded);
    EXPECT_EQ(back, welcome) << "field " << field;
    EXPECT_EQ(back.ring_capacity, welcome.ring_capacity) << "field " << field;
    EXPECT_EQ(back.segment_bytes, welcome.segment_bytes) << "field " << field;
    EXPECT_EQ(back.busy_poll_us, welcome.busy_poll_us) << "field " << field;
    EXPECT_FALSE(back.reattached);
  }
  // The sample (every field non-default) through a whole frame.
  const Welcome sample = sampleWelcome();
  ASSERT_NE(sample.ring_capacity, Welcome{}.ring_capacity);
  ASSERT_NE(sample.segment_bytes, Welcome{}.segment_bytes);
  ASSERT_NE(sample.busy_poll_us, Welcome{}.busy_poll_us);
  auto frame = encodeFrame(sample, 9);
  ASSERT_TRUE(frame.ok()) << frame.error().message;
  EXPECT_EQ(frame->size(), kHeaderBytes + std::size_t{5} * 8 + 4 + 8 + 4 + 1 + 1 + 4);
  auto decoded = decodePayload(MessageType::kWelcome, std::span(*frame).subspan(kHeaderBytes));
  ASSERT_TRUE(decoded.ok()) << decoded.error().message;
  EXPECT_EQ(*decoded, Message(sample));
}

TEST(ProtocolPayload, ProtocolOneWelcomeIsTruncatedNotMisread) {
  // A version-1 Welcome (five u64 then reattached) read as version 2: the
  // reattached byte would be the start of ring_capacity; refused instead.
  const auto v1 = Bytes().u64(1).u64(2).u64(3).u64(4).u64(5).u8(1).get();
  const std::string error = decodeError(MessageType::kWelcome, v1);
  EXPECT_NE(error.find("truncated"), std::string::npos) << error;
  EXPECT_NE(error.find("ring_capacity"), std::string::npos) << error;
}

TEST(ProtocolRoundTrip, PayloadLayoutOfSlotGrantedEndsWithTheScales) {
  const SlotGranted granted{3, 1, 1ULL << 33U, Region{256, 1000}, Region{1280, 1000}, Region{2304, 64}};
  const auto expected =
      Bytes().u32(3).u32(1).u64(1ULL << 33U).u64(256).u64(1000).u64(1280).u64(1000).u64(2304).u64(64).get();
  EXPECT_EQ(payloadOf(granted), expected);
}

TEST(ProtocolRoundTrip, LimitsThemselvesAreAccepted) {
  RegisterGroup group;
  group.name = std::string(kMaxStringBytes, 'n');
  group.tensors.resize(kMaxTensorsPerGroup);
  for (std::size_t i = 0; i < group.tensors.size(); ++i) {
    group.tensors[i] = tensorDecl("t" + std::to_string(i), {1, 2, 3, 4, 5, 6, 7, static_cast<std::int64_t>(i)}, "", 7);
  }
  const auto payload = payloadOf(group);
  auto decoded = decodePayload(MessageType::kRegisterGroup, payload);
  ASSERT_TRUE(decoded.ok()) << decoded.error().message;
  EXPECT_EQ(*decoded, Message(group));

  Hello hello = sampleHello();
  hello.job_id = std::string(128, 'a');
  auto hello_decoded = decodePayload(MessageType::kHello, payloadOf(hello));
  ASSERT_TRUE(hello_decoded.ok()) << hello_decoded.error().message;
  EXPECT_EQ(*hello_decoded, Message(hello));
}

// --------------------------------------------------------------- bad headers

TEST(ProtocolHeader, BadMagicIsRejected) {
  auto bytes = validHeaderBytes();
  bytes[0] = std::byte{'X'};
  auto decoded = decodeHeader(bytes);
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(decoded.error().message.find("magic"), std::string::npos) << decoded.error().message;
}

TEST(ProtocolHeader, OtherProtocolVersionIsRejectedAsSuch) {
  // 1 is the version before the data plane, 2 the one before the memory
  // kind, 3 the one before stream-ordered ops (a smaller session segment), 4
  // the one before the GPU's UUID (a shorter Hello), 5 the one before the
  // ranks of an error (a shorter ErrorReply, other completion entries), 6
  // the one before jobs across nodes (a shorter Hello), 7 the one before
  // operators' requests, 8 the one before AcquireSlot::grow (a shorter
  // AcquireSlot): they must be refused as a version, not half-decoded.
  for (const std::uint16_t version : {std::uint16_t{0}, std::uint16_t{1}, std::uint16_t{2}, std::uint16_t{3},
                                      std::uint16_t{4}, std::uint16_t{5}, std::uint16_t{6}, std::uint16_t{7},
                                      std::uint16_t{8}, std::uint16_t{10}, std::uint16_t{0xFFFF}}) {
    FrameHeader header;
    header.version = version;
    header.type = MessageType::kHello;
    auto decoded = decodeHeader(encodeHeader(header));
    ASSERT_FALSE(decoded.ok());
    EXPECT_NE(decoded.error().message.find("protocol version"), std::string::npos) << decoded.error().message;
  }
  // A future version with a type we do not know still hears about the version.
  auto bytes = validHeaderBytes();
  bytes[4] = std::byte{kProtocolVersion + 1};
  bytes[6] = std::byte{99};
  auto decoded = decodeHeader(bytes);
  ASSERT_FALSE(decoded.ok());
  EXPECT_NE(decoded.error().message.find("protocol version"), std::string::npos) << decoded.error().message;
}

TEST(ProtocolHeader, UnknownTypeIsRejected) {
  for (const std::uint16_t type : {std::uint16_t{0}, std::uint16_t{17}, std::uint16_t{0x0100}, std::uint16_t{0xFFFF}}) {
    auto bytes = validHeaderBytes();
    bytes[6] = static_cast<std::byte>(type & 0xFFU);
    bytes[7] = static_cast<std::byte>(type >> 8U);
    auto decoded = decodeHeader(bytes);
    ASSERT_FALSE(decoded.ok()) << type;
    EXPECT_NE(decoded.error().message.find("unknown message type " + std::to_string(type)), std::string::npos)
        << decoded.error().message;
  }
  for (const MessageType type : allTypes()) {
    FrameHeader header;
    header.type = type;
    EXPECT_TRUE(decodeHeader(encodeHeader(header)).ok());
  }
}

TEST(ProtocolHeader, OversizeLengthIsRejected) {
  FrameHeader header;
  header.type = MessageType::kRegisterGroup;
  header.payload_bytes = kMaxPayloadBytes;
  EXPECT_TRUE(decodeHeader(encodeHeader(header)).ok());
  for (const std::uint32_t length : {kMaxPayloadBytes + 1, 0xFFFFFFFFU}) {
    header.payload_bytes = length;
    auto decoded = decodeHeader(encodeHeader(header));
    ASSERT_FALSE(decoded.ok());
    EXPECT_NE(decoded.error().message.find("payload length"), std::string::npos) << decoded.error().message;
  }
}

TEST(ProtocolHeader, NonzeroReservedIsRejected) {
  for (std::size_t offset = 12; offset < 16; ++offset) {
    auto bytes = validHeaderBytes();
    bytes[offset] = std::byte{0x80};
    auto decoded = decodeHeader(bytes);
    ASSERT_FALSE(decoded.ok());
    EXPECT_NE(decoded.error().message.find("reserved"), std::string::npos) << decoded.error().message;
  }
}

// -------------------------------------------------------------- bad payloads

TEST(ProtocolPayload, EveryProperPrefixIsRejected) {
  for (const Message& message : sampleMessages()) {
    const auto payload = payloadOf(message);
    const MessageType type = typeOf(message);
    for (std::size_t length = 0; length < payload.size(); ++length) {
      auto decoded = decodePayload(type, std::span(payload).first(length));
      ASSERT_FALSE(decoded.ok()) << "type " << static_cast<int>(type) << " prefix " << length;
      EXPECT_NE(decoded.error().message.find("truncated"), std::string::npos) << decoded.error().message;
    }
  }
}

TEST(ProtocolPayload, TrailingBytesAreRejected) {
  for (const Message& message : sampleMessages()) {
    auto payload = payloadOf(message);
    payload.push_back(std::byte{0});
    const std::string error = decodeError(typeOf(message), payload);
    EXPECT_NE(error.find("1 trailing byte after the last field"), std::string::npos) << error;
  }
}

TEST(ProtocolPayload, BoolMustBeZeroOrOne) {
  auto hello = payloadOf(sampleHello());
  // Hello ends with persistent (1 byte) then prefetch_depth (4 bytes).
  const std::size_t persistent = hello.size() - 5;
  ASSERT_EQ(hello[persistent], std::byte{1});
  for (const int value : {2, 0x80, 0xFF}) {
    hello[persistent] = static_cast<std::byte>(value);
    EXPECT_EQ(decodeError(MessageType::kHello, hello),
              "Hello.persistent: bool byte " + std::to_string(value) + " is neither 0 nor 1");
  }
  auto welcome = payloadOf(Welcome{1, 2, 3, 4, 5, false});
  welcome[welcome.size() - 6] = std::byte{7};  // reattached, before the memory kind (1) and device (4)
  EXPECT_EQ(decodeError(MessageType::kWelcome, welcome), "Welcome.reattached: bool byte 7 is neither 0 nor 1");
}

TEST(ProtocolPayload, UnknownMemoryKindIsRejected) {
  auto welcome = payloadOf(Welcome{});
  welcome[welcome.size() - 5] = std::byte{2};  // memory_kind, before the 4-byte device
  EXPECT_NE(decodeError(MessageType::kWelcome, welcome).find("memory_kind"), std::string::npos)
      << decodeError(MessageType::kWelcome, welcome);
}

TEST(ProtocolPayload, StringTooLongIsRejectedOnBothSides) {
  RegisterGroup group = sampleRegisterGroup();
  group.tensors[2].granularity = std::string(kMaxStringBytes + 1, 'g');
  EXPECT_EQ(encodeError(group), "RegisterGroup.tensors[2].granularity: length 513 exceeds 512");

  EXPECT_EQ(encodeError(Shutdown{std::string(kMaxStringBytes + 1, 'r')}), "Shutdown.reason: length 513 exceeds 512");
  // The length is checked before the bytes: a huge claimed length is refused
  // without reading (or allocating) anything.
  auto payload = Bytes().u32(kMaxStringBytes + 1).get();
  payload.resize(payload.size() + kMaxStringBytes + 1, std::byte{'r'});
  EXPECT_EQ(decodeError(MessageType::kShutdown, payload), "Shutdown.reason: length 513 exceeds 512");
  EXPECT_EQ(decodeError(MessageType::kShutdown, Bytes().u32(0xFFFFFFFFU).get()),
            "Shutdown.reason: length 4294967295 exceeds 512");
}

TEST(ProtocolPayload, AdminLimitsAreCheckedOnBothSides) {
  // A reply may be a payload long, where every other string is 512 bytes.
  EXPECT_EQ(encodePayload(AdminReply{std::string(kMaxAdminReplyBytes, ' ')})->size(), kMaxPayloadBytes);
  EXPECT_EQ(encodeError(AdminReply{std::string(kMaxAdminReplyBytes + 1, ' ')}),
            "AdminReply.json: length 1048573 exceeds 1048572");
  EXPECT_EQ(decodeError(MessageType::kAdminReply, Bytes().u32(kMaxAdminReplyBytes + 1).get()),
            "AdminReply.json: length 1048573 exceeds 1048572");
  EXPECT_EQ(encodeError(AdminRequest{std::string(kMaxStringBytes + 1, 'v'), {}}),
            "AdminRequest.verb: length 513 exceeds 512");
  EXPECT_EQ(encodeError(AdminRequest{"job", std::vector<std::string>(kMaxAdminArgs + 1)}),
            "AdminRequest.args: count 9 exceeds 8");
  // A claimed count is checked against the bytes left before anything is allocated.
  EXPECT_EQ(decodeError(MessageType::kAdminRequest, Bytes().str("job").u32(8).get()),
            "AdminRequest.args: truncated: 8 items need at least 32 bytes, 0 left");
}

TEST(ProtocolPayload, EmbeddedNulIsRejectedOnBothSides) {
  std::string reason = "stop";
  reason += '\0';
  reason += "ping";
  EXPECT_EQ(encodeError(Shutdown{reason}), "Shutdown.reason: embedded NUL byte at offset 4");
  EXPECT_EQ(decodeError(MessageType::kShutdown, Bytes().str(reason).get()),
            "Shutdown.reason: embedded NUL byte at offset 4");
}

TEST(ProtocolPayload, TooManyTensorsIsRejected) {
  RegisterGroup group;
  group.tensors.resize(kMaxTensorsPerGroup + 1);
  EXPECT_EQ(encodeError(group), "RegisterGroup.tensors: count 8193 exceeds 8192");
  GroupReady ready;
  ready.tensors.resize(kMaxTensorsPerGroup + 1);
  EXPECT_EQ(encodeError(ready), "GroupReady.tensors: count 8193 exceeds 8192");

  const auto payload =
      Bytes().str("g").str("fp32").str("bf16").str("element").u32(16).u32(kMaxTensorsPerGroup + 1).get();
  EXPECT_EQ(decodeError(MessageType::kRegisterGroup, payload), "RegisterGroup.tensors: count 8193 exceeds 8192");
}

TEST(ProtocolPayload, CountLargerThanTheBytesLeftIsRejectedBeforeAllocating) {
  const auto payload = Bytes().str("g").str("fp32").str("bf16").str("element").u32(16).u32(8000).u64(0).get();
  const std::string error = decodeError(MessageType::kRegisterGroup, payload);
  EXPECT_EQ(error, "RegisterGroup.tensors: truncated: 8000 items need at least 128000 bytes, 8 left");
}

TEST(ProtocolPayload, ShapeRankTooLargeNamesTheTensor) {
  RegisterGroup group = sampleRegisterGroup();
  group.tensors[3].shape.assign(kMaxTensorRank + 1, 2);
  EXPECT_EQ(encodeError(group), "RegisterGroup.tensors[3].shape: rank 9 exceeds 8");

  Bytes bytes;
  bytes.str("g").str("fp32").str("bf16").str("element").u32(16).u32(5);
  for (int i = 0; i < 3; ++i) bytes.str("t" + std::to_string(i)).u32(1).i64(10).str("").i32(-1);
  bytes.str("t3").u32(kMaxTensorRank + 1);
  for (std::uint32_t d = 0; d < kMaxTensorRank + 1; ++d) bytes.i64(2);
  EXPECT_EQ(decodeError(MessageType::kRegisterGroup, bytes.get()), "RegisterGroup.tensors[3].shape: rank 9 exceeds 8");

  GroupReady ready = sampleGroupReady();
  ready.tensors[1].shape.assign(kMaxTensorRank + 1, 2);
  EXPECT_EQ(encodeError(ready), "GroupReady.tensors[1].shape: rank 9 exceeds 8");
}

TEST(ProtocolPayload, TensorParallelDimMustBeAShapeDimension) {
  RegisterGroup group = sampleRegisterGroup();
  group.tensors[1].tp_dim = 1;  // shape {4096}
  EXPECT_EQ(encodeError(group), "RegisterGroup.tensors[1].tp_dim: 1 is neither -1 nor a dimension of the rank-1 shape");
  group.tensors[1].tp_dim = -2;
  EXPECT_NE(encodeError(group).find("tp_dim: -2"), std::string::npos);

  const auto payload =
      Bytes().str("g").str("fp32").str("bf16").str("element").u32(16).u32(1).str("t").u32(0).str("").i32(0).get();
  EXPECT_EQ(decodeError(MessageType::kRegisterGroup, payload),
            "RegisterGroup.tensors[0].tp_dim: 0 is neither -1 nor a dimension of the rank-0 shape");
}

TEST(ProtocolPayload, BadJobIdIsRejectedOnBothSides) {
  std::string with_nul = "job";
  with_nul += '\0';
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "job id is empty"},
      {std::string(129, 'a'), "job id is 129 bytes long; at most 128 allowed"},
      {"job/1", "job id byte 47 at offset 3 is not in [A-Za-z0-9._-]"},
      {"job 1", "job id byte 32 at offset 3 is not in [A-Za-z0-9._-]"},
      {"j\xc3\xa9", "job id byte 195 at offset 1 is not in [A-Za-z0-9._-]"},
      {"a\n", "job id byte 10 at offset 1 is not in [A-Za-z0-9._-]"},
  };
  for (const auto& [job_id, reason] : cases) {
    Hello hello = sampleHello();
    hello.job_id = job_id;
    EXPECT_EQ(encodeError(hello), "Hello.job_id: " + reason);
    const auto payload =
        Bytes().u16(1).str(job_id).u32(0).u32(1).u32(0).i32(-1).u64(0).u64(0).u64(0).u8(0).u32(1).get();
    EXPECT_EQ(decodeError(MessageType::kHello, payload), "Hello.job_id: " + reason);
    EXPECT_FALSE(validateJobId(job_id).ok());
  }
  Hello hello = sampleHello();
  hello.job_id = with_nul;
  EXPECT_EQ(encodeError(hello), "Hello.job_id: embedded NUL byte at offset 3");
  EXPECT_TRUE(validateJobId("Job-1.a_b").ok());
}

TEST(ProtocolPayload, OutOfRangeEnumIsRejected) {
  for (const std::uint16_t code : {std::uint16_t{0}, std::uint16_t{13}, std::uint16_t{0xFFFF}}) {
    EXPECT_EQ(decodeError(MessageType::kError, Bytes().u16(code).str("x").u32(0).get()),
              "ErrorReply.code: value " + std::to_string(code) + " is out of range");
    EXPECT_EQ(encodeError(ErrorReply{static_cast<WireError>(code), "x", {}}),
              "ErrorReply.code: value " + std::to_string(code) + " is out of range");
  }
  for (std::uint16_t code = 1; code <= 12; ++code) {
    auto decoded = decodePayload(MessageType::kError, Bytes().u16(code).str("").u32(0).get());
    ASSERT_TRUE(decoded.ok()) << decoded.error().message;
  }
  for (const std::uint16_t type : {std::uint16_t{0}, std::uint16_t{17}}) {
    EXPECT_EQ(decodeError(static_cast<MessageType>(type), {}), "unknown message type " + std::to_string(type));
  }
}

TEST(ProtocolPayload, ErrorReplyRanksFollowTheMessage) {
  const ErrorReply reply{WireError::kTimeout, "ranks 1, 3 of job j have not submitted it", {1, 3}};
  EXPECT_EQ(payloadOf(reply), Bytes().u16(6).str(reply.message).u32(2).u32(1).u32(3).get());
  auto decoded = decodePayload(MessageType::kError, payloadOf(reply));
  ASSERT_TRUE(decoded.ok()) << decoded.error().message;
  EXPECT_EQ(std::get<ErrorReply>(*decoded).ranks, (std::vector<std::uint32_t>{1, 3}));
  EXPECT_EQ(payloadOf(ErrorReply{WireError::kConflict, "x", {}}), Bytes().u16(4).str("x").u32(0).get());
}

TEST(ProtocolPayload, ErrorReplyRankCountIsCheckedAgainstThePayloadAndTheMaximum) {
  // A payload of protocol version 5 (no ranks at all), a count the bytes do
  // not hold, and a count over the maximum: each is refused, naming the field.
  EXPECT_EQ(decodeError(MessageType::kError, Bytes().u16(6).str("x").get()),
            "ErrorReply.ranks: truncated: needs 4 bytes, 0 left");
  EXPECT_EQ(decodeError(MessageType::kError, Bytes().u16(6).str("x").u32(3).u32(1).u32(2).get()),
            "ErrorReply.ranks: truncated: 3 items need at least 12 bytes, 8 left");
  EXPECT_EQ(decodeError(MessageType::kError, Bytes().u16(6).str("x").u32(0xFFFFFFFFU).get()),
            "ErrorReply.ranks: count 4294967295 exceeds 65536");
  Bytes over = Bytes().u16(6).str("x").u32(kMaxErrorRanks + 1);
  for (std::uint32_t r = 0; r <= kMaxErrorRanks; ++r) over.u32(r);
  EXPECT_EQ(decodeError(MessageType::kError, over.get()), "ErrorReply.ranks: count 65537 exceeds 65536");
  EXPECT_EQ(decodeError(MessageType::kError, Bytes().u16(6).str("x").u32(1).u32(1).u8(0).get()),
            "ErrorReply: 1 trailing byte after the last field");

  ErrorReply most{WireError::kTimeout, "x", std::vector<std::uint32_t>(kMaxErrorRanks)};
  for (std::uint32_t r = 0; r < kMaxErrorRanks; ++r) most.ranks[r] = r;
  auto decoded = decodePayload(MessageType::kError, payloadOf(most));
  ASSERT_TRUE(decoded.ok()) << decoded.error().message;
  EXPECT_EQ(*decoded, Message(most));
  most.ranks.push_back(kMaxErrorRanks);
  EXPECT_EQ(encodeError(most), "ErrorReply.ranks: count 65537 exceeds 65536");
}

// ----------------------------------------------------------------- error codes

/// Every ErrorCode: a new one must be added here (and to toWire / fromWire).
std::vector<ErrorCode> allErrorCodes() {
  static_assert(static_cast<int>(ErrorCode::kCancelled) == 11, "a new ErrorCode: list it here and map it in ipc");
  std::vector<ErrorCode> codes;
  for (int raw = 0; raw <= static_cast<int>(ErrorCode::kCancelled); ++raw) codes.push_back(static_cast<ErrorCode>(raw));
  return codes;
}

TEST(ProtocolErrorCodes, EveryCodeTheDaemonSendsSurvivesTheWire) {
  std::set<WireError> used;
  for (const ErrorCode code : allErrorCodes()) {
    if (code == ErrorCode::kCancelled) continue;  // client-local: the daemon never sends it
    const WireError wire = toWire(code);
    EXPECT_TRUE(used.insert(wire).second) << toString(code) << " shares wire code " << static_cast<int>(wire);
    EXPECT_NE(wire, WireError::kVersionMismatch) << toString(code);
    EXPECT_EQ(fromWire(wire), code) << toString(code) << " came back as " << toString(fromWire(wire));
    // And through a whole ErrorReply.
    auto decoded = decodePayload(MessageType::kError, payloadOf(ErrorReply{wire, "m", {2}}));
    ASSERT_TRUE(decoded.ok()) << decoded.error().message;
    EXPECT_EQ(fromWire(std::get<ErrorReply>(*decoded).code), code) << toString(code);
  }
  EXPECT_EQ(used.size(), 11U);
}

TEST(ProtocolErrorCodes, TheMappingIsTheDocumentedOne) {
  // The existing numbers stay (older clients read them); the new codes follow.
  EXPECT_EQ(toWire(ErrorCode::kInvalidArgument), WireError::kBadRequest);
  EXPECT_EQ(toWire(ErrorCode::kPermissionDenied), WireError::kPermissionDenied);
  EXPECT_EQ(toWire(ErrorCode::kConflict), WireError::kConflict);
  EXPECT_EQ(toWire(ErrorCode::kInfeasible), WireError::kQuotaExceeded);
  EXPECT_EQ(toWire(ErrorCode::kTimeout), WireError::kTimeout);
  EXPECT_EQ(toWire(ErrorCode::kNotFound), WireError::kNotFound);
  EXPECT_EQ(toWire(ErrorCode::kUnavailable), WireError::kShuttingDown);
  EXPECT_EQ(toWire(ErrorCode::kInternal), WireError::kInternal);
  EXPECT_EQ(static_cast<int>(toWire(ErrorCode::kIo)), 10);
  EXPECT_EQ(static_cast<int>(toWire(ErrorCode::kWouldBlock)), 11);
  EXPECT_EQ(static_cast<int>(toWire(ErrorCode::kDevice)), 12);
  // An NCCL or CUDA failure in the daemon is kDevice on the client, not kInternal.
  EXPECT_EQ(fromWire(WireError::kDevice), ErrorCode::kDevice);
  EXPECT_EQ(fromWire(WireError::kIo), ErrorCode::kIo);
  // A frame of another protocol version is its own wire code; libdbuf reports it as a bad argument.
  EXPECT_EQ(static_cast<int>(WireError::kVersionMismatch), 2);
  EXPECT_EQ(fromWire(WireError::kVersionMismatch), ErrorCode::kInvalidArgument);
  EXPECT_EQ(toWire(ErrorCode::kCancelled), WireError::kInternal);
  // A completion status is a raw u16: anything outside the enum is kInternal.
  for (const std::uint16_t raw : {std::uint16_t{0}, std::uint16_t{13}, std::uint16_t{0xFFFF}}) {
    EXPECT_EQ(fromWire(static_cast<WireError>(raw)), ErrorCode::kInternal) << raw;
  }
}

TEST(ProtocolPayload, PayloadOverTheMaximumIsRefusedNotTruncated) {
  GroupReady ready;
  ready.tensors.resize(4000);
  for (auto& tensor : ready.tensors) tensor.name = std::string(kMaxStringBytes, 'n');
  const std::string error = encodeError(ready);
  EXPECT_NE(error.find("GroupReady: payload of"), std::string::npos) << error;
  EXPECT_NE(error.find("exceeds the maximum 1048576"), std::string::npos) << error;
  EXPECT_FALSE(encodeFrame(ready, 1).ok());

  const std::vector<std::byte> big(kMaxPayloadBytes + 1);
  EXPECT_NE(decodeError(MessageType::kShutdown, big).find("exceeds the maximum"), std::string::npos);
}

TEST(ProtocolPayload, EmptyMessagesRejectAnyByte) {
  EXPECT_TRUE(decodePayload(MessageType::kDetach, {}).ok());
  EXPECT_TRUE(decodePayload(MessageType::kDetached, {}).ok());
  EXPECT_EQ(decodeError(MessageType::kDetach, Bytes().u8(0).get()), "Detach: 1 trailing byte after the last field");
}

// ---------------------------------------------------------------------- fuzz

std::vector<std::byte> randomBytes(std::mt19937_64& rng, std::size_t max_length) {
  std::uniform_int_distribution<std::size_t> length_dist(0, max_length);
  std::vector<std::byte> bytes(length_dist(rng));
  // Mostly small values, so that lengths and counts are often plausible and
  // the decoder gets past the first field.
  std::uniform_int_distribution<int> kind(0, 3);
  std::uniform_int_distribution<int> any(0, 255);
  std::uniform_int_distribution<int> small(0, 9);
  for (auto& byte : bytes) byte = static_cast<std::byte>(kind(rng) == 0 ? any(rng) : small(rng));
  return bytes;
}

/// decode must never crash; when it accepts, the encoding is canonical:
/// re-encoding the message gives the very same bytes.
void checkDecodeIsSafeAndCanonical(MessageType type, std::span<const std::byte> bytes) {
  auto decoded = decodePayload(type, bytes);
  if (!decoded.ok()) {
    EXPECT_FALSE(decoded.error().message.empty());
    return;
  }
  ASSERT_EQ(typeOf(*decoded), type);
  auto again = encodePayload(*decoded);
  ASSERT_TRUE(again.ok()) << again.error().message;
  ASSERT_TRUE(std::equal(again->begin(), again->end(), bytes.begin(), bytes.end()));
}

TEST(ProtocolFuzz, RandomPayloadsForEveryType) {
  std::mt19937_64 rng(20260131);
  for (const MessageType type : allTypes()) {
    for (int i = 0; i < 3000; ++i) {
      const auto bytes = randomBytes(rng, 160);
      checkDecodeIsSafeAndCanonical(type, bytes);
    }
  }
}

TEST(ProtocolFuzz, MutatedValidPayloads) {
  std::mt19937_64 rng(77);
  const auto messages = sampleMessages();
  for (const Message& message : messages) {
    const auto valid = payloadOf(message);
    for (int i = 0; i < 2000; ++i) {
      auto bytes = valid;
      std::uniform_int_distribution<int> mutations(1, 4);
      for (int m = mutations(rng); m > 0; --m) {
        std::uniform_int_distribution<int> op(0, 3);
        switch (op(rng)) {
          case 0:  // flip a byte
            if (!bytes.empty()) {
              std::uniform_int_distribution<std::size_t> at(0, bytes.size() - 1);
              bytes[at(rng)] = static_cast<std::byte>(std::uniform_int_distribution<int>(0, 255)(rng));
            }
            break;
          case 1:  // cut the tail
            if (!bytes.empty()) bytes.resize(std::uniform_int_distribution<std::size_t>(0, bytes.size() - 1)(rng));
            break;
          case 2:  // append junk
            bytes.push_back(static_cast<std::byte>(std::uniform_int_distribution<int>(0, 255)(rng)));
            break;
          default:  // decode it as another type
            break;
        }
      }
      checkDecodeIsSafeAndCanonical(typeOf(message), bytes);
      const MessageType other = allTypes()[std::uniform_int_distribution<std::size_t>(0, allTypes().size() - 1)(rng)];
      checkDecodeIsSafeAndCanonical(other, bytes);
    }
  }
}

TEST(ProtocolFuzz, RandomHeaders) {
  std::mt19937_64 rng(5);
  for (int i = 0; i < 20000; ++i) {
    auto bytes = validHeaderBytes();
    std::uniform_int_distribution<std::size_t> at(0, kHeaderBytes - 1);
    bytes[at(rng)] = static_cast<std::byte>(std::uniform_int_distribution<int>(0, 255)(rng));
    auto decoded = decodeHeader(bytes);
    if (decoded.ok()) {
      EXPECT_EQ(encodeHeader(*decoded), bytes);
    }
  }
}

}  // namespace
}  // namespace dbuf::ipc
