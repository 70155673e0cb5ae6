#pragma once
// CUDA builds of libdbuf: restores the calling thread's current GPU on scope
// exit. The trainer's current GPU is its own business, and the driver helpers
// libdbuf calls make the session's GPU current.
#include <cuda_runtime_api.h>

namespace dbuf {

class DeviceScope {
 public:
  DeviceScope() { had_ = cudaGetDevice(&previous_) == cudaSuccess; }
  ~DeviceScope() {
    if (had_) static_cast<void>(cudaSetDevice(previous_));
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  bool had_ = false;
};

}  // namespace dbuf
