#pragma once
/// \file
/// Multi-process test harness: a real `dbufd` started with posix_spawn on a
/// socket in a fresh mkdtemp directory, real trainer processes
/// (`dbuf-mp-rank`) driven line by line over pipes, and counters read from
/// `/proc/<dbufd pid>` (memfds, sockets, mappings).
///
/// Nothing here sleeps to synchronise: a rank answers every command on its
/// stdout pipe and then blocks reading its stdin, so the test knows which
/// stage a process is in when it kills it. The only waits are polls with a
/// deadline for things that are asynchronous to the test by nature (a socket
/// starting to accept, the daemon reclaiming after an EOF).
///
/// Every child is killed (SIGKILL, by pid) and reaped by its destructor if the
/// test did not do it (dbuf::testing::Child); every temp directory is removed
/// (dbuf::testing::TempDir, support/temp_dir.hpp).

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "support/child_process.hpp"
#include "support/temp_dir.hpp"
#include "support/text.hpp"

namespace dbuf::mp {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

inline constexpr milliseconds kReplyTimeout{10000};

using dbuf::testing::Child;
using dbuf::testing::contains;
using dbuf::testing::startsWith;
using dbuf::testing::TempDir;

/// A trainer process (dbuf-mp-rank), see mp_rank.cpp for its commands.
class Rank {
 public:
  /// `uid`: the process drops to this uid (and gid) before doing anything.
  explicit Rank(std::string name, std::optional<uid_t> uid = std::nullopt, std::optional<gid_t> gid = std::nullopt);

  /// Sends `command` and returns its "ok ..." / "err ..." line (skipping
  /// "begin" lines); "<timeout>" or "<eof>" if none came.
  std::string call(const std::string& command, milliseconds timeout = kReplyTimeout);
  /// Sends a command that blocks on other ranks and waits for its "begin" line.
  void begin(const std::string& command);
  /// The "ok" / "err" line of a command started with begin().
  std::string result(milliseconds timeout = kReplyTimeout);

  /// connect + attach; expects both to succeed; returns the attach line.
  std::string attach(const std::string& socket, const std::string& job, std::uint32_t rank, std::uint32_t world_size,
                     bool persistent = false);

  /// The first line of the process ("ok ids ..." / "err ids ...") when started with a uid.
  std::string ids();

  /// kill -9 and reap; expects the process to die of it.
  void kill9();
  /// "exit", then waits for a clean exit.
  void exit();

  [[nodiscard]] pid_t pid() const noexcept { return child_.pid(); }
  [[nodiscard]] const std::string& name() const noexcept { return name_; }

 private:
  std::string name_;
  Child child_;
};

/// Counters of a running daemon, from /proc/<pid>.
struct DaemonCounts {
  int memfds = 0;      ///< open fds that are dbuf memfds ("/memfd:dbuf:...")
  int sockets = 0;     ///< open socket fds (the listener + one per connection)
  int maps_lines = 0;  ///< lines of /proc/<pid>/maps
  int memfd_maps = 0;  ///< of which map a dbuf memfd
  /// Of which map a file (a path: the binary, libraries, memfds): what the
  /// daemon maps itself. Anonymous memory is the allocator's (glibc's, or a
  /// sanitizer runtime's, which grows its regions and shadow as it likes) and
  /// threads' stacks (counted by `threads`).
  int file_maps = 0;
  int threads = 0;  ///< entries of /proc/<pid>/task
  [[nodiscard]] std::string text() const;
};

/// dbufd: from $DBUF_BIN_DIR when set (the GPU bundle's copies), else the
/// one this build made.
[[nodiscard]] std::string dbufdExecutable();

/// A real dbufd on `<dir>/dbufd.sock`, config written to `<dir>/dbufd.toml`,
/// its stderr (the log) in `<dir>/dbufd.log`.
class Daemon {
 public:
  struct Settings {
    int handshake_ms = 20000;
    int register_ms = 30000;
    int grace_period_s = 1;
    bool tenants_by_uid = true;  ///< tenant "a" = uid 0, tenant "b" = uid 65534; else none (the default tenant)
    std::vector<std::string> extra_args;  ///< appended to dbufd's command line (e.g. --backend cuda)
    int collective_ms = 30000;
    std::string extra_config;  ///< TOML appended to the config (e.g. a [cluster] table)
    /// Runs dbufd through this command (e.g. {"ip", "netns", "exec", NAME}:
    /// in a network namespace); it must exec dbufd, keeping its pid.
    std::vector<std::string> launcher;
  };
  Daemon(const std::filesystem::path& dir, const Settings& settings);
  explicit Daemon(const std::filesystem::path& dir) : Daemon(dir, Settings{}) {}
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  /// Spawns dbufd and waits (retrying connect until a deadline) until it accepts.
  void start();
  /// Spawns another dbufd with the same config and socket; runs it to its end
  /// (stderr captured). Returns {wait status, stderr}.
  std::pair<int, std::string> startSecond();

  [[nodiscard]] pid_t pid() const;
  [[nodiscard]] const std::string& socket() const noexcept { return socket_; }
  [[nodiscard]] const std::string& configPath() const noexcept { return config_; }
  [[nodiscard]] std::string log() const;
  [[nodiscard]] Child& process() { return *process_; }

  [[nodiscard]] DaemonCounts counts() const;
  /// Memfds of one job (names "dbuf:<job>:..."); `part` narrows it further:
  /// "<group>:" its shard files ("<group>:<rank>"), "slot:<rank>" a rank's
  /// unsharded slot, "session:<rank>" a rank's session segment (one per
  /// attached rank since protocol 2).
  [[nodiscard]] int memfdsOf(const std::string& job, const std::string& part = "") const;
  /// fd numbers (in the daemon) of the memfds of `job`, narrowed by `part` as
  /// in memfdsOf.
  [[nodiscard]] std::vector<int> memfdNumbers(const std::string& job, const std::string& part = "") const;
  /// A listing of the daemon's fds (for failure messages).
  [[nodiscard]] std::string fdListing() const;

  /// Runs a complete one-rank job (attach, register, write, unshard, reshard,
  /// detach) so every lazily created daemon structure exists, waits until the
  /// daemon is back to just its listener, and records the counts as baseline.
  void warmUpAndTakeBaseline();
  [[nodiscard]] const DaemonCounts& baseline() const noexcept { return baseline_; }

  /// SIGTERM and wait for the exit; returns the wait status (or -1 on timeout).
  int terminate(milliseconds timeout = milliseconds(10000));
  void kill9();

 private:
  [[nodiscard]] std::vector<std::string> commandLine() const;
  std::filesystem::path dir_;
  std::string socket_;
  std::string config_;
  std::string log_;
  std::vector<std::string> extra_args_;
  std::vector<std::string> launcher_;
  std::optional<Child> process_;
  DaemonCounts baseline_;
};

/// Polls `done` until it is true or `timeout` passes (a deadline for work the
/// daemon does asynchronously to the test, never a synchronisation sleep).
bool eventually(const std::function<bool()>& done, milliseconds timeout = milliseconds(5000));

}  // namespace dbuf::mp
