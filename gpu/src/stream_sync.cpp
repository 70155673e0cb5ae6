#include "dbuf/gpu/stream_sync.hpp"

#include <string>
#include <utility>

#include "dbuf/gpu/device_memory.hpp"

namespace dbuf::gpu {

Result<bool> streamMemOpsSupported(int device) {
  auto d = driver();
  if (!d) return d.error();
  if (auto r = useDevice(device); !r) return r.error();
  int supported = 0;
  if (auto r = cuStatus((*d)->deviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, device),
                        "cuDeviceGetAttribute(CAN_USE_64_BIT_STREAM_MEM_OPS)");
      !r) {
    return r.error();
  }
  return supported != 0;
}

// ---- DeviceMappedHost -------------------------------------------------------------------

Result<DeviceMappedHost> DeviceMappedHost::registerPages(void* pages, std::size_t bytes, int device) {
  auto d = driver();
  if (!d) return d.error();
  if (auto r = useDevice(device); !r) return r.error();
  // PORTABLE: usable from every context of this process; DEVICEMAP: gets a
  // device address (the same as the host one on 64-bit UVA systems).
  if (auto r = cuStatus((*d)->memHostRegister(pages, bytes, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP),
                        "cuMemHostRegister (" + std::to_string(bytes) + " bytes)");
      !r) {
    return r.error();
  }
  return DeviceMappedHost(pages, bytes);
}

DeviceMappedHost::DeviceMappedHost(DeviceMappedHost&& other) noexcept
    : pages_(std::exchange(other.pages_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceMappedHost& DeviceMappedHost::operator=(DeviceMappedHost&& other) noexcept {
  if (this != &other) {
    release();
    pages_ = std::exchange(other.pages_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

DeviceMappedHost::~DeviceMappedHost() {
  release();
}

void DeviceMappedHost::release() noexcept {
  if (pages_ == nullptr) return;
  if (auto d = driver(); d) static_cast<void>((*d)->memHostUnregister(pages_));
  pages_ = nullptr;
}

Result<CUdeviceptr> DeviceMappedHost::devicePointer(const void* p) const {
  const auto* begin = static_cast<const unsigned char*>(pages_);
  const auto* at = static_cast<const unsigned char*>(p);
  if (pages_ == nullptr || at < begin || at >= begin + bytes_) {
    return makeError(ErrorCode::kInvalidArgument, "gpu: address outside the registered pages");
  }
  CUdeviceptr base = 0;
  if (auto r = cuStatus((**driver()).memHostGetDevicePointer(&base, pages_, 0), "cuMemHostGetDevicePointer"); !r) {
    return r.error();
  }
  return base + static_cast<CUdeviceptr>(at - begin);
}

Result<DeviceMappedHost> registerCounterPages(void* pages, std::size_t bytes, int device) {
  auto supported = streamMemOpsSupported(device);
  if (!supported) return supported.error();
  if (!*supported) {
    return makeError(ErrorCode::kUnavailable, "GPU " + std::to_string(device) +
                                                  " has no 64-bit stream memory operations: ops cannot be ordered on "
                                                  "its streams (order them on the host)");
  }
  return DeviceMappedHost::registerPages(pages, bytes, device);
}

// ---- StreamCounter --------------------------------------------------------------------------

Result<StreamCounter> StreamCounter::at(const DeviceMappedHost& pages, std::uint64_t* word) {
  if (reinterpret_cast<std::uintptr_t>(word) % alignof(std::uint64_t) != 0) {
    return makeError(ErrorCode::kInvalidArgument, "gpu: a stream counter must be 8-byte aligned");
  }
  auto device = pages.devicePointer(word);
  if (!device) return device.error();
  return StreamCounter(word, *device);
}

Result<void> StreamCounter::signal(CUstream stream, std::uint64_t value) const {
  return cuStatus((**driver()).streamWriteValue64(stream, device_, value, CU_STREAM_WRITE_VALUE_DEFAULT),
                  "cuStreamWriteValue64");
}

Result<void> StreamCounter::wait(CUstream stream, std::uint64_t value) const {
  return cuStatus((**driver()).streamWaitValue64(stream, device_, value, CU_STREAM_WAIT_VALUE_GEQ),
                  "cuStreamWaitValue64");
}

std::uint64_t StreamCounter::value() const noexcept {
  return counterValue(*host_);
}

void StreamCounter::publish(std::uint64_t value) const noexcept {
  publishCounter(*host_, value);
}

void StreamCounter::poison() const noexcept {
  poisonCounter(*host_);
}

}  // namespace dbuf::gpu
