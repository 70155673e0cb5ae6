#pragma once
/// \file
/// The dbuf wire protocol between libdbuf and dbufd over a Unix stream socket.
///
/// Every message is one frame: a fixed 24-byte little-endian header followed
/// by the payload. Header layout (byte offset: field):
///   0: u32 magic (kMagic)     4: u16 version      6: u16 type (MessageType)
///   8: u32 payload length    12: u32 reserved, 0  16: u64 request id
/// Shared memory travels beside a frame as file descriptors (SCM_RIGHTS),
/// never by name. Payloads are encoded field by field
/// (little-endian integers of the field's width; bool as one byte 0 or 1;
/// enums as their underlying integer, range-checked; strings and arrays as a
/// u32 count then the items; nested structs inline), and every count and
/// length is checked against the limits below before anything is allocated:
/// the daemon never trusts a client. Strings may not contain NUL bytes.
///
/// One encode/decode pair per message type; decode rejects trailing bytes.
/// Pure functions over value types; thread-safe.

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "dbuf/common/gpu_uuid.hpp"
#include "dbuf/common/result.hpp"

namespace dbuf::ipc {

inline constexpr std::uint32_t kMagic = 0x46554244;   // "DBUF" little-endian
inline constexpr std::uint16_t kProtocolVersion = 9;  // 2: session segment, collectives; 3: memory kind;
                                                      // 4: stream-ordered ops (segment version 2);
                                                      // 5: the GPU's UUID in Hello;
                                                      // 6: error codes kIo, kWouldBlock, kDevice, the
                                                      //    ranks of an error (segment version 3);
                                                      // 7: a job across nodes (Hello's node layout, store);
                                                      // 8: operators' requests (AdminRequest, AdminReply);
                                                      // 9: AcquireSlot::grow
inline constexpr std::size_t kHeaderBytes = 24;
inline constexpr std::uint32_t kMaxPayloadBytes = 1U << 20;  // 1 MiB
inline constexpr std::uint32_t kMaxStringBytes = 512;
inline constexpr std::uint32_t kMaxTensorsPerGroup = 8192;
inline constexpr std::uint32_t kMaxTensorRank = 8;
inline constexpr std::size_t kMaxFdsPerFrame = 8;
inline constexpr std::uint32_t kMaxErrorRanks = 65536;  ///< ErrorReply::ranks
inline constexpr std::uint32_t kMaxAdminArgs = 8;       ///< AdminRequest::args
/// AdminReply::json: a payload's worth, less its length field.
inline constexpr std::uint32_t kMaxAdminReplyBytes = kMaxPayloadBytes - 4;

enum class MessageType : std::uint16_t {
  kHello = 1,          ///< client -> daemon, first frame
  kWelcome = 2,        ///< daemon -> client, + session segment memfd and daemon eventfd
  kError = 3,          ///< daemon -> client, reply to any failed request
  kRegisterGroup = 4,  ///< client -> daemon
  kGroupReady = 5,     ///< daemon -> client, + the group's shard memfd
  kAcquireSlot = 6,    ///< client -> daemon: unsharded memory for a group
  kSlotGranted = 7,    ///< daemon -> client, + the slot memfd
  kReleaseSlot = 8,    ///< client -> daemon: give the slot's pages back
  kSlotReleased = 9,   ///< daemon -> client
  kDetach = 10,        ///< client -> daemon: orderly goodbye
  kDetached = 11,      ///< daemon -> client
  kShutdown = 12,      ///< daemon -> client, unsolicited: the daemon is stopping
  kAdminRequest = 13,  ///< operator -> daemon, instead of a Hello: a question (dbufctl)
  kAdminReply = 14,    ///< daemon -> operator: the answer, a JSON document
  kUnregisterGroup = 15,   ///< client -> daemon: this rank is done with a group
  kGroupUnregistered = 16, ///< daemon -> client
};

/// Wire error codes: one per dbuf::ErrorCode the daemon sends, plus
/// kVersionMismatch. toWire / fromWire convert; every conversion of an Error
/// into a reply or a completion status goes through them, so a code survives
/// the wire (ErrorCode -> WireError -> ErrorCode is the identity for every
/// code but kCancelled).
///
///   WireError              ErrorCode
///   1  kBadRequest         kInvalidArgument
///   2  kVersionMismatch    kInvalidArgument (fromWire; never from toWire: the
///                          daemon picks it for a frame of another protocol
///                          version, and libdbuf reports it as a bad argument
///                          whose message says "protocol version")
///   3  kPermissionDenied   kPermissionDenied
///   4  kConflict           kConflict
///   5  kQuotaExceeded      kInfeasible (a quota, a limit, or else unsatisfiable)
///   6  kTimeout            kTimeout
///   7  kNotFound           kNotFound
///   8  kShuttingDown       kUnavailable
///   9  kInternal           kInternal; also toWire(kCancelled), which is
///                          client-local (the daemon never sends it)
///  10  kIo                 kIo
///  11  kWouldBlock         kWouldBlock
///  12  kDevice             kDevice (the GPU, its driver or NCCL failed)
enum class WireError : std::uint16_t {
  kBadRequest = 1,        ///< malformed frame or payload
  kVersionMismatch = 2,   ///< protocol version not supported
  kPermissionDenied = 3,  ///< peer credentials not allowed for this job / tenant
  kConflict = 4,          ///< (job, rank) already attached, spec mismatch between ranks
  kQuotaExceeded = 5,     ///< tenant quota or daemon memory limit
  kTimeout = 6,           ///< peers did not arrive in time
  kNotFound = 7,          ///< unknown group
  kShuttingDown = 8,      ///< daemon refuses new work
  kInternal = 9,
  kIo = 10,          ///< a file, memfd or socket operation of the daemon failed
  kWouldBlock = 11,  ///< no room now, and the request asked not to wait
  kDevice = 12,      ///< the GPU, its driver or NCCL failed in the daemon
};

/// The wire code of `code` (table above). Pure; thread-safe.
[[nodiscard]] WireError toWire(ErrorCode code) noexcept;
/// The ErrorCode of a wire code; a value outside the enum (a completion
/// status is a raw u16) is kInternal. Pure; thread-safe.
[[nodiscard]] ErrorCode fromWire(WireError code) noexcept;

struct FrameHeader {
  std::uint32_t magic = kMagic;
  std::uint16_t version = kProtocolVersion;
  MessageType type = MessageType::kError;
  std::uint32_t payload_bytes = 0;
  std::uint64_t request_id = 0;
};

/// Encodes the 24-byte header.
[[nodiscard]] std::array<std::byte, kHeaderBytes> encodeHeader(const FrameHeader& header);
/// Decodes and validates a header: magic, version, reserved == 0, known type,
/// length <= max (checked in that order). A version mismatch is reported as
/// such: its message contains "protocol version" (the daemon answers it with
/// an Error of code kVersionMismatch). All errors have code kInvalidArgument.
[[nodiscard]] Result<FrameHeader> decodeHeader(std::span<const std::byte, kHeaderBytes> bytes);

// ----------------------------------------------------------------- messages

struct Hello {
  std::uint16_t protocol_version = kProtocolVersion;
  std::string job_id;  ///< 1..128 bytes, [A-Za-z0-9._-]
  std::uint32_t rank = 0;
  std::uint32_t world_size = 1;
  std::uint32_t local_rank = 0;        ///< rank among the job's ranks on this node (they are contiguous)
  std::uint32_t local_world_size = 0;  ///< the job's ranks on this node; 0: all of them (one node)
  /// Where the job's daemons meet when it spans nodes (local_world_size <
  /// world_size): "file:DIR" or "redis:HOST:PORT", optionally "#PREFIX"
  /// (keys are prefixed with the job and PREFIX). Empty on one node.
  std::string store;
  std::int32_t device = -1;  ///< GPU index as the client sees it, -1 for host memory
  GpuUuid gpu_uuid;          ///< that GPU's UUID (unknown: dbufd takes `device` as its own index)
  std::uint64_t nonce = 0;
  bool persistent = false;           ///< keep the job's memory for the grace period if every rank goes
  std::uint32_t prefetch_depth = 1;  ///< unsharded slots per rank = prefetch_depth + 1
  friend bool operator==(const Hello&, const Hello&) = default;
};

/// Where a session's DBuffers live, and so what the group and slot fds are.
enum class MemoryKind : std::uint8_t {
  kHost = 0,  ///< memfds: mmap them
  kCuda = 1,  ///< CUDA VMM allocations exported as POSIX fds: import and map them on the Hello's GPU
};

struct Welcome {
  std::uint64_t nonce = 0;  ///< echo of Hello::nonce
  std::uint64_t daemon_instance_id = 0;
  std::uint64_t session_id = 0;
  std::uint64_t memory_quota_bytes = 0;  ///< the tenant's quota
  std::uint64_t memory_used_bytes = 0;   ///< already used by the tenant
  bool reattached = false;               ///< a persistent job's rank came back: its shards are intact
  // The data plane (see ring.hpp). The frame carries two fds: the session
  // segment (segment_bytes long) and the eventfd that wakes the daemon.
  std::uint32_t ring_capacity = 0;
  std::uint64_t segment_bytes = 0;
  std::uint32_t busy_poll_us = 0;              ///< how long to spin before sleeping
  MemoryKind memory_kind = MemoryKind::kHost;  ///< what the group and slot fds are
  std::int32_t device = 0;                     ///< kCuda: the GPU holding this rank's memory, as dbufd numbers it
  friend bool operator==(const Welcome&, const Welcome&) = default;
};

struct ErrorReply {
  WireError code = WireError::kInternal;
  std::string message;
  /// Error::ranks: the ranks the error is about (missing, gone, disagreeing),
  /// ascending; at most kMaxErrorRanks. Encoded after the message.
  std::vector<std::uint32_t> ranks;
  friend bool operator==(const ErrorReply&, const ErrorReply&) = default;
};

struct TensorDecl {
  std::string name;
  std::vector<std::int64_t> shape;
  std::string granularity;   ///< a rule (see planner granularity.hpp); empty: the group's default
  std::int32_t tp_dim = -1;  ///< -1: not tensor-parallel sharded
  friend bool operator==(const TensorDecl&, const TensorDecl&) = default;
};

struct RegisterGroup {
  std::string name;
  std::string sharded_dtype = "fp32";    ///< dtype of the persistent shard (e.g. fp32 master)
  std::string unsharded_dtype = "bf16";  ///< dtype of the gathered copy (and gradients)
  std::string granularity = "element";   ///< default rule for 2D+ tensors
  std::uint32_t align_bytes = 16;
  std::vector<TensorDecl> tensors;
  friend bool operator==(const RegisterGroup&, const RegisterGroup&) = default;
};

/// Where a region lives in a memfd.
struct Region {
  std::uint64_t offset = 0;  ///< bytes, 256-byte aligned
  std::uint64_t bytes = 0;
  friend bool operator==(const Region&, const Region&) = default;
};

struct PlacedTensorWire {
  std::string name;
  std::vector<std::int64_t> shape;
  std::int64_t offset = 0;  ///< elements, in the global buffer of devices * shard_elems
  std::int64_t numel = 0;
  std::int64_t granularity = 1;
  friend bool operator==(const PlacedTensorWire&, const PlacedTensorWire&) = default;
};

/// Reply to RegisterGroup. The frame carries one fd: this rank's shard memfd
/// holding `sharded` and `sharded_grad`, each shard_elems of sharded_dtype
/// (the master copy and the reduced gradient it is updated from).
struct GroupReady {
  std::uint32_t group_id = 0;
  std::uint32_t devices = 1;
  std::int64_t shard_elems = 0;
  std::string sharded_dtype;
  std::string unsharded_dtype;
  std::vector<PlacedTensorWire> tensors;
  std::uint64_t shard_file_bytes = 0;
  Region sharded;
  Region sharded_grad;
  std::uint64_t slot_bytes = 0;  ///< unsharded params + grads: devices*shard_elems of unsharded_dtype each
  friend bool operator==(const GroupReady&, const GroupReady&) = default;
};

struct AcquireSlot {
  std::uint32_t group_id = 0;
  /// When every slot of the rank's pool is held: a slot beyond the pool
  /// (charged to the tenant's quota, its memory given back at its release)
  /// instead of kConflict.
  bool grow = false;
  friend bool operator==(const AcquireSlot&, const AcquireSlot&) = default;
};

/// Reply to AcquireSlot; the frame carries the slot memfd (slot_file_bytes
/// long, of which `params` and `grads` are used by this group).
struct SlotGranted {
  std::uint32_t group_id = 0;
  std::uint32_t slot_index = 0;
  std::uint64_t slot_file_bytes = 0;
  Region params;  ///< devices*shard_elems of unsharded_dtype
  Region grads;   ///< devices*shard_elems of the gradient dtype (unsharded_dtype; bf16 for fp8 groups)
  Region scales;  ///< fp8 groups: one fp32 scale per granularity block; empty otherwise
  friend bool operator==(const SlotGranted&, const SlotGranted&) = default;
};

struct ReleaseSlot {
  std::uint32_t group_id = 0;
  friend bool operator==(const ReleaseSlot&, const ReleaseSlot&) = default;
};

struct SlotReleased {
  std::uint32_t group_id = 0;
  friend bool operator==(const SlotReleased&, const SlotReleased&) = default;
};

/// A rank is done with a group (its parameters moved to another one, or its
/// model dropped): once every rank of the job on this node has said so, the
/// daemon frees the group's memory and its name may be registered again. The
/// rank must hold no slot of the group.
struct UnregisterGroup {
  std::uint32_t group_id = 0;
  friend bool operator==(const UnregisterGroup&, const UnregisterGroup&) = default;
};

struct GroupUnregistered {
  std::uint32_t group_id = 0;
  friend bool operator==(const GroupUnregistered&, const GroupUnregistered&) = default;
};

struct Detach {
  friend bool operator==(const Detach&, const Detach&) = default;
};

struct Detached {
  friend bool operator==(const Detached&, const Detached&) = default;
};

struct Shutdown {
  std::string reason;
  friend bool operator==(const Shutdown&, const Shutdown&) = default;
};

/// An operator's request (docs/operations.md lists the verbs and their
/// arguments). It may come first on a connection, in place of a Hello, and
/// any number of times after; the daemon decides what the peer may see from
/// its credentials (SO_PEERCRED, SO_PEERGROUPS). Answered by an AdminReply or
/// an ErrorReply.
struct AdminRequest {
  std::string verb;               ///< "status", "jobs", "job", "sessions", "plan", "trace", "drain"
  std::vector<std::string> args;  ///< at most kMaxAdminArgs
  friend bool operator==(const AdminRequest&, const AdminRequest&) = default;
};

/// The answer to an AdminRequest: a JSON object whose layout is the verb's
/// (docs/operations.md), at most kMaxAdminReplyBytes long.
struct AdminReply {
  std::string json;
  friend bool operator==(const AdminReply&, const AdminReply&) = default;
};

using Message = std::variant<Hello, Welcome, ErrorReply, RegisterGroup, GroupReady, AcquireSlot, SlotGranted,
                             ReleaseSlot, SlotReleased, Detach, Detached, Shutdown, AdminRequest, AdminReply,
                             UnregisterGroup, GroupUnregistered>;

[[nodiscard]] MessageType typeOf(const Message& message) noexcept;

/// Payload bytes of `message` (without the header). Fails only if a field is
/// over a limit (a string longer than kMaxStringBytes, too many tensors...).
[[nodiscard]] Result<std::vector<std::byte>> encodePayload(const Message& message);

/// Decodes the payload of a frame of `type`; rejects short, long or
/// out-of-range payloads with a message naming the field.
[[nodiscard]] Result<Message> decodePayload(MessageType type, std::span<const std::byte> payload);

/// Checks a job id: 1..128 bytes of [A-Za-z0-9._-]. Applied to Hello::job_id
/// by encodePayload and decodePayload; exported for early checks by callers.
[[nodiscard]] Result<void> validateJobId(std::string_view job_id);

/// Header + payload, ready to send.
[[nodiscard]] Result<std::vector<std::byte>> encodeFrame(const Message& message, std::uint64_t request_id);

}  // namespace dbuf::ipc
