// A session's stream counters in the daemon (CUDA builds): its page of the
// session segment registered for the GPU whose stream writes done.
#include <utility>

#include "dbuf/gpu/device_memory.hpp"
#include "dbuf/gpu/stream_sync.hpp"
#include "executor.hpp"

namespace dbuf::daemon {
namespace {

class CudaSessionCounters final : public SessionCounters {
 public:
  CudaSessionCounters(gpu::DeviceMappedHost page, gpu::StreamCounter done, int device, void* stream)
      : page_(std::move(page)), done_(done), device_(device), stream_(static_cast<CUstream>(stream)) {}

  Result<void> signalDone(std::uint64_t ticket) override {
    // The stream's own GPU current (the data plane's last call may have set another).
    if (auto used = gpu::useDevice(device_); !used) return used;
    return done_.signal(stream_, ticket);
  }

 private:
  gpu::DeviceMappedHost page_;  // unregistered when this goes
  gpu::StreamCounter done_;
  int device_;
  CUstream stream_;
};

}  // namespace

Result<std::unique_ptr<SessionCounters>> cudaSessionCounters(ipc::StreamCounters& counters, int device, void* stream) {
  auto page = gpu::registerCounterPages(&counters, ipc::kStreamCountersBytes, device);
  if (!page) return page.error();
  auto done = gpu::StreamCounter::at(*page, &counters.done);
  if (!done) return done.error();
  return std::unique_ptr<SessionCounters>(
      std::make_unique<CudaSessionCounters>(std::move(*page), *done, device, stream));
}

}  // namespace dbuf::daemon
