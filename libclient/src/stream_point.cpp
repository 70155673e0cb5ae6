#include "stream_point.hpp"

#include <string>
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

namespace {

/// A failed runtime call leaves its error for the thread's next
/// cudaGetLastError, which would blame the trainer's next launch for it.
Result<void> checked(cudaError_t error, const std::string& what) {
  if (error != cudaSuccess) static_cast<void>(cudaGetLastError());
  return cudaStatus(error, what);
}

}  // namespace

Result<StreamPoint> StreamPoint::record(void* stream, int device) {
  const DeviceScope scope;  // the trainer's current GPU is its own business
  if (auto used = gpu::useDevice(device); !used) return used.error();
  auto* cuda_stream = static_cast<cudaStream_t>(stream);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (auto r = checked(cudaStreamIsCapturing(cuda_stream, &capture), "cudaStreamIsCapturing"); !r) return r.error();
  if (capture != cudaStreamCaptureStatusNone) {
    // An event recorded into a graph cannot be queried from the host.
    return makeError(ErrorCode::kInvalidArgument, "a reshard cannot be ordered on a stream captured into a CUDA graph");
  }
  auto made = std::make_unique<Event>();
  if (auto r = checked(cudaEventCreateWithFlags(&made->event, cudaEventDisableTiming), "cudaEventCreate"); !r) {
    return r.error();
  }
  if (auto r = checked(cudaEventRecord(made->event, cuda_stream),
                       "cudaEventRecord on the trainer's stream (a stream of the session's GPU?)");
      !r) {
    return r.error();
  }
  return StreamPoint(std::move(made));
}

Result<bool> StreamPoint::reached() const {
  const cudaError_t queried = cudaEventQuery(event_->event);
  if (queried == cudaErrorNotReady) return false;
  if (auto r = checked(queried, "the trainer's stream before a reshard"); !r) return r.error();
  return true;
}

Result<void> StreamPoint::wait() const {
  return checked(cudaEventSynchronize(event_->event), "waiting for the trainer's stream before a reshard");
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
