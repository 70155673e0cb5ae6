#include "dbuf/gpu/nccl.hpp"

#include <dlfcn.h>

#include <string>
#include <utility>

namespace dbuf::gpu {
namespace {

constexpr const char* kLibrary = "libnccl.so.2";

template <typename Fn>
Result<void> resolve(void* library, const char* name, Fn& fn) {
  void* address = dlsym(library, name);
  if (address == nullptr) {
    return makeError(ErrorCode::kUnavailable, std::string(kLibrary) + " has no " + name + " (NCCL too old?)");
  }
  fn = reinterpret_cast<Fn>(address);  // NOLINT(cppcoreguidelines-pro-type-reinterpret-cast): dlsym
  return {};
}

Result<Nccl> load() {
  // Never unloaded: NCCL keeps threads and state for the process's lifetime.
  void* library = dlopen(kLibrary, RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = dlerror();
    return makeError(ErrorCode::kUnavailable,
                     std::string("NCCL is not installed here: ") + (why != nullptr ? why : kLibrary) +
                         " (install NCCL, or point LD_LIBRARY_PATH at a pip nvidia-nccl-cu13's nvidia/nccl/lib)");
  }
  Nccl n;
  Result<void> r;
  const auto get = [&](const char* name, auto& fn) {
    if (r) r = resolve(library, name, fn);
  };
  get("ncclGetVersion", n.getVersion);
  get("ncclGetErrorString", n.getErrorString);
  get("ncclGetLastError", n.getLastError);
  get("ncclCommInitAll", n.commInitAll);
  get("ncclGetUniqueId", n.getUniqueId);
  get("ncclCommInitRank", n.commInitRank);
  get("ncclCommDestroy", n.commDestroy);
  get("ncclCommAbort", n.commAbort);
  get("ncclCommGetAsyncError", n.commGetAsyncError);
  get("ncclGroupStart", n.groupStart);
  get("ncclGroupEnd", n.groupEnd);
  get("ncclAllGather", n.allGather);
  get("ncclReduceScatter", n.reduceScatter);
  get("ncclAllReduce", n.allReduce);
  get("ncclBroadcast", n.broadcast);
  if (!r) return r.error();
  if (n.getVersion(&n.version) != ncclSuccess) return makeError(ErrorCode::kUnavailable, "ncclGetVersion failed");
  return n;
}

}  // namespace

Result<const Nccl*> nccl() {
  static const Result<Nccl> loaded = load();  // thread-safe once
  if (!loaded) return loaded.error();
  return &*loaded;
}

Result<void> ncclStatus(ncclResult_t status, std::string_view what) {
  if (status == ncclSuccess) return {};
  std::string text = "ncclResult " + std::to_string(static_cast<int>(status));
  if (auto n = nccl(); n) {
    text = (*n)->getErrorString(status);
    // The error string is generic ("unhandled cuda error..."); NCCL's last
    // warning usually says which call failed and why. It is one buffer for
    // the process, so it may be older than this error: labelled as such, and
    // not added to argument errors, which say it all already.
    const char* last = (*n)->getLastError(nullptr);
    if (status != ncclInvalidArgument && status != ncclInvalidUsage && last != nullptr && *last != '\0') {
      text += std::string(" (NCCL's last warning: ") + last + ")";
    }
  }
  return makeError(ErrorCode::kDevice, std::string(what) + ": " + text);
}

Result<ncclDataType_t> ncclType(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kF16:
      return ncclFloat16;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kF8E4M3:
      return ncclFloat8e4m3;
    case DType::kF8E5M2:
      return ncclFloat8e5m2;
    case DType::kF64:
      return ncclFloat64;
    case DType::kI8:
      return ncclInt8;
    case DType::kU8:
      return ncclUint8;
    case DType::kI32:
      return ncclInt32;
    case DType::kI64:
      return ncclInt64;
  }
  return makeError(ErrorCode::kInvalidArgument, "no NCCL type for dtype " + std::string(toString(dtype)));
}

// ---- LocalComms ---------------------------------------------------------------------

Result<LocalComms> LocalComms::create(std::span<const int> devices) {
  auto n = nccl();
  if (!n) return n.error();
  if (devices.empty()) return makeError(ErrorCode::kInvalidArgument, "nccl: no devices");
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  if (auto r = ncclStatus((*n)->commInitAll(comms.data(), static_cast<int>(devices.size()), devices.data()),
                          "ncclCommInitAll over " + std::to_string(devices.size()) + " GPUs");
      !r) {
    return r.error();
  }
  const int world = static_cast<int>(devices.size());
  return LocalComms(std::move(comms), world, 0);
}

Result<LocalComms> LocalComms::join(std::span<const int> devices, const ncclUniqueId& id, int world, int first_rank) {
  auto n = nccl();
  if (!n) return n.error();
  if (devices.empty() || first_rank < 0 || first_rank + static_cast<int>(devices.size()) > world) {
    return makeError(ErrorCode::kInvalidArgument, "nccl: ranks " + std::to_string(first_rank) + " + " +
                                                      std::to_string(devices.size()) + " of " + std::to_string(world));
  }
  const std::string what = "ncclCommInitRank (ranks " + std::to_string(first_rank) + "-" +
                           std::to_string(first_rank + static_cast<int>(devices.size()) - 1) + " of " +
                           std::to_string(world) + ")";
  // Every GPU is checked before the group: inside it, the ranks already
  // queued would wait in ncclGroupEnd for ones that never come.
  for (const int device : devices) {
    if (const cudaError_t current = cudaSetDevice(device); current != cudaSuccess) {
      return makeError(ErrorCode::kDevice,
                       "cudaSetDevice(" + std::to_string(device) + ") for " + what + ": " + cudaGetErrorString(current));
    }
  }
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  if (auto r = ncclStatus((*n)->groupStart(), "ncclGroupStart"); !r) return r.error();
  Result<void> joined;
  for (std::size_t i = 0; i < devices.size() && joined; ++i) {
    static_cast<void>(cudaSetDevice(devices[i]));  // (checked above)
    joined = ncclStatus((*n)->commInitRank(&comms[i], world, id, first_rank + static_cast<int>(i)), what);
  }
  const Result<void> ended = ncclStatus((*n)->groupEnd(), what + " (ncclGroupEnd)");
  if (!joined || !ended) {
    for (ncclComm_t c : comms) {
      if (c != nullptr) static_cast<void>((*n)->commAbort(c));
    }
    return !joined ? joined.error() : ended.error();
  }
  return LocalComms(std::move(comms), world, first_rank);
}

LocalComms::LocalComms(LocalComms&& other) noexcept
    : comms_(std::exchange(other.comms_, {})),
      world_(std::exchange(other.world_, 0)),
      first_rank_(std::exchange(other.first_rank_, 0)),
      failure_(std::exchange(other.failure_, std::nullopt)) {}

LocalComms& LocalComms::operator=(LocalComms&& other) noexcept {
  if (this != &other) {
    release();
    comms_ = std::exchange(other.comms_, {});
    world_ = std::exchange(other.world_, 0);
    first_rank_ = std::exchange(other.first_rank_, 0);
    failure_ = std::exchange(other.failure_, std::nullopt);
  }
  return *this;
}

LocalComms::~LocalComms() {
  release();
}

void LocalComms::release() noexcept {
  if (comms_.empty()) return;
  if (failure_) {
    abortAll();
  } else if (auto n = nccl(); n) {
    for (ncclComm_t c : comms_) static_cast<void>((*n)->commDestroy(c));
  }
  comms_.clear();
}

void LocalComms::abortAll() noexcept {
  if (auto n = nccl(); n) {
    for (ncclComm_t& c : comms_) {
      if (c != nullptr) static_cast<void>((*n)->commAbort(c));
      c = nullptr;
    }
  }
}

Result<void> LocalComms::checkShapes(std::span<void* const> buffers, std::span<const cudaStream_t> streams) const {
  if (failure_) return *failure_;
  if (buffers.size() != comms_.size() || streams.size() != comms_.size()) {
    return makeError(ErrorCode::kInvalidArgument, "nccl: " + std::to_string(comms_.size()) + " ranks but " +
                                                      std::to_string(buffers.size()) + " buffers and " +
                                                      std::to_string(streams.size()) + " streams");
  }
  return {};
}

Result<void> LocalComms::grouped(std::span<void* const> buffers, std::span<const cudaStream_t> streams,
                                 const char* what, const RankCall& call) {
  if (auto r = checkShapes(buffers, streams); !r) return r;
  const Nccl& n = **nccl();
  if (auto r = ncclStatus(n.groupStart(), "ncclGroupStart"); !r) return r;
  ncclResult_t failed = ncclSuccess;
  Result<void> queued;
  for (std::size_t r = 0; r < comms_.size() && queued; ++r) {
    failed = call(n, r, comms_[r], streams[r]);
    queued = ncclStatus(failed, what);
  }
  // The group must be closed either way; the call's own error is the more
  // telling one (NCCL then launches nothing and reports a generic error).
  const ncclResult_t ended = n.groupEnd();
  if (queued) {
    failed = ended;
    queued = ncclStatus(ended, "ncclGroupEnd");
  }
  // Bad arguments leave the communicators as they were; anything else (a
  // CUDA or system error, ncclInProgress from a non-blocking communicator
  // dbufd does not expect) may have left a rank's part queued: abort.
  if (!queued && failed != ncclInvalidArgument && failed != ncclInvalidUsage) fail(queued.error());
  return queued;
}

void LocalComms::fail(Error why) noexcept {
  if (failure_) return;
  failure_ = std::move(why);
  abortAll();
}

namespace {

void* elementAt(void* buffer, std::size_t index, DType dtype) {
  return static_cast<unsigned char*>(buffer) + index * static_cast<std::size_t>(sizeBytes(dtype));
}

}  // namespace

Result<void> LocalComms::allGather(std::span<void* const> buffers, std::size_t count, DType dtype,
                                   std::span<const cudaStream_t> streams) {
  auto type = ncclType(dtype);
  if (!type) return type.error();
  // In place: the send buffer is this rank's part of the receive buffer.
  return grouped(buffers, streams, "ncclAllGather", [&](const Nccl& n, std::size_t r, ncclComm_t comm, cudaStream_t s) {
    return n.allGather(elementAt(buffers[r], ownPart(r, count), dtype), buffers[r], count, *type, comm, s);
  });
}

Result<void> LocalComms::reduceScatter(std::span<void* const> buffers, std::size_t count, DType dtype, ncclRedOp_t op,
                                       std::span<const cudaStream_t> streams) {
  auto type = ncclType(dtype);
  if (!type) return type.error();
  // In place: the receive buffer is this rank's part of the send buffer.
  return grouped(
      buffers, streams, "ncclReduceScatter", [&](const Nccl& n, std::size_t r, ncclComm_t comm, cudaStream_t s) {
        return n.reduceScatter(buffers[r], elementAt(buffers[r], ownPart(r, count), dtype), count, *type, op, comm, s);
      });
}

Result<void> LocalComms::allReduce(std::span<void* const> buffers, std::size_t count, DType dtype, ncclRedOp_t op,
                                   std::span<const cudaStream_t> streams) {
  auto type = ncclType(dtype);
  if (!type) return type.error();
  return grouped(buffers, streams, "ncclAllReduce", [&](const Nccl& n, std::size_t r, ncclComm_t comm, cudaStream_t s) {
    return n.allReduce(buffers[r], buffers[r], count, *type, op, comm, s);
  });
}

Result<void> LocalComms::broadcast(std::span<void* const> buffers, std::size_t count, DType dtype, int root,
                                   std::span<const cudaStream_t> streams) {
  auto type = ncclType(dtype);
  if (!type) return type.error();
  if (root < 0 || root >= size()) {
    return makeError(ErrorCode::kInvalidArgument,
                     "nccl: broadcast root " + std::to_string(root) + " of " + std::to_string(size()) + " ranks");
  }
  return grouped(buffers, streams, "ncclBroadcast", [&](const Nccl& n, std::size_t r, ncclComm_t comm, cudaStream_t s) {
    return n.broadcast(buffers[r], buffers[r], count, *type, root, comm, s);
  });
}

Result<void> LocalComms::allGatherParts(std::span<void* const> buffers, std::span<const Part> parts, DType dtype,
                                        std::span<const cudaStream_t> streams) {
  auto type = ncclType(dtype);
  if (!type) return type.error();
  if (parts.size() != static_cast<std::size_t>(world_)) {
    return makeError(ErrorCode::kInvalidArgument, "nccl: " + std::to_string(world_) + " ranks but " +
                                                      std::to_string(parts.size()) + " parts");
  }
  return grouped(buffers, streams, "ncclBroadcast (parts)",
                 [&](const Nccl& n, std::size_t r, ncclComm_t comm, cudaStream_t s) {
                   for (std::size_t root = 0; root < parts.size(); ++root) {
                     if (parts[root].count == 0) continue;  // the same on every rank: skipped by all
                     void* part = elementAt(buffers[r], parts[root].first, dtype);
                     const ncclResult_t issued =
                         n.broadcast(part, part, parts[root].count, *type, static_cast<int>(root), comm, s);
                     if (issued != ncclSuccess) return issued;
                   }
                   return ncclSuccess;
                 });
}

Result<void> LocalComms::poll() {
  if (failure_) return *failure_;
  const Nccl& n = **nccl();
  for (std::size_t r = 0; r < comms_.size(); ++r) {
    ncclResult_t async = ncclSuccess;
    Result<void> status = ncclStatus(n.commGetAsyncError(comms_[r], &async), "ncclCommGetAsyncError");
    if (status && async != ncclSuccess && async != ncclInProgress) {
      status = ncclStatus(async, "communicator of local rank " + std::to_string(r) + " failed");
    }
    if (!status) {
      fail(status.error());
      return status;
    }
  }
  return {};
}

}  // namespace dbuf::gpu
