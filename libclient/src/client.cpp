#include "dbuf/client.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <random>

#include "connection.hpp"
#include "dbuf/common/shared_memory.hpp"
#include "stream_point.hpp"
#if defined(DBUF_WITH_CUDA)
#include "dbuf/common/cuda_device.hpp"
#endif
#include "dbuf/ipc/protocol.hpp"
#include "dbuf/ipc/ring.hpp"

namespace dbuf {
namespace {

std::string resolveSocketPath(const ClientOptions& options) {
  if (!options.socket_path.empty()) return options.socket_path;
  const char* from_env = std::getenv("DBUF_SOCKET");  // NOLINT(concurrency-mt-unsafe): read per connect
  return from_env != nullptr && *from_env != '\0' ? std::string(from_env) : std::string(kDefaultSocketPath);
}

ipc::RegisterGroup toWire(const GroupSpec& spec) {
  ipc::RegisterGroup wire;
  wire.name = spec.name;
  wire.sharded_dtype = std::string(toString(spec.sharded_dtype));
  wire.unsharded_dtype = std::string(toString(spec.unsharded_dtype));
  wire.granularity = spec.granularity;
  wire.align_bytes = spec.align_bytes;
  for (const TensorSpec& tensor : spec.tensors) {
    wire.tensors.push_back({tensor.name, tensor.shape, tensor.granularity, tensor.tp_dim});
  }
  return wire;
}

/// Checks that the regions the daemon described fit in the file it sent:
/// never trust sizes from across a process boundary either.
/// The regions dbufd described lie inside the memory it announced (the
/// memory's own size is checked when it is mapped).
Result<void> checkRegions(std::uint64_t file_bytes, std::initializer_list<ipc::Region> regions) {
  for (const ipc::Region& region : regions) {
    if (region.offset > file_bytes || region.bytes > file_bytes - region.offset) {
      return makeError(ErrorCode::kInternal, "dbufd described a region outside its file");
    }
  }
  return {};
}

/// Where the last of `regions` ends (checked against the file first).
std::uint64_t regionsEnd(std::initializer_list<ipc::Region> regions) {
  std::uint64_t end = 0;
  for (const ipc::Region& region : regions) end = std::max(end, region.offset + region.bytes);
  return end;
}

std::uint64_t pageAligned(std::uint64_t bytes) {
  const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

/// The UUID of the trainer's GPU `device`, so that dbufd finds it whatever
/// CUDA_VISIBLE_DEVICES each process has; unknown without CUDA or a GPU
/// (dbufd then takes the index as it is).
GpuUuid uuidOf(std::int32_t device) {
#if defined(DBUF_WITH_CUDA)
  if (device >= 0) {
    auto uuid = gpuUuidOf(device);
    if (uuid) return *uuid;
  }
#else
  static_cast<void>(device);
#endif
  return {};
}

}  // namespace

// ----------------------------------------------------------------- Group

using SlotIdentity = Connection::SlotIdentity;

struct Group::State final : Connection::DeferredRelease, Connection::KeptSlot {
  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State() override {
    if (!connection) return;
    std::erase(connection->on_detach, &unmap);
    std::erase(connection->deferred_releases, this);
    std::erase(connection->kept_slots, this);
    // The slot goes back to the pool (best effort: once a stream-ordered
    // reshard's stream is there, or now), not held by a group that is gone.
    if (!connection->attached) return;
    if (release_point) {
      static_cast<void>(finishRelease(true));
    } else if (slot.valid()) {
      static_cast<void>(release(std::nullopt, DbufferMapping::GpuWork::kMayBePending));
    }
  }

  std::shared_ptr<Connection> connection;
  std::function<void()> unmap = [this] {
    release_point.reset();
    shard.reset();
    slot.reset();
    kept.reset();
  };
  std::string name;
  GroupPlan plan;
  DType sharded_dtype = DType::kF32;
  DType unsharded_dtype = DType::kBF16;
  std::uint32_t rank = 0;
  // Each range is declared before what is mapped in it, so that it outlives
  // the mapping; views pin them (dbuffer_mapping.hpp).
  ReservedRange shard_range;
  DbufferMapping shard;  // whole shard file
  ipc::Region sharded;
  ipc::Region sharded_grad;
  ReservedRange slot_range;                  // the slot's address, the same across reshard / unshard
  DbufferMapping slot;                       // while unsharded, and until a deferred release is done
  SlotIdentity slot_identity;                // of the slot mapped in `slot`
  DbufferMapping kept;                       // keep_slot_mappings: the slot given back, still mapped
  SlotIdentity kept_identity;                // of the slot in `kept`
  std::optional<StreamPoint> release_point;  // reshardOnStream: the slot goes back once the stream is there
  ipc::Region slot_params;
  ipc::Region slot_grads;
  ipc::Region slot_scales;
  planner::BlockNumbering blocks;  // fp8 scale indices

  bool unregistered = false;  // Group::unregister() done: nothing of it is mapped or may be asked for

  /// The slot is this group's to use: mapped, and no release pending.
  [[nodiscard]] bool holdsSlot() const noexcept { return slot.valid() && !release_point; }

  [[nodiscard]] Result<void> checkRegistered() const {
    if (!unregistered) return {};
    return makeError(ErrorCode::kInvalidArgument, "group '" + name + "' was unregistered");
  }

  /// Asks dbufd for a slot and maps it.
  Result<void> acquire(std::optional<std::chrono::milliseconds> timeout, bool grow) {
    auto reply = connection->call(ipc::AcquireSlot{plan.group_id, grow}, timeout);
    if (!reply) return std::move(reply).error();
    const auto* granted = std::get_if<ipc::SlotGranted>(&reply->message);
    if (granted == nullptr || reply->fds.size() != 1) {
      return makeError(ErrorCode::kInternal, "dbufd answered AcquireSlot with something else");
    }
    const int fd = reply->fds.front().get();
    if (auto ok = checkRegions(granted->slot_file_bytes, {granted->params, granted->grads, granted->scales}); !ok) {
      return ok;
    }
    auto file = fileIdentity(fd);
    if (!file) return std::move(file).error();
    const SlotIdentity identity{granted->slot_index, *file};
    for (KeptSlot* group : connection->kept_slots) group->forgetIfReplaced(identity);
    slot_params = granted->params;
    slot_grads = granted->grads;
    slot_scales = granted->scales;
    slot_identity = identity;
    if (kept.valid() && kept_identity == identity) {
      slot = std::move(kept);  // the slot this group gave back, still mapped: nothing to map, no page to fault in
      return {};
    }
    kept.reset();
    // A slot may be larger than this group needs (it served a larger group
    // before): only the group's part is mapped, so its range, and the
    // address of its views, never change.
    const std::uint64_t used =
        std::min(granted->slot_file_bytes, pageAligned(regionsEnd({granted->params, granted->grads, granted->scales})));
    auto mapping = DbufferMapping::map(connection->memory, fd, granted->slot_file_bytes, used, slot_range);
    if (!mapping) return std::move(mapping).error();
    slot = std::move(*mapping);  // the fd closes here; the mapping keeps the memory
    return {};
  }

  /// Whether a slot given back stays mapped (see AttachOptions::keep_slot_mappings):
  /// host memory, a pool slot (a slot beyond the pool goes back to the system
  /// at its release, so no mapping may keep its pages).
  [[nodiscard]] bool keepsReleasedSlot() const noexcept {
    return connection->keep_slot_mappings && connection->memory.kind == ipc::MemoryKind::kHost &&
           slot_identity.index < connection->pool_slots;
  }

  void forgetIfReplaced(const SlotIdentity& granted) noexcept override {
    if (kept.valid() && kept_identity.index == granted.index && kept_identity.file != granted.file) kept.reset();
  }

  /// Waits for this group's ops in flight, unmaps the slot (or keeps it mapped) and gives it back.
  Result<void> release(std::optional<std::chrono::milliseconds> timeout, DbufferMapping::GpuWork work) {
    // This group's ops in flight may still read or write the slot (the daemon
    // refuses the release while they are queued); other groups' ops, a
    // prefetched all-gather for instance, go on.
    if (auto drained = connection->drain(plan.group_id, timeout); !drained) return drained;
    if (keepsReleasedSlot()) {
      kept = std::move(slot);
      kept_identity = slot_identity;
    } else {
      slot.reset(work);  // unmap first: the slot goes back to the pool
    }
    // Not waited for: dbufd refuses a release only where this group holds no
    // slot or has ops in flight, neither of which the drain above leaves, and
    // it handles a session's requests in order, so the next AcquireSlot finds
    // the slot back in the pool. A round trip per gather saved (docs/python.md).
    return connection->post(ipc::ReleaseSlot{plan.group_id});
  }

  Result<bool> finishRelease(bool wait) override {
    if (!release_point) return true;
    Result<bool> reached = true;
    if (wait) {
      if (auto waited = release_point->wait(); !waited) reached = std::move(waited).error();
    } else {
      reached = release_point->reached();
    }
    if (reached && !*reached) return false;
    release_point.reset();
    // Past the point, everything queued on the stream before it has run: no
    // wait for the rest of the process's GPU work. If the point cannot be
    // read, the release waits for all of it, as reshard() does.
    const auto work = reached ? DbufferMapping::GpuWork::kDone : DbufferMapping::GpuWork::kMayBePending;
    if (auto released = release(std::nullopt, work); !released) {
      // Still mapped and held where the drain failed: the group is unsharded
      // again, and reshard() gives it back.
      return forGroup(std::move(released).error());
    }
    if (!reached) return forGroup(std::move(reached).error());
    return true;
  }

  /// Keeps the slot after all: the pending release is dropped.
  void cancelRelease() {
    release_point.reset();
    std::erase(connection->deferred_releases, this);
  }

  [[nodiscard]] Error forGroup(Error error) const {
    error.message = "group '" + name + "': giving its slot back after reshardOnStream: " + error.message;
    return error;
  }

  Result<OpHandle> submit(ipc::OpCode op, const SubmitOptions& options, const ReduceOptions& reduce = {},
                          std::uint32_t root = 0) const {
    ipc::Submission entry;
    entry.group_id = plan.group_id;
    entry.op = static_cast<std::uint8_t>(op);
    entry.reduce =
        static_cast<std::uint8_t>(reduce.mode == ReduceMode::kAvg ? ipc::ReduceMode::kAvg : ipc::ReduceMode::kSum);
    entry.flags = reduce.accumulate ? ipc::kFlagAccumulate : 0;
    entry.root = root;
    entry.pre_scale = reduce.pre_scale;
    entry.post_scale = reduce.post_scale;
    return connection->submit(entry, options);
  }

  /// This rank's part of tensor `index` within a region of the shard file.
  TensorView shardPart(std::size_t index, const ipc::Region& region) const {
    const PlacedTensor& tensor = plan.tensors.at(index);
    TensorView view{tensor.name, sharded_dtype, tensor.shape, nullptr, 0, 0, 0};
    if (!shard.valid()) return view;  // detached
    const auto slice = planner::sliceOnRank(tensor, plan.shard_elems, rank);
    if (!slice) {
      // None of the tensor here: an empty view at the start of the rank's part of the region, so that it has
      // an address as every other local shard does (a null one reads as "no storage" to torch's code).
      view.base = shard.data() + region.offset;
      view.pin = shard_range.pin();
      return view;
    }
    // The slice starts at global element offset + begin; this rank's shard at rank * S.
    const std::int64_t in_shard = tensor.offset + slice->begin - static_cast<std::int64_t>(rank) * plan.shard_elems;
    const auto element = static_cast<std::size_t>(sizeBytes(sharded_dtype));
    view.base = shard.data() + region.offset + static_cast<std::size_t>(in_shard) * element;
    view.begin = slice->begin;
    view.end = slice->end;
    view.local_units = slice->local_units;
    view.pin = shard_range.pin();
    return view;
  }

  Result<TensorView> slotPart(std::size_t index, const ipc::Region& region, DType dtype) const {
    if (!holdsSlot()) return makeError(ErrorCode::kInvalidArgument, "group '" + name + "' is not unsharded");
    const PlacedTensor& tensor = plan.tensors.at(index);
    const auto element = static_cast<std::size_t>(sizeBytes(dtype));
    TensorView view{tensor.name, dtype, tensor.shape, nullptr, 0, tensor.numel, 0};
    view.base = slot.data() + region.offset + static_cast<std::size_t>(tensor.offset) * element;
    view.local_units = (tensor.numel + tensor.granularity - 1) / tensor.granularity;
    view.pin = slot_range.pin();
    return view;
  }
};

Group::Group(std::unique_ptr<State> state) : state_(std::move(state)) {}
Group::Group(Group&&) noexcept = default;
Group& Group::operator=(Group&&) noexcept = default;
Group::~Group() = default;

const std::string& Group::name() const noexcept {
  return state_->name;
}
const GroupPlan& Group::plan() const noexcept {
  return state_->plan;
}
std::uint32_t Group::rank() const noexcept {
  return state_->rank;
}
std::size_t Group::shardBytes() const noexcept {
  return state_->shard.size();
}
bool Group::unsharded() const noexcept {
  return state_->holdsSlot();
}

TensorView Group::shardView(std::size_t index) const {
  return state_->shardPart(index, state_->sharded);
}
TensorView Group::shardGradView(std::size_t index) const {
  return state_->shardPart(index, state_->sharded_grad);
}
Result<TensorView> Group::unshardedView(std::size_t index) const {
  return state_->slotPart(index, state_->slot_params, state_->unsharded_dtype);
}
Result<TensorView> Group::unshardedGradView(std::size_t index) const {
  return state_->slotPart(index, state_->slot_grads, gradientDType(state_->sharded_dtype, state_->unsharded_dtype));
}

std::span<float> Group::unshardedScales() const noexcept {
  if (!state_->holdsSlot() || state_->slot_scales.bytes == 0) return {};
  return {reinterpret_cast<float*>(state_->slot.data() + state_->slot_scales.offset),
          state_->slot_scales.bytes / sizeof(float)};
}

std::shared_ptr<const void> Group::slotPin() const {
  return state_->slot_range.pin();
}

std::int64_t Group::scaleIndex(std::size_t tensor) const {
  return state_->blocks.first.at(tensor);
}

Result<OpHandle> Group::submitAllGather(const SubmitOptions& options) {
  if (auto registered = state_->checkRegistered(); !registered) return std::move(registered).error();
  if (!state_->holdsSlot()) {
    return makeError(ErrorCode::kInvalidArgument, "group '" + state_->name + "' holds no slot: acquireSlot() first");
  }
  return state_->submit(ipc::OpCode::kAllGather, options);
}
Result<OpHandle> Group::submitReduceScatter(const ReduceOptions& reduce, const SubmitOptions& options) {
  if (auto registered = state_->checkRegistered(); !registered) return std::move(registered).error();
  return state_->submit(ipc::OpCode::kReduceScatter, options, reduce);
}
Result<OpHandle> Group::submitAllReduce(const ReduceOptions& reduce, const SubmitOptions& options) {
  if (auto registered = state_->checkRegistered(); !registered) return std::move(registered).error();
  return state_->submit(ipc::OpCode::kAllReduce, options, reduce);
}
Result<OpHandle> Group::submitBroadcast(std::uint32_t root, const SubmitOptions& options) {
  if (auto registered = state_->checkRegistered(); !registered) return std::move(registered).error();
  return state_->submit(ipc::OpCode::kBroadcast, options, {}, root);
}

Result<void> Group::allGather(std::optional<std::chrono::milliseconds> timeout) {
  return state_->connection->complete(submitAllGather({true, timeout, {}}), timeout);
}
Result<void> Group::reduceScatter(const ReduceOptions& reduce, std::optional<std::chrono::milliseconds> timeout) {
  return state_->connection->complete(submitReduceScatter(reduce, {true, timeout, {}}), timeout);
}
Result<void> Group::allReduce(const ReduceOptions& reduce, std::optional<std::chrono::milliseconds> timeout) {
  return state_->connection->complete(submitAllReduce(reduce, {true, timeout, {}}), timeout);
}
Result<void> Group::broadcast(std::uint32_t root, std::optional<std::chrono::milliseconds> timeout) {
  return state_->connection->complete(submitBroadcast(root, {true, timeout, {}}), timeout);
}

Result<void> Group::unshard(std::optional<std::chrono::milliseconds> timeout) {
  if (auto slot = acquireSlot(timeout); !slot) return slot;
  return allGather(timeout);
}

Result<void> Group::acquireSlot(std::optional<std::chrono::milliseconds> timeout, WhenPoolFull when_full) {
  if (auto registered = state_->checkRegistered(); !registered) return registered;
  if (state_->release_point) {
    state_->cancelRelease();  // still mapped, still this group's: taken back as it is
    return {};
  }
  if (state_->slot.valid()) return {};
  Connection& connection = *state_->connection;
  if (auto finished = connection.finishReleases(false); !finished) return finished;
  auto acquired = state_->acquire(timeout, false);
  if (!acquired && acquired.error().code == ErrorCode::kConflict && !connection.deferred_releases.empty()) {
    // Every slot is held, some by releases waiting for their streams: the
    // host waits for those streams, and asks again.
    if (auto finished = connection.finishReleases(true); !finished) return finished;
    acquired = state_->acquire(timeout, false);
  }
  if (!acquired && acquired.error().code == ErrorCode::kConflict && when_full == WhenPoolFull::kGrow) {
    acquired = state_->acquire(timeout, true);  // only once the pool is really full: its slots keep their pages
  }
  return acquired;
}

Result<void> Group::acquireSlot(std::optional<std::chrono::milliseconds> timeout) {
  return acquireSlot(timeout, WhenPoolFull::kFail);
}

Result<void> Group::reshard(std::optional<std::chrono::milliseconds> timeout) {
  if (state_->release_point) state_->cancelRelease();  // given back now instead
  if (!state_->slot.valid()) return {};
  return state_->release(timeout, DbufferMapping::GpuWork::kMayBePending);
}

Result<void> Group::unregister(std::optional<std::chrono::milliseconds> timeout) {
  if (auto registered = state_->checkRegistered(); !registered) return registered;
  if (auto resharded = reshard(timeout); !resharded) return resharded;
  Connection& connection = *state_->connection;
  // Ops that need no slot (a reduce-scatter into the shards) may still be in flight.
  if (auto drained = connection.drain(state_->plan.group_id, timeout); !drained) return drained;
  auto reply = connection.call(ipc::UnregisterGroup{state_->plan.group_id}, timeout);
  if (!reply) return std::move(reply).error();
  if (!std::holds_alternative<ipc::GroupUnregistered>(reply->message)) {
    return makeError(ErrorCode::kInternal, "dbufd answered UnregisterGroup with something else");
  }
  state_->unregistered = true;
  state_->unmap();
  return {};
}

bool Group::registered() const noexcept {
  return !state_->unregistered;
}

Result<void> Group::reshardOnStream(void* stream) {
  if (!state_->holdsSlot()) return {};
  Connection& connection = *state_->connection;
  if (connection.memory.kind != ipc::MemoryKind::kCuda) {
    return makeError(ErrorCode::kInvalidArgument,
                     "a reshard ordered on a CUDA stream needs GPU memory, and dbufd put this session's in host "
                     "memory (its host backend): call reshard()");
  }
  auto point = StreamPoint::record(stream, connection.memory.device);
  if (!point) return std::move(point).error();
  state_->release_point = std::move(*point);
  connection.deferred_releases.push_back(state_.get());
  return {};
}

// ----------------------------------------------------------------- Client

Client::Client(std::shared_ptr<Connection> connection) : connection_(std::move(connection)) {}
Client::Client(Client&&) noexcept = default;
Client& Client::operator=(Client&&) noexcept = default;
Client::~Client() {
  if (connection_) connection_->close();
}

namespace {

Result<std::shared_ptr<Connection>> openConnection(const ClientOptions& options) {
  const std::string path = resolveSocketPath(options);
  auto socket = ipc::connectUnix(path, ipc::Clock::now() + options.timeout);
  if (!socket) {
    return makeError(ErrorCode::kUnavailable, "cannot reach dbufd at " + path + ": " + socket.error().message);
  }
  auto connection = std::make_shared<Connection>(std::move(*socket), options.timeout, options.interrupted);
  connection->origin = options;
  return connection;
}

}  // namespace

Result<Client> Client::connect(const ClientOptions& options) {
  auto connection = openConnection(options);
  if (!connection) return std::move(connection).error();
  return Client(std::move(*connection));
}

Result<void> Client::attach(const AttachOptions& options, std::optional<std::chrono::milliseconds> timeout) {
  if (connection_->attached) return makeError(ErrorCode::kInvalidArgument, "already attached");
  ipc::Hello hello;
  hello.job_id = options.job;
  hello.rank = options.rank;
  hello.world_size = options.world_size;
  hello.local_rank = options.local_rank;
  hello.local_world_size = options.local_world_size;
  hello.store = options.store;
  hello.device = options.device;
  hello.gpu_uuid = uuidOf(options.device);
  hello.persistent = options.persistent;
  hello.prefetch_depth = options.prefetch_depth;
  hello.nonce = std::random_device{}();
  if (!connection_->open()) {  // dbufd closed it: an attach it refused, a detach, the handshake deadline
    connection_->close();
    auto fresh = openConnection(connection_->origin);
    if (!fresh) return std::move(fresh).error();
    connection_ = std::move(*fresh);
  }
  auto reply = connection_->call(hello, timeout);
  if (!reply) {
    connection_->close();  // dbufd closes a connection whose Hello it refused: the next attach opens another
    return std::move(reply).error();
  }
  const auto* welcome = std::get_if<ipc::Welcome>(&reply->message);
  if (welcome == nullptr || welcome->nonce != hello.nonce) {
    connection_->close();
    return makeError(ErrorCode::kInternal, "dbufd answered Hello with something else");
  }
  if (auto rings = connection_->openRings(*welcome, reply->fds); !rings) {
    connection_->close();
    return rings;
  }
  connection_->attached = true;
  connection_->rank = options.rank;
  connection_->pool_slots = options.prefetch_depth + 1;
  connection_->keep_slot_mappings = options.keep_slot_mappings;
  connection_->reattached = welcome->reattached;
  connection_->instance_id = welcome->daemon_instance_id;
  // Mapped on the trainer's GPU as it numbers it (dbufd's index may differ).
  connection_->memory = {welcome->memory_kind, options.device};
  return {};
}

bool Client::reattached() const noexcept {
  return connection_->reattached;
}
std::uint64_t Client::daemonInstanceId() const noexcept {
  return connection_->instance_id;
}
std::optional<std::int32_t> Client::memoryDevice() const noexcept {
  if (!connection_->attached || connection_->memory.kind != ipc::MemoryKind::kCuda) return std::nullopt;
  return connection_->memory.device;
}

Result<Group> Client::registerGroup(const GroupSpec& spec, std::optional<std::chrono::milliseconds> timeout) {
  if (!connection_->attached) return makeError(ErrorCode::kInvalidArgument, "attach() first");
  auto reply = connection_->call(toWire(spec), timeout);
  if (!reply) return std::move(reply).error();
  const auto* ready = std::get_if<ipc::GroupReady>(&reply->message);
  if (ready == nullptr || reply->fds.size() != 1) {
    return makeError(ErrorCode::kInternal, "dbufd answered RegisterGroup with something else");
  }
  const int fd = reply->fds.front().get();
  if (auto ok = checkRegions(ready->shard_file_bytes, {ready->sharded, ready->sharded_grad}); !ok) return ok.error();
  auto state = std::make_unique<Group::State>();
  auto mapping = DbufferMapping::map(connection_->memory, fd, ready->shard_file_bytes, ready->shard_file_bytes,
                                     state->shard_range);
  if (!mapping) return std::move(mapping).error();
  state->connection = connection_;
  state->name = spec.name;
  state->plan.group_id = ready->group_id;
  state->plan.devices = ready->devices;
  state->plan.shard_elems = ready->shard_elems;
  for (const ipc::PlacedTensorWire& tensor : ready->tensors) {
    state->plan.tensors.push_back({tensor.name, tensor.shape, tensor.offset, tensor.numel, tensor.granularity});
  }
  state->sharded_dtype = spec.sharded_dtype;
  state->unsharded_dtype = spec.unsharded_dtype;
  state->rank = connection_->rank;
  state->shard = std::move(*mapping);
  state->sharded = ready->sharded;
  state->sharded_grad = ready->sharded_grad;
  state->blocks = planner::numberBlocks(state->plan.tensors);
  connection_->on_detach.push_back(&state->unmap);
  connection_->kept_slots.push_back(state.get());
  return Group(std::move(state));
}

Result<OpHandle> Client::submitBarrier(const SubmitOptions& options) {
  ipc::Submission entry;
  entry.op = static_cast<std::uint8_t>(ipc::OpCode::kBarrier);
  return connection_->submit(entry, options);
}

Result<void> Client::barrier(std::optional<std::chrono::milliseconds> timeout) {
  return connection_->complete(submitBarrier({true, timeout, {}}), timeout);
}

Result<OpHandle> Client::submitNoop(const SubmitOptions& options) {
  ipc::Submission entry;
  entry.op = static_cast<std::uint8_t>(ipc::OpCode::kNoop);
  return connection_->submit(entry, options);
}

Result<OpResult> Client::wait(OpHandle handle, std::optional<std::chrono::milliseconds> timeout) {
  return connection_->wait(handle, timeout);
}

void Client::abandon(OpHandle handle) noexcept {
  connection_->abandon(handle);
}

std::uint32_t Client::inFlight() const noexcept {
  return connection_->inFlight();
}

Result<void> Client::detach(std::optional<std::chrono::milliseconds> timeout) {
  auto reply = connection_->call(ipc::Detach{}, timeout);
  connection_->close();
  connection_->attached = false;
  // Pending stream-ordered releases end with the session: each group's
  // unmap waits for the process's GPU work instead.
  connection_->deferred_releases.clear();
  for (std::function<void()>* unmap : connection_->on_detach) (*unmap)();
  if (!reply) return std::move(reply).error();
  return {};
}

}  // namespace dbuf
