#include "daemon_watch.hpp"

#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>


namespace dbuf {

Result<std::unique_ptr<DaemonWatch>> DaemonWatch::start(std::function<void()> lost, int socket) {
  UniqueFd stop(::eventfd(0, EFD_CLOEXEC));
  if (!stop) return makeError(ErrorCode::kIo, "eventfd: " + std::string(std::strerror(errno)));
  std::unique_ptr<DaemonWatch> watch(new DaemonWatch(std::move(stop)));  // NOLINT: private constructor
  sigset_t all;
  sigset_t previous;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &previous);  // the thread inherits the mask
  watch->thread_ = std::thread([lost = std::move(lost), socket, stop_fd = watch->stop_.get()] {
    pollfd watched[2] = {{socket, POLLRDHUP, 0}, {stop_fd, POLLIN, 0}};
    for (;;) {
      const int ready = ::poll(watched, 2, -1);
      if (ready < 0 && errno == EINTR) continue;
      if (ready < 0 || (watched[1].revents & POLLIN) != 0) return;
      if (watched[0].revents != 0) {  // hang-up, error, or the fd gone (POLLNVAL): never spin on it
        lost();
        return;
      }
    }
  });
  pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  return watch;
}

void DaemonWatch::stop() noexcept {
  if (!thread_.joinable()) return;
  const std::uint64_t one = 1;
  static_cast<void>(::write(stop_.get(), &one, sizeof(one)));
  thread_.join();
}

}  // namespace dbuf
