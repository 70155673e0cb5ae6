#include "dbuf/ipc/protocol.hpp"

#include <string_view>
#include <type_traits>
#include <utility>

#include "wire.hpp"

namespace dbuf::ipc {
namespace {

// ------------------------------------------------------------ header layout
// offset 0: u32 magic, 4: u16 version, 6: u16 type, 8: u32 payload length,
// 12: u32 reserved (0), 16: u64 request id. All little-endian.
constexpr std::size_t kMagicOffset = 0;
constexpr std::size_t kVersionOffset = 4;
constexpr std::size_t kTypeOffset = 6;
constexpr std::size_t kLengthOffset = 8;
constexpr std::size_t kReservedOffset = 12;
constexpr std::size_t kRequestIdOffset = 16;
static_assert(kRequestIdOffset + 8 == kHeaderBytes);

template <typename T>
void storeLe(std::span<std::byte, kHeaderBytes> out, std::size_t offset, T value) {
  auto bits = static_cast<std::uint64_t>(value);
  for (std::size_t i = 0; i < sizeof(T); ++i) {
    out[offset + i] = static_cast<std::byte>(bits & 0xFFU);
    bits >>= 8U;
  }
}

template <typename T>
T loadLe(std::span<const std::byte, kHeaderBytes> in, std::size_t offset) {
  std::uint64_t bits = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) bits |= static_cast<std::uint64_t>(in[offset + i]) << (8U * i);
  return static_cast<T>(bits);
}

constexpr bool validMessageType(MessageType type) noexcept {
  const auto raw = static_cast<std::uint16_t>(type);
  return raw >= static_cast<std::uint16_t>(MessageType::kHello) &&
         raw <= static_cast<std::uint16_t>(MessageType::kGroupUnregistered);
}

constexpr bool validWireError(WireError code) noexcept {
  const auto raw = static_cast<std::uint16_t>(code);
  return raw >= static_cast<std::uint16_t>(WireError::kBadRequest) &&
         raw <= static_cast<std::uint16_t>(WireError::kDevice);
}

constexpr bool validMemoryKind(MemoryKind kind) noexcept {
  return kind == MemoryKind::kHost || kind == MemoryKind::kCuda;
}

// ------------------------------------------------------- message <-> type
// Message alternatives are declared in MessageType order, so the type of
// alternative i is i + 1; the static_asserts pin that down.
template <typename T>
struct Traits;
#define DBUF_IPC_MESSAGE(Type, Enumerator)                        \
  template <>                                                     \
  struct Traits<Type> {                                           \
    static constexpr MessageType kType = MessageType::Enumerator; \
    static constexpr std::string_view kName = #Type;              \
  }
DBUF_IPC_MESSAGE(Hello, kHello);
DBUF_IPC_MESSAGE(Welcome, kWelcome);
DBUF_IPC_MESSAGE(ErrorReply, kError);
DBUF_IPC_MESSAGE(RegisterGroup, kRegisterGroup);
DBUF_IPC_MESSAGE(GroupReady, kGroupReady);
DBUF_IPC_MESSAGE(AcquireSlot, kAcquireSlot);
DBUF_IPC_MESSAGE(SlotGranted, kSlotGranted);
DBUF_IPC_MESSAGE(ReleaseSlot, kReleaseSlot);
DBUF_IPC_MESSAGE(SlotReleased, kSlotReleased);
DBUF_IPC_MESSAGE(Detach, kDetach);
DBUF_IPC_MESSAGE(Detached, kDetached);
DBUF_IPC_MESSAGE(Shutdown, kShutdown);
DBUF_IPC_MESSAGE(AdminRequest, kAdminRequest);
DBUF_IPC_MESSAGE(AdminReply, kAdminReply);
DBUF_IPC_MESSAGE(UnregisterGroup, kUnregisterGroup);
DBUF_IPC_MESSAGE(GroupUnregistered, kGroupUnregistered);
#undef DBUF_IPC_MESSAGE

template <std::size_t... I>
constexpr bool alternativesInTypeOrder(std::index_sequence<I...> /*indices*/) {
  return ((static_cast<std::size_t>(Traits<std::variant_alternative_t<I, Message>>::kType) == I + 1) && ...);
}
static_assert(alternativesInTypeOrder(std::make_index_sequence<std::variant_size_v<Message>>{}));
static_assert(std::variant_size_v<Message> == static_cast<std::size_t>(MessageType::kGroupUnregistered));

// ------------------------------------------------------------- field lists
// One function per message lists its fields in wire order. `Io` is a
// wire::Writer (M is const) or a wire::Reader (M is mutable); range checks
// beyond the wire format go after the fields so both sides apply them.

template <typename M, typename T>
concept MessageOf = std::is_same_v<std::remove_const_t<M>, T>;

// Minimum encoded sizes of array items, checked against the bytes left before
// an array is allocated.
constexpr std::size_t kShapeDimBytes = 8;
constexpr std::size_t kTensorDeclMinBytes = 4 + 4 + 4 + 4;        // name, shape count, granularity, tp_dim
constexpr std::size_t kPlacedTensorMinBytes = 4 + 4 + 8 + 8 + 8;  // name, shape count, offset, numel, granularity
constexpr std::size_t kRankBytes = 4;

template <typename Io, typename Shape>
void shapeField(Io& io, Shape& shape) {
  io.array("shape", shape, kMaxTensorRank, "rank", kShapeDimBytes, [&io](auto& dim) { io.integer("", dim); });
}

template <typename Io, MessageOf<Hello> M>
void fields(Io& io, M& m) {
  io.integer("protocol_version", m.protocol_version);
  io.string("job_id", m.job_id);
  if (io.ok()) {
    if (auto valid = validateJobId(m.job_id); !valid) io.fail("job_id", valid.error().message);
  }
  io.integer("rank", m.rank);
  io.integer("world_size", m.world_size);
  io.integer("local_rank", m.local_rank);
  io.integer("local_world_size", m.local_world_size);
  io.string("store", m.store);
  io.integer("device", m.device);
  io.integer("gpu_uuid_high", m.gpu_uuid.high);
  io.integer("gpu_uuid_low", m.gpu_uuid.low);
  io.integer("nonce", m.nonce);
  io.boolean("persistent", m.persistent);
  io.integer("prefetch_depth", m.prefetch_depth);
}

template <typename Io, MessageOf<Welcome> M>
void fields(Io& io, M& m) {
  io.integer("nonce", m.nonce);
  io.integer("daemon_instance_id", m.daemon_instance_id);
  io.integer("session_id", m.session_id);
  io.integer("memory_quota_bytes", m.memory_quota_bytes);
  io.integer("memory_used_bytes", m.memory_used_bytes);
  io.integer("ring_capacity", m.ring_capacity);
  io.integer("segment_bytes", m.segment_bytes);
  io.integer("busy_poll_us", m.busy_poll_us);
  io.boolean("reattached", m.reattached);
  io.enumeration("memory_kind", m.memory_kind, &validMemoryKind);
  io.integer("device", m.device);
}

template <typename Io, MessageOf<ErrorReply> M>
void fields(Io& io, M& m) {
  io.enumeration("code", m.code, &validWireError);
  io.string("message", m.message);
  io.array("ranks", m.ranks, kMaxErrorRanks, "count", kRankBytes, [&io](auto& rank) { io.integer("", rank); });
}

template <typename Io, MessageOf<TensorDecl> M>
void fields(Io& io, M& m) {
  io.string("name", m.name);
  shapeField(io, m.shape);
  io.string("granularity", m.granularity);
  io.integer("tp_dim", m.tp_dim);
  if (io.ok() && (m.tp_dim < -1 || m.tp_dim >= static_cast<std::int64_t>(m.shape.size()))) {
    io.fail("tp_dim", std::to_string(m.tp_dim) + " is neither -1 nor a dimension of the rank-" +
                          std::to_string(m.shape.size()) + " shape");
  }
}

template <typename Io, MessageOf<RegisterGroup> M>
void fields(Io& io, M& m) {
  io.string("name", m.name);
  io.string("sharded_dtype", m.sharded_dtype);
  io.string("unsharded_dtype", m.unsharded_dtype);
  io.string("granularity", m.granularity);
  io.integer("align_bytes", m.align_bytes);
  io.array("tensors", m.tensors, kMaxTensorsPerGroup, "count", kTensorDeclMinBytes,
           [&io](auto& tensor) { fields(io, tensor); });
}

template <typename Io, MessageOf<Region> M>
void fields(Io& io, M& m) {
  io.integer("offset", m.offset);
  io.integer("bytes", m.bytes);
}

template <typename Io, MessageOf<PlacedTensorWire> M>
void fields(Io& io, M& m) {
  io.string("name", m.name);
  shapeField(io, m.shape);
  io.integer("offset", m.offset);
  io.integer("numel", m.numel);
  io.integer("granularity", m.granularity);
}

template <typename Io, MessageOf<GroupReady> M>
void fields(Io& io, M& m) {
  io.integer("group_id", m.group_id);
  io.integer("devices", m.devices);
  io.integer("shard_elems", m.shard_elems);
  io.string("sharded_dtype", m.sharded_dtype);
  io.string("unsharded_dtype", m.unsharded_dtype);
  io.array("tensors", m.tensors, kMaxTensorsPerGroup, "count", kPlacedTensorMinBytes,
           [&io](auto& tensor) { fields(io, tensor); });
  io.integer("shard_file_bytes", m.shard_file_bytes);
  io.nested("sharded", std::nullopt, [&] { fields(io, m.sharded); });
  io.nested("sharded_grad", std::nullopt, [&] { fields(io, m.sharded_grad); });
  io.integer("slot_bytes", m.slot_bytes);
}

template <typename Io, MessageOf<AcquireSlot> M>
void fields(Io& io, M& m) {
  io.integer("group_id", m.group_id);
  io.boolean("grow", m.grow);
}

template <typename Io, MessageOf<SlotGranted> M>
void fields(Io& io, M& m) {
  io.integer("group_id", m.group_id);
  io.integer("slot_index", m.slot_index);
  io.integer("slot_file_bytes", m.slot_file_bytes);
  io.nested("params", std::nullopt, [&] { fields(io, m.params); });
  io.nested("grads", std::nullopt, [&] { fields(io, m.grads); });
  io.nested("scales", std::nullopt, [&] { fields(io, m.scales); });
}

template <typename Io, MessageOf<ReleaseSlot> M>
void fields(Io& io, M& m) {
  io.integer("group_id", m.group_id);
}

template <typename Io, MessageOf<SlotReleased> M>
void fields(Io& io, M& m) {
  io.integer("group_id", m.group_id);
}

template <typename Io, MessageOf<UnregisterGroup> M>
void fields(Io& io, M& m) {
  io.integer("group_id", m.group_id);
}

template <typename Io, MessageOf<GroupUnregistered> M>
void fields(Io& io, M& m) {
  io.integer("group_id", m.group_id);
}

template <typename Io, MessageOf<Detach> M>
void fields(Io& /*io*/, M& /*m*/) {}

template <typename Io, MessageOf<Detached> M>
void fields(Io& /*io*/, M& /*m*/) {}

template <typename Io, MessageOf<Shutdown> M>
void fields(Io& io, M& m) {
  io.string("reason", m.reason);
}

constexpr std::size_t kStringMinBytes = 4;  // its length

template <typename Io, MessageOf<AdminRequest> M>
void fields(Io& io, M& m) {
  io.string("verb", m.verb);
  io.array("args", m.args, kMaxAdminArgs, "count", kStringMinBytes, [&io](auto& arg) { io.string("", arg); });
}

template <typename Io, MessageOf<AdminReply> M>
void fields(Io& io, M& m) {
  io.string("json", m.json, kMaxAdminReplyBytes);
}

template <typename T>
Result<Message> decodeAs(std::span<const std::byte> payload) {
  wire::Reader reader(Traits<T>::kName, payload);
  T message{};
  fields(reader, message);
  if (auto done = reader.finish(); !done) return std::move(done).error();
  return Message(std::move(message));
}

}  // namespace

WireError toWire(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return WireError::kBadRequest;
    case ErrorCode::kNotFound:
      return WireError::kNotFound;
    case ErrorCode::kIo:
      return WireError::kIo;
    case ErrorCode::kInfeasible:
      return WireError::kQuotaExceeded;
    case ErrorCode::kInternal:
      return WireError::kInternal;
    case ErrorCode::kPermissionDenied:
      return WireError::kPermissionDenied;
    case ErrorCode::kConflict:
      return WireError::kConflict;
    case ErrorCode::kTimeout:
      return WireError::kTimeout;
    case ErrorCode::kUnavailable:
      return WireError::kShuttingDown;
    case ErrorCode::kWouldBlock:
      return WireError::kWouldBlock;
    case ErrorCode::kDevice:
      return WireError::kDevice;
    case ErrorCode::kCancelled:
      break;  // client-local: a daemon that converts one has a bug
  }
  return WireError::kInternal;
}

ErrorCode fromWire(WireError code) noexcept {
  switch (code) {
    case WireError::kBadRequest:
    case WireError::kVersionMismatch:
      return ErrorCode::kInvalidArgument;
    case WireError::kPermissionDenied:
      return ErrorCode::kPermissionDenied;
    case WireError::kConflict:
      return ErrorCode::kConflict;
    case WireError::kQuotaExceeded:
      return ErrorCode::kInfeasible;
    case WireError::kTimeout:
      return ErrorCode::kTimeout;
    case WireError::kNotFound:
      return ErrorCode::kNotFound;
    case WireError::kShuttingDown:
      return ErrorCode::kUnavailable;
    case WireError::kInternal:
      return ErrorCode::kInternal;
    case WireError::kIo:
      return ErrorCode::kIo;
    case WireError::kWouldBlock:
      return ErrorCode::kWouldBlock;
    case WireError::kDevice:
      return ErrorCode::kDevice;
  }
  return ErrorCode::kInternal;
}

std::array<std::byte, kHeaderBytes> encodeHeader(const FrameHeader& header) {
  std::array<std::byte, kHeaderBytes> bytes{};
  const std::span<std::byte, kHeaderBytes> out(bytes);
  storeLe(out, kMagicOffset, header.magic);
  storeLe(out, kVersionOffset, header.version);
  storeLe(out, kTypeOffset, static_cast<std::uint16_t>(header.type));
  storeLe(out, kLengthOffset, header.payload_bytes);
  storeLe(out, kReservedOffset, std::uint32_t{0});
  storeLe(out, kRequestIdOffset, header.request_id);
  return bytes;
}

Result<FrameHeader> decodeHeader(std::span<const std::byte, kHeaderBytes> bytes) {
  FrameHeader header;
  header.magic = loadLe<std::uint32_t>(bytes, kMagicOffset);
  header.version = loadLe<std::uint16_t>(bytes, kVersionOffset);
  const auto type = loadLe<std::uint16_t>(bytes, kTypeOffset);
  header.payload_bytes = loadLe<std::uint32_t>(bytes, kLengthOffset);
  const auto reserved = loadLe<std::uint32_t>(bytes, kReservedOffset);
  header.request_id = loadLe<std::uint64_t>(bytes, kRequestIdOffset);

  auto hex = [](std::uint64_t value) {
    constexpr std::string_view kDigits = "0123456789abcdef";
    std::string out = "0x";
    bool started = false;
    for (int shift = 60; shift >= 0; shift -= 4) {
      const auto digit = static_cast<std::size_t>((value >> static_cast<unsigned>(shift)) & 0xFU);
      if (digit != 0 || started || shift == 0) {
        out += kDigits[digit];
        started = true;
      }
    }
    return out;
  };
  // Magic first (not a dbuf peer at all), then the version: a peer speaking
  // another version may well use types or flags we do not know, and deserves
  // to hear that the version is the problem.
  if (header.magic != kMagic) {
    return makeError(ErrorCode::kInvalidArgument,
                     "frame header: bad magic " + hex(header.magic) + " (expected " + hex(kMagic) + ")");
  }
  if (header.version != kProtocolVersion) {
    return makeError(ErrorCode::kInvalidArgument,
                     "frame header: unsupported protocol version " + std::to_string(header.version) +
                         " (this side speaks protocol version " + std::to_string(kProtocolVersion) + ")");
  }
  if (reserved != 0) {
    return makeError(ErrorCode::kInvalidArgument, "frame header: reserved field is " + hex(reserved) + ", must be 0");
  }
  header.type = static_cast<MessageType>(type);
  if (!validMessageType(header.type)) {
    return makeError(ErrorCode::kInvalidArgument, "frame header: unknown message type " + std::to_string(type));
  }
  if (header.payload_bytes > kMaxPayloadBytes) {
    return makeError(ErrorCode::kInvalidArgument, "frame header: payload length " +
                                                      std::to_string(header.payload_bytes) + " exceeds the maximum " +
                                                      std::to_string(kMaxPayloadBytes));
  }
  return header;
}

Result<void> validateJobId(std::string_view job_id) {
  constexpr std::size_t kMaxJobIdBytes = 128;
  if (job_id.empty()) return makeError(ErrorCode::kInvalidArgument, "job id is empty");
  if (job_id.size() > kMaxJobIdBytes) {
    return makeError(ErrorCode::kInvalidArgument, "job id is " + std::to_string(job_id.size()) +
                                                      " bytes long; at most " + std::to_string(kMaxJobIdBytes) +
                                                      " allowed");
  }
  for (std::size_t i = 0; i < job_id.size(); ++i) {
    const char c = job_id[i];
    const bool allowed =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    if (!allowed) {
      // The byte goes into the message as a number: it may be a NUL or a
      // control character, and error messages travel back over the wire.
      return makeError(ErrorCode::kInvalidArgument, "job id byte " + std::to_string(static_cast<unsigned char>(c)) +
                                                        " at offset " + std::to_string(i) +
                                                        " is not in [A-Za-z0-9._-]");
    }
  }
  return {};
}

MessageType typeOf(const Message& message) noexcept {
  // Alternative i has type i + 1 (static_asserts above); std::visit could
  // throw on a valueless variant, the index cannot.
  return static_cast<MessageType>(static_cast<std::uint16_t>(message.index() + 1));
}

Result<std::vector<std::byte>> encodePayload(const Message& message) {
  return std::visit(
      [](const auto& m) -> Result<std::vector<std::byte>> {
        using T = std::decay_t<decltype(m)>;
        wire::Writer writer(Traits<T>::kName);
        fields(writer, m);
        if (!writer.ok()) return writer.takeError();
        if (writer.bytes().size() > kMaxPayloadBytes) {
          return makeError(ErrorCode::kInvalidArgument,
                           std::string(Traits<T>::kName) + ": payload of " + std::to_string(writer.bytes().size()) +
                               " bytes exceeds the maximum " + std::to_string(kMaxPayloadBytes));
        }
        return std::move(writer.bytes());
      },
      message);
}

Result<Message> decodePayload(MessageType type, std::span<const std::byte> payload) {
  if (payload.size() > kMaxPayloadBytes) {
    return makeError(ErrorCode::kInvalidArgument, "payload of " + std::to_string(payload.size()) +
                                                      " bytes exceeds the maximum " + std::to_string(kMaxPayloadBytes));
  }
  switch (type) {
    case MessageType::kHello:
      return decodeAs<Hello>(payload);
    case MessageType::kWelcome:
      return decodeAs<Welcome>(payload);
    case MessageType::kError:
      return decodeAs<ErrorReply>(payload);
    case MessageType::kRegisterGroup:
      return decodeAs<RegisterGroup>(payload);
    case MessageType::kGroupReady:
      return decodeAs<GroupReady>(payload);
    case MessageType::kAcquireSlot:
      return decodeAs<AcquireSlot>(payload);
    case MessageType::kSlotGranted:
      return decodeAs<SlotGranted>(payload);
    case MessageType::kReleaseSlot:
      return decodeAs<ReleaseSlot>(payload);
    case MessageType::kSlotReleased:
      return decodeAs<SlotReleased>(payload);
    case MessageType::kDetach:
      return decodeAs<Detach>(payload);
    case MessageType::kDetached:
      return decodeAs<Detached>(payload);
    case MessageType::kShutdown:
      return decodeAs<Shutdown>(payload);
    case MessageType::kAdminRequest:
      return decodeAs<AdminRequest>(payload);
    case MessageType::kAdminReply:
      return decodeAs<AdminReply>(payload);
    case MessageType::kUnregisterGroup:
      return decodeAs<UnregisterGroup>(payload);
    case MessageType::kGroupUnregistered:
      return decodeAs<GroupUnregistered>(payload);
  }
  return makeError(ErrorCode::kInvalidArgument,
                   "unknown message type " + std::to_string(static_cast<std::uint16_t>(type)));
}

Result<std::vector<std::byte>> encodeFrame(const Message& message, std::uint64_t request_id) {
  auto payload = encodePayload(message);
  if (!payload) return std::move(payload).error();
  FrameHeader header;
  header.type = typeOf(message);
  header.payload_bytes = static_cast<std::uint32_t>(payload->size());  // <= kMaxPayloadBytes
  header.request_id = request_id;
  const auto head = encodeHeader(header);
  std::vector<std::byte> frame;
  frame.reserve(head.size() + payload->size());
  frame.insert(frame.end(), head.begin(), head.end());
  frame.insert(frame.end(), payload->begin(), payload->end());
  return frame;
}

}  // namespace dbuf::ipc
