#pragma once
/// \file
/// libdbuf, C++ API: a trainer process's connection to its node's dbufd.
///
/// ```
/// auto client = dbuf::Client::connect({});            // socket from options, $DBUF_SOCKET or the default
/// client->attach({.job = "run-42", .rank = r, .world_size = 4});
/// auto group = client->registerGroup(spec);            // collective: every rank registers the same group
/// float* shard = group->shardView(0).data<float>();   // this rank's part of tensor 0
/// group->unshard();                                   // slot + all-gather of every rank's shard
/// ... forward / backward on group->unshardedView(i) and unshardedGradView(i) ...
/// group->reduceScatter({.mode = dbuf::ReduceMode::kAvg});  // gradients -> this rank's sharded gradient
/// group->reshard();                                    // give the unsharded slot back
/// client->detach();
/// ```
///
/// Collectives (all-gather, reduce-scatter, all-reduce, broadcast, barrier)
/// go through the session's shared-memory rings, not the socket: a submit
/// writes one 64-byte entry; the daemon runs the op once every rank of the job
/// submitted its k-th op, and the same k-th op (a mismatch fails it on every
/// rank, naming each rank's op). `submit*` returns a handle at once; `wait`
/// blocks (spinning for the daemon's busy-poll window, then sleeping) until
/// the op completes. Up to the ring capacity may be in flight; beyond that a
/// submit waits for room, or fails with kWouldBlock when asked not to wait.
///
/// Errors are values (`dbuf::Result`); the library never exits or aborts the
/// process. Every call that talks to the daemon takes a timeout (defaulting to
/// the client's). A daemon that dies surfaces as an error on the next call.
///
/// Thread safety: a Client and its Groups share one connection and must be
/// used by one thread at a time (or externally synchronised).
///
/// Memory views show the daemon's memory while their Group is alive, the
/// client has not detached and, for unsharded views, until `reshard()`;
/// views taken afterwards are empty. A group keeps one address range per
/// DBuffer (its shard, its unsharded slot) for its whole life: every
/// unshard() maps the slot at the same address, so a view taken once stays
/// right across reshard / unshard. Host memory (dbufd's host backend): once
/// unmapped, a range holds private zero pages, so a stale view reads zeros
/// (its writes land in private pages that the next mapping replaces) and
/// never faults (unless AttachOptions::keep_slot_mappings keeps a slot mapped); a view's `pin` keeps its range reserved even after the
/// Group is gone (language bindings hold it in the objects they hand out).
/// GPU memory: the range stays reserved, unmapped; kernels must not use it
/// after reshard() (an illegal-address fault).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dbuf/common/dtype.hpp"
#include "dbuf/common/result.hpp"
#include "dbuf/planner/unit_plan.hpp"

namespace dbuf {

inline constexpr const char* kDefaultSocketPath = "/run/dbufd/dbufd.sock";

struct ClientOptions {
  /// Empty: $DBUF_SOCKET if set, else kDefaultSocketPath.
  std::string socket_path;
  std::chrono::milliseconds timeout{10000};  ///< default for every call
  /// Asked by the waiting thread at least every kInterruptPeriod while a
  /// call of this client blocks (an op's wait, a full ring, a drain, a
  /// request to dbufd); returning true ends the wait with kCancelled (a
  /// language binding checks its signals here: Ctrl-C). A cancelled wait()
  /// leaves the op in flight (wait again), a cancelled submit submitted
  /// nothing, a cancelled reshard() keeps the slot; a cancelled request to
  /// dbufd (attach, registerGroup, acquireSlot, detach...) closes the
  /// connection, as its reply can no longer be told apart (later calls fail
  /// with kUnavailable). Empty: never.
  std::function<bool()> interrupted = {};
};

/// How often a blocking call asks ClientOptions::interrupted at least.
inline constexpr std::chrono::milliseconds kInterruptPeriod{20};

struct AttachOptions {
  std::string job;
  std::uint32_t rank = 0;
  std::uint32_t world_size = 1;
  std::uint32_t local_rank = 0;
  /// The trainer's GPU, as it numbers its GPUs (libdbuf also sends the GPU's
  /// UUID, so dbufd finds it whatever CUDA_VISIBLE_DEVICES each process
  /// has); -1: none (host memory).
  std::int32_t device = -1;
  bool persistent = false;           ///< keep shards for the daemon's grace period if every rank dies
  std::uint32_t prefetch_depth = 1;  ///< unsharded slots = prefetch_depth + 1
  /// A job across nodes: the job's ranks on this node (they are contiguous,
  /// local_rank 0 first, as torchrun numbers them); 0: every rank is here.
  std::uint32_t local_world_size = 0;
  /// Across nodes: where the nodes' daemons meet, "file:DIR" (a directory
  /// every node shares, owned by the caller's uid) or "redis:HOST:PORT" (a
  /// host dbufd's [cluster] store_hosts lists), then optionally "#PREFIX":
  /// unique per run of the job, so that a restarted job never reads the keys
  /// of an earlier run. Every rank of the job passes the same store.
  std::string store = {};
  /// Host memory: a group's slot stays mapped after reshard(), until the
  /// group maps another slot or the slot's memory is replaced, so that an
  /// unshard that gets the same slot back (dbufd prefers it) maps nothing
  /// and takes no page faults. The price: a view kept past reshard() reads
  /// whatever the slot holds by then (another group's data), not zeros, and
  /// its writes reach the slot. For a caller that uses the unsharded views
  /// only while the group holds its slot (dbuf.torch). GPU memory: ignored.
  bool keep_slot_mappings = false;
};

struct TensorSpec {
  std::string name;
  std::vector<std::int64_t> shape;
  std::string granularity;  ///< empty: the group's rule
  std::int32_t tp_dim = -1;
};

struct GroupSpec {
  std::string name;
  std::vector<TensorSpec> tensors;
  std::string granularity = "element";  ///< default rule for 2D+ tensors
  /// Persistent shard (master weights) and sharded gradient: fp32, bf16 or
  /// fp16; or another dtype held as it is on both sides (fp64, reduced in
  /// fp64; fp8 and integers, gather-only: see dbuf/common/dtype.hpp).
  DType sharded_dtype = DType::kF32;
  /// Gathered parameters and their gradients: fp32, bf16, fp16, or fp8_e4m3
  /// (block-quantized parameters, bf16 gradients); the sharded dtype for the
  /// dtypes held as they are.
  DType unsharded_dtype = DType::kBF16;
  std::uint32_t align_bytes = 16;
};

/// A typed view of memory the daemon shares with this process.
struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<std::int64_t> shape;  ///< the whole tensor's shape
  std::byte* base = nullptr;        ///< first element this view covers
  std::int64_t begin = 0;           ///< first element (flattened) of the tensor in this view
  std::int64_t end = 0;             ///< one past the last
  std::int64_t local_units = 0;     ///< RaggedShard blocks in this view
  /// Keeps the address range of this view reserved while held (see the file
  /// comment: zero pages once unmapped, for host memory); null when empty.
  std::shared_ptr<const void> pin = {};

  [[nodiscard]] std::int64_t numel() const noexcept { return end - begin; }
  template <typename T>
  [[nodiscard]] T* data() const noexcept {
    return reinterpret_cast<T*>(base);
  }
};

/// A tensor's place in the group's global buffer of devices * shard_elems
/// elements, as the planner computed it.
using PlacedTensor = planner::PlannedTensor;

struct GroupPlan {
  std::uint32_t group_id = 0;
  std::uint32_t devices = 1;
  std::int64_t shard_elems = 0;
  std::vector<PlacedTensor> tensors;
};

enum class ReduceMode : std::uint8_t { kSum, kAvg };

/// A reduction's arithmetic, in fp32 whatever the dtypes (fp64 in fp64 groups):
///   result = post_scale * sum over ranks r = 0..world-1 of (pre_scale * x_r)
/// summed in rank order (so every rank and every run gets the same bits);
/// kAvg divides post_scale by the world size (post_scale / float(world); in
/// fp64 groups double(post_scale) / world).
struct ReduceOptions {
  ReduceMode mode = ReduceMode::kSum;
  float pre_scale = 1.0F;
  float post_scale = 1.0F;
  /// reduceScatter only: add the result into the sharded gradient (which
  /// must then be fp32, or fp64 in an fp64 group) instead of overwriting it.
  bool accumulate = false;
};

/// An op in flight; pass it to Client::wait exactly once (or to
/// Client::abandon). A client keeps track of twice the ring capacity of
/// submitted ops; a submit that would take the place of an op nobody waited
/// for yet fails with kWouldBlock.
struct OpHandle {
  std::uint64_t id = 0;
};

struct SubmitOptions {
  /// Ring full: wait for room (up to the timeout) or fail at once with kWouldBlock.
  bool wait_if_full = true;
  std::optional<std::chrono::milliseconds> timeout;  ///< empty: the client's default
  /// GPU memory (dbufd's cuda backend) only: order the op on this CUDA stream
  /// (a cudaStream_t; nullptr is the default stream) instead of on the host.
  /// dbufd starts the op once the work queued on the stream before the
  /// submit has run, and the work queued on it afterwards waits for the op:
  /// the submit returns at once and neither host blocks. wait() still
  /// reports the op's result. If the op fails, the stream's wait is released
  /// anyway (what the op should have written is undefined), wait() returns
  /// the error, and later stream-ordered submits of the session fail with
  /// kConflict (detach and attach again). reshard() waits for the process's
  /// GPU work before it unmaps; reshardOnStream() does not. Needs GPUs
  /// with 64-bit stream memory operations. Empty: host ordering (finish the
  /// GPU work that produces the op's input before submitting it).
  std::optional<void*> stream;
};

/// What the daemon reported about a completed op.
struct OpResult {
  std::uint64_t sequence = 0;        ///< index of the op among the job's collectives
  std::chrono::nanoseconds wait{0};  ///< from this rank's submission to the last rank's
  std::chrono::nanoseconds run{0};   ///< execution in the daemon
};

/// Group::acquireSlot when every slot of the rank's pool is held.
enum class WhenPoolFull : std::uint8_t {
  kFail,  ///< kConflict: the pool bounds unsharded memory (prefetching asks so)
  kGrow,  ///< a slot beyond the pool, within the tenant's quota, its memory given back at reshard
};

class Connection;  // internal, shared by a Client and its Groups

class Group {
 public:
  Group(Group&&) noexcept;
  Group& operator=(Group&&) noexcept;
  /// Gives a slot it still holds back to the pool (as reshard(), best
  /// effort), and unmaps its memory. The daemon keeps the shards.
  ~Group();

  [[nodiscard]] const std::string& name() const noexcept;
  [[nodiscard]] const GroupPlan& plan() const noexcept;
  [[nodiscard]] std::uint32_t rank() const noexcept;

  /// This rank's part of tensor `index` in the sharded (master) region; an
  /// empty view (numel 0) when the rank holds none of it, at the start of the
  /// rank's shard (null only once detached).
  [[nodiscard]] TensorView shardView(std::size_t index) const;
  /// The same part in the sharded gradient region.
  [[nodiscard]] TensorView shardGradView(std::size_t index) const;
  /// The whole tensor in the unsharded slot; requires unshard().
  [[nodiscard]] Result<TensorView> unshardedView(std::size_t index) const;
  [[nodiscard]] Result<TensorView> unshardedGradView(std::size_t index) const;

  /// Maps an unsharded slot (params + grads, devices * shard_elems each)
  /// without gathering anything; not a collective. When every slot of the
  /// pool is held by other groups: fails with kConflict (WhenPoolFull::kFail),
  /// or takes a slot beyond the pool, charged to the tenant's quota and given
  /// back with its memory at reshard (kGrow; kInfeasible over quota).
  /// The slot holds what its previous group left (zeros the first time):
  /// write or zero the gradients before reducing them.
  [[nodiscard]] Result<void> acquireSlot(std::optional<std::chrono::milliseconds> timeout,
                                         WhenPoolFull when_full);
  /// acquireSlot(timeout, WhenPoolFull::kFail) (a symbol of its own: libdbuf.so.0's).
  [[nodiscard]] Result<void> acquireSlot(std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  /// Collective: acquireSlot() if needed, then allGather() and wait for it.
  [[nodiscard]] Result<void> unshard(std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  /// Waits for this group's ops in flight (not other groups': a prefetched
  /// all-gather of the next unit keeps running), then unmaps the slot (or
  /// keeps it mapped: AttachOptions::keep_slot_mappings), which goes back to
  /// the rank's pool (pages kept for the next group). It does not wait for
  /// dbufd's answer: dbufd takes the slot back in order with this client's
  /// later requests, and a release it refused (only a client's bug can make
  /// it) closes the connection, the next call saying why. Not a
  /// collective. With GPU memory it first waits for all of this process's
  /// work on the GPU (cudaDeviceSynchronize): kernels still reading the slot
  /// would fault once it is unmapped (work in the device's primary context,
  /// the one the runtime API and PyTorch use; `timeout` does not bound this
  /// wait). Detaching, and destroying the Group, wait the same way.
  /// reshardOnStream() does not make the host wait.
  [[nodiscard]] Result<void> reshard(std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  /// reshard() ordered on a CUDA stream (a cudaStream_t of the session's
  /// GPU; GPU memory only): returns at once, and the group counts as
  /// resharded (unsharded() false, no unsharded views). The slot stays
  /// mapped and held until `stream` has run what is queued on it now; then a
  /// later call of this client gives it back without waiting for anything
  /// else: acquireSlot() / unshard() of any group finish the releases whose
  /// streams are there, and when every slot of the pool is held they wait
  /// for the pending ones' streams and ask again. So every use of the slot
  /// must be queued on `stream`, or ordered before its current point (not a
  /// stream being captured into a CUDA graph). This group's own
  /// acquireSlot() / unshard() before that takes the slot back as it is (the
  /// stream may still read it: order an all-gather into it on that stream);
  /// reshard() gives it back at once (waiting as reshard() does); detach
  /// drops pending releases (its unmap waits for the GPU); destroying the
  /// Group gives it back once the stream is there. When acquireSlot() waits
  /// for pending streams, its `timeout` does not bound that wait. If giving
  /// the slot back fails, the later call that tried says so, and the group
  /// holds its slot again (reshard() gives it back).
  [[nodiscard]] Result<void> reshardOnStream(void* stream);
  [[nodiscard]] bool unsharded() const noexcept;
  /// This rank is done with the group (its parameters moved to another group,
  /// its model dropped): gives its slot back (as reshard()), waits for its ops
  /// in flight, and tells dbufd, which frees the group's memory once every
  /// rank of the job on the node has unregistered it (the name may then be
  /// registered again). Afterwards the group's views are empty and its ops,
  /// slots and a second unregister fail with kInvalidArgument. Not a
  /// collective, but every rank must call it for the memory to go back.
  [[nodiscard]] Result<void> unregister(std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  [[nodiscard]] bool registered() const noexcept;

  // Collectives on this group (every rank of the job submits the same op).
  // The submit forms return at once; the plain forms submit and wait.

  /// Every rank's shard (sharded dtype) -> every rank's unsharded params
  /// (unsharded dtype: a cast, or fp8 e4m3 block quantization with one fp32
  /// scale per granularity block, see unshardedScales()). Needs the slot
  /// (acquireSlot() or unshard()).
  [[nodiscard]] Result<OpHandle> submitAllGather(const SubmitOptions& options = {});
  /// Every rank's unsharded gradient -> the reduction of this rank's part of
  /// it, written (or added) into this rank's sharded gradient.
  [[nodiscard]] Result<OpHandle> submitReduceScatter(const ReduceOptions& reduce = {},
                                                     const SubmitOptions& options = {});
  /// Every rank's unsharded gradient becomes the reduction of all of them.
  [[nodiscard]] Result<OpHandle> submitAllReduce(const ReduceOptions& reduce = {}, const SubmitOptions& options = {});
  /// `root`'s unsharded params -> every rank's unsharded params.
  [[nodiscard]] Result<OpHandle> submitBroadcast(std::uint32_t root, const SubmitOptions& options = {});

  [[nodiscard]] Result<void> allGather(std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  [[nodiscard]] Result<void> reduceScatter(const ReduceOptions& reduce = {},
                                           std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  [[nodiscard]] Result<void> allReduce(const ReduceOptions& reduce = {},
                                       std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  [[nodiscard]] Result<void> broadcast(std::uint32_t root,
                                       std::optional<std::chrono::milliseconds> timeout = std::nullopt);

  /// fp8 groups: the per-block scales gathered beside the data (one fp32 per
  /// granularity block of each tensor, numbered in buffer order); empty otherwise
  /// or when not unsharded. Block b of tensor i has scale
  /// scales[scaleIndex(i) + b].
  [[nodiscard]] std::span<float> unshardedScales() const noexcept;
  /// A pin of the slot's address range (as TensorView::pin), for views of
  /// unshardedScales(); null before the first acquireSlot().
  [[nodiscard]] std::shared_ptr<const void> slotPin() const;
  [[nodiscard]] std::int64_t scaleIndex(std::size_t tensor) const;

  /// Bytes of this rank's shard file (sharded + sharded gradient).
  [[nodiscard]] std::size_t shardBytes() const noexcept;

 private:
  friend class Client;
  struct State;
  explicit Group(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

class Client {
 public:
  [[nodiscard]] static Result<Client> connect(const ClientOptions& options);

  Client(Client&&) noexcept;
  Client& operator=(Client&&) noexcept;
  ~Client();  ///< closes the connection (the daemon reclaims the session)

  /// HELLO / WELCOME. Fails if (job, rank) is taken, the rank is outside the
  /// world size, or this user is not in the job's tenant. The client stays
  /// usable: an attach on a connection dbufd closed (an attach it refused, a
  /// detach, the handshake deadline) connects again first.
  [[nodiscard]] Result<void> attach(const AttachOptions& options,
                                    std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  /// True if the daemon kept this job's shards from an earlier life of this rank.
  [[nodiscard]] bool reattached() const noexcept;
  [[nodiscard]] std::uint64_t daemonInstanceId() const noexcept;
  /// Where this session's views point once attached: nullopt for host
  /// memory (dbufd's host backend), else the GPU as the trainer numbers it
  /// (AttachOptions::device).
  [[nodiscard]] std::optional<std::int32_t> memoryDevice() const noexcept;

  /// Collective: returns once every rank of the job registered the same group.
  [[nodiscard]] Result<Group> registerGroup(const GroupSpec& spec,
                                            std::optional<std::chrono::milliseconds> timeout = std::nullopt);

  /// Collective across the job: returns once every rank reached it.
  [[nodiscard]] Result<OpHandle> submitBarrier(const SubmitOptions& options = {});
  [[nodiscard]] Result<void> barrier(std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  /// Not a collective: the daemon answers at once (measures the ring round trip).
  [[nodiscard]] Result<OpHandle> submitNoop(const SubmitOptions& options = {});

  /// Waits for an op; its error (mismatch, timeout naming the missing ranks,
  /// a rank that died, a bad request) comes back here. kTimeout leaves the op
  /// in flight (wait again); any other result ends it.
  /// Error::ranks lists the ranks the daemon's error names; of more than 6, the first 6 (the message names all).
  [[nodiscard]] Result<OpResult> wait(OpHandle handle, std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  /// Gives up on an op nobody will wait for (a handle dropped, a blocking
  /// form whose wait timed out or was cancelled, which do this themselves):
  /// its result is dropped when it completes, so it does not keep its place
  /// among the results a client tracks. The op still runs; ops of its group
  /// still drain before a reshard. Unknown or finished handles are ignored.
  void abandon(OpHandle handle) noexcept;
  /// Ops submitted and not yet completed by the daemon.
  [[nodiscard]] std::uint32_t inFlight() const noexcept;

  /// Orderly goodbye; the connection is closed afterwards.
  [[nodiscard]] Result<void> detach(std::optional<std::chrono::milliseconds> timeout = std::nullopt);

 private:
  explicit Client(std::shared_ptr<Connection> connection);
  std::shared_ptr<Connection> connection_;
};

}  // namespace dbuf
