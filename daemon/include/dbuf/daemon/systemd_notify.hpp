#pragma once
/// \file
/// The systemd notify protocol (READY=1, STATUS=..., WATCHDOG=1, STOPPING=1)
/// without libsystemd: one datagram to $NOTIFY_SOCKET. A no-op when not run
/// by systemd. The environment is read once, by the caller, and passed in.

#include <chrono>
#include <optional>
#include <string>

namespace dbuf::daemon {

class SystemdNotifier {
 public:
  /// `notify_socket`: the value of $NOTIFY_SOCKET (empty: not under systemd).
  /// `watchdog_usec`: the value of $WATCHDOG_USEC, if set.
  SystemdNotifier(std::string notify_socket, std::optional<std::string> watchdog_usec);

  void notify(const std::string& state) const;
  [[nodiscard]] bool enabled() const noexcept { return !socket_.empty(); }
  /// Half the watchdog period systemd asked for, if it asked.
  [[nodiscard]] std::optional<std::chrono::milliseconds> heartbeatPeriod() const noexcept { return heartbeat_; }

 private:
  std::string socket_;
  std::optional<std::chrono::milliseconds> heartbeat_;
};

}  // namespace dbuf::daemon
