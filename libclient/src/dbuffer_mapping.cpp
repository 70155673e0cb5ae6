#include "dbuffer_mapping.hpp"

#include <string>
#include <utility>

#if defined(DBUF_WITH_CUDA)
#include <cuda_runtime_api.h>

#include <optional>

#include "dbuf/gpu/device_memory.hpp"
#include "device_scope.hpp"
#endif

namespace dbuf {

#if defined(DBUF_WITH_CUDA)

struct ReservedRange::Impl {
  std::optional<gpu::AddressRange> range;
};

struct DbufferMapping::Device {
  gpu::PhysicalMemory memory;
  gpu::AddressRange* range = nullptr;    // where it is mapped (at offset 0)
  std::optional<gpu::AddressRange> own;  // when no ReservedRange was given
  bool gpu_work_done = false;            // no wait for the GPU before unmapping

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

struct ReservedRange::Impl {};
struct DbufferMapping::Device {};

#endif

ReservedRange::ReservedRange() : impl(std::make_unique<Impl>()) {}
ReservedRange::~ReservedRange() = default;
ReservedRange::ReservedRange(ReservedRange&&) noexcept = default;
ReservedRange& ReservedRange::operator=(ReservedRange&&) noexcept = default;

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
  return host_.data();
}

std::uint64_t DbufferMapping::size() const noexcept {
#if defined(DBUF_WITH_CUDA)
  if (device_ != nullptr) return device_->memory.size();
#endif
  return host_.size();
}

Result<DbufferMapping> DbufferMapping::map(const MemorySite& site, int fd, std::uint64_t bytes, ReservedRange* range) {
  DbufferMapping mapping;
  if (site.kind == ipc::MemoryKind::kHost) {
    auto size = fileSize(fd);
    if (!size) return std::move(size).error();
    if (*size < bytes) return makeError(ErrorCode::kInternal, "dbufd sent a file smaller than announced");
    auto host = Mapping::map(fd, bytes);
    if (!host) return std::move(host).error();
    mapping.host_ = std::move(*host);
    return mapping;
  }
#if defined(DBUF_WITH_CUDA)
  const DeviceScope scope;  // the trainer's current GPU is its own business: restored after
  auto memory = gpu::PhysicalMemory::import(fd, bytes, site.device);
  if (!memory) return std::move(memory).error();
  auto device = std::make_unique<Device>(std::move(*memory));
  std::optional<gpu::AddressRange>& slot = range != nullptr ? range->impl->range : device->own;
  if (!slot || slot->size() < device->memory.size()) {
    // First use, or a larger slot than this group had: (re)reserve. The
    // address changes only in that case.
    slot.reset();
    auto reserved = gpu::AddressRange::reserve(device->memory.size(), site.device);
    if (!reserved) return std::move(reserved).error();
    slot = std::move(*reserved);
  }
  if (auto mapped = slot->map(0, device->memory); !mapped) return mapped.error();
  device->range = &*slot;
  mapping.device_ = std::move(device);
  return mapping;
#else
  static_cast<void>(range);
  return makeError(ErrorCode::kUnavailable,
                   "dbufd serves GPU memory but this libdbuf was built without CUDA (rebuild with -DDBUF_CUDA=ON)");
#endif
}

}  // namespace dbuf
