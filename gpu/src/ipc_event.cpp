#include "dbuf/gpu/ipc_event.hpp"

#include <cstring>
#include <utility>

#include "dbuf/common/cuda_status.hpp"

namespace dbuf::gpu {

Result<IpcEvent> IpcEvent::create() {
  cudaEvent_t event = nullptr;
  if (auto r = cudaStatus(cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventInterprocess),
                          "cudaEventCreateWithFlags (interprocess)");
      !r) {
    return r.error();
  }
  return IpcEvent(event);
}

Result<IpcEvent> IpcEvent::open(const Handle& handle) {
  cudaIpcEventHandle_t raw{};
  std::memcpy(&raw, handle.data(), sizeof raw);
  cudaEvent_t event = nullptr;
  if (auto r = cudaStatus(cudaIpcOpenEventHandle(&event, raw), "cudaIpcOpenEventHandle"); !r) return r.error();
  return IpcEvent(event);
}

IpcEvent::IpcEvent(IpcEvent&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}

IpcEvent& IpcEvent::operator=(IpcEvent&& other) noexcept {
  if (this != &other) {
    if (event_ != nullptr) static_cast<void>(cudaEventDestroy(event_));
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}

IpcEvent::~IpcEvent() {
  if (event_ != nullptr) static_cast<void>(cudaEventDestroy(event_));
}

Result<IpcEvent::Handle> IpcEvent::handle() const {
  cudaIpcEventHandle_t raw{};
  if (auto r = cudaStatus(cudaIpcGetEventHandle(&raw, event_), "cudaIpcGetEventHandle"); !r) return r.error();
  Handle bytes{};
  std::memcpy(bytes.data(), &raw, sizeof raw);
  return bytes;
}

Result<void> IpcEvent::record(cudaStream_t stream) const {
  return cudaStatus(cudaEventRecord(event_, stream), "cudaEventRecord (interprocess)");
}

Result<void> IpcEvent::wait(cudaStream_t stream) const {
  return cudaStatus(cudaStreamWaitEvent(stream, event_, 0), "cudaStreamWaitEvent (interprocess)");
}

Result<bool> IpcEvent::done() const {
  const cudaError_t status = cudaEventQuery(event_);
  if (status == cudaErrorNotReady) return false;
  if (auto r = cudaStatus(status, "cudaEventQuery (interprocess)"); !r) return r.error();
  return true;
}

}  // namespace dbuf::gpu
