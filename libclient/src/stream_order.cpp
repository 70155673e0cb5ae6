#include "stream_order.hpp"

#include <string>

#include "dbuf/common/stream_counter_word.hpp"

#if defined(DBUF_WITH_CUDA)
#include <utility>

#include "dbuf/gpu/device_memory.hpp"
#include "dbuf/gpu/stream_sync.hpp"
#include "device_scope.hpp"
#endif

namespace dbuf {

#if defined(DBUF_WITH_CUDA)
namespace {

class CudaStreamOrder final : public StreamOrder {
 public:
  CudaStreamOrder(ipc::StreamCounters& counters, gpu::DeviceMappedHost page, gpu::StreamCounter ready,
                  gpu::StreamCounter done, int device)
      : counters_(counters),
        page_(std::move(page)),
        ready_(ready),
        done_(done),
        device_(device),
        next_ticket_(counterValue(counters.ready) + 1) {}

  Result<std::uint64_t> order(void* stream) override {
    if (isPoisoned(counterValue(counters_.done))) {
      return makeError(ErrorCode::kConflict,
                       "an earlier stream-ordered op of this session failed (its error came back from wait()): "
                       "the session's stream ordering is over; detach and attach again");
    }
    const DeviceScope scope;
    if (auto used = gpu::useDevice(device_); !used) return used.error();
    const std::uint64_t ticket = next_ticket_;
    auto* cu_stream = static_cast<CUstream>(stream);
    if (auto r = ready_.signal(cu_stream, ticket); !r) return r.error();
    if (auto r = done_.wait(cu_stream, ticket); !r) {
      abandon();  // the ready above may still reach dbufd: nothing must wait for this ticket
      return r.error();
    }
    ++next_ticket_;
    return ticket;
  }

  void abandon() noexcept override { poisonCounter(counters_.done); }

 private:
  ipc::StreamCounters& counters_;
  gpu::DeviceMappedHost page_;  // unregistered when this goes, before the segment is unmapped
  gpu::StreamCounter ready_;
  gpu::StreamCounter done_;
  int device_;
  std::uint64_t next_ticket_;
};

}  // namespace

Result<std::unique_ptr<StreamOrder>> StreamOrder::open(ipc::StreamCounters& counters, int device) {
  const DeviceScope scope;
  auto supported = gpu::streamMemOpsSupported(device);
  if (!supported) return supported.error();
  if (!*supported) {
    return makeError(ErrorCode::kUnavailable, "GPU " + std::to_string(device) +
                                                  " has no 64-bit stream memory operations: order ops on the host "
                                                  "(synchronise the stream, submit, wait)");
  }
  auto page = gpu::DeviceMappedHost::registerPages(&counters, ipc::kStreamCountersBytes, device);
  if (!page) return page.error();
  auto ready = gpu::StreamCounter::at(*page, &counters.ready);
  if (!ready) return ready.error();
  auto done = gpu::StreamCounter::at(*page, &counters.done);
  if (!done) return done.error();
  return std::unique_ptr<StreamOrder>(
      std::make_unique<CudaStreamOrder>(counters, std::move(*page), *ready, *done, device));
}

#else

Result<std::unique_ptr<StreamOrder>> StreamOrder::open(ipc::StreamCounters& /*counters*/, int /*device*/) {
  return makeError(ErrorCode::kUnavailable, "this libdbuf was built without CUDA: it cannot order ops on a stream");
}

#endif

}  // namespace dbuf
