#pragma once
// A thread that acts at once when dbufd's end of the connection closes (it
// died, or it closed the session): the connection wakes its waits with it, so
// that a wait on the rings learns that the daemon is gone in microseconds,
// not at its next periodic check; stream ordering poisons a stream counter
// (dbuf/common/stream_counter_word.hpp) with it, so that no CUDA stream waits
// for a daemon that is gone. Reads nothing from the socket: the connection's
// replies stay the connection's. Signals are blocked in the thread (they stay
// with the trainer's threads).

#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "dbuf/common/result.hpp"
#include "dbuf/common/unique_fd.hpp"

namespace dbuf {

class DaemonWatch {
 public:
  /// Watches `socket` (which must stay open until stop()); calls `lost`, on
  /// the watch's thread, once it closes. `lost` must be safe to run beside
  /// the connection's other threads, and what it touches must outlive stop().
  [[nodiscard]] static Result<std::unique_ptr<DaemonWatch>> start(std::function<void()> lost, int socket);
  ~DaemonWatch() { stop(); }
  DaemonWatch(const DaemonWatch&) = delete;
  DaemonWatch& operator=(const DaemonWatch&) = delete;

  /// Ends the watch (idempotent); returns once the thread has.
  void stop() noexcept;

 private:
  explicit DaemonWatch(UniqueFd stop) : stop_(std::move(stop)) {}
  UniqueFd stop_;  // an eventfd: written to end the watch
  std::thread thread_;
};

}  // namespace dbuf
