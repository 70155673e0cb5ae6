#include "rank_gpu.hpp"

#include <string>

#include "dbuf/common/cuda_status.hpp"
#include "dbuf/gpu/nccl.hpp"

namespace dbuf::daemon {
namespace {

Result<std::unique_ptr<RankGpu>> makeRankGpu(int device) {
  auto gpu = std::make_unique<RankGpu>(device);
  const std::string on = " on GPU " + std::to_string(device);
  if (auto r = cudaStatus(cudaSetDevice(device), "cudaSetDevice" + on); !r) return r.error();
  if (auto r = cudaStatus(cudaStreamCreateWithFlags(&gpu->stream, cudaStreamNonBlocking), "cudaStreamCreate" + on);
      !r) {
    return r.error();
  }
  if (auto r = cudaStatus(cudaEventCreateWithFlags(&gpu->event, cudaEventDisableTiming), "cudaEventCreate" + on); !r) {
    return r.error();
  }
  void* scratch = nullptr;
  // Made with the job, so that a GPU too full for it fails the attach, not a
  // reduction halfway through training.
  if (auto r =
          cudaStatus(cudaMalloc(&scratch, kScratchElements * sizeof(float)),
                     "cudaMalloc (reduction scratch, " + std::to_string(kScratchElements * 4 >> 20) + " MiB)" + on);
      !r) {
    return r.error();
  }
  gpu->scratch = static_cast<float*>(scratch);
  gpu->runner = std::make_unique<kernels::cuda::CudaRunner>(gpu->stream);
  return gpu;
}

}  // namespace

Result<std::vector<std::unique_ptr<RankGpu>>> rankGpus(const std::vector<int>& devices) {
  if (auto loaded = gpu::nccl(); !loaded) return loaded.error();  // say so at attach, not at the first op
  std::vector<std::unique_ptr<RankGpu>> gpus;
  for (const int device : devices) {
    auto gpu = makeRankGpu(device);
    if (!gpu) return std::move(gpu).error();
    gpus.push_back(std::move(*gpu));
  }
  return gpus;
}


}  // namespace dbuf::daemon
