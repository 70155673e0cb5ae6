#include "backend.hpp"

#include <string>

#if defined(DBUF_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "dbuf/common/cuda_device.hpp"
#include "dbuf/gpu/device_memory.hpp"
#include "dbuf/gpu/nccl.hpp"
#include "dbuf/kernels/cuda_ops.hpp"
#endif

namespace dbuf::daemon {
namespace {

/// Why the cuda backend cannot run here, or empty. Creates every device's
/// context on the way (a first Hello would otherwise stall the event loop
/// for it).
std::string cudaUnavailable() {
#if defined(DBUF_WITH_CUDA)
  const kernels::cuda::DeviceCheck device = kernels::cuda::checkDevice();
  if (!device.usable) return "no usable CUDA device: " + device.reason;
  int count = 0;
  static_cast<void>(cudaGetDeviceCount(&count));
  for (int d = 0; d < count; ++d) {
    if (auto sharing = gpu::checkSharedMemorySupport(d); !sharing) return sharing.error().message;
    if (cudaSetDevice(d) != cudaSuccess || cudaFree(nullptr) != cudaSuccess) {
      return "GPU " + std::to_string(d) + " has no usable CUDA context";
    }
  }
  return {};
#else
  return "this dbufd was built without CUDA (rebuild with -DDBUF_CUDA=ON)";
#endif
}

bool ncclLoads() {
#if defined(DBUF_WITH_CUDA)
  return gpu::nccl().ok();
#else
  return false;
#endif
}

}  // namespace

Result<Backend> resolveBackend(const Config& config) {
  const Backend requested = config.backend;
  if (requested == Backend::kHost) return Backend::kHost;
  const std::string why = cudaUnavailable();
  if (requested == Backend::kAuto)
    return why.empty() && (config.virtual_ranks > 0 || ncclLoads()) ? Backend::kCuda : Backend::kHost;
  if (!why.empty()) return makeError(ErrorCode::kUnavailable, "backend \"cuda\": " + why);
  return Backend::kCuda;
}

std::vector<GpuUuid> visibleGpus() {
  std::vector<GpuUuid> gpus;
#if defined(DBUF_WITH_CUDA)
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return gpus;
  for (int d = 0; d < count; ++d) {
    auto uuid = gpuUuidOf(d);
    gpus.push_back(uuid ? *uuid : GpuUuid{});
  }
#endif
  return gpus;
}

}  // namespace dbuf::daemon
