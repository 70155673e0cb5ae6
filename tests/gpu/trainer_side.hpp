#pragma once
// The trainer's half of the cross-process GPU memory tests, shared by the
// gpu/ layer's test and dbufd's allocator test: receive an fd, import and
// map the allocation, check the producer's bytes, write the first granule.
// Header-only; for processes forked before anything touched CUDA.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstdint>
#include <vector>

#include "dbuf/common/unique_fd.hpp"
#include "dbuf/gpu/device_memory.hpp"
#include "forked_pair.hpp"

namespace dbuf::testing {

inline bool gpuPresent() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

/// Every one of `bytes` device bytes at `device` equals `value`.
inline bool holds(const void* device, std::size_t bytes, std::uint8_t value) {
  std::vector<std::uint8_t> host(bytes);
  if (cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) return false;
  for (const std::uint8_t b : host) {
    if (b != value) return false;
  }
  return true;
}

/// Returns 0, kNoGpu, or the failed step (12-17). Then says "done" with one
/// byte, so the producer can check `written` in its first granule.
inline int trainerImportsChecksAndWrites(int socket, std::uint8_t expected, std::uint8_t written) {
  if (!gpuPresent()) return kNoGpu;
  int fd = -1;
  std::uint64_t size = 0;
  if (!receiveFd(socket, fd, size)) return 12;
  const UniqueFd owned(fd);
  auto memory = gpu::PhysicalMemory::import(fd, size, 0);
  if (!memory) return 13;
  auto range = gpu::AddressRange::reserve(size, 0);
  if (!range || !range->map(0, *memory)) return 14;
  if (!holds(range->pointer(), size, expected)) return 15;
  auto granularity = gpu::allocationGranularity(0);
  if (!granularity || cudaMemset(range->pointer(), written, *granularity) != cudaSuccess) return 16;
  if (cudaDeviceSynchronize() != cudaSuccess) return 16;
  const char done = 1;
  return write(socket, &done, 1) == 1 ? 0 : 17;
}

}  // namespace dbuf::testing
