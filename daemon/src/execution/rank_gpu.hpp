#pragma once
// The nccl executors' GPUs (CUDA builds): each rank's stream, the event that
// marks an op's end on it, the fused kernels queued there and its fp32
// scratch for reductions, made with the job so that a GPU too full fails the
// attach, not a reduction halfway through training.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "dbuf/common/result.hpp"
#include "dbuf/kernels/cuda_runner.hpp"

namespace dbuf::daemon {

/// fp32 elements of each GPU's reduction scratch (128 MiB; half as many fp64).
constexpr std::int64_t kScratchElements = std::int64_t{1} << 25;

/// One rank's GPU: its stream, the event marking an op's end on it, and the
/// fused kernels queued on that stream. Owns the stream and event.
struct RankGpu {
  explicit RankGpu(int gpu) : device(gpu) {}
  RankGpu(const RankGpu&) = delete;
  RankGpu& operator=(const RankGpu&) = delete;
  ~RankGpu() {
    static_cast<void>(cudaSetDevice(device));
    runner.reset();  // its cached segment table is on this GPU
    if (event != nullptr) static_cast<void>(cudaEventDestroy(event));
    if (stream != nullptr) static_cast<void>(cudaStreamDestroy(stream));
    if (scratch != nullptr) static_cast<void>(cudaFree(scratch));
  }

  int device;
  cudaStream_t stream = nullptr;
  cudaEvent_t event = nullptr;
  std::unique_ptr<kernels::cuda::CudaRunner> runner;
  float* scratch = nullptr;  ///< kScratchElements floats for reductions
};

/// NCCL (loaded now: an attach says it is missing, not the first op), and a
/// RankGpu for each of `devices`.
[[nodiscard]] Result<std::vector<std::unique_ptr<RankGpu>>> rankGpus(const std::vector<int>& devices);

}  // namespace dbuf::daemon
