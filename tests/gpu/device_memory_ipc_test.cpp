// A VMM allocation crossing a process boundary the way DBuffers do: one
// process (the daemon's role) creates and fills it and sends the exported fd
// with SCM_RIGHTS; another (a trainer's) imports, maps, reads and writes it;
// the first sees the write. Both are forked before anything touches CUDA
// (a CUDA context does not survive fork), and say "no GPU" with exit code 77.
// Label `gpu`.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "dbuf/gpu/device_memory.hpp"
#include "forked_pair.hpp"
#include "trainer_side.hpp"

namespace dbuf::gpu {
namespace {

using testing::gpuPresent;
using testing::holds;
using testing::kNoGpu;
using testing::sendFd;
constexpr unsigned char kFromDaemon = 0xab;
constexpr unsigned char kFromTrainer = 0xcd;

/// The daemon's side: allocate, fill, export, send; then check the trainer's write.
int daemonSide(int socket) {
  if (!gpuPresent()) return kNoGpu;
  auto granularity = allocationGranularity(0);
  if (!granularity) return 2;
  auto memory = PhysicalMemory::create(0, 2 * *granularity);
  if (!memory) return 3;
  auto range = AddressRange::reserve(memory->size(), 0);
  if (!range || !range->map(0, *memory)) return 4;
  if (cudaMemset(range->pointer(), kFromDaemon, memory->size()) != cudaSuccess) return 5;
  if (cudaDeviceSynchronize() != cudaSuccess) return 5;
  auto fd = memory->exportFd();
  if (!fd || !sendFd(socket, fd->get(), memory->size())) return 6;
  char done = 0;
  if (read(socket, &done, 1) != 1) return 7;
  // The trainer wrote its first granule.
  return holds(range->pointer(), *granularity, kFromTrainer) &&
                 holds(range->pointer(*granularity), *granularity, kFromDaemon)
             ? 0
             : 8;
}

TEST(DeviceMemoryIpc, ATrainerProcessMapsTheDaemonsAllocationByFd) {
  testing::expectBothDone(
      testing::runForkedPair(
          daemonSide,
          [](int socket) { return testing::trainerImportsChecksAndWrites(socket, kFromDaemon, kFromTrainer); }),
      "daemon side", "trainer side");
}

}  // namespace
}  // namespace dbuf::gpu
