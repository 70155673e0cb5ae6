#include "stream_point.hpp"

#include <utility>

#if defined(DBUF_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "dbuf/common/cuda_status.hpp"
#include "dbuf/gpu/device_memory.hpp"
#include "device_scope.hpp"
#endif

namespace dbuf {

#if defined(DBUF_WITH_CUDA)

struct StreamPoint::Event {
  cudaEvent_t event = nullptr;
  ~Event() {
    if (event != nullptr) static_cast<void>(cudaEventDestroy(event));
  }
};

Result<StreamPoint> StreamPoint::record(void* stream, int device) {
  const DeviceScope scope;  // the trainer's current GPU is its own business
  if (auto used = gpu::useDevice(device); !used) return used.error();
  auto made = std::make_unique<Event>();
  if (auto r = cudaStatus(cudaEventCreateWithFlags(&made->event, cudaEventDisableTiming), "cudaEventCreate"); !r) {
    return r.error();
  }
  if (auto r = cudaStatus(cudaEventRecord(made->event, static_cast<cudaStream_t>(stream)),
                          "cudaEventRecord on the trainer's stream (a stream of the session's GPU?)");
      !r) {
    return r.error();
  }
  return StreamPoint(std::move(made));
}

Result<bool> StreamPoint::reached() const {
  const cudaError_t status = cudaEventQuery(event_->event);
  if (status == cudaErrorNotReady) return false;
  if (auto r = cudaStatus(status, "the trainer's stream before a reshard"); !r) return r.error();
  return true;
}

Result<void> StreamPoint::wait() const {
  return cudaStatus(cudaEventSynchronize(event_->event), "waiting for the trainer's stream before a reshard");
}

#else

struct StreamPoint::Event {};

Result<StreamPoint> StreamPoint::record(void* /*stream*/, int /*device*/) {
  return makeError(ErrorCode::kUnavailable,
                   "this libdbuf was built without CUDA: it cannot order a reshard on a stream");
}

Result<bool> StreamPoint::reached() const {
  return true;
}

Result<void> StreamPoint::wait() const {
  return {};
}

#endif

StreamPoint::StreamPoint(std::unique_ptr<Event> event) noexcept : event_(std::move(event)) {}
StreamPoint::StreamPoint(StreamPoint&&) noexcept = default;
StreamPoint& StreamPoint::operator=(StreamPoint&&) noexcept = default;
StreamPoint::~StreamPoint() = default;

}  // namespace dbuf
