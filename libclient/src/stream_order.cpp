#include "stream_order.hpp"

#include <string>

#include "dbuf/common/stream_counter_word.hpp"

#if defined(DBUF_WITH_CUDA)
#include <utility>

#include "daemon_watch.hpp"
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
                  gpu::StreamCounter done, int device, std::unique_ptr<DaemonWatch> watch)
      : counters_(counters),
        page_(std::move(page)),
        ready_(ready),
        done_(done),
        device_(device),
        next_ticket_(counterValue(counters.ready) + 1),
        watch_(std::move(watch)) {}

  Result<std::uint64_t> order(void* stream) override {
    if (over_ || isPoisoned(counterValue(counters_.done))) {
      over_ = true;
      return makeError(ErrorCode::kConflict,
                       "an earlier stream-ordered op of this session failed or dbufd went away (the error came back "
                       "from wait()): the session's stream ordering is over; detach and attach again");
    }
    const DeviceScope scope;
    if (auto used = gpu::useDevice(device_); !used) return used.error();
    const std::uint64_t ticket = next_ticket_;
    auto* cu_stream = static_cast<CUstream>(stream);
    Result<void> queued = ready_.wait(cu_stream, ticket - 1);
    if (queued) queued = ready_.signal(cu_stream, ticket);
    if (queued) queued = done_.wait(cu_stream, ticket);
    if (!queued) {
      // A ready = ticket may be queued for an op that is never submitted:
      // the next op could not be told apart from it. Over.
      release();
      return queued.error();
    }
    ++next_ticket_;
    return ticket;
  }

  void release() noexcept override {
    over_ = true;
    poisonCounter(counters_.done);
  }

  void stop() noexcept override {
    watch_->stop();
    release();
  }

 private:
  ipc::StreamCounters& counters_;
  gpu::DeviceMappedHost page_;  // unregistered when this goes, before the segment is unmapped
  gpu::StreamCounter ready_;
  gpu::StreamCounter done_;
  int device_;
  std::uint64_t next_ticket_;
  bool over_ = false;
  std::unique_ptr<DaemonWatch> watch_;  // last: stopped first
};

}  // namespace

Result<std::unique_ptr<StreamOrder>> StreamOrder::open(ipc::StreamCounters& counters, int device, int socket) {
  const DeviceScope scope;
  auto page = gpu::registerCounterPages(&counters, ipc::kStreamCountersBytes, device);
  if (!page) return page.error();
  auto ready = gpu::StreamCounter::at(*page, &counters.ready);
  if (!ready) return ready.error();
  auto done = gpu::StreamCounter::at(*page, &counters.done);
  if (!done) return done.error();
  auto watch = DaemonWatch::start([&done = counters.done] { poisonCounter(done); }, socket);
  if (!watch) return watch.error();
  return std::unique_ptr<StreamOrder>(
      std::make_unique<CudaStreamOrder>(counters, std::move(*page), *ready, *done, device, std::move(*watch)));
}

#else

Result<std::unique_ptr<StreamOrder>> StreamOrder::open(ipc::StreamCounters& /*counters*/, int /*device*/,
                                                       int /*socket*/) {
  return makeError(ErrorCode::kUnavailable, "this libdbuf was built without CUDA: it cannot order ops on a stream");
}

#endif

}  // namespace dbuf
