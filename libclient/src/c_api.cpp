// The C API: dbuf::Client behind opaque handles; errors become a status and
// the whole dbuf::Error, kept in the client handle (or per thread when there
// is no client to keep it in).
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "dbuf/client.hpp"
#include "dbuf/dbuf.h"
#include "dbuf/ipc/protocol.hpp"

struct dbuf_client {
  dbuf::Client client;
  dbuf::Error last_error{dbuf::ErrorCode::kInternal, "", {}};
  bool failed = false;  // last_error holds a failure (dbuf_last_error_status)
};

struct dbuf_group {
  dbuf::Group group;
  dbuf_client* owner;  // keeps the group accessors' errors; groups are freed before their client
};

struct dbuf_pin {
  std::shared_ptr<const void> range;  // TensorView::pin: the reserved address range, nothing else
};

namespace {

dbuf_status toStatus(dbuf::ErrorCode code) {
  switch (code) {
    case dbuf::ErrorCode::kInvalidArgument:
      return DBUF_INVALID_ARGUMENT;
    case dbuf::ErrorCode::kNotFound:
      return DBUF_NOT_FOUND;
    case dbuf::ErrorCode::kIo:
      return DBUF_IO;
    case dbuf::ErrorCode::kInfeasible:
      return DBUF_INFEASIBLE;
    case dbuf::ErrorCode::kInternal:
      return DBUF_INTERNAL;
    case dbuf::ErrorCode::kPermissionDenied:
      return DBUF_PERMISSION_DENIED;
    case dbuf::ErrorCode::kConflict:
      return DBUF_CONFLICT;
    case dbuf::ErrorCode::kTimeout:
      return DBUF_TIMEOUT;
    case dbuf::ErrorCode::kUnavailable:
      return DBUF_UNAVAILABLE;
    case dbuf::ErrorCode::kWouldBlock:
      return DBUF_WOULD_BLOCK;
    case dbuf::ErrorCode::kDevice:
      return DBUF_DEVICE;
    case dbuf::ErrorCode::kCancelled:
      return DBUF_CANCELLED;
  }
  return DBUF_INTERNAL;
}

/// The calling thread's last failure that had no client to keep it (a failed
/// dbuf_connect, a NULL client or group, the *_init functions):
/// dbuf_last_error(NULL) and friends.
struct ThreadError {
  dbuf::Error error{dbuf::ErrorCode::kInternal, "no client", {}};
  bool failed = false;
};
thread_local ThreadError thread_error;  // NOLINT(readability-identifier-naming)

dbuf_status fail(dbuf_client* client, dbuf::Error error) {
  const dbuf_status status = toStatus(error.code);
  if (client != nullptr) {
    client->last_error = std::move(error);
    client->failed = true;
  } else {
    thread_error.error = std::move(error);
    thread_error.failed = true;
  }
  return status;
}

dbuf_status invalid(dbuf_client* client, std::string why) {
  return fail(client, dbuf::Error{dbuf::ErrorCode::kInvalidArgument, std::move(why), {}});
}

std::chrono::milliseconds ms(int64_t timeout_ms) {
  return std::chrono::milliseconds(timeout_ms);
}

// ---- versioned structs ----
// Each struct's first version is its size today; the structs have no padding,
// so a later field always makes struct_size grow (the asserts keep it so).
static_assert(sizeof(dbuf_connect_options) == offsetof(dbuf_connect_options, interrupt_data) + sizeof(void*));
static_assert(sizeof(dbuf_attach_options) == offsetof(dbuf_attach_options, store) + sizeof(const char*));
static_assert(sizeof(dbuf_tensor_spec) == offsetof(dbuf_tensor_spec, tp_dim) + sizeof(int32_t));
static_assert(sizeof(dbuf_group_options) == offsetof(dbuf_group_options, reserved) + sizeof(uint32_t));
static_assert(sizeof(dbuf_op_result) == offsetof(dbuf_op_result, run_ns) + sizeof(int64_t));
constexpr std::size_t kConnectOptionsV1 = sizeof(dbuf_connect_options);
constexpr std::size_t kAttachOptionsV1 = offsetof(dbuf_attach_options, local_world_size);
constexpr std::size_t kTensorSpecV1 = sizeof(dbuf_tensor_spec);
constexpr std::size_t kGroupOptionsV1 = sizeof(dbuf_group_options);
constexpr std::size_t kOpResultV1 = sizeof(dbuf_op_result);
/// Larger than any version will be: a struct_size over it was never set.
constexpr std::size_t kMaxStructSize = 4096;

static_assert(DBUF_MAX_NDIM == dbuf::ipc::kMaxTensorRank);
static_assert(std::chrono::milliseconds(DBUF_INTERRUPT_PERIOD_MS) == dbuf::kInterruptPeriod);

std::string checkSize(std::size_t size, std::size_t first_version, const char* what) {
  if (size < first_version) {
    return std::string(what) + ".struct_size " + std::to_string(size) + " is below its first version's " +
           std::to_string(first_version) + " bytes";
  }
  if (size > kMaxStructSize) {
    return std::string(what) + ".struct_size " + std::to_string(size) + " is over " + std::to_string(kMaxStructSize) +
           " (not initialised? use its _init function)";
  }
  return {};
}

/// Reads a caller's versioned struct into `out` (which holds the defaults):
/// the fields the caller's struct_size covers, and refuses a size out of
/// range or non-zero bytes past what this library knows. "" when it is fine.
template <typename T>
std::string readVersioned(const void* in, std::size_t first_version, const char* what, T& out) {
  std::size_t size = 0;
  std::memcpy(&size, in, sizeof size);
  if (std::string why = checkSize(size, first_version, what); !why.empty()) return why;
  const auto* bytes = static_cast<const unsigned char*>(in);
  for (std::size_t b = sizeof(T); b < size; ++b) {
    if (bytes[b] != 0) {
      return std::string(what) + " sets fields past byte " + std::to_string(sizeof(T)) +
             " that this libdbuf does not know (a newer header?)";
    }
  }
  std::memcpy(&out, in, std::min(size, sizeof(T)));
  return {};
}

/// *_init: the defaults, struct_size as given, zeros past what we know.
template <typename T>
dbuf_status initVersioned(T* out, std::size_t size, std::size_t first_version, const char* what, const T& defaults) {
  if (out == nullptr) return invalid(nullptr, std::string(what) + "_init: NULL struct");
  if (std::string why = checkSize(size, first_version, what); !why.empty()) {
    return invalid(nullptr, what + (": " + why));
  }
  T value = defaults;
  value.struct_size = size;
  std::memcpy(out, &value, std::min(size, sizeof(T)));
  if (size > sizeof(T)) std::memset(reinterpret_cast<unsigned char*>(out) + sizeof(T), 0, size - sizeof(T));
  return DBUF_OK;
}

dbuf_connect_options connectDefaults() {
  dbuf_connect_options options{};
  options.struct_size = sizeof options;
  options.socket_path = nullptr;
  options.timeout_ms = dbuf::ClientOptions{}.timeout.count();
  options.interrupted = nullptr;
  options.interrupt_data = nullptr;
  return options;
}

/// dbuf_connect / dbuf_connect_ex once the options are read; `fn` names the
/// public function in messages. *out is already NULL.
dbuf_status connectWith(const std::string& fn, const dbuf_connect_options& given, dbuf_client** out) {
  if (given.timeout_ms <= 0) return invalid(nullptr, fn + ": timeout_ms must be > 0");
  dbuf::ClientOptions options;
  if (given.socket_path != nullptr) options.socket_path = given.socket_path;
  options.timeout = ms(given.timeout_ms);
  if (given.interrupted != nullptr) {
    // Asked by the thread blocked in a call of the client (Connection), so
    // the C callback sees the same thread as the call it interrupts.
    options.interrupted = [check = given.interrupted, data = given.interrupt_data] { return check(data) != 0; };
  }
  auto client = dbuf::Client::connect(options);
  if (!client) return fail(nullptr, std::move(client).error());
  *out = new (std::nothrow) dbuf_client{std::move(*client)};
  return *out == nullptr ? fail(nullptr, dbuf::Error{dbuf::ErrorCode::kInternal, "out of memory", {}}) : DBUF_OK;
}

dbuf_attach_options attachDefaults() {
  dbuf_attach_options options{};
  options.struct_size = sizeof options;
  options.job = nullptr;
  options.rank = 0;
  options.world_size = 1;
  options.local_rank = 0;
  options.device = -1;
  options.persistent = 0;
  options.prefetch_depth = 1;
  options.local_world_size = 0;
  options.store = nullptr;
  return options;
}

dbuf_tensor_spec tensorDefaults() {
  dbuf_tensor_spec spec{};
  spec.struct_size = sizeof spec;
  spec.tp_dim = -1;
  return spec;
}

dbuf_group_options groupDefaults() {
  dbuf_group_options options{};
  options.struct_size = sizeof options;
  options.align_bytes = 16;
  return options;
}

/// A group accessor's checks: a group, an out pointer, and (index given) a tensor.
dbuf_status checkGroup(const dbuf_group* group, const void* out, const char* what) {
  if (group == nullptr) return invalid(nullptr, std::string(what) + ": NULL group");
  if (out == nullptr) return invalid(group->owner, std::string(what) + ": NULL output pointer");
  return DBUF_OK;
}

dbuf_status checkTensor(const dbuf_group* group, size_t index, const void* out, const char* what) {
  if (const dbuf_status status = checkGroup(group, out, what); status != DBUF_OK) return status;
  const std::size_t count = group->group.plan().tensors.size();
  if (index >= count) {
    return invalid(group->owner,
                   std::string(what) + ": tensor " + std::to_string(index) + " of a group of " + std::to_string(count));
  }
  return DBUF_OK;
}

dbuf_status checkClient(const dbuf_client* client, const void* out, const char* what) {
  if (client == nullptr) return invalid(nullptr, std::string(what) + ": NULL client");
  // The accessors take a const client (they change nothing in it) but keep
  // their error in it as every call does.
  if (out == nullptr) return invalid(const_cast<dbuf_client*>(client), std::string(what) + ": NULL output pointer");
  return DBUF_OK;
}

/// An accessor: the argument checks, then *out = get(the C++ client / group).
template <typename T, typename Get>
dbuf_status readClient(const dbuf_client* client, T* out, const char* what, Get get) {
  if (const dbuf_status status = checkClient(client, out, what); status != DBUF_OK) return status;
  *out = static_cast<T>(get(client->client));
  return DBUF_OK;
}
template <typename T, typename Get>
dbuf_status readGroup(const dbuf_group* group, T* out, const char* what, Get get) {
  if (const dbuf_status status = checkGroup(group, out, what); status != DBUF_OK) return status;
  *out = static_cast<T>(get(group->group));
  return DBUF_OK;
}

/// A dtype name, or its default for NULL; false (and `why`) when unknown.
bool dtypeOf(const char* name, dbuf::DType fallback, const char* what, dbuf::DType& out, std::string& why) {
  if (name == nullptr) {
    out = fallback;
    return true;
  }
  const auto parsed = dbuf::parseDType(name);
  if (!parsed) {
    why = std::string("unknown ") + what + " dtype '" + name + "'";
    return false;
  }
  out = *parsed;
  return true;
}

/// The caller's tensor specs as dbuf::TensorSpecs; "" when they are fine.
std::string readTensors(size_t count, const dbuf_tensor_spec* tensors, std::vector<dbuf::TensorSpec>& out) {
  if (count == 0) return {};
  if (tensors == nullptr) return "tensors is NULL with tensor_count " + std::to_string(count);
  if (count > dbuf::ipc::kMaxTensorsPerGroup) {
    return "tensor_count " + std::to_string(count) + " is over " + std::to_string(dbuf::ipc::kMaxTensorsPerGroup);
  }
  // The array's stride is the caller's struct size, which may differ from ours.
  std::size_t stride = 0;
  std::memcpy(&stride, tensors, sizeof stride);
  if (std::string why = checkSize(stride, kTensorSpecV1, "tensors[0]"); !why.empty()) return why;
  if (stride % alignof(dbuf_tensor_spec) != 0) {
    return "tensors[0].struct_size " + std::to_string(stride) + " is not a multiple of the struct's alignment";
  }
  const auto* base = reinterpret_cast<const unsigned char*>(tensors);
  out.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    const std::string which = "tensors[" + std::to_string(i) + "]";
    const unsigned char* at = base + i * stride;
    std::size_t size = 0;
    std::memcpy(&size, at, sizeof size);
    if (size != stride) {
      return which + ".struct_size " + std::to_string(size) + " differs from tensors[0]'s " + std::to_string(stride) +
             " (the array's stride)";
    }
    dbuf_tensor_spec spec = tensorDefaults();
    if (std::string why = readVersioned(at, kTensorSpecV1, which.c_str(), spec); !why.empty()) return why;
    if (spec.name == nullptr) return "a tensor name is NULL (" + which + ")";
    if (spec.ndim > DBUF_MAX_NDIM) {
      return which + " ('" + spec.name + "') has " + std::to_string(spec.ndim) + " dims, over " +
             std::to_string(DBUF_MAX_NDIM);
    }
    if (spec.ndim > 0 && spec.shape == nullptr) return which + " ('" + spec.name + "'): shape is NULL";
    dbuf::TensorSpec tensor;
    tensor.name = spec.name;
    if (spec.ndim > 0) tensor.shape.assign(spec.shape, spec.shape + spec.ndim);
    if (spec.granularity != nullptr) tensor.granularity = spec.granularity;
    tensor.tp_dim = spec.tp_dim;
    out.push_back(std::move(tensor));
  }
  return {};
}

/// dbuf_register_group_ex; `fn` names the public function in messages.
dbuf_status registerGroup(const std::string& fn, dbuf_client* client, const char* name, size_t tensor_count,
                          const dbuf_tensor_spec* tensors, const dbuf_group_options* options, int64_t timeout_ms,
                          dbuf_group** out) {
  if (client == nullptr) return invalid(nullptr, fn + ": NULL client");
  if (out == nullptr) return invalid(client, fn + ": NULL output pointer");
  *out = nullptr;
  if (name == nullptr) return invalid(client, fn + ": NULL name");
  if (timeout_ms <= 0) return invalid(client, fn + ": timeout_ms must be > 0");
  dbuf_group_options given = groupDefaults();
  if (options != nullptr) {
    if (std::string why = readVersioned(options, kGroupOptionsV1, "dbuf_group_options", given); !why.empty()) {
      return invalid(client, fn + ": " + why);
    }
    if (given.reserved != 0) return invalid(client, fn + ": options->reserved must be 0");
  }
  dbuf::GroupSpec spec;
  spec.name = name;
  if (given.granularity != nullptr) spec.granularity = given.granularity;
  std::string why;
  if (!dtypeOf(given.sharded_dtype, dbuf::DType::kF32, "sharded", spec.sharded_dtype, why) ||
      !dtypeOf(given.unsharded_dtype, dbuf::DType::kBF16, "unsharded", spec.unsharded_dtype, why)) {
    return invalid(client, fn + ": " + why);
  }
  spec.align_bytes = given.align_bytes;
  why = readTensors(tensor_count, tensors, spec.tensors);
  if (!why.empty()) return invalid(client, fn + ": " + why);
  auto group = client->client.registerGroup(spec, ms(timeout_ms));
  if (!group) return fail(client, std::move(group).error());
  *out = new (std::nothrow) dbuf_group{std::move(*group), client};
  return *out == nullptr ? fail(client, dbuf::Error{dbuf::ErrorCode::kInternal, "out of memory", {}}) : DBUF_OK;
}

}  // namespace

extern "C" {

const char* dbuf_status_name(dbuf_status status) {
  switch (status) {
    case DBUF_OK:
      return "DBUF_OK";
    case DBUF_INVALID_ARGUMENT:
      return "DBUF_INVALID_ARGUMENT";
    case DBUF_NOT_FOUND:
      return "DBUF_NOT_FOUND";
    case DBUF_IO:
      return "DBUF_IO";
    case DBUF_INFEASIBLE:
      return "DBUF_INFEASIBLE";
    case DBUF_INTERNAL:
      return "DBUF_INTERNAL";
    case DBUF_PERMISSION_DENIED:
      return "DBUF_PERMISSION_DENIED";
    case DBUF_CONFLICT:
      return "DBUF_CONFLICT";
    case DBUF_TIMEOUT:
      return "DBUF_TIMEOUT";
    case DBUF_UNAVAILABLE:
      return "DBUF_UNAVAILABLE";
    case DBUF_WOULD_BLOCK:
      return "DBUF_WOULD_BLOCK";
    case DBUF_DEVICE:
      return "DBUF_DEVICE";
    case DBUF_CANCELLED:
      return "DBUF_CANCELLED";
  }
  return "DBUF_UNKNOWN_STATUS";
}

dbuf_status dbuf_connect(const char* socket_path, int64_t timeout_ms, dbuf_client** out) {
  if (out == nullptr) return invalid(nullptr, "dbuf_connect: NULL output pointer");
  *out = nullptr;
  dbuf_connect_options options = connectDefaults();
  options.socket_path = socket_path;
  options.timeout_ms = timeout_ms;
  return connectWith("dbuf_connect", options, out);
}

dbuf_status dbuf_connect_options_init(dbuf_connect_options* options, size_t struct_size) {
  return initVersioned(options, struct_size, kConnectOptionsV1, "dbuf_connect_options", connectDefaults());
}

dbuf_status dbuf_connect_ex(const dbuf_connect_options* options, dbuf_client** out) {
  if (out == nullptr) return invalid(nullptr, "dbuf_connect_ex: NULL output pointer");
  *out = nullptr;
  dbuf_connect_options given = connectDefaults();
  if (options != nullptr) {
    if (std::string why = readVersioned(options, kConnectOptionsV1, "dbuf_connect_options", given); !why.empty()) {
      return invalid(nullptr, "dbuf_connect_ex: " + why);
    }
  }
  return connectWith("dbuf_connect_ex", given, out);
}

void dbuf_client_free(dbuf_client* client) {
  delete client;
}

const char* dbuf_last_error(const dbuf_client* client) {
  if (client != nullptr) return client->last_error.message.c_str();
  return thread_error.error.message.c_str();
}

dbuf_status dbuf_last_error_status(const dbuf_client* client) {
  if (client != nullptr) return client->failed ? toStatus(client->last_error.code) : DBUF_OK;
  return thread_error.failed ? toStatus(thread_error.error.code) : DBUF_OK;
}

dbuf_status dbuf_last_error_ranks(const dbuf_client* client, const uint32_t** ranks, size_t* count) {
  // No fail(): that would replace the error asked about.
  if (ranks == nullptr || count == nullptr) return DBUF_INVALID_ARGUMENT;
  const std::vector<uint32_t>& all = client != nullptr ? client->last_error.ranks : thread_error.error.ranks;
  *ranks = all.empty() ? nullptr : all.data();
  *count = all.size();
  return DBUF_OK;
}

dbuf_status dbuf_attach_options_init(dbuf_attach_options* options, size_t struct_size) {
  return initVersioned(options, struct_size, kAttachOptionsV1, "dbuf_attach_options", attachDefaults());
}

dbuf_status dbuf_tensor_spec_init(dbuf_tensor_spec* spec, size_t struct_size) {
  return initVersioned(spec, struct_size, kTensorSpecV1, "dbuf_tensor_spec", tensorDefaults());
}

dbuf_status dbuf_group_options_init(dbuf_group_options* options, size_t struct_size) {
  return initVersioned(options, struct_size, kGroupOptionsV1, "dbuf_group_options", groupDefaults());
}

dbuf_status dbuf_op_result_init(dbuf_op_result* result, size_t struct_size) {
  return initVersioned(result, struct_size, kOpResultV1, "dbuf_op_result",
                       dbuf_op_result{sizeof(dbuf_op_result), 0, 0, 0});
}

dbuf_status dbuf_attach_ex(dbuf_client* client, const dbuf_attach_options* options, int64_t timeout_ms) {
  if (client == nullptr) return invalid(nullptr, "dbuf_attach_ex: NULL client");
  if (options == nullptr) return invalid(client, "dbuf_attach_ex: NULL options");
  if (timeout_ms <= 0) return invalid(client, "dbuf_attach_ex: timeout_ms must be > 0");
  dbuf_attach_options given = attachDefaults();
  if (std::string why = readVersioned(options, kAttachOptionsV1, "dbuf_attach_options", given); !why.empty()) {
    return invalid(client, "dbuf_attach_ex: " + why);
  }
  if (given.job == nullptr) return invalid(client, "dbuf_attach_ex: options->job is NULL");
  if (given.device < -1) {
    return invalid(client, "dbuf_attach_ex: device " + std::to_string(given.device) + " (a GPU index, or -1 for none)");
  }
  dbuf::AttachOptions attach;
  attach.job = given.job;
  attach.rank = given.rank;
  attach.world_size = given.world_size;
  attach.local_rank = given.local_rank;
  attach.device = given.device;
  attach.persistent = given.persistent != 0;
  attach.prefetch_depth = given.prefetch_depth;
  attach.local_world_size = given.local_world_size;
  if (given.store != nullptr) attach.store = given.store;
  auto attached = client->client.attach(attach, ms(timeout_ms));
  return attached ? DBUF_OK : fail(client, std::move(attached).error());
}

dbuf_status dbuf_attach(dbuf_client* client, const char* job, uint32_t rank, uint32_t world_size, int persistent,
                        uint32_t prefetch_depth, int64_t timeout_ms) {
  if (client == nullptr || job == nullptr || timeout_ms <= 0) return invalid(client, "bad argument to dbuf_attach");
  dbuf_attach_options options = attachDefaults();
  options.job = job;
  options.rank = rank;
  options.world_size = world_size;
  options.persistent = persistent != 0 ? 1 : 0;
  options.prefetch_depth = prefetch_depth;
  return dbuf_attach_ex(client, &options, timeout_ms);
}

dbuf_status dbuf_reattached(const dbuf_client* client, int* reattached) {
  return readClient(client, reattached, "dbuf_reattached",
                    [](const dbuf::Client& x) { return x.reattached() ? 1 : 0; });
}

dbuf_status dbuf_daemon_instance_id(const dbuf_client* client, uint64_t* id) {
  return readClient(client, id, "dbuf_daemon_instance_id", [](const dbuf::Client& x) { return x.daemonInstanceId(); });
}

dbuf_status dbuf_memory_device(const dbuf_client* client, int32_t* device) {
  return readClient(client, device, "dbuf_memory_device",
                    [](const dbuf::Client& x) { return x.memoryDevice().value_or(-1); });
}

dbuf_status dbuf_in_flight(const dbuf_client* client, uint32_t* count) {
  return readClient(client, count, "dbuf_in_flight", [](const dbuf::Client& x) { return x.inFlight(); });
}

dbuf_status dbuf_register_group_ex(dbuf_client* client, const char* name, size_t tensor_count,
                                   const dbuf_tensor_spec* tensors, const dbuf_group_options* options,
                                   int64_t timeout_ms, dbuf_group** out) {
  return registerGroup("dbuf_register_group_ex", client, name, tensor_count, tensors, options, timeout_ms, out);
}

dbuf_status dbuf_register_group(dbuf_client* client, const char* name, size_t tensor_count,
                                const char* const* tensor_names, const uint32_t* ranks, const int64_t* shapes,
                                const char* granularity, const char* sharded_dtype, const char* unsharded_dtype,
                                int64_t timeout_ms, dbuf_group** out) {
  if (client == nullptr || name == nullptr || tensor_names == nullptr || ranks == nullptr || shapes == nullptr ||
      out == nullptr || timeout_ms <= 0) {
    return invalid(client, "bad argument to dbuf_register_group");
  }
  *out = nullptr;
  if (tensor_count > dbuf::ipc::kMaxTensorsPerGroup) {
    return invalid(client, "dbuf_register_group: tensor_count " + std::to_string(tensor_count) + " is over " +
                               std::to_string(dbuf::ipc::kMaxTensorsPerGroup));
  }
  std::vector<dbuf_tensor_spec> tensors(tensor_count, tensorDefaults());
  const int64_t* dims = shapes;
  for (size_t i = 0; i < tensor_count; ++i) {
    tensors[i].name = tensor_names[i];
    tensors[i].ndim = ranks[i];
    tensors[i].shape = dims;
    if (ranks[i] > DBUF_MAX_NDIM) break;  // refused below, before reading further dims
    dims += ranks[i];
  }
  dbuf_group_options options = groupDefaults();
  options.granularity = granularity;
  options.sharded_dtype = sharded_dtype;
  options.unsharded_dtype = unsharded_dtype;
  return registerGroup("dbuf_register_group", client, name, tensor_count, tensors.data(), &options, timeout_ms, out);
}

void dbuf_group_free(dbuf_group* group) {
  delete group;
}

dbuf_status dbuf_group_name(const dbuf_group* group, const char** name) {
  if (const dbuf_status status = checkGroup(group, name, "dbuf_group_name"); status != DBUF_OK) return status;
  *name = group->group.name().c_str();
  return DBUF_OK;
}

dbuf_status dbuf_group_id(const dbuf_group* group, uint32_t* id) {
  return readGroup(group, id, "dbuf_group_id", [](const dbuf::Group& x) { return x.plan().group_id; });
}

dbuf_status dbuf_group_devices(const dbuf_group* group, uint32_t* devices) {
  return readGroup(group, devices, "dbuf_group_devices", [](const dbuf::Group& x) { return x.plan().devices; });
}

dbuf_status dbuf_group_rank(const dbuf_group* group, uint32_t* rank) {
  return readGroup(group, rank, "dbuf_group_rank", [](const dbuf::Group& x) { return x.rank(); });
}

dbuf_status dbuf_group_shard_bytes(const dbuf_group* group, uint64_t* bytes) {
  return readGroup(group, bytes, "dbuf_group_shard_bytes", [](const dbuf::Group& x) { return x.shardBytes(); });
}

dbuf_status dbuf_group_is_unsharded(const dbuf_group* group, int* unsharded) {
  return readGroup(group, unsharded, "dbuf_group_is_unsharded",
                   [](const dbuf::Group& x) { return x.unsharded() ? 1 : 0; });
}

dbuf_status dbuf_group_tensor_name(const dbuf_group* group, size_t index, const char** name) {
  if (const dbuf_status status = checkTensor(group, index, name, "dbuf_group_tensor_name"); status != DBUF_OK) {
    return status;
  }
  *name = group->group.plan().tensors[index].name.c_str();
  return DBUF_OK;
}

dbuf_status dbuf_group_tensor_ndim(const dbuf_group* group, size_t index, uint32_t* ndim) {
  if (const dbuf_status status = checkTensor(group, index, ndim, "dbuf_group_tensor_ndim"); status != DBUF_OK) {
    return status;
  }
  *ndim = static_cast<uint32_t>(group->group.plan().tensors[index].shape.size());
  return DBUF_OK;
}

dbuf_status dbuf_group_tensor_shape(const dbuf_group* group, size_t index, const int64_t** dims, uint32_t* ndim) {
  if (const dbuf_status status = checkTensor(group, index, dims, "dbuf_group_tensor_shape"); status != DBUF_OK) {
    return status;
  }
  if (ndim == nullptr) return invalid(group->owner, "dbuf_group_tensor_shape: NULL output pointer");
  const std::vector<int64_t>& shape = group->group.plan().tensors[index].shape;
  *dims = shape.empty() ? nullptr : shape.data();
  *ndim = static_cast<uint32_t>(shape.size());
  return DBUF_OK;
}

dbuf_status dbuf_group_tensor_numel(const dbuf_group* group, size_t index, int64_t* numel) {
  if (const dbuf_status status = checkTensor(group, index, numel, "dbuf_group_tensor_numel"); status != DBUF_OK) {
    return status;
  }
  *numel = group->group.plan().tensors[index].numel;
  return DBUF_OK;
}

dbuf_status dbuf_group_tensor_granularity(const dbuf_group* group, size_t index, int64_t* granularity) {
  if (const dbuf_status status = checkTensor(group, index, granularity, "dbuf_group_tensor_granularity");
      status != DBUF_OK) {
    return status;
  }
  *granularity = group->group.plan().tensors[index].granularity;
  return DBUF_OK;
}

int64_t dbuf_group_shard_elems(const dbuf_group* group) {
  return group == nullptr ? -1 : group->group.plan().shard_elems;
}

size_t dbuf_group_tensor_count(const dbuf_group* group) {
  return group == nullptr ? 0 : group->group.plan().tensors.size();
}

int64_t dbuf_group_tensor_offset(const dbuf_group* group, size_t index) {
  if (group == nullptr || index >= group->group.plan().tensors.size()) return -1;
  return group->group.plan().tensors[index].offset;
}

dbuf_status dbuf_group_view(dbuf_client* client, const dbuf_group* group, size_t index, dbuf_region region,
                            dbuf_tensor_view* out) {
  if (group == nullptr || out == nullptr || index >= group->group.plan().tensors.size()) {
    return invalid(client, "bad argument to dbuf_group_view");
  }
  dbuf::TensorView view;
  switch (region) {
    case DBUF_REGION_SHARD:
      view = group->group.shardView(index);
      break;
    case DBUF_REGION_SHARD_GRAD:
      view = group->group.shardGradView(index);
      break;
    case DBUF_REGION_UNSHARDED:
    case DBUF_REGION_UNSHARDED_GRAD: {
      auto full =
          region == DBUF_REGION_UNSHARDED ? group->group.unshardedView(index) : group->group.unshardedGradView(index);
      if (!full) return fail(client, full.error());
      view = *full;
      break;
    }
    default:
      return invalid(client, "unknown region");
  }
  *out = dbuf_tensor_view{view.base, dbuf::toString(view.dtype).data(), view.begin, view.end, view.local_units};
  return DBUF_OK;
}

dbuf_status dbuf_group_pin(dbuf_client* client, const dbuf_group* group, dbuf_region region, dbuf_pin** out) {
  if (client == nullptr) return invalid(nullptr, "dbuf_group_pin: NULL client");
  if (out == nullptr) return invalid(client, "dbuf_group_pin: NULL output pointer");
  *out = nullptr;
  if (group == nullptr) return invalid(client, "dbuf_group_pin: NULL group");
  if (group->owner != client) return invalid(client, "dbuf_group_pin: the group belongs to another client");
  std::shared_ptr<const void> range;
  switch (region) {
    case DBUF_REGION_SHARD:
    case DBUF_REGION_SHARD_GRAD:
      // Every shard view pins the one shard range; a view with no element
      // (none of the tensor on this rank, or detached) pins nothing.
      for (std::size_t t = 0; t < group->group.plan().tensors.size() && range == nullptr; ++t) {
        range = group->group.shardView(t).pin;
      }
      break;
    case DBUF_REGION_UNSHARDED:
    case DBUF_REGION_UNSHARDED_GRAD:
      range = group->group.slotPin();  // null before the first acquire
      break;
    default:
      return invalid(client, "dbuf_group_pin: unknown region " + std::to_string(static_cast<int>(region)));
  }
  if (range == nullptr) return DBUF_OK;  // no view points anywhere: nothing to keep
  *out = new (std::nothrow) dbuf_pin{std::move(range)};
  return *out == nullptr ? fail(client, dbuf::Error{dbuf::ErrorCode::kInternal, "out of memory", {}}) : DBUF_OK;
}

void dbuf_pin_free(dbuf_pin* pin) {
  delete pin;
}

dbuf_status dbuf_group_unshard(dbuf_client* client, dbuf_group* group, int64_t timeout_ms) {
  if (group == nullptr || timeout_ms <= 0) return invalid(client, "bad argument to dbuf_group_unshard");
  auto done = group->group.unshard(ms(timeout_ms));
  return done ? DBUF_OK : fail(client, done.error());
}

dbuf_status dbuf_group_scales(const dbuf_group* group, float** scales, size_t* count) {
  if (group == nullptr || scales == nullptr || count == nullptr) return DBUF_INVALID_ARGUMENT;
  const std::span<float> all = group->group.unshardedScales();
  *scales = all.empty() ? nullptr : all.data();
  *count = all.size();
  return DBUF_OK;
}

int64_t dbuf_group_scale_index(const dbuf_group* group, size_t index) {
  if (group == nullptr || index >= group->group.plan().tensors.size()) return -1;
  return group->group.scaleIndex(index);
}

dbuf_status dbuf_group_acquire_slot(dbuf_client* client, dbuf_group* group, int64_t timeout_ms) {
  if (group == nullptr || timeout_ms <= 0) return invalid(client, "bad argument to dbuf_group_acquire_slot");
  auto done = group->group.acquireSlot(ms(timeout_ms));
  return done ? DBUF_OK : fail(client, done.error());
}

dbuf_status dbuf_group_acquire_slot_growing(dbuf_client* client, dbuf_group* group, int64_t timeout_ms) {
  if (group == nullptr || timeout_ms <= 0) return invalid(client, "bad argument to dbuf_group_acquire_slot_growing");
  auto done = group->group.acquireSlot(ms(timeout_ms), dbuf::WhenPoolFull::kGrow);
  return done ? DBUF_OK : fail(client, done.error());
}

namespace {

/// The int a C caller stored in an enum field. C lets it store any value;
/// C++ may not load one outside the enum's range (undefined behaviour), so
/// the field is read as the int it is, and checked as one.
int storedValue(const dbuf_reduce_mode& field) {
  static_assert(sizeof(dbuf_reduce_mode) == sizeof(int), "a C enum is an int");
  int value = 0;
  std::memcpy(&value, &field, sizeof value);
  return value;
}

dbuf_status submitWith(dbuf_client* client, dbuf_group* group, dbuf_op_kind kind, const dbuf_reduce_options* reduce,
                       uint32_t root, const dbuf::SubmitOptions& submit, dbuf_op* out) {
  const bool needs_group = kind != DBUF_OP_BARRIER && kind != DBUF_OP_NOOP;
  if (needs_group && group == nullptr) return invalid(client, "this op needs a group");
  dbuf::ReduceOptions options;
  if (reduce != nullptr) {
    const int mode = storedValue(reduce->mode);
    if (mode != DBUF_REDUCE_SUM && mode != DBUF_REDUCE_AVG) return invalid(client, "bad reduce mode");
    options = {mode == DBUF_REDUCE_AVG ? dbuf::ReduceMode::kAvg : dbuf::ReduceMode::kSum, reduce->pre_scale,
               reduce->post_scale, reduce->accumulate != 0};
  }
  dbuf::Result<dbuf::OpHandle> handle = dbuf::Error{dbuf::ErrorCode::kInvalidArgument, "unknown op kind"};
  switch (kind) {
    case DBUF_OP_ALL_GATHER:
      handle = group->group.submitAllGather(submit);
      break;
    case DBUF_OP_REDUCE_SCATTER:
      handle = group->group.submitReduceScatter(options, submit);
      break;
    case DBUF_OP_ALL_REDUCE:
      handle = group->group.submitAllReduce(options, submit);
      break;
    case DBUF_OP_BROADCAST:
      handle = group->group.submitBroadcast(root, submit);
      break;
    case DBUF_OP_BARRIER:
      handle = client->client.submitBarrier(submit);
      break;
    case DBUF_OP_NOOP:
      handle = client->client.submitNoop(submit);
      break;
  }
  if (!handle) return fail(client, handle.error());
  *out = handle->id;
  return DBUF_OK;
}

}  // namespace

dbuf_status dbuf_submit(dbuf_client* client, dbuf_group* group, dbuf_op_kind kind, const dbuf_reduce_options* reduce,
                        uint32_t root, int wait_if_full, int64_t timeout_ms, dbuf_op* out) {
  if (client == nullptr || out == nullptr || timeout_ms <= 0) return invalid(client, "bad argument to dbuf_submit");
  return submitWith(client, group, kind, reduce, root, {wait_if_full != 0, ms(timeout_ms), {}}, out);
}

dbuf_status dbuf_submit_on_stream(dbuf_client* client, dbuf_group* group, dbuf_op_kind kind,
                                  const dbuf_reduce_options* reduce, uint32_t root, void* stream, int64_t timeout_ms,
                                  dbuf_op* out) {
  if (client == nullptr || out == nullptr || timeout_ms <= 0) {
    return invalid(client, "bad argument to dbuf_submit_on_stream");
  }
  if (kind == DBUF_OP_BARRIER || kind == DBUF_OP_NOOP) return invalid(client, "only group ops are ordered on a stream");
  return submitWith(client, group, kind, reduce, root, {true, ms(timeout_ms), stream}, out);
}

dbuf_status dbuf_wait_result(dbuf_client* client, dbuf_op op, int64_t timeout_ms, dbuf_op_result* out) {
  if (client == nullptr) return invalid(nullptr, "dbuf_wait_result: NULL client");
  if (out == nullptr) return invalid(client, "dbuf_wait_result: NULL result");
  if (timeout_ms <= 0) return invalid(client, "dbuf_wait_result: timeout_ms must be > 0");
  std::size_t size = 0;
  std::memcpy(&size, out, sizeof size);
  if (std::string why = checkSize(size, kOpResultV1, "dbuf_op_result"); !why.empty()) {
    return invalid(client, "dbuf_wait_result: " + why);
  }
  auto done = client->client.wait(dbuf::OpHandle{op}, ms(timeout_ms));
  if (!done) return fail(client, std::move(done).error());
  const dbuf_op_result result{size, done->sequence, static_cast<int64_t>(done->wait.count()),
                              static_cast<int64_t>(done->run.count())};
  std::memcpy(out, &result, std::min(size, sizeof result));
  if (size > sizeof result) std::memset(reinterpret_cast<unsigned char*>(out) + sizeof result, 0, size - sizeof result);
  return DBUF_OK;
}

dbuf_status dbuf_wait(dbuf_client* client, dbuf_op op, int64_t timeout_ms) {
  if (client == nullptr || timeout_ms <= 0) return invalid(client, "bad argument to dbuf_wait");
  dbuf_op_result ignored{sizeof ignored, 0, 0, 0};
  return dbuf_wait_result(client, op, timeout_ms, &ignored);
}

dbuf_status dbuf_run(dbuf_client* client, dbuf_group* group, dbuf_op_kind kind, const dbuf_reduce_options* reduce,
                     uint32_t root, int64_t timeout_ms) {
  dbuf_op op = 0;
  const dbuf_status submitted = dbuf_submit(client, group, kind, reduce, root, 1, timeout_ms, &op);
  return submitted != DBUF_OK ? submitted : dbuf_wait(client, op, timeout_ms);
}

dbuf_status dbuf_group_reshard(dbuf_client* client, dbuf_group* group, int64_t timeout_ms) {
  if (group == nullptr || timeout_ms <= 0) return invalid(client, "bad argument to dbuf_group_reshard");
  auto done = group->group.reshard(ms(timeout_ms));
  return done ? DBUF_OK : fail(client, done.error());
}

dbuf_status dbuf_group_unregister(dbuf_client* client, dbuf_group* group, int64_t timeout_ms) {
  if (group == nullptr || timeout_ms <= 0) return invalid(client, "bad argument to dbuf_group_unregister");
  auto done = group->group.unregister(ms(timeout_ms));
  return done ? DBUF_OK : fail(client, done.error());
}

dbuf_status dbuf_group_reshard_on_stream(dbuf_client* client, dbuf_group* group, void* stream) {
  if (group == nullptr) return invalid(client, "bad argument to dbuf_group_reshard_on_stream");
  auto done = group->group.reshardOnStream(stream);
  return done ? DBUF_OK : fail(client, done.error());
}

dbuf_status dbuf_detach(dbuf_client* client, int64_t timeout_ms) {
  if (client == nullptr || timeout_ms <= 0) return invalid(client, "bad argument to dbuf_detach");
  auto done = client->client.detach(ms(timeout_ms));
  return done ? DBUF_OK : fail(client, done.error());
}

}  // extern "C"
