#pragma once
/// \file
/// NCCL for the daemon's collectives among the node's local GPUs. NCCL is
/// loaded at run time (dlopen of libnccl.so.2, found through the loader's
/// path: the system's, or LD_LIBRARY_PATH pointing into a Python
/// nvidia-nccl-cu13 install), so dbufd runs its host backend where NCCL is
/// not installed and reports NCCL's absence only when a GPU job needs it.
///
/// LocalComms: one communicator per local GPU, created together in one
/// ncclCommInitAll at job start and reused for every op (or, for a job
/// across nodes, this node's ranks of one communicator over every node's
/// GPUs, joined in one group of ncclCommInitRank); each op is issued for all
/// local ranks inside one ncclGroupStart / ncclGroupEnd, in place
/// (all-gather: communicator rank c's part already at c * count of its
/// buffer; reduce-scatter: rank c's result at c * count of its buffer). poll() asks
/// every communicator for an asynchronous error; on one, every communicator
/// is aborted (ncclCommAbort returns even with work stuck on the GPU), so
/// the ranks get an error and never a hang.
///
/// Ownership: LocalComms owns its communicators (destroyed, or aborted after
/// a failure, with it). Thread safety: one thread at a time per LocalComms.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <functional>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "dbuf/common/dtype.hpp"
#include "dbuf/common/result.hpp"

namespace dbuf::gpu {

/// The NCCL entry points dbuf uses.
struct Nccl {
  decltype(&::ncclGetVersion) getVersion = nullptr;
  decltype(&::ncclGetErrorString) getErrorString = nullptr;
  decltype(&::ncclGetLastError) getLastError = nullptr;  ///< NCCL's own words on the last failure
  decltype(&::ncclCommInitAll) commInitAll = nullptr;
  decltype(&::ncclGetUniqueId) getUniqueId = nullptr;    ///< a communicator across processes (benchmarks)
  decltype(&::ncclCommInitRank) commInitRank = nullptr;
  decltype(&::ncclCommDestroy) commDestroy = nullptr;
  decltype(&::ncclCommAbort) commAbort = nullptr;
  decltype(&::ncclCommGetAsyncError) commGetAsyncError = nullptr;
  decltype(&::ncclGroupStart) groupStart = nullptr;
  decltype(&::ncclGroupEnd) groupEnd = nullptr;
  decltype(&::ncclAllGather) allGather = nullptr;
  decltype(&::ncclReduceScatter) reduceScatter = nullptr;
  decltype(&::ncclAllReduce) allReduce = nullptr;
  decltype(&::ncclBroadcast) broadcast = nullptr;
  int version = 0;  ///< NCCL_VERSION_CODE style, e.g. 22809
};

/// NCCL, loaded on first use; kUnavailable (saying where it looked) when
/// libnccl.so.2 cannot be loaded or lacks a symbol.
[[nodiscard]] Result<const Nccl*> nccl();

/// ncclSuccess -> {}; otherwise kDevice naming `what` and NCCL's error
/// string. The one place an ncclResult_t becomes an Error.
[[nodiscard]] Result<void> ncclStatus(ncclResult_t status, std::string_view what);

/// NCCL's type for a dbuf dtype; kInvalidArgument for those NCCL lacks.
[[nodiscard]] Result<ncclDataType_t> ncclType(DType dtype);

class LocalComms {
 public:
  /// One communicator per entry of `devices` (distinct GPUs: NCCL refuses
  /// two ranks on one GPU, which is what virtual ranks are for).
  [[nodiscard]] static Result<LocalComms> create(std::span<const int> devices);
  /// Ranks first_rank .. first_rank + devices.size() - 1 of a communicator
  /// of `world` ranks over several processes (a job across nodes), which
  /// the others join with the same `id`: one group of ncclCommInitRank,
  /// which returns once every rank has joined.
  [[nodiscard]] static Result<LocalComms> join(std::span<const int> devices, const ncclUniqueId& id, int world,
                                               int first_rank);

  LocalComms(LocalComms&& other) noexcept;
  LocalComms& operator=(LocalComms&& other) noexcept;
  LocalComms(const LocalComms&) = delete;
  LocalComms& operator=(const LocalComms&) = delete;
  ~LocalComms();

  /// Ranks of the communicator (every node's), and this node's first.
  [[nodiscard]] int size() const noexcept { return world_; }
  [[nodiscard]] int firstRank() const noexcept { return first_rank_; }

  /// In place, every rank at once: buffers[r] holds size() * count elements
  /// and rank r's own part is at r * count; afterwards every buffer holds all
  /// parts. Queued on streams[r]; returns once queued.
  [[nodiscard]] Result<void> allGather(std::span<void* const> buffers, std::size_t count, DType dtype,
                                       std::span<const cudaStream_t> streams);
  /// In place: buffers[r] holds size() * count elements; afterwards rank r's
  /// reduced part is at r * count of its buffer.
  [[nodiscard]] Result<void> reduceScatter(std::span<void* const> buffers, std::size_t count, DType dtype,
                                           ncclRedOp_t op, std::span<const cudaStream_t> streams);
  /// In place: every buffers[r] (count elements) becomes the reduction of all.
  [[nodiscard]] Result<void> allReduce(std::span<void* const> buffers, std::size_t count, DType dtype, ncclRedOp_t op,
                                       std::span<const cudaStream_t> streams);
  /// Every buffers[r] (count elements) becomes a copy of buffers[root].
  [[nodiscard]] Result<void> broadcast(std::span<void* const> buffers, std::size_t count, DType dtype, int root,
                                       std::span<const cudaStream_t> streams);
  /// An all-gather of parts of different sizes (NCCL's needs equal ones): rank
  /// r's part is elements [parts[r].first, + parts[r].count) of its buffer
  /// (a part for every rank of the communicator), and afterwards every
  /// buffer holds every part at the same place. One broadcast per rank with
  /// a part, all in one group.
  struct Part {
    std::size_t first = 0;
    std::size_t count = 0;
  };
  [[nodiscard]] Result<void> allGatherParts(std::span<void* const> buffers, std::span<const Part> parts, DType dtype,
                                            std::span<const cudaStream_t> streams);

  /// Asynchronous errors of any communicator; the first one aborts them all
  /// and is returned now and by every later call.
  [[nodiscard]] Result<void> poll();
  [[nodiscard]] bool failed() const noexcept { return failure_.has_value(); }
  /// Aborts every communicator for a failure NCCL cannot see (a GPU fault on
  /// one rank leaves the others' kernels waiting for it); `why` is returned
  /// by every later call. A failure already recorded is kept.
  void fail(Error why) noexcept;

 private:
  LocalComms(std::vector<ncclComm_t> comms, int world, int first_rank) noexcept
      : comms_(std::move(comms)), world_(world), first_rank_(first_rank) {}
  /// Where local rank r's part of `count` elements starts in its buffer
  /// (at its communicator rank).
  [[nodiscard]] std::size_t ownPart(std::size_t r, std::size_t count) const noexcept {
    return (static_cast<std::size_t>(first_rank_) + r) * count;
  }
  [[nodiscard]] Result<void> checkShapes(std::span<void* const> buffers, std::span<const cudaStream_t> streams) const;
  /// The NCCL calls of one local rank (its communicator and stream).
  using RankCall = std::function<ncclResult_t(const Nccl&, std::size_t rank, ncclComm_t, cudaStream_t)>;
  /// `call` for every local rank, all inside one ncclGroupStart / ncclGroupEnd.
  [[nodiscard]] Result<void> grouped(std::span<void* const> buffers, std::span<const cudaStream_t> streams,
                                     const char* what, const RankCall& call);
  void abortAll() noexcept;
  void release() noexcept;

  std::vector<ncclComm_t> comms_;  // this node's ranks
  int world_ = 0;
  int first_rank_ = 0;
  std::optional<Error> failure_;
};

}  // namespace dbuf::gpu
