#pragma once
// Where a job's memory goes and how its collectives run, decided from its
// ranks' Hellos: pure functions of the request, the backend and the node's
// GPUs (tested without a GPU).

#include <cstdint>
#include <span>
#include <vector>

#include "dbuf/common/gpu_uuid.hpp"
#include "dbuf/common/result.hpp"
#include "dbuf/ipc/protocol.hpp"

namespace dbuf::daemon {

enum class Placement : std::uint8_t {
  kHost,        ///< host memory, the CPU kernels
  kSharedGpu,   ///< cuda, virtual ranks: every rank on one GPU, the CUDA kernels
  kGpuPerRank,  ///< cuda: each rank on its own GPU, the CUDA kernels and NCCL
};

/// What the daemon offers: GPU memory or not, how many ranks may share one
/// GPU (--virtual-ranks), the GPUs it sees.
struct GpuOffer {
  bool gpu_memory = false;  ///< the cuda backend
  std::uint32_t virtual_ranks = 0;
  std::vector<GpuUuid> gpus;  ///< [device]: each GPU's UUID (unknown where the runtime would not say)
  [[nodiscard]] int gpuCount() const noexcept { return static_cast<int>(gpus.size()); }
};

/// The GPU a Hello names, as dbufd numbers it: the one with the Hello's UUID
/// (the client may number its GPUs otherwise: CUDA_VISIBLE_DEVICES), or, from
/// a client that sent none, its index as is. kInvalidArgument naming the UUID
/// when dbufd has no such GPU.
[[nodiscard]] Result<std::int32_t> daemonDevice(const ipc::Hello& hello, std::span<const GpuUuid> uuids);

/// The job's ranks on the rank's node, as its Hello says (local_world_size;
/// 0: all of them).
[[nodiscard]] std::uint32_t ranksOnThisNode(const ipc::Hello& hello);

/// Where a new job (its first Hello) goes: jobs of at most virtual_ranks
/// ranks on this node share a GPU, larger ones need a GPU per rank;
/// kInvalidArgument saying so when the node has too few.
[[nodiscard]] Result<Placement> placeJob(const ipc::Hello& hello, const GpuOffer& offer);

/// Whether a rank may attach on the GPU its Hello names, given the GPU each
/// of the job's ranks on this node attached on before (`devices`: ranks
/// `first_rank`, `first_rank` + 1, ...; -1 for ranks not seen yet): one that
/// exists, the one it had (its memory is there), the others' for a shared
/// GPU, none of the others' with a GPU per rank. kInvalidArgument for a GPU
/// dbufd does not serve or a rank not on this node, kConflict for a clash
/// with the job's ranks.
[[nodiscard]] Result<void> checkRankDevice(Placement placement, std::span<const std::int32_t> devices,
                                           std::uint32_t first_rank, const ipc::Hello& hello, int gpus);

}  // namespace dbuf::daemon
