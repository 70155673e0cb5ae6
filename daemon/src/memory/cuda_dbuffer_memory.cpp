// The cuda backend's DBuffer memory (CUDA builds only): a VMM allocation on
// the rank's GPU, exported as a POSIX fd for the trainer and mapped into a
// range of the daemon's own device address space for the data plane.
#include <cuda_runtime_api.h>

#include "dbuf/common/cuda_status.hpp"
#include "dbuf/common/unique_fd.hpp"
#include "dbuf/gpu/device_memory.hpp"
#include "dbuffer_memory.hpp"

namespace dbuf::daemon {
namespace {

class CudaMemory final : public DbufferMemory {
 public:
  CudaMemory(gpu::PhysicalMemory memory, gpu::AddressRange range, UniqueFd fd)
      : memory_(std::move(memory)), range_(std::move(range)), fd_(std::move(fd)) {}
  int fd() const noexcept override { return fd_.get(); }
  std::uint64_t bytes() const noexcept override { return memory_.size(); }
  std::byte* data() const noexcept override { return static_cast<std::byte*>(range_.pointer()); }

 private:
  // Destroyed in reverse: the fd, then the range (unmapping), then the handle.
  gpu::PhysicalMemory memory_;
  gpu::AddressRange range_;
  UniqueFd fd_;
};

class CudaAllocator final : public DbufferAllocator {
 public:
  explicit CudaAllocator(int device) : device_(device) {}
  ~CudaAllocator() override {
    if (zeroing_ != nullptr) static_cast<void>(cudaStreamDestroy(zeroing_));
  }
  CudaAllocator(const CudaAllocator&) = delete;
  CudaAllocator& operator=(const CudaAllocator&) = delete;

  Result<std::uint64_t> roundedSize(std::uint64_t bytes) const override {
    auto granularity = gpu::allocationGranularity(device_);
    if (!granularity) return granularity.error();
    return static_cast<std::uint64_t>(gpu::roundUp(bytes, *granularity));
  }

  Result<std::unique_ptr<DbufferMemory>> allocate(const std::string& /*name*/, std::uint64_t bytes) override {
    auto memory = gpu::PhysicalMemory::create(device_, bytes);
    if (!memory) return std::move(memory).error();
    auto range = gpu::AddressRange::reserve(memory->size(), device_);
    if (!range) return std::move(range).error();
    if (auto mapped = range->map(0, *memory); !mapped) return std::move(mapped).error();
    if (auto zeroed = zero(range->pointer(), memory->size()); !zeroed) return std::move(zeroed).error();
    auto fd = memory->exportFd();
    if (!fd) return std::move(fd).error();
    return std::unique_ptr<DbufferMemory>(
        std::make_unique<CudaMemory>(std::move(*memory), std::move(*range), std::move(*fd)));
  }

 private:
  /// New physical memory holds whatever was there before: zeroed, as a memfd
  /// is, so no job sees another's bytes, and waited for before the fd goes
  /// out. On a stream of its own: a device-wide wait would also wait for
  /// every job's queued work, for good if an NCCL op is stuck. (`device_` is
  /// current: the allocation above made it so.)
  Result<void> zero(void* memory, std::size_t bytes) {
    if (zeroing_ == nullptr) {
      if (auto made = cudaStatus(cudaStreamCreateWithFlags(&zeroing_, cudaStreamNonBlocking),
                                 "cudaStreamCreate (zeroing new DBuffers)");
          !made) {
        return made;
      }
    }
    if (auto queued = cudaStatus(cudaMemsetAsync(memory, 0, bytes, zeroing_), "cudaMemsetAsync (new DBuffer)");
        !queued) {
      return queued;
    }
    return cudaStatus(cudaStreamSynchronize(zeroing_), "zeroing a new DBuffer");
  }

  int device_;
  cudaStream_t zeroing_ = nullptr;
};

}  // namespace

std::unique_ptr<DbufferAllocator> cudaAllocator(int device) {
  return std::make_unique<CudaAllocator>(device);
}

}  // namespace dbuf::daemon
