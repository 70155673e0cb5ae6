#include "stream_order.hpp"

#include <string>

#include "dbuf/common/stream_counter_word.hpp"

#if defined(DBUF_WITH_CUDA)
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>
#include <utility>

#include "dbuf/common/unique_fd.hpp"
#include "dbuf/gpu/device_memory.hpp"
#include "dbuf/gpu/stream_sync.hpp"
#include "device_scope.hpp"
#endif

namespace dbuf {

#if defined(DBUF_WITH_CUDA)
namespace {

/// Poisons `done` when dbufd's end of `socket` closes (it died, or it closed
/// the session), until stopped. Reads nothing from the socket: the
/// connection's replies stay the connection's.
class DaemonWatch {
 public:
  DaemonWatch(std::uint64_t& done, int socket, UniqueFd stop) : stop_(std::move(stop)) {
    // Signals stay with the trainer's threads.
    sigset_t all;
    sigset_t previous;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &previous);
    thread_ = std::thread([&done, socket, stop_fd = stop_.get()] {
      pollfd watched[2] = {{socket, POLLRDHUP, 0}, {stop_fd, POLLIN, 0}};
      for (;;) {
        const int ready = ::poll(watched, 2, -1);
        if (ready < 0 && errno == EINTR) continue;
        if (ready < 0 || (watched[1].revents & POLLIN) != 0) return;
        if (watched[0].revents != 0) {  // hang-up, error, or the fd gone (POLLNVAL)
          poisonCounter(done);
          return;
        }
      }
    });
    pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  }
  ~DaemonWatch() { stop(); }
  DaemonWatch(const DaemonWatch&) = delete;
  DaemonWatch& operator=(const DaemonWatch&) = delete;

  void stop() noexcept {
    if (!thread_.joinable()) return;
    const std::uint64_t one = 1;
    static_cast<void>(::write(stop_.get(), &one, sizeof(one)));
    thread_.join();
  }

 private:
  UniqueFd stop_;
  std::thread thread_;
};

class CudaStreamOrder final : public StreamOrder {
 public:
  CudaStreamOrder(ipc::StreamCounters& counters, gpu::DeviceMappedHost page, gpu::StreamCounter ready,
                  gpu::StreamCounter done, int device, int socket, UniqueFd stop)
      : counters_(counters),
        page_(std::move(page)),
        ready_(ready),
        done_(done),
        device_(device),
        next_ticket_(counterValue(counters.ready) + 1),
        watch_(counters.done, socket, std::move(stop)) {}

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
    watch_.stop();
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
  DaemonWatch watch_;  // last: stopped first
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
  UniqueFd stop(::eventfd(0, EFD_CLOEXEC));
  if (!stop) return makeError(ErrorCode::kIo, "eventfd: " + std::string(std::strerror(errno)));
  return std::unique_ptr<StreamOrder>(
      std::make_unique<CudaStreamOrder>(counters, std::move(*page), *ready, *done, device, socket, std::move(stop)));
}

#else

Result<std::unique_ptr<StreamOrder>> StreamOrder::open(ipc::StreamCounters& /*counters*/, int /*device*/,
                                                       int /*socket*/) {
  return makeError(ErrorCode::kUnavailable, "this libdbuf was built without CUDA: it cannot order ops on a stream");
}

#endif

}  // namespace dbuf
