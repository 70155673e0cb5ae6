// GPU memory and stream ordering (gpu/): VMM allocations mapped, unmapped
// and re-mapped at stable addresses, exported and imported by fd, refused
// overlapping / misaligned mappings; stream counters that hold a stream back
// until the host (or another stream) publishes, and poisoning that releases
// it. Label `gpu`: skipped, saying why, without a usable CUDA device.
#include "dbuf/gpu/device_memory.hpp"

#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "dbuf/gpu/stream_sync.hpp"
#include "dbuf/kernels/cuda_ops.hpp"
#include "gpu_test_support.hpp"

namespace dbuf::gpu {
namespace {

template <typename T>
T must(Result<T> r) {
  EXPECT_TRUE(r.ok()) << r.error().message;
  if (!r.ok()) throw std::runtime_error(r.error().message);
  return std::move(*r);
}
void must(const Result<void>& r) {
  ASSERT_TRUE(r.ok()) << r.error().message;
}

std::vector<unsigned char> download(const void* device, std::size_t bytes) {
  std::vector<unsigned char> host(bytes);
  EXPECT_EQ(cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

bool allBytes(const std::vector<unsigned char>& bytes, unsigned char value) {
  for (const unsigned char b : bytes) {
    if (b != value) return false;
  }
  return true;
}

TEST(DeviceMemory, ChunksMapUnmapAndRemapAtStableAddresses) {
  DBUF_SKIP_WITHOUT_GPU();
  const std::size_t granularity = must(allocationGranularity(0));
  ASSERT_GT(granularity, 0U);
  ASSERT_EQ(granularity & (granularity - 1), 0U) << "granularity " << granularity << " is not a power of two";
  PhysicalMemory a = must(PhysicalMemory::create(0, granularity + 1));  // rounded up to two granules
  PhysicalMemory b = must(PhysicalMemory::create(0, 2 * granularity));
  ASSERT_EQ(a.size(), 2 * granularity);
  AddressRange range = must(AddressRange::reserve(4 * granularity, 0));
  void* const slot = range.pointer(0);

  must(range.map(0, a));
  ASSERT_EQ(cudaMemset(slot, 0x11, a.size()), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // cudaMemset may return before it ran: not while unmapped
  must(range.unmap(0));
  must(range.map(0, b));  // the next group's chunk, same address
  EXPECT_EQ(range.pointer(0), slot);
  ASSERT_EQ(cudaMemset(slot, 0x22, b.size()), cudaSuccess);
  must(range.map(2 * granularity, a));  // a kept its bytes while unmapped
  EXPECT_TRUE(allBytes(download(range.pointer(2 * granularity), a.size()), 0x11));
  EXPECT_TRUE(allBytes(download(slot, b.size()), 0x22));
}

TEST(DeviceMemory, BadMappingsAreRefused) {
  DBUF_SKIP_WITHOUT_GPU();
  const std::size_t granularity = must(allocationGranularity(0));
  PhysicalMemory a = must(PhysicalMemory::create(0, granularity));
  AddressRange range = must(AddressRange::reserve(2 * granularity, 0));
  must(range.map(0, a));
  EXPECT_EQ(range.map(0, a).error().code, ErrorCode::kConflict);
  EXPECT_EQ(range.map(granularity / 2, a).error().code, ErrorCode::kInvalidArgument);
  EXPECT_EQ(range.map(2 * granularity, a).error().code, ErrorCode::kInvalidArgument);
  EXPECT_EQ(range.unmap(granularity).error().code, ErrorCode::kNotFound);
  EXPECT_EQ(PhysicalMemory::create(0, 0).error().code, ErrorCode::kInvalidArgument);
}

TEST(DeviceMemory, AnExportedFdImportsTheSameMemory) {
  DBUF_SKIP_WITHOUT_GPU();
  const std::size_t granularity = must(allocationGranularity(0));
  PhysicalMemory a = must(PhysicalMemory::create(0, granularity));
  AddressRange first = must(AddressRange::reserve(granularity, 0));
  must(first.map(0, a));
  ASSERT_EQ(cudaMemset(first.pointer(), 0x5a, granularity), cudaSuccess);
  UniqueFd fd = must(a.exportFd());
  PhysicalMemory imported = must(PhysicalMemory::import(fd.get(), a.size(), 0));
  AddressRange second = must(AddressRange::reserve(granularity, 0));
  must(second.map(0, imported));
  EXPECT_TRUE(allBytes(download(second.pointer(), granularity), 0x5a));
  EXPECT_EQ(PhysicalMemory::import(fd.get(), granularity + 1, 0).error().code, ErrorCode::kInvalidArgument);
}

/// Waits up to 10 s for `stream`: a broken wait becomes a failure, not a hang.
bool finishes(cudaStream_t stream) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (cudaStreamQuery(stream) == cudaErrorNotReady) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return cudaStreamQuery(stream) == cudaSuccess;
}

/// Poisons the counter when the test ends, however it ends, so no wait the
/// GPU still polls outlives the registered page.
struct ReleaseWaitersAtExit {
  const StreamCounter& counter;
  ~ReleaseWaitersAtExit() {
    counter.poison();
    // Nothing may still wait on the page when it is unregistered and unmapped.
    static_cast<void>(cudaDeviceSynchronize());
  }
};

/// One shared, page-aligned page of counters, as in a session segment.
struct CounterPage {
  void* page = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ~CounterPage() { munmap(page, 4096); }
  std::uint64_t* word(std::size_t i) const { return static_cast<std::uint64_t*>(page) + i; }
};

TEST(StreamCounter, AStreamWaitsUntilTheHostPublishes) {
  DBUF_SKIP_WITHOUT_GPU();
  if (!must(streamMemOpsSupported(0))) GTEST_SKIP() << "GPU 0 has no 64-bit stream memory operations";
  CounterPage page;
  DeviceMappedHost mapped = must(DeviceMappedHost::registerPages(page.page, 4096, 0));
  const StreamCounter counter = must(StreamCounter::at(mapped, page.word(0)));
  const ReleaseWaitersAtExit release{counter};
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  void* buffer = nullptr;
  ASSERT_EQ(cudaMalloc(&buffer, 4096), cudaSuccess);
  ASSERT_EQ(cudaMemset(buffer, 0, 4096), cudaSuccess);

  must(counter.wait(stream, 1));
  ASSERT_EQ(cudaMemsetAsync(buffer, 7, 4096, stream), cudaSuccess);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(cudaStreamQuery(stream), cudaErrorNotReady) << "the stream ran past an unpublished counter";
  counter.publish(1);
  ASSERT_TRUE(finishes(stream)) << "the stream did not see the published counter";
  EXPECT_TRUE(allBytes(download(buffer, 4096), 7));

  // A stream signals: the host sees the value once the work before it is done.
  ASSERT_EQ(cudaMemsetAsync(buffer, 9, 4096, stream), cudaSuccess);
  must(counter.signal(stream, 5));
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(counter.value(), 5U);

  cudaFree(buffer);
  cudaStreamDestroy(stream);
}

TEST(StreamCounter, PoisonReleasesEveryWaiter) {
  DBUF_SKIP_WITHOUT_GPU();
  if (!must(streamMemOpsSupported(0))) GTEST_SKIP() << "GPU 0 has no 64-bit stream memory operations";
  CounterPage page;
  DeviceMappedHost mapped = must(DeviceMappedHost::registerPages(page.page, 4096, 0));
  const StreamCounter counter = must(StreamCounter::at(mapped, page.word(3)));
  const ReleaseWaitersAtExit release{counter};
  counter.publish(41);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  must(counter.wait(stream, 1000));  // a peer's signal that will never come
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(cudaStreamQuery(stream), cudaErrorNotReady);
  counter.poison();
  ASSERT_TRUE(finishes(stream)) << "poisoning did not release the waiting stream";
  EXPECT_TRUE(isPoisoned(counter.value()));
  EXPECT_EQ(counter.value(), 41 + kPoisonOffset);
  counter.poison();  // once only: a second poison must not carry it past 2^63
  EXPECT_EQ(counter.value(), 41 + kPoisonOffset);
  cudaStreamDestroy(stream);
}

TEST(StreamCounter, ValuesBelowTheOffsetAreNotPoisoned) {
  // No device needed: the arithmetic the GEQ wait relies on.
  EXPECT_FALSE(isPoisoned(0));
  EXPECT_FALSE(isPoisoned(kPoisonOffset - 1));
  EXPECT_TRUE(isPoisoned(kPoisonOffset));
  const std::uint64_t target = kPoisonOffset - 1;    // the largest target a waiter can have
  const std::uint64_t poisoned = 0 + kPoisonOffset;  // a counter poisoned at 0
  EXPECT_GE(static_cast<std::int64_t>(poisoned - target), 0);
}

}  // namespace
}  // namespace dbuf::gpu
