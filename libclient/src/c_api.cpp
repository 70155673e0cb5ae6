// The C API: dbuf::Client behind opaque handles; errors become a status and a
// message kept in the client handle.
#include <chrono>
#include <new>
#include <string>

#include "dbuf/client.hpp"
#include "dbuf/dbuf.h"

struct dbuf_client {
  dbuf::Client client;
  std::string last_error;
};

struct dbuf_group {
  dbuf::Group group;
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
  }
  return DBUF_INTERNAL;
}

dbuf_status fail(dbuf_client* client, const dbuf::Error& error) {
  if (client != nullptr) client->last_error = error.message;
  return toStatus(error.code);
}

dbuf_status invalid(dbuf_client* client, const char* why) {
  return fail(client, dbuf::Error{dbuf::ErrorCode::kInvalidArgument, why});
}

/// Why the calling thread's last dbuf_connect failed (there is no client to
/// keep it in): dbuf_last_error(NULL).
thread_local std::string connect_error;  // NOLINT(readability-identifier-naming)

std::chrono::milliseconds ms(int64_t timeout_ms) {
  return std::chrono::milliseconds(timeout_ms);
}

}  // namespace

extern "C" {

dbuf_status dbuf_connect(const char* socket_path, int64_t timeout_ms, dbuf_client** out) {
  if (out == nullptr || timeout_ms <= 0) return DBUF_INVALID_ARGUMENT;
  *out = nullptr;
  dbuf::ClientOptions options;
  if (socket_path != nullptr) options.socket_path = socket_path;
  options.timeout = ms(timeout_ms);
  auto client = dbuf::Client::connect(options);
  if (!client) {
    connect_error = client.error().message;
    return toStatus(client.error().code);
  }
  *out = new (std::nothrow) dbuf_client{std::move(*client), {}};
  return *out == nullptr ? DBUF_INTERNAL : DBUF_OK;
}

void dbuf_client_free(dbuf_client* client) {
  delete client;
}

const char* dbuf_last_error(const dbuf_client* client) {
  if (client != nullptr) return client->last_error.c_str();
  return connect_error.empty() ? "no client" : connect_error.c_str();
}

dbuf_status dbuf_attach(dbuf_client* client, const char* job, uint32_t rank, uint32_t world_size, int persistent,
                        uint32_t prefetch_depth, int64_t timeout_ms) {
  if (client == nullptr || job == nullptr || timeout_ms <= 0) return invalid(client, "bad argument to dbuf_attach");
  dbuf::AttachOptions options;
  options.job = job;
  options.rank = rank;
  options.world_size = world_size;
  options.persistent = persistent != 0;
  options.prefetch_depth = prefetch_depth;
  auto attached = client->client.attach(options, ms(timeout_ms));
  return attached ? DBUF_OK : fail(client, attached.error());
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
  dbuf::GroupSpec spec;
  spec.name = name;
  if (granularity != nullptr) spec.granularity = granularity;
  const auto sharded = dbuf::parseDType(sharded_dtype != nullptr ? sharded_dtype : "fp32");
  const auto unsharded = dbuf::parseDType(unsharded_dtype != nullptr ? unsharded_dtype : "bf16");
  if (!sharded || !unsharded) return invalid(client, "unknown dtype");
  spec.sharded_dtype = *sharded;
  spec.unsharded_dtype = *unsharded;
  const int64_t* dims = shapes;
  for (size_t i = 0; i < tensor_count; ++i) {
    if (tensor_names[i] == nullptr) return invalid(client, "a tensor name is NULL");
    spec.tensors.push_back({tensor_names[i], std::vector<int64_t>(dims, dims + ranks[i]), "", -1});
    dims += ranks[i];
  }
  auto group = client->client.registerGroup(spec, ms(timeout_ms));
  if (!group) return fail(client, group.error());
  *out = new (std::nothrow) dbuf_group{std::move(*group)};
  return *out == nullptr ? DBUF_INTERNAL : DBUF_OK;
}

void dbuf_group_free(dbuf_group* group) {
  delete group;
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

namespace {

dbuf_status submitWith(dbuf_client* client, dbuf_group* group, dbuf_op_kind kind, const dbuf_reduce_options* reduce,
                       uint32_t root, const dbuf::SubmitOptions& submit, dbuf_op* out) {
  const bool needs_group = kind != DBUF_OP_BARRIER && kind != DBUF_OP_NOOP;
  if (needs_group && group == nullptr) return invalid(client, "this op needs a group");
  dbuf::ReduceOptions options;
  if (reduce != nullptr) {
    if (reduce->mode != DBUF_REDUCE_SUM && reduce->mode != DBUF_REDUCE_AVG) return invalid(client, "bad reduce mode");
    options = {reduce->mode == DBUF_REDUCE_AVG ? dbuf::ReduceMode::kAvg : dbuf::ReduceMode::kSum, reduce->pre_scale,
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

dbuf_status dbuf_wait(dbuf_client* client, dbuf_op op, int64_t timeout_ms) {
  if (client == nullptr || timeout_ms <= 0) return invalid(client, "bad argument to dbuf_wait");
  auto done = client->client.wait(dbuf::OpHandle{op}, ms(timeout_ms));
  return done ? DBUF_OK : fail(client, done.error());
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
