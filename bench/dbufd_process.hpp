#pragma once
// A real dbufd for the benchmarks: a temp directory under /tmp with a config
// (socket, busy-poll, memory limit, one tenant for this uid), the daemon
// forked + exec'd (optionally pinned to one core), its log in
// <dir>/dbufd.log. Ready once its socket accepts a connection. The
// destructor stops it (SIGTERM, then SIGKILL by its pid after 5 s) and
// removes the directory.

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dbuf::bench {

struct DaemonSettings {
  std::uint32_t busy_poll_us = 50;  ///< [rings] busy_poll_us
  int cpu = -1;                     ///< pin the daemon to this core; -1: not pinned
  std::string memory_limit = "64GiB";
  std::string memory_quota = "64GiB";  ///< the tenant of this uid
  std::uint32_t collective_ms = 120000;
  std::string log_level = "warn";
  std::vector<std::string> extra_args;  ///< appended to dbufd's command line (e.g. --backend cuda)
};

class DaemonProcess {
 public:
  /// Starts `executable`; on failure `error()` says why and `ok()` is false.
  DaemonProcess(const std::string& executable, const DaemonSettings& settings);
  ~DaemonProcess();
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;

  [[nodiscard]] bool ok() const noexcept { return pid_ > 0 && error_.empty(); }
  [[nodiscard]] const std::string& error() const noexcept { return error_; }
  [[nodiscard]] pid_t pid() const noexcept { return pid_; }
  [[nodiscard]] const std::string& socket() const noexcept { return socket_; }
  [[nodiscard]] const std::string& directory() const noexcept { return dir_; }
  /// The tail of the daemon's log (for error messages).
  [[nodiscard]] std::string logTail(std::size_t bytes = 2000) const;

  /// SIGTERM and wait; returns true on a clean exit.
  bool stop();

 private:
  std::string dir_;
  std::string socket_;
  std::string config_;
  std::string log_;
  std::string error_;
  pid_t pid_ = -1;
};

/// Where the benchmarks find dbufd: $DBUFD if set, else the compile-time
/// path of the build's dbufd (DBUF_BENCH_DBUFD_EXE), else "dbufd" beside
/// this executable.
[[nodiscard]] std::string dbufdExecutable();

}  // namespace dbuf::bench
