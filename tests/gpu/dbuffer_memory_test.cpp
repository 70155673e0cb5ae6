// dbufd's cuda DBuffer memory (daemon/src/memory/cuda_dbuffer_memory.cpp) across a
// process boundary, the way a shard file or slot travels: the daemon's side
// allocates through the cuda allocator (zeroed, granularity-rounded), writes
// it with the CUDA kernels at the daemon's own address and sends the fd; a
// trainer's side imports and maps it, reads the bytes, writes its own; the
// daemon sees them. Forked before anything touches CUDA; "no GPU" is exit
// code 77. Label `gpu`.
#include "dbuffer_memory.hpp"

#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "dbuf/gpu/device_memory.hpp"
#include "dbuf/kernels/cuda_ops.hpp"
#include "forked_pair.hpp"
#include "trainer_side.hpp"

namespace dbuf::daemon {
namespace {

using testing::gpuPresent;
using testing::holds;
using testing::kNoGpu;
using testing::sendFd;
constexpr std::uint64_t kAsked = (std::uint64_t{3} << 20) + 5;  // rounded up by the allocator
constexpr std::uint8_t kFromDaemon = 0x5a;
constexpr std::uint8_t kFromTrainer = 0xc3;

int daemonSide(int socket) {
  if (!gpuPresent()) return kNoGpu;
  auto memory = cudaAllocator(0)->allocate("test", kAsked);
  if (!memory) return 2;
  const DbufferMemory& m = **memory;
  auto granularity = gpu::allocationGranularity(0);
  if (!granularity || m.bytes() < kAsked || m.bytes() % *granularity != 0) return 3;
  if (!holds(m.data(), m.bytes(), 0)) return 4;  // zeroed, like a memfd
  // The data plane's way in: a fused kernel writing at the daemon's address.
  void* source = nullptr;
  if (cudaMalloc(&source, m.bytes()) != cudaSuccess || cudaMemset(source, kFromDaemon, m.bytes()) != cudaSuccess) {
    return 5;
  }
  const auto n = static_cast<std::int64_t>(m.bytes());
  const kernels::Segment all{0, 0, n, 0, 0};
  if (!kernels::cuda::copy({source, DType::kU8, n}, {m.data(), DType::kU8, n}, {&all, 1}).ok()) return 6;
  if (cudaDeviceSynchronize() != cudaSuccess) return 6;
  if (!sendFd(socket, m.fd(), m.bytes())) return 7;
  char done = 0;
  if (read(socket, &done, 1) != 1) return 8;
  return holds(m.data(), *granularity, kFromTrainer) &&
                 holds(m.data() + *granularity, m.bytes() - *granularity, kFromDaemon)
             ? 0
             : 9;
}

TEST(CudaDbufferMemory, TheDaemonsAllocationReachesATrainerByFd) {
  testing::expectBothDone(
      testing::runForkedPair(
          daemonSide,
          [](int socket) { return testing::trainerImportsChecksAndWrites(socket, kFromDaemon, kFromTrainer); }),
      "daemon side", "trainer side");
}

}  // namespace
}  // namespace dbuf::daemon
