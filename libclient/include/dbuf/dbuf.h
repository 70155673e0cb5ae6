/* libdbuf C API: the C++ client (dbuf/client.hpp) behind opaque handles, for
 * FFI from Python and other languages. The header is C89 (with <stdint.h>).
 *
 * Errors: most functions return a dbuf_status; on failure the last error of
 * that client (its status, message and the ranks it names) is kept in the
 * client handle: dbuf_last_error(), dbuf_last_error_status(),
 * dbuf_last_error_ranks(). A later failing call on the same client or one
 * of its groups replaces it (successful calls leave it); what the getters
 * hand out is valid until the next call on that client or its groups, or
 * dbuf_client_free. A call that has no client to keep it in (a failed
 * dbuf_connect / dbuf_connect_ex, a NULL client or group, the *_init
 * functions) keeps it per thread instead: pass NULL as the client to the
 * getters.
 * Arguments are checked (NULL handles and pointers, indices, enums, struct
 * sizes): a bad one gives DBUF_INVALID_ARGUMENT and a message, never a crash
 * (pointers that are not NULL must point to what they say). Nothing here
 * exits or aborts the process.
 *
 * Strings passed in are borrowed for the call only (copied if kept).
 * Strings and arrays handed out are owned by the library: valid as each
 * function says, never to be freed by the caller.
 *
 * Thread safety: a client and its groups must be used by one thread at a
 * time (or externally synchronised); different clients are independent.
 * dbuf_status_name, the *_init functions and dbuf_pin_free may be called
 * from any thread. A client's interrupt check (dbuf_connect_ex) runs on the
 * thread that makes the call it interrupts. Free groups before their
 * client; pins may outlive both.
 *
 * Memory: a view's data pointer keeps one address for its group's life
 * (across reshard / unshard), and stays reserved after the group is gone
 * while a pin of it is held (dbuf_group_pin). With host memory a view whose
 * memory is no longer mapped (after reshard, detach or dbuf_group_free)
 * reads zeros (writes land in private pages the next mapping replaces) and
 * never faults; with GPU memory
 * kernels must not touch it then. "View lifetimes and pins" below has the
 * rules.
 *
 * Versioned structs (dbuf_connect_options, dbuf_attach_options,
 * dbuf_tensor_spec, dbuf_group_options, dbuf_op_result) start with
 * `size_t struct_size`: the size of the struct as the caller's header
 * declares it. Fill one with its *_init function, passing sizeof the struct
 * (the library never writes past the size it is given, so an older caller
 * is safe with a newer library):
 *
 *   dbuf_attach_options options;
 *   dbuf_attach_options_init(&options, sizeof options);
 *   options.job = "run-42"; options.rank = r; options.world_size = 4;
 *   status = dbuf_attach_ex(client, &options, 10000);
 *
 * Later versions of libdbuf only append fields (never into padding: these
 * structs have none), so a caller built against an older header passes a
 * smaller struct_size and gets the defaults of the fields it does not know.
 * A struct_size below the first version's size, or above 4096 (not
 * initialised), is refused; so are non-zero bytes past the fields this
 * library knows (a newer caller asking for something this library cannot
 * do). Output structs (dbuf_op_result) are written up to struct_size only. */
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
  DBUF_UNAVAILABLE = 9,  /* daemon gone or shutting down */
  DBUF_WOULD_BLOCK = 10, /* ring full and the caller asked not to wait */
  DBUF_DEVICE = 11,      /* the GPU, its driver or NCCL failed */
  DBUF_CANCELLED = 12    /* a wait was stopped by the client's interrupt check */
} dbuf_status;

typedef struct dbuf_client dbuf_client;
typedef struct dbuf_group dbuf_group;

typedef enum dbuf_region {
  DBUF_REGION_SHARD = 0,         /* this rank's part, sharded (master) dtype */
  DBUF_REGION_SHARD_GRAD = 1,    /* this rank's part of the sharded gradient */
  DBUF_REGION_UNSHARDED = 2,     /* whole tensor, unsharded dtype; while the group holds its slot */
  DBUF_REGION_UNSHARDED_GRAD = 3 /* whole tensor gradient (bf16 for fp8 groups); while it holds its slot */
} dbuf_region;

/* The tensor's name, shape and numel: dbuf_group_tensor_name / _shape /
 * _numel with the same index (a view covers elements [begin, end) of the
 * flattened tensor). */
typedef struct dbuf_tensor_view {
  void* data;          /* first element of the view, NULL when empty */
  const char* dtype;   /* "fp32", "bf16", ... (static storage) */
  int64_t begin;       /* first element (flattened) of the tensor in the view */
  int64_t end;         /* one past the last */
  int64_t local_units; /* RaggedShard blocks in the view */
} dbuf_tensor_view;

/* A static string naming a status ("DBUF_OK", "DBUF_TIMEOUT", ...);
 * "DBUF_UNKNOWN_STATUS" for a value that is none of them. Never NULL. */
const char* dbuf_status_name(dbuf_status status);

/* dbuf_connect_ex with socket_path and timeout_ms, and no interrupt check.
 * socket_path may be NULL: $DBUF_SOCKET, else /run/dbufd/dbufd.sock.
 * timeout_ms (> 0) is the default of every call of the client that talks to
 * the daemon. When it fails there is no client: dbuf_last_error(NULL) then
 * gives the reason (see the file comment). */
dbuf_status dbuf_connect(const char* socket_path, int64_t timeout_ms, dbuf_client** out);

/* How often, at least, a blocking call asks the client's interrupt check
 * (dbuf::kInterruptPeriod). */
#define DBUF_INTERRUPT_PERIOD_MS 20

/* dbuf::ClientOptions. Defaults (dbuf_connect_options_init): socket_path
 * NULL, timeout_ms 10000, interrupted NULL, interrupt_data NULL. No padding
 * (LP64: 5 x 8 bytes). */
typedef struct dbuf_connect_options {
  size_t struct_size;                  /* sizeof(dbuf_connect_options) as the caller knows it */
  const char* socket_path;             /* borrowed for the call; NULL: $DBUF_SOCKET, else /run/dbufd/dbufd.sock */
  int64_t timeout_ms;                  /* > 0: the default of every call of the client that talks to the daemon */
  int (*interrupted)(void* user_data); /* the interrupt check (see dbuf_connect_ex); NULL: never interrupted */
  void* interrupt_data;                /* its argument, owned by the caller; unused when interrupted is NULL */
} dbuf_connect_options;
dbuf_status dbuf_connect_options_init(dbuf_connect_options* options, size_t struct_size);

/* Connects to dbufd with every client option; options NULL: the defaults.
 * On success *out is a new client (free it with dbuf_client_free); on
 * failure *out is NULL and dbuf_last_error(NULL) gives the reason.
 *
 * The interrupt check: while a call of this client or one of its groups
 * blocks (dbuf_wait, dbuf_wait_result and dbuf_run waiting for an op;
 * dbuf_submit waiting for room in a full ring; dbuf_group_reshard waiting
 * for the group's ops; and every request to dbufd: attach, register_group,
 * acquire_slot, unshard, reshard, detach...), the library calls
 * interrupted(interrupt_data) on the thread that made that call, at least
 * every DBUF_INTERRUPT_PERIOD_MS, and at no other time (dbuf_group_free may
 * block, and ask, while a stream-ordered reshard of the group is pending).
 * A non-zero return ends the wait: the call returns DBUF_CANCELLED (a
 * language binding checks its signals here: Ctrl-C). The callback must
 * return quickly, must not call any function of this client or its groups
 * (it runs inside one of them), and must not unwind (longjmp, a C++
 * exception) through libdbuf; interrupt_data must stay valid until
 * dbuf_client_free. What a cancelled call leaves:
 *   - dbuf_wait / dbuf_wait_result: the op, still in flight: wait for it
 *     again (as after DBUF_TIMEOUT).
 *   - dbuf_submit waiting for room: nothing submitted.
 *   - dbuf_run, dbuf_group_unshard: cancelled while waiting for their op,
 *     it stays in flight with no handle to wait for (a group's reshard
 *     still waits for it), and, as after their DBUF_TIMEOUT, the client
 *     never frees its place among the ops it keeps track of: a submit
 *     2 x ring capacity ops later fails with DBUF_WOULD_BLOCK. Where a wait
 *     may be interrupted, submit and wait separately (wait again).
 *   - dbuf_group_reshard waiting for the group's ops: the group keeps its
 *     slot (still unsharded); reshard again.
 *   - a request to dbufd (attach, register_group, acquire_slot, the release
 *     in reshard, detach...): the connection is closed, since a late reply
 *     could no longer be told apart from the next call's: dbufd reclaims
 *     the session as if the process had gone, and later calls of the
 *     client fail with DBUF_UNAVAILABLE (free it and connect again). */
dbuf_status dbuf_connect_ex(const dbuf_connect_options* options, dbuf_client** out);
/* Closes the connection (the daemon reclaims the session). NULL: no-op. */
void dbuf_client_free(dbuf_client* client);

/* The last error of `client` (NULL: of the calling thread's calls that had no
 * client, see the file comment); what they return is valid until the next
 * call on that client or its groups (for NULL: the thread's next such
 * failure). They never fail nor replace the error they report.
 * dbuf_last_error: its message, "" if none ("no client" for NULL if none). */
const char* dbuf_last_error(const dbuf_client* client);
/* Its status: DBUF_OK if nothing failed yet. */
dbuf_status dbuf_last_error_status(const dbuf_client* client);
/* The ranks it is about, ascending (those that did not arrive, died or
 * disagreed), where it names some: *ranks points to *count ranks owned by
 * the library (NULL and 0 when it names none). DBUF_INVALID_ARGUMENT if ranks
 * or count is NULL (the only way it fails; the last error stays). */
dbuf_status dbuf_last_error_ranks(const dbuf_client* client, const uint32_t** ranks, size_t* count);

/* dbuf_attach_ex with local_rank 0 and device -1 (host memory). */
dbuf_status dbuf_attach(dbuf_client* client, const char* job, uint32_t rank, uint32_t world_size, int persistent,
                        uint32_t prefetch_depth, int64_t timeout_ms);

/* dbuf::AttachOptions. Defaults (dbuf_attach_options_init): job NULL (must
 * be set), rank 0, world_size 1, local_rank 0, device -1, persistent 0,
 * prefetch_depth 1, local_world_size 0, store NULL. No padding (LP64: 8 + 8 +
 * 7 x 4 + 8 bytes; version 1 ended at prefetch_depth, 40 bytes). */
typedef struct dbuf_attach_options {
  size_t struct_size;      /* sizeof(dbuf_attach_options) as the caller knows it */
  const char* job;         /* the job's name; borrowed for the call */
  uint32_t rank;           /* this process's rank, < world_size */
  uint32_t world_size;     /* ranks of the job */
  uint32_t local_rank;     /* rank among the job's processes on this node */
  int32_t device;          /* the trainer's GPU as it numbers them (CUDA builds); -1: none */
  int32_t persistent;      /* non-zero: keep the shards for the daemon's grace period if every rank dies */
  uint32_t prefetch_depth; /* unsharded slots = prefetch_depth + 1 */
  /* Since version 2 (a job across nodes; see dbuf::AttachOptions): */
  uint32_t local_world_size; /* the job's ranks on this node, contiguous from rank - local_rank; 0: all */
  const char* store;         /* "file:DIR" or "redis:HOST:PORT", optionally "#PREFIX"; NULL: one node */
} dbuf_attach_options;

/* Sets *options to the defaults with options->struct_size = struct_size
 * (pass sizeof *options), zeroing bytes past the fields this library knows.
 * DBUF_INVALID_ARGUMENT for NULL or a struct_size out of range. Touches no
 * client (failures go to dbuf_last_error(NULL)). */
dbuf_status dbuf_attach_options_init(dbuf_attach_options* options, size_t struct_size);

/* HELLO / WELCOME with every attach option. Fails if (job, rank) is taken,
 * rank >= world_size, or this user is not in the job's tenant. */
dbuf_status dbuf_attach_ex(dbuf_client* client, const dbuf_attach_options* options, int64_t timeout_ms);

/* After a successful attach: *reattached is 1 if the daemon kept this job's
 * shards from an earlier life of this rank (a persistent job), else 0. */
dbuf_status dbuf_reattached(const dbuf_client* client, int* reattached);
/* The daemon's instance id (from WELCOME; 0 before attach). */
dbuf_status dbuf_daemon_instance_id(const dbuf_client* client, uint64_t* id);
/* Where this client's views point: *device is -1 for host memory (dbufd's
 * host backend: host addresses), else the GPU as the trainer numbers it
 * (dbuf_attach_options.device: device addresses). -1 before attach and
 * after detach. */
dbuf_status dbuf_memory_device(const dbuf_client* client, int32_t* device);
/* Ops submitted and not yet seen completed (completions are collected when
 * the client waits or submits, so it counts down there, not by itself). */
dbuf_status dbuf_in_flight(const dbuf_client* client, uint32_t* count);

/* dbuf_register_group_ex with tensors of the group's granularity, no tp_dim
 * and 16-byte alignment.
 * shapes: the dims of every tensor back to back; ranks[i] dims for tensor i.
 * granularity: default rule for 2D+ tensors ("element", "rows:32", ...).
 * sharded_dtype: "fp32", "bf16", "fp16"; unsharded_dtype: those or "fp8_e4m3". */
dbuf_status dbuf_register_group(dbuf_client* client, const char* name, size_t tensor_count,
                                const char* const* tensor_names, const uint32_t* ranks, const int64_t* shapes,
                                const char* granularity, const char* sharded_dtype, const char* unsharded_dtype,
                                int64_t timeout_ms, dbuf_group** out);

#define DBUF_MAX_NDIM 8 /* dims of a tensor, at most */

/* dbuf::TensorSpec. Defaults (dbuf_tensor_spec_init): name NULL (must be
 * set), shape NULL, ndim 0, granularity NULL, tp_dim -1. */
typedef struct dbuf_tensor_spec {
  size_t struct_size;      /* sizeof(dbuf_tensor_spec) as the caller knows it */
  const char* name;        /* borrowed for the call */
  const int64_t* shape;    /* ndim dims, outermost first; may be NULL when ndim is 0 */
  const char* granularity; /* its own rule ("rows:32", ...); NULL or "": the group's */
  uint32_t ndim;           /* <= DBUF_MAX_NDIM */
  int32_t tp_dim;          /* the tensor-parallel dim; -1: none */
} dbuf_tensor_spec;
dbuf_status dbuf_tensor_spec_init(dbuf_tensor_spec* spec, size_t struct_size);

/* The rest of dbuf::GroupSpec. Defaults (dbuf_group_options_init):
 * granularity "element", sharded_dtype "fp32", unsharded_dtype "bf16",
 * align_bytes 16 (each of the NULL pointers means its default). */
typedef struct dbuf_group_options {
  size_t struct_size;          /* sizeof(dbuf_group_options) as the caller knows it */
  const char* granularity;     /* default rule for 2D+ tensors ("element", "rows:32", ...) */
  const char* sharded_dtype;   /* master weights and sharded gradient: "fp32", "bf16", "fp16" */
  const char* unsharded_dtype; /* gathered params and grads: those or "fp8_e4m3" */
  uint32_t align_bytes;        /* each tensor's offset, in bytes of the narrower dtype, is a multiple of it */
  uint32_t reserved;           /* 0 (keeps the struct free of padding) */
} dbuf_group_options;
dbuf_status dbuf_group_options_init(dbuf_group_options* options, size_t struct_size);

/* Collective: returns once every rank of the job registered the same group.
 * tensors: an array of tensor_count specs (NULL when tensor_count is 0), each
 * with the same struct_size, which is the array's stride; options NULL: the
 * defaults. Everything is borrowed for the call. On success *out is a new
 * group (free it with dbuf_group_free before the client); on failure NULL. */
dbuf_status dbuf_register_group_ex(dbuf_client* client, const char* name, size_t tensor_count,
                                   const dbuf_tensor_spec* tensors, const dbuf_group_options* options,
                                   int64_t timeout_ms, dbuf_group** out);
/* Unmaps the group's memory, and releases its address ranges but those a
 * pin holds (see "view lifetimes and pins"); before its client. NULL: no-op. */
void dbuf_group_free(dbuf_group* group);

/* ---- the group's plan ----
 * These need no daemon. Strings and arrays they hand out are owned by the
 * group and valid until dbuf_group_free. Failures (a NULL group or pointer,
 * an index >= dbuf_group_tensor_count) give DBUF_INVALID_ARGUMENT, kept by
 * the group's client (the thread's for a NULL group). */

/* -1 for a NULL group. */
int64_t dbuf_group_shard_elems(const dbuf_group* group);
/* 0 for a NULL group. */
size_t dbuf_group_tensor_count(const dbuf_group* group);
/* Offset (elements) of tensor `index` in the global buffer of devices * shard_elems; -1 if out of range. */
int64_t dbuf_group_tensor_offset(const dbuf_group* group, size_t index);

dbuf_status dbuf_group_name(const dbuf_group* group, const char** name);
/* The daemon's id of the group within its job. */
dbuf_status dbuf_group_id(const dbuf_group* group, uint32_t* id);
/* Ranks the group is sharded over. */
dbuf_status dbuf_group_devices(const dbuf_group* group, uint32_t* devices);
/* This process's rank. */
dbuf_status dbuf_group_rank(const dbuf_group* group, uint32_t* rank);
/* Bytes of this rank's shard file (sharded + sharded gradient). */
dbuf_status dbuf_group_shard_bytes(const dbuf_group* group, uint64_t* bytes);
/* 1 while the group holds an unsharded slot (acquire_slot / unshard until reshard), else 0. */
dbuf_status dbuf_group_is_unsharded(const dbuf_group* group, int* unsharded);

dbuf_status dbuf_group_tensor_name(const dbuf_group* group, size_t index, const char** name);
dbuf_status dbuf_group_tensor_ndim(const dbuf_group* group, size_t index, uint32_t* ndim);
/* *dims points to the tensor's *ndim dims (NULL when ndim is 0). */
dbuf_status dbuf_group_tensor_shape(const dbuf_group* group, size_t index, const int64_t** dims, uint32_t* ndim);
dbuf_status dbuf_group_tensor_numel(const dbuf_group* group, size_t index, int64_t* numel);
/* Elements per granularity block (1: element granularity); no block
 * straddles two ranks. */
dbuf_status dbuf_group_tensor_granularity(const dbuf_group* group, size_t index, int64_t* granularity);

/* ---- memory ----
 *
 * View lifetimes and pins. A group keeps one address range per DBuffer for
 * its whole life: one for its shard file (the SHARD and SHARD_GRAD regions)
 * and one for its unsharded slot (UNSHARDED, UNSHARDED_GRAD and the fp8
 * scales). Every acquire_slot / unshard maps the slot at the same address,
 * so a view->data taken once stays right across reshard / unshard. The
 * memory behind it is the daemon's (shared with the other ranks' gathers)
 * while the group lives and its client is attached, and, for the slot's
 * regions, while the group holds the slot (acquire_slot / unshard until
 * reshard). Outside those times the address stays reserved, never reused by
 * the process for anything else, while the group lives or a pin of its
 * range (dbuf_group_pin) is held:
 *   - host memory (dbuf_memory_device: -1): the range holds private zero
 *     pages: a stale view reads zeros (its writes land in private pages the
 *     next mapping replaces), never a fault;
 *   - GPU memory: the range is reserved but unmapped: kernels must not
 *     touch it (an illegal-address fault, which ends the process's CUDA
 *     context).
 * Once the group is freed and no pin holds a range, the range is unmapped
 * and its address may be reused: its views must not be touched then. */

/* Tensor `index` in a region (see dbuf_region and the rules above).
 * Unsharded regions need the slot (DBUF_INVALID_ARGUMENT otherwise); views
 * taken after detach are empty (data NULL). */
dbuf_status dbuf_group_view(dbuf_client* client, const dbuf_group* group, size_t index, dbuf_region region,
                            dbuf_tensor_view* out);

/* A pin: keeps the address range of a group's views reserved (zero pages
 * for host memory once unmapped), even after dbuf_group_free, dbuf_detach
 * and dbuf_client_free. It keeps the address only, not the daemon's memory.
 * A language binding holds one in each array it hands out. */
typedef struct dbuf_pin dbuf_pin;

/* A new pin in *out of the range behind `region`'s views of `group`: the
 * shard file for DBUF_REGION_SHARD / SHARD_GRAD (one range, the same for
 * both), the slot for DBUF_REGION_UNSHARDED / UNSHARDED_GRAD (and the
 * scales). *out is NULL, with DBUF_OK, when no view of the region points
 * anywhere, so there is nothing to keep: the slot before the group's first
 * acquire_slot / unshard, the shard when this rank holds no element of the
 * group or once the client detached (take the pin with the views). Needs no
 * daemon. client: the group's (it keeps the errors). Free the pin with
 * dbuf_pin_free. */
dbuf_status dbuf_group_pin(dbuf_client* client, const dbuf_group* group, dbuf_region region, dbuf_pin** out);
/* Releases a pin; the last hold on a range whose group is freed unmaps it.
 * Any thread, before or after its group and client are freed. NULL: no-op. */
void dbuf_pin_free(dbuf_pin* pin);
/* fp8 groups, while the slot is held: the gathered per-block scales (one
 * float per granularity block; tensor i's blocks start at
 * dbuf_group_scale_index(group, i)). *scales is NULL and *count 0 otherwise. */
dbuf_status dbuf_group_scales(const dbuf_group* group, float** scales, size_t* count);
int64_t dbuf_group_scale_index(const dbuf_group* group, size_t index);

/* Maps an unsharded slot without gathering (not a collective), at the
 * group's slot address (the same every time). */
dbuf_status dbuf_group_acquire_slot(dbuf_client* client, dbuf_group* group, int64_t timeout_ms);
/* The same, but when every slot of the rank's pool is held (where
 * dbuf_group_acquire_slot fails with DBUF_CONFLICT): a slot beyond the pool,
 * charged to the tenant's quota (DBUF_INFEASIBLE over it), whose memory goes
 * back at reshard. */
dbuf_status dbuf_group_acquire_slot_growing(dbuf_client* client, dbuf_group* group, int64_t timeout_ms);
/* Collective: acquire the slot if needed, then all-gather into it. */
dbuf_status dbuf_group_unshard(dbuf_client* client, dbuf_group* group, int64_t timeout_ms);
/* Waits for this group's ops in flight (and, with GPU memory, for all of the
 * process's work on the GPU), then unmaps the slot and gives it back: the
 * unsharded views keep their address, which reads zeros with host memory
 * until the next acquire_slot / unshard maps the slot there again. */
dbuf_status dbuf_group_reshard(dbuf_client* client, dbuf_group* group, int64_t timeout_ms);
/* This rank is done with the group: gives its slot back (as reshard), waits
 * for its ops in flight and tells dbufd, which frees the group's memory once
 * every rank of the job on the node has unregistered it (its name may then be
 * registered again). Not a collective. The group's views are empty
 * afterwards and every call on it but dbuf_group_free fails with
 * DBUF_INVALID_ARGUMENT; free it as before. (Since DBUF_0.2.) */
dbuf_status dbuf_group_unregister(dbuf_client* client, dbuf_group* group, int64_t timeout_ms);
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

/* result = post_scale * sum_r(pre_scale * x_r), in fp32 (fp64 for fp64
 * groups), ranks in order; avg divides post_scale by the world size.
 * accumulate (reduce-scatter only): add into the sharded gradient (fp32, or
 * fp64 for fp64 groups) instead of overwriting it. */
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

/* What the daemon reported about a completed op (dbuf::OpResult). */
typedef struct dbuf_op_result {
  size_t struct_size; /* sizeof(dbuf_op_result) as the caller knows it; set before the call */
  uint64_t sequence;  /* index of the op among the job's collectives */
  int64_t wait_ns;    /* from this rank's submission to the last rank's */
  int64_t run_ns;     /* execution in the daemon */
} dbuf_op_result;
/* Zeroes *result and sets result->struct_size = struct_size. */
dbuf_status dbuf_op_result_init(dbuf_op_result* result, size_t struct_size);

/* dbuf_wait, and on DBUF_OK the op's result in *out (written up to
 * out->struct_size; bytes past the fields this library knows are zeroed).
 * *out is left as it was on failure. out must not be NULL. */
dbuf_status dbuf_wait_result(dbuf_client* client, dbuf_op op, int64_t timeout_ms, dbuf_op_result* out);
/* dbuf_submit + dbuf_wait. */
dbuf_status dbuf_run(dbuf_client* client, dbuf_group* group, dbuf_op_kind kind, const dbuf_reduce_options* reduce,
                     uint32_t root, int64_t timeout_ms);

/* Orderly goodbye; the connection is closed afterwards (even on failure),
 * and every group of the client is unmapped: its views read zeros (host
 * memory), its ranges stay reserved until dbuf_group_free or their pins. */
dbuf_status dbuf_detach(dbuf_client* client, int64_t timeout_ms);

#ifdef __cplusplus
}
#endif

#endif /* DBUF_DBUF_H_ */
