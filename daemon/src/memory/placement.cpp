#include "placement.hpp"

#include <string>
#include <utility>

namespace dbuf::daemon {

std::uint32_t ranksOnThisNode(const ipc::Hello& hello) {
  return hello.local_world_size == 0 ? hello.world_size : hello.local_world_size;
}

Result<Placement> placeJob(const ipc::Hello& hello, const GpuOffer& offer) {
  const std::uint32_t local_ranks = ranksOnThisNode(hello);
  if (!offer.gpu_memory) return Placement::kHost;
  if (local_ranks <= offer.virtual_ranks) return Placement::kSharedGpu;
  if (std::cmp_greater(local_ranks, offer.gpuCount())) {
    return makeError(
        ErrorCode::kInvalidArgument,
        "job '" + hello.job_id + "' has " + std::to_string(local_ranks) + " ranks on this node, which has " +
            std::to_string(offer.gpuCount()) + " GPUs for one rank each; ranks share a GPU only as virtual ranks (" +
            (offer.virtual_ranks == 0 ? std::string("off") : "at most " + std::to_string(offer.virtual_ranks)) +
            " per GPU on this dbufd: --virtual-ranks)");
  }
  return Placement::kGpuPerRank;
}

Result<std::int32_t> daemonDevice(const ipc::Hello& hello, std::span<const GpuUuid> uuids) {
  if (!hello.gpu_uuid.known()) return hello.device;
  for (std::size_t d = 0; d < uuids.size(); ++d) {
    if (uuids[d] == hello.gpu_uuid) return static_cast<std::int32_t>(d);
  }
  std::string seen;
  for (const GpuUuid& uuid : uuids) seen += (seen.empty() ? "" : ", ") + uuid.text();
  return makeError(ErrorCode::kInvalidArgument,
                   "rank " + std::to_string(hello.rank) + " of job '" + hello.job_id + "' is on " +
                       hello.gpu_uuid.text() + ", which is not one of dbufd's GPUs (" +
                       (seen.empty() ? std::string("it sees none") : seen) +
                       "): run dbufd where it sees the trainers' GPUs (its CUDA_VISIBLE_DEVICES)");
}

Result<void> checkRankDevice(Placement placement, std::span<const std::int32_t> devices, std::uint32_t first_rank,
                             const ipc::Hello& hello, int gpus) {
  if (placement == Placement::kHost) return {};
  const std::string who = "rank " + std::to_string(hello.rank) + " of job '" + hello.job_id + "'";
  if (hello.rank < first_rank || hello.rank - first_rank >= devices.size()) {
    return makeError(ErrorCode::kInvalidArgument, who + " is not one of its ranks on this node (" +
                                                      std::to_string(first_rank) + " to " +
                                                      std::to_string(first_rank + devices.size() - 1) + ")");
  }
  const std::size_t local = hello.rank - first_rank;
  if (hello.device < 0 || hello.device >= gpus) {
    return makeError(ErrorCode::kInvalidArgument, who + " names GPU " + std::to_string(hello.device) +
                                                      " but dbufd serves GPU memory on GPUs 0-" +
                                                      std::to_string(gpus - 1) + " (numbered as dbufd sees them)");
  }
  const std::int32_t before = devices[local];
  if (before >= 0 && before != hello.device) {
    return makeError(ErrorCode::kConflict, who + " is on GPU " + std::to_string(hello.device) +
                                               " but attached on GPU " + std::to_string(before) +
                                               " before, where its memory is");
  }
  for (std::size_t r = 0; r < devices.size(); ++r) {
    const std::int32_t other = devices[r];
    if (r == local || other < 0) continue;
    if (placement == Placement::kSharedGpu && other != hello.device) {
      return makeError(ErrorCode::kConflict, who + " is on GPU " + std::to_string(hello.device) +
                                                 " but the job's ranks share GPU " + std::to_string(other) +
                                                 " (virtual ranks)");
    }
    if (placement == Placement::kGpuPerRank && other == hello.device) {
      return makeError(ErrorCode::kConflict,
                       who + " is on GPU " + std::to_string(hello.device) + ", which rank " +
                           std::to_string(first_rank + r) +
                           " already has: with one rank per GPU (NCCL) each rank needs its own GPU");
    }
  }
  return {};
}

}  // namespace dbuf::daemon
