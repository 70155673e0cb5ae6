// A session's stream counters in the daemon (CUDA builds): its page of the
// session segment registered for the GPU whose stream writes done.
#include <utility>

#include "dbuf/gpu/stream_sync.hpp"
#include "executor.hpp"

namespace dbuf::daemon {
namespace {

class CudaSessionCounters final : public SessionCounters {
 public:
  CudaSessionCounters(gpu::DeviceMappedHost page, gpu::StreamCounter done, void* stream)
      : page_(std::move(page)), done_(done), stream_(static_cast<CUstream>(stream)) {}

  Result<void> signalDone(std::uint64_t ticket) override { return done_.signal(stream_, ticket); }

 private:
  gpu::DeviceMappedHost page_;  // unregistered when this goes
  gpu::StreamCounter done_;
  CUstream stream_;
};

}  // namespace

Result<std::unique_ptr<SessionCounters>> cudaSessionCounters(ipc::StreamCounters& counters, int device, void* stream) {
  auto supported = gpu::streamMemOpsSupported(device);
  if (!supported) return supported.error();
  if (!*supported) {
    return makeError(ErrorCode::kUnavailable, "GPU " + std::to_string(device) +
                                                  " has no 64-bit stream memory operations: stream-ordered ops "
                                                  "cannot run here (order them on the host)");
  }
  auto page = gpu::DeviceMappedHost::registerPages(&counters, ipc::kStreamCountersBytes, device);
  if (!page) return page.error();
  auto done = gpu::StreamCounter::at(*page, &counters.done);
  if (!done) return done.error();
  return std::unique_ptr<SessionCounters>(std::make_unique<CudaSessionCounters>(std::move(*page), *done, stream));
}

}  // namespace dbuf::daemon
