#include "dbuf/common/cuda_device.hpp"

#include <cuda_runtime_api.h>

#include <string>

#include "dbuf/common/cuda_status.hpp"

namespace dbuf {

Result<GpuUuid> gpuUuidOf(int device) {
  cudaDeviceProp properties{};
  if (auto r = cudaStatus(cudaGetDeviceProperties(&properties, device),
                          "cudaGetDeviceProperties (GPU " + std::to_string(device) + ")");
      !r) {
    return r.error();
  }
  std::array<std::uint8_t, 16> bytes{};
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::uint8_t>(properties.uuid.bytes[i]);
  return GpuUuid::fromBytes(bytes);
}

}  // namespace dbuf
