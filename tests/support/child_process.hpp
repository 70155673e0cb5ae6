#pragma once
/// \file
/// A real executable run as a child process (posix_spawn, no shell) with
/// pipes to the test where asked. Include as "support/child_process.hpp"
/// (target dbuf_test_util).
///
/// Two ways to use it:
///   - runChild(): run to the end (or a deadline) with stdout and stderr
///     captured, stdin from /dev/null;
///   - Child: a process driven line by line (send() to its stdin, readLine()
///     from its stdout), signalled, waited for with a deadline, killed.
/// A Child the test did not reap is killed (SIGKILL, by pid) and reaped by its
/// destructor.

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace dbuf::testing {

/// One child process. Every pipe end the test keeps is close-on-exec, so no
/// other child inherits it (a leaked stdin write end would keep a child from
/// ever seeing EOF).
class Child {
 public:
  struct Options {
    bool pipe_stdin = false;   ///< else stdin is /dev/null
    bool pipe_stdout = false;  ///< else inherited
    bool pipe_stderr = false;  ///< else `stderr_path`, or inherited
    std::string stderr_path;   ///< stderr appended to this file (when not piped); empty: inherit
    /// "NAME=value" entries; nullopt: this process's environment.
    std::optional<std::vector<std::string>> environment;
  };

  /// Spawns `executable` with `args` (argv[1..]). Throws std::runtime_error
  /// when it cannot. Piping stdin makes this process ignore SIGPIPE, so that
  /// writing to a child that died does not end the test.
  Child(const std::string& executable, const std::vector<std::string>& args, const Options& options);
  ~Child();
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  Child(Child&&) = delete;
  Child& operator=(Child&&) = delete;

  [[nodiscard]] pid_t pid() const noexcept { return pid_; }
  [[nodiscard]] bool running() const noexcept { return !reaped_; }

  /// Writes `line` and a newline to the child's stdin (a failed write is a
  /// test failure; nothing is written once the child is reaped).
  void send(const std::string& line);
  /// The next line of the child's stdout, or nullopt on EOF or timeout.
  [[nodiscard]] std::optional<std::string> readLine(std::chrono::milliseconds timeout);
  /// Reads the child's stdout and stderr pipes (those it has) to EOF, appending
  /// to `out` and `err`. False if `deadline` came first.
  [[nodiscard]] bool readToEnd(std::string& out, std::string& err, std::chrono::steady_clock::time_point deadline);

  void signal(int signal);
  /// Waits (pidfd + poll) until the child ends and reaps it; its wait status,
  /// or nullopt on timeout (or when it was already reaped).
  [[nodiscard]] std::optional<int> waitExit(std::chrono::milliseconds timeout);
  /// Waits as long as it takes and reaps; the wait status.
  int wait();
  /// SIGKILL, then reap. Returns true if the child died of the SIGKILL.
  bool killAndReap();

 private:
  void closeStdout();

  pid_t pid_ = -1;
  int stdin_fd_ = -1;
  int stdout_fd_ = -1;
  int stderr_fd_ = -1;
  std::string buffer_;  ///< stdout read but not yet returned by readLine
  bool reaped_ = false;
};

struct ChildResult {
  int exit_code = -1;  ///< -1 when the child did not exit normally
  int signal = 0;      ///< the signal that ended it, else 0
  bool timed_out = false;
  std::string out;
  std::string err;
};

/// Runs `executable` with `args` (argv[1..]) to its end, stdin from /dev/null,
/// stdout and stderr captured. Kills the child (SIGKILL, by its pid) if it
/// runs longer than `timeout_ms`.
[[nodiscard]] ChildResult runChild(const std::string& executable, const std::vector<std::string>& args,
                                   int timeout_ms = 30000);

}  // namespace dbuf::testing
