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
  DBUF_UNAVAILABLE = 9, /* daemon gone or shutting down */
  DBUF_WOULD_BLOCK = 10, /* ring full and the caller asked not to wait */
  DBUF_DEVICE = 11       /* the GPU, its driver or NCCL failed */
} dbuf_status;

typedef struct dbuf_client dbuf_client;
typedef struct dbuf_group dbuf_group;

typedef enum dbuf_region {
  DBUF_REGION_SHARD = 0,          /* this rank's part, sharded (master) dtype */
  DBUF_REGION_SHARD_GRAD = 1,     /* this rank's part of the sharded gradient */
  DBUF_REGION_UNSHARDED = 2,      /* whole tensor, unsharded dtype; while the group holds its slot */
  DBUF_REGION_UNSHARDED_GRAD = 3  /* whole tensor gradient (bf16 for fp8 groups); while it holds its slot */
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
 * sharded_dtype: "fp32", "bf16", "fp16"; unsharded_dtype: those or "fp8_e4m3". */
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
/* fp8 groups, while the slot is held: the gathered per-block scales (one
 * float per granularity block; tensor i's blocks start at
 * dbuf_group_scale_index(group, i)). *scales is NULL and *count 0 otherwise. */
dbuf_status dbuf_group_scales(const dbuf_group* group, float** scales, size_t* count);
int64_t dbuf_group_scale_index(const dbuf_group* group, size_t index);

/* Maps an unsharded slot without gathering (not a collective). */
dbuf_status dbuf_group_acquire_slot(dbuf_client* client, dbuf_group* group, int64_t timeout_ms);
/* Collective: acquire the slot if needed, then all-gather into it. */
dbuf_status dbuf_group_unshard(dbuf_client* client, dbuf_group* group, int64_t timeout_ms);
/* Waits for this client's ops in flight (and, with GPU memory, for all of the
 * process's work on the GPU), then gives the slot back. */
dbuf_status dbuf_group_reshard(dbuf_client* client, dbuf_group* group, int64_t timeout_ms);
/* Gives the slot back once `stream` (a cudaStream_t of the session's GPU) has
 * run what is queued on it now; returns at once (GPU memory only; see
 * dbuf::Group::reshardOnStream). */
dbuf_status dbuf_group_reshard_on_stream(dbuf_client* client, dbuf_group* group, void* stream);

/* ---- collectives (dbuf/client.hpp documents their semantics) ---- */

typedef enum dbuf_op_kind {
  DBUF_OP_ALL_GATHER = 0,     /* shards -> every rank's unsharded params */
  DBUF_OP_REDUCE_SCATTER = 1, /* unsharded grads -> each rank's sharded grad */
  DBUF_OP_ALL_REDUCE = 2,     /* unsharded grads -> their reduction, in place */
  DBUF_OP_BROADCAST = 3,      /* root's unsharded params -> every rank's */
  DBUF_OP_BARRIER = 4,        /* the whole job; group may be NULL */
  DBUF_OP_NOOP = 5            /* not a collective: answered at once */
} dbuf_op_kind;

typedef enum dbuf_reduce_mode { DBUF_REDUCE_SUM = 0, DBUF_REDUCE_AVG = 1 } dbuf_reduce_mode;

/* result = post_scale * sum_r(pre_scale * x_r), in fp32, ranks in order;
 * avg divides post_scale by the world size. accumulate (reduce-scatter
 * only): add into the fp32 sharded gradient instead of overwriting it. */
typedef struct dbuf_reduce_options {
  dbuf_reduce_mode mode;
  float pre_scale;
  float post_scale;
  int accumulate;
} dbuf_reduce_options;

typedef uint64_t dbuf_op; /* an op in flight */

/* Submits an op and returns at once. reduce may be NULL (sum, scales 1);
 * root is for broadcast. A full ring waits up to timeout_ms, or fails at once
 * with DBUF_WOULD_BLOCK when wait_if_full is 0. */
dbuf_status dbuf_submit(dbuf_client* client, dbuf_group* group, dbuf_op_kind kind, const dbuf_reduce_options* reduce,
                        uint32_t root, int wait_if_full, int64_t timeout_ms, dbuf_op* out);
/* GPU memory only: dbuf_submit with the op ordered on a CUDA stream
 * (stream: a cudaStream_t, NULL the default stream) instead of on the host:
 * dbufd starts it once the work queued on the stream before it has run, and
 * the stream's later work waits for it; neither host blocks. Group ops only.
 * If the op fails the stream is released anyway and dbuf_wait returns the
 * error; later stream-ordered submits of the client then fail
 * (DBUF_CONFLICT). See SubmitOptions::stream in dbuf/client.hpp. */
dbuf_status dbuf_submit_on_stream(dbuf_client* client, dbuf_group* group, dbuf_op_kind kind,
                                  const dbuf_reduce_options* reduce, uint32_t root, void* stream, int64_t timeout_ms,
                                  dbuf_op* out);
/* Waits for a submitted op; its error (mismatch, timeout, a dead rank) is
 * returned here. DBUF_TIMEOUT leaves the op in flight. */
dbuf_status dbuf_wait(dbuf_client* client, dbuf_op op, int64_t timeout_ms);
/* dbuf_submit + dbuf_wait. */
dbuf_status dbuf_run(dbuf_client* client, dbuf_group* group, dbuf_op_kind kind, const dbuf_reduce_options* reduce,
                     uint32_t root, int64_t timeout_ms);

dbuf_status dbuf_detach(dbuf_client* client, int64_t timeout_ms);

#ifdef __cplusplus
}
#endif

#endif /* DBUF_DBUF_H_ */
