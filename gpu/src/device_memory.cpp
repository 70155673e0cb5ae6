#include "dbuf/gpu/device_memory.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>
#include <utility>

#include "dbuf/common/cuda_status.hpp"

namespace dbuf::gpu {
namespace {

CUmemAllocationProp allocationProperties(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

std::string onDevice(const char* what, int device) {
  return std::string(what) + " on GPU " + std::to_string(device);
}

}  // namespace

Result<void> useDevice(int device) {
  return cudaStatus(cudaSetDevice(device), onDevice("cudaSetDevice", device));
}

Result<void> checkSharedMemorySupport(int device) {
  auto d = driver();
  if (!d) return d.error();
  const auto attribute = [&](CUdevice_attribute which, const char* name) -> Result<int> {
    int value = 0;
    if (auto r = cuStatus((*d)->deviceGetAttribute(&value, which, device),
                          onDevice((std::string("cuDeviceGetAttribute(") + name + ")").c_str(), device));
        !r) {
      return r.error();
    }
    return value;
  };
  auto vmm = attribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED");
  if (!vmm) return vmm.error();
  auto fds = attribute(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                       "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED");
  if (!fds) return fds.error();
  auto mode = attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_MODE, "COMPUTE_MODE");
  if (!mode) return mode.error();
  // Under MPS the GPU is usually exclusive-process, which binds the MPS
  // server, not its clients: dbufd and the trainers then share it.
  auto mps = attribute(CU_DEVICE_ATTRIBUTE_MPS_ENABLED, "MPS_ENABLED");
  const bool shared_by_mps = mps && *mps != 0 && *mode == CU_COMPUTEMODE_EXCLUSIVE_PROCESS;
  const std::string gpu = "GPU " + std::to_string(device);
  if (*vmm == 0) return makeError(ErrorCode::kUnavailable, gpu + " has no CUDA virtual memory management");
  if (*fds == 0) return makeError(ErrorCode::kUnavailable, gpu + " cannot export memory as POSIX file descriptors");
  if (*mode != CU_COMPUTEMODE_DEFAULT && !shared_by_mps) {
    return makeError(ErrorCode::kUnavailable,
                     gpu + " is in compute mode " + std::to_string(*mode) +
                         " (exclusive-process or prohibited) without MPS: dbufd and the trainers each need a "
                         "context on it; set the default mode (nvidia-smi -c DEFAULT) or run them all under MPS "
                         "as one user");
  }
  return {};
}

Result<std::size_t> allocationGranularity(int device) {
  auto d = driver();
  if (!d) return d.error();
  // Every VMM path starts here: make sure the driver is initialised and the
  // device's context exists, whatever the caller did before.
  if (auto r = useDevice(device); !r) return r.error();
  const CUmemAllocationProp prop = allocationProperties(device);
  std::size_t granularity = 0;
  if (auto r = cuStatus((*d)->memGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                        onDevice("cuMemGetAllocationGranularity", device));
      !r) {
    return r.error();
  }
  return granularity;
}

// ---- PhysicalMemory ---------------------------------------------------------------------

Result<PhysicalMemory> PhysicalMemory::create(int device, std::size_t bytes) {
  if (bytes == 0) return makeError(ErrorCode::kInvalidArgument, "gpu: an allocation of 0 bytes");
  auto granularity = allocationGranularity(device);
  if (!granularity) return granularity.error();
  const std::size_t size = roundUp(bytes, *granularity);
  const CUmemAllocationProp prop = allocationProperties(device);
  CUmemGenericAllocationHandle handle = 0;
  if (auto r = cuStatus((**driver()).memCreate(&handle, size, &prop, 0),
                        onDevice("cuMemCreate", device) + " (" + std::to_string(size) + " bytes)");
      !r) {
    return r.error();
  }
  return PhysicalMemory(handle, size, device);
}

Result<PhysicalMemory> PhysicalMemory::import(int fd, std::size_t bytes, int device) {
  auto granularity = allocationGranularity(device);
  if (!granularity) return granularity.error();
  if (bytes == 0 || bytes % *granularity != 0) {
    return makeError(ErrorCode::kInvalidArgument, "gpu: imported allocation size " + std::to_string(bytes) +
                                                      " is not a multiple of the granularity " +
                                                      std::to_string(*granularity));
  }
  CUmemGenericAllocationHandle handle = 0;
  // The POSIX-fd handle type takes the fd itself in the pointer argument.
  void* os_handle = reinterpret_cast<void*>(static_cast<std::intptr_t>(fd));  // NOLINT(performance-no-int-to-ptr)
  if (auto r = cuStatus(
          (**driver()).memImportFromShareableHandle(&handle, os_handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
          onDevice("cuMemImportFromShareableHandle", device));
      !r) {
    return r.error();
  }
  return PhysicalMemory(handle, bytes, device);
}

PhysicalMemory::PhysicalMemory(PhysicalMemory&& other) noexcept
    : handle_(std::exchange(other.handle_, 0)), size_(std::exchange(other.size_, 0)), device_(other.device_) {}

PhysicalMemory& PhysicalMemory::operator=(PhysicalMemory&& other) noexcept {
  if (this != &other) {
    release();
    handle_ = std::exchange(other.handle_, 0);
    size_ = std::exchange(other.size_, 0);
    device_ = other.device_;
  }
  return *this;
}

PhysicalMemory::~PhysicalMemory() {
  release();
}

void PhysicalMemory::release() noexcept {
  if (handle_ == 0) return;
  if (auto d = driver(); d) static_cast<void>((*d)->memRelease(handle_));
  handle_ = 0;
}

Result<UniqueFd> PhysicalMemory::exportFd() const {
  int fd = -1;
  if (auto r =
          cuStatus((**driver()).memExportToShareableHandle(&fd, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                   onDevice("cuMemExportToShareableHandle", device_));
      !r) {
    return r.error();
  }
  return UniqueFd(fd);
}

// ---- AddressRange -------------------------------------------------------------------------

Result<AddressRange> AddressRange::reserve(std::size_t bytes, int device) {
  if (bytes == 0) return makeError(ErrorCode::kInvalidArgument, "gpu: a reservation of 0 bytes");
  auto granularity = allocationGranularity(device);
  if (!granularity) return granularity.error();
  const std::size_t size = roundUp(bytes, *granularity);
  CUdeviceptr base = 0;
  if (auto r = cuStatus((**driver()).memAddressReserve(&base, size, *granularity, 0, 0),
                        "cuMemAddressReserve (" + std::to_string(size) + " bytes)");
      !r) {
    return r.error();
  }
  return AddressRange(base, size, *granularity, device);
}

AddressRange::AddressRange(AddressRange&& other) noexcept
    : base_(std::exchange(other.base_, 0)),
      size_(std::exchange(other.size_, 0)),
      granularity_(other.granularity_),
      device_(other.device_),
      mappings_(std::exchange(other.mappings_, {})) {}

AddressRange& AddressRange::operator=(AddressRange&& other) noexcept {
  if (this != &other) {
    release();
    base_ = std::exchange(other.base_, 0);
    size_ = std::exchange(other.size_, 0);
    granularity_ = other.granularity_;
    device_ = other.device_;
    mappings_ = std::exchange(other.mappings_, {});
  }
  return *this;
}

AddressRange::~AddressRange() {
  release();
}

void AddressRange::release() noexcept {
  if (base_ == 0) return;
  if (auto d = driver(); d) {
    for (const auto& [offset, bytes] : mappings_) static_cast<void>((*d)->memUnmap(base_ + offset, bytes));
    static_cast<void>((*d)->memAddressFree(base_, size_));
  }
  mappings_.clear();
  base_ = 0;
}

void* AddressRange::pointer(std::size_t offset) const noexcept {
  return reinterpret_cast<void*>(base_ + offset);  // NOLINT(performance-no-int-to-ptr): a device address
}

Result<void> AddressRange::map(std::size_t offset, const PhysicalMemory& memory, std::size_t part) {
  const std::size_t bytes = part == 0 ? memory.size() : std::min(roundUp(part, granularity_), memory.size());
  if (offset % granularity_ != 0 || offset > size_ || bytes > size_ - offset) {
    return makeError(ErrorCode::kInvalidArgument, "gpu: mapping [" + std::to_string(offset) + ", +" +
                                                      std::to_string(bytes) + ") does not fit the reserved " +
                                                      std::to_string(size_) + " bytes at granularity " +
                                                      std::to_string(granularity_));
  }
  // No overlap with the mapping before or after `offset`.
  const auto next = mappings_.lower_bound(offset);
  const bool overlaps_next = next != mappings_.end() && next->first < offset + bytes;
  const bool overlaps_prev = next != mappings_.begin() && std::prev(next)->first + std::prev(next)->second > offset;
  if (overlaps_next || overlaps_prev) {
    return makeError(ErrorCode::kConflict,
                     "gpu: mapping at offset " + std::to_string(offset) + " overlaps one already there");
  }
  const Driver& d = **driver();
  if (auto r = cuStatus(d.memMap(base_ + offset, bytes, 0, memory.handle(), 0), "cuMemMap"); !r) return r;
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (auto r = cuStatus(d.memSetAccess(base_ + offset, bytes, &access, 1), onDevice("cuMemSetAccess", device_)); !r) {
    static_cast<void>(d.memUnmap(base_ + offset, bytes));
    return r;
  }
  mappings_.emplace(offset, bytes);
  return {};
}

Result<void> AddressRange::unmap(std::size_t offset) {
  const auto it = mappings_.find(offset);
  if (it == mappings_.end()) {
    return makeError(ErrorCode::kNotFound, "gpu: nothing is mapped at offset " + std::to_string(offset));
  }
  if (auto r = cuStatus((**driver()).memUnmap(base_ + offset, it->second), "cuMemUnmap"); !r) return r;
  mappings_.erase(it);
  return {};
}

}  // namespace dbuf::gpu
