/* libdbuf C API: the C++ client (dbuf/client.hpp) behind opaque handles, for
 * FFI from Python and other languages.
 *
 * Every function returns a dbuf_status; on failure the message of the last
 * error of that client is available from dbuf_last_error() until the next
 * call on the same client. Nothing here exits or aborts the process.
 * Handles are not thread-safe: use one client (and its groups) from one thread
 * at a time. Free groups before their client. */
#ifndef DBUF_DBUF_H_
#define DBUF_DBUF_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum dbuf_status {
  DBUF_OK = 0,
  DBUF_INVALID_ARGUMENT = 1,
  DBUF_NOT_FOUND = 2,
  DBUF_IO = 3,
  DBUF_INFEASIBLE = 4, /* e.g. over quota */
  DBUF_INTERNAL = 5,
  DBUF_PERMISSION_DENIED = 6,
  DBUF_CONFLICT = 7,
  DBUF_TIMEOUT = 8,
  DBUF_UNAVAILABLE = 9 /* daemon gone or shutting down */
} dbuf_status;

typedef struct dbuf_client dbuf_client;
typedef struct dbuf_group dbuf_group;

typedef enum dbuf_region {
  DBUF_REGION_SHARD = 0,          /* this rank's part, sharded (master) dtype */
  DBUF_REGION_SHARD_GRAD = 1,     /* this rank's part of the sharded gradient */
  DBUF_REGION_UNSHARDED = 2,      /* whole tensor, unsharded dtype; after dbuf_group_unshard */
  DBUF_REGION_UNSHARDED_GRAD = 3  /* whole tensor gradient; after dbuf_group_unshard */
} dbuf_region;

typedef struct dbuf_tensor_view {
  void* data;            /* first element of the view, NULL when empty */
  const char* dtype;     /* "fp32", "bf16", ... (static storage) */
  int64_t begin;         /* first element (flattened) of the tensor in the view */
  int64_t end;           /* one past the last */
  int64_t local_units;   /* RaggedShard blocks in the view */
} dbuf_tensor_view;

/* socket_path may be NULL: $DBUF_SOCKET, else /run/dbufd/dbufd.sock.
 * When it fails there is no client: dbuf_last_error(NULL) then gives the
 * reason of the calling thread's last failed dbuf_connect ("no client" if
 * none failed). */
dbuf_status dbuf_connect(const char* socket_path, int64_t timeout_ms, dbuf_client** out);
void dbuf_client_free(dbuf_client* client);
const char* dbuf_last_error(const dbuf_client* client);

dbuf_status dbuf_attach(dbuf_client* client, const char* job, uint32_t rank, uint32_t world_size,
                        int persistent, uint32_t prefetch_depth, int64_t timeout_ms);

/* shapes: the dims of every tensor back to back; ranks[i] dims for tensor i.
 * granularity: default rule for 2D+ tensors ("element", "rows:32", ...).
 * dtypes: "fp32", "bf16", "fp16". */
dbuf_status dbuf_register_group(dbuf_client* client, const char* name, size_t tensor_count,
                                const char* const* tensor_names, const uint32_t* ranks, const int64_t* shapes,
                                const char* granularity, const char* sharded_dtype, const char* unsharded_dtype,
                                int64_t timeout_ms, dbuf_group** out);
void dbuf_group_free(dbuf_group* group);

int64_t dbuf_group_shard_elems(const dbuf_group* group);
size_t dbuf_group_tensor_count(const dbuf_group* group);
/* Offset (elements) of tensor `index` in the global buffer of devices * shard_elems. */
int64_t dbuf_group_tensor_offset(const dbuf_group* group, size_t index);
dbuf_status dbuf_group_view(dbuf_client* client, const dbuf_group* group, size_t index, dbuf_region region,
                            dbuf_tensor_view* out);
dbuf_status dbuf_group_unshard(dbuf_client* client, dbuf_group* group, int64_t timeout_ms);
dbuf_status dbuf_group_reshard(dbuf_client* client, dbuf_group* group, int64_t timeout_ms);

dbuf_status dbuf_detach(dbuf_client* client, int64_t timeout_ms);

#ifdef __cplusplus
}
#endif

#endif /* DBUF_DBUF_H_ */
