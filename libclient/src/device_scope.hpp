#pragma once
// CUDA builds of libdbuf: restores the calling thread's CUDA context on scope
// exit. The trainer's current GPU is its own business, and the driver helpers
// libdbuf calls make the session's GPU (its primary context) current.
#include <cuda_runtime_api.h>

#include "dbuf/gpu/driver.hpp"

namespace dbuf {

class DeviceScope {
 public:
  DeviceScope() {
    if (auto d = gpu::driver(); d && (*d)->ctxGetCurrent(&context_) == CUDA_SUCCESS) {
      driver_ = *d;
    } else {
      context_ = nullptr;  // no driver: the runtime's device is all there is to restore
    }
    if (context_ == nullptr) had_device_ = cudaGetDevice(&device_) == cudaSuccess;
  }
  ~DeviceScope() {
    // The very context that was current: it may be one the trainer made
    // itself (a green context, cuCtxCreate), not its device's primary one.
    if (driver_ != nullptr && context_ != nullptr) {
      static_cast<void>(driver_->ctxSetCurrent(context_));
    } else if (had_device_) {
      // None was: the thread's runtime device goes back to what it was, so
      // its next runtime call runs where it would have (that makes this
      // device's primary context current, which that call would have done).
      static_cast<void>(cudaSetDevice(device_));
    }
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  const gpu::Driver* driver_ = nullptr;
  CUcontext context_ = nullptr;
  int device_ = 0;
  bool had_device_ = false;
};

}  // namespace dbuf
