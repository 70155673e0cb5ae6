#pragma once
/// \file
/// dbufd as a library: the control-plane server. One Unix socket, one
/// persistent connection per rank; jobs, groups and their shared memory.
///
/// Threading: all state lives on one Asio event loop; `run()` drives it on the
/// calling thread. `requestStop()` is the only member safe to call from
/// another thread (or a signal handler context via Asio's signal_set).
/// Tests embed a Server on a thread with a unique socket path.

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "dbuf/common/result.hpp"
#include "dbuf/daemon/config.hpp"

namespace dbuf::daemon {

/// Counters for tests and `dbufctl status` (read on the loop thread, or after
/// run() returned).
struct ServerStats {
  std::size_t sessions = 0;        ///< attached connections
  std::size_t jobs = 0;            ///< live or persisting jobs
  std::size_t memfds = 0;          ///< shared-memory files the daemon holds open
  std::uint64_t bytes_in_use = 0;  ///< charged against the memory limit
};

class Server {
 public:
  /// Binds the socket (after taking the lock file beside it and removing a
  /// stale socket); nothing runs until `run()`.
  [[nodiscard]] static Result<std::unique_ptr<Server>> create(Config config);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  /// Serves until `requestStop()` (or SIGTERM / SIGINT when `handle_signals`),
  /// then tells clients it is shutting down, frees everything and removes
  /// its socket.
  void run(bool handle_signals = false);

  /// Calls `beat` on the loop thread every `period` while serving (the
  /// systemd watchdog: a stuck loop stops the beats). Call before run().
  void setHeartbeat(std::chrono::milliseconds period, std::function<void()> beat);

  /// Where a reload reads the configuration (the daemon's file and flags,
  /// layered as at start). With handle_signals, SIGHUP reloads: the tenants
  /// (who belongs, quotas, job limits), [admin] and the log level take effect
  /// at once; other keys that changed are logged as needing a restart; a
  /// configuration with errors is logged and changes nothing. Call before run().
  void setConfigSource(std::function<Result<Config>()> source);

  /// Thread-safe: asks the loop to stop (returns at once).
  void requestStop();

  /// Thread-safe snapshot of the counters (taken on the loop).
  [[nodiscard]] ServerStats stats();

  [[nodiscard]] const std::string& socketPath() const noexcept;
  [[nodiscard]] std::uint64_t instanceId() const noexcept;

 private:
  class Impl;
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// Threads an ended job left running (NCCL's set-up of its communicators
/// cannot be interrupted; it ends, and cleans up, on its own thread). While
/// any runs, a process ends with std::_Exit rather than by returning from
/// main: static destructors and CUDA's teardown would run under it.
[[nodiscard]] int abandonedThreads() noexcept;

}  // namespace dbuf::daemon
