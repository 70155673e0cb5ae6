#include "dbuf/daemon/systemd_notify.hpp"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <charconv>
#include <cstring>

#include "dbuf/common/unique_fd.hpp"

namespace dbuf::daemon {

SystemdNotifier::SystemdNotifier(std::string notify_socket, std::optional<std::string> watchdog_usec)
    : socket_(std::move(notify_socket)) {
  if (!watchdog_usec) return;
  std::uint64_t usec = 0;
  const auto* end = watchdog_usec->data() + watchdog_usec->size();
  if (std::from_chars(watchdog_usec->data(), end, usec).ec == std::errc() && usec >= 2000) {
    heartbeat_ = std::chrono::milliseconds(usec / 2000);
  }
}

void SystemdNotifier::notify(const std::string& state) const {
  if (socket_.empty() || socket_.size() >= sizeof(sockaddr_un::sun_path)) return;
  UniqueFd fd(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!fd) return;
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, socket_.data(), socket_.size());
  if (address.sun_path[0] == '@') address.sun_path[0] = '\0';  // abstract namespace
  const auto length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + socket_.size());
  // Best effort: systemd's own tooling ignores failures here too.
  (void)::sendto(fd.get(), state.data(), state.size(), MSG_NOSIGNAL, reinterpret_cast<sockaddr*>(&address), length);
}

}  // namespace dbuf::daemon
