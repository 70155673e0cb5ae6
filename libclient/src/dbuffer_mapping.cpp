#include "dbuffer_mapping.hpp"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#if defined(DBUF_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "dbuf/gpu/device_memory.hpp"
#include "device_scope.hpp"
#endif

namespace dbuf {
namespace {

Error systemError(const char* what) {
  return makeError(ErrorCode::kIo, std::string(what) + ": " + std::strerror(errno));  // NOLINT(concurrency-mt-unsafe)
}

/// Host address space reserved for one DBuffer: private zero pages, except
/// while a memfd is mapped over (the start of) them.
class HostReservation {
 public:
  static Result<std::shared_ptr<HostReservation>> reserve(std::size_t bytes) {
    void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) return systemError("reserving address space for a DBuffer");
    return std::shared_ptr<HostReservation>(new HostReservation(static_cast<std::byte*>(base), bytes));
  }
  HostReservation(const HostReservation&) = delete;
  HostReservation& operator=(const HostReservation&) = delete;
  ~HostReservation() { ::munmap(base_, bytes_); }

  [[nodiscard]] std::byte* base() const noexcept { return base_; }
  [[nodiscard]] std::size_t size() const noexcept { return bytes_; }

  /// The first `bytes` of `fd`, shared, in place of what is there.
  [[nodiscard]] Result<void> mapShared(int fd, std::size_t bytes) const {
    if (::mmap(base_, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
      return systemError("mmap of a DBuffer");
    }
    return {};
  }
  /// Zero pages in place of the first `bytes`: one mmap replaces the shared
  /// mapping atomically, so no thread ever sees the range unmapped.
  void blank(std::size_t bytes) const noexcept {
    static_cast<void>(
        ::mmap(base_, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0));
  }

 private:
  HostReservation(std::byte* base, std::size_t bytes) noexcept : base_(base), bytes_(bytes) {}
  std::byte* base_;
  std::size_t bytes_;
};

}  // namespace

struct DbufferMapping::Host {
  std::shared_ptr<HostReservation> range;
  std::size_t bytes = 0;
  ~Host() { range->blank(bytes); }
  Host(std::shared_ptr<HostReservation> r, std::size_t b) : range(std::move(r)), bytes(b) {}
  Host(const Host&) = delete;
  Host& operator=(const Host&) = delete;
};

#if defined(DBUF_WITH_CUDA)

struct ReservedRange::Impl {
  std::shared_ptr<HostReservation> host;
  std::shared_ptr<gpu::AddressRange> device;
};

struct DbufferMapping::Device {
  gpu::PhysicalMemory memory;
  std::shared_ptr<gpu::AddressRange> range;  // where it is mapped (at offset 0)
  std::size_t mapped = 0;                    // bytes of `memory` mapped there
  bool gpu_work_done = false;                // no wait for the GPU before unmapping

  explicit Device(gpu::PhysicalMemory m) : memory(std::move(m)) {}
  ~Device() {
    if (range == nullptr) return;
    // Kernels this process queued may still use the range (the trainer's
    // compute on unsharded params, say, queued before reshard), and touching
    // an unmapped range is a sticky fault that ends the process's CUDA
    // context: wait for this process's work on the GPU first. Stream waits
    // on dbufd's counters do not hold this forever: a failed or abandoned op
    // poisons them.
    if (!gpu_work_done) {
      const DeviceScope scope;
      if (gpu::useDevice(memory.device())) static_cast<void>(cudaDeviceSynchronize());
    }
    static_cast<void>(range->unmap(0));
  }
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
};

#else

struct ReservedRange::Impl {
  std::shared_ptr<HostReservation> host;
};
struct DbufferMapping::Device {};

#endif

ReservedRange::ReservedRange() : impl(std::make_unique<Impl>()) {}
ReservedRange::~ReservedRange() = default;
ReservedRange::ReservedRange(ReservedRange&&) noexcept = default;
ReservedRange& ReservedRange::operator=(ReservedRange&&) noexcept = default;

std::shared_ptr<const void> ReservedRange::pin() const {
#if defined(DBUF_WITH_CUDA)
  if (impl->device != nullptr) return impl->device;
#endif
  return impl->host;
}

DbufferMapping::DbufferMapping() = default;
DbufferMapping::~DbufferMapping() = default;
DbufferMapping::DbufferMapping(DbufferMapping&&) noexcept = default;
DbufferMapping& DbufferMapping::operator=(DbufferMapping&&) noexcept = default;

void DbufferMapping::reset(GpuWork work) noexcept {
  host_.reset();
#if defined(DBUF_WITH_CUDA)
  if (device_ != nullptr) device_->gpu_work_done = work == GpuWork::kDone;
#else
  static_cast<void>(work);
#endif
  device_.reset();
}

std::byte* DbufferMapping::data() const noexcept {
#if defined(DBUF_WITH_CUDA)
  if (device_ != nullptr) return static_cast<std::byte*>(device_->range->pointer());
#endif
  return host_ != nullptr ? host_->range->base() : nullptr;
}

std::uint64_t DbufferMapping::size() const noexcept {
#if defined(DBUF_WITH_CUDA)
  if (device_ != nullptr) return device_->mapped;
#endif
  return host_ != nullptr ? host_->bytes : 0;
}

Result<DbufferMapping> DbufferMapping::map(const MemorySite& site, int fd, std::uint64_t file_bytes,
                                           std::uint64_t used_bytes, ReservedRange& range) {
  DbufferMapping mapping;
  if (site.kind == ipc::MemoryKind::kHost) {
    auto size = fileSize(fd);
    if (!size) return std::move(size).error();
    if (*size < file_bytes || used_bytes > file_bytes) {
      return makeError(ErrorCode::kInternal, "dbufd sent a file smaller than announced");
    }
    std::shared_ptr<HostReservation>& reserved = range.impl->host;
    if (!reserved || reserved->size() < used_bytes) {
      // First use, or a larger DBuffer than this range had: the address
      // changes only then (pins keep the old range for views still on it).
      auto fresh = HostReservation::reserve(used_bytes);
      if (!fresh) return std::move(fresh).error();
      reserved = std::move(*fresh);
    }
    if (auto mapped = reserved->mapShared(fd, used_bytes); !mapped) return mapped.error();
    mapping.host_ = std::make_unique<Host>(reserved, used_bytes);
    return mapping;
  }
#if defined(DBUF_WITH_CUDA)
  const DeviceScope scope;  // the trainer's current GPU is its own business: restored after
  auto memory = gpu::PhysicalMemory::import(fd, file_bytes, site.device);
  if (!memory) return std::move(memory).error();
  auto device = std::make_unique<Device>(std::move(*memory));
  std::shared_ptr<gpu::AddressRange>& slot = range.impl->device;
  // A slot that served a larger group is mapped in part, the group's bytes
  // only, so that its range (and its views' address) stays the same.
  bool mapped = false;
  if (slot && slot->size() >= used_bytes && slot->size() < device->memory.size()) {
    mapped = slot->map(0, device->memory, used_bytes).ok();  // else: a driver that maps whole allocations only
    if (mapped) device->mapped = slot->mappedBytes(0);
  }
  if (!mapped) {
    if (!slot || slot->size() < device->memory.size()) {
      // First use, or a larger slot than this range holds and no partial
      // mapping: (re)reserve; the address changes only then.
      auto reserved = gpu::AddressRange::reserve(device->memory.size(), site.device);
      if (!reserved) return std::move(reserved).error();
      slot = std::make_shared<gpu::AddressRange>(std::move(*reserved));
    }
    if (auto whole = slot->map(0, device->memory); !whole) return whole.error();
    device->mapped = slot->mappedBytes(0);
  }
  device->range = slot;
  mapping.device_ = std::move(device);
  return mapping;
#else
  return makeError(ErrorCode::kUnavailable,
                   "dbufd serves GPU memory but this libdbuf was built without CUDA (rebuild with -DDBUF_CUDA=ON)");
#endif
}

}  // namespace dbuf
