// The fallback ordering: a producer process records a CUDA IPC event after
// 1 s of GPU work and sends the handle; a consumer process's stream waits
// for it before its own work, which therefore cannot finish before the
// producer's. Both processes are forked before anything touches CUDA; "no
// GPU" is exit code 77. Label `gpu`.
#include "dbuf/gpu/ipc_event.hpp"

#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>

#include "forked_pair.hpp"
#include "spin_kernel.hpp"
#include "trainer_side.hpp"

namespace dbuf::gpu {
namespace {

using testing::gpuPresent;
using testing::kNoGpu;
constexpr unsigned long long kSpinNs = 1'000'000'000ULL;  // 1 s of producer work

int producer(int socket) {
  if (!gpuPresent()) return kNoGpu;
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return 2;
  auto event = IpcEvent::create();
  if (!event) return 3;
  auto handle = event->handle();
  if (!handle) return 4;
  // Work, then the record, and only then the handle goes out (a wait queued
  // before the record would not wait for it).
  if (testing::spinFor(stream, kSpinNs) != cudaSuccess || !event->record(stream)) return 5;
  if (write(socket, handle->data(), handle->size()) != static_cast<ssize_t>(handle->size())) return 6;
  if (cudaStreamSynchronize(stream) != cudaSuccess) return 7;
  char done = 0;
  return read(socket, &done, 1) == 1 ? 0 : 8;  // keep the event alive until the consumer is done
}

int consumer(int socket) {
  if (!gpuPresent()) return kNoGpu;
  // Context, stream and buffer first, so that only the wait is timed.
  cudaStream_t stream = nullptr;
  void* buffer = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return 14;
  if (cudaMalloc(&buffer, 4096) != cudaSuccess) return 14;
  IpcEvent::Handle handle{};
  if (read(socket, handle.data(), handle.size()) != static_cast<ssize_t>(handle.size())) return 12;
  const auto received = std::chrono::steady_clock::now();
  auto event = IpcEvent::open(handle);
  if (!event) return 13;
  if (!event->wait(stream) || cudaMemsetAsync(buffer, 1, 4096, stream) != cudaSuccess) return 15;
  if (cudaStreamSynchronize(stream) != cudaSuccess) return 16;
  const auto waited = std::chrono::steady_clock::now() - received;
  const char done = 1;
  if (write(socket, &done, 1) != 1) return 17;
  // The memset could only run after the producer's 1 s spin, which started
  // just before the handle was sent: well over half a second.
  return waited > std::chrono::milliseconds(500) ? 0 : 18;
}

TEST(IpcEvent, AConsumersStreamWaitsForTheProducersRecordedWork) {
  testing::expectBothDone(testing::runForkedPair(producer, consumer), "producer", "consumer", " (18: did not wait)");
}

}  // namespace
}  // namespace dbuf::gpu
