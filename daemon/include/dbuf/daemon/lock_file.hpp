#pragma once
/// \file
/// Single-instance guard for dbufd: an flock(2) on `<socket path>.lock`.
///
/// The daemon takes the lock before it touches the socket path. While it holds
/// the lock no other dbufd serves that path, so a socket file found there was
/// left behind by a daemon that died and may be unlinked (removeStaleSocket).
/// On shutdown, unlink the socket *before* the LockFile is destroyed, so the
/// next daemon never sees a live socket without a held lock.
///
/// flock locks belong to the open file description: a second acquire() on the
/// same path fails even inside the same process, and the lock is released when
/// the LockFile is destroyed (or the process dies, however it dies). The file
/// itself is kept; it holds the pid of the last daemon that took it.
/// Thread safety: a LockFile is a value type; don't share one between threads
/// without synchronisation. acquire() and removeStaleSocket() are reentrant.

#include <sys/types.h>

#include <string>
#include <utility>

#include "dbuf/common/result.hpp"
#include "dbuf/common/unique_fd.hpp"

namespace dbuf::daemon {

class LockFile {
 public:
  /// Opens or creates `<socket_path>.lock` (mode 0600, close-on-exec, no
  /// symlink following) and takes an exclusive, non-blocking flock. On success
  /// the file holds this process's pid. If another process holds the lock:
  /// kInfeasible, "another dbufd (pid N) holds <lock path>".
  [[nodiscard]] static Result<LockFile> acquire(const std::string& socket_path);

  LockFile(const LockFile&) = delete;
  LockFile& operator=(const LockFile&) = delete;
  LockFile(LockFile&&) noexcept = default;
  LockFile& operator=(LockFile&& other) noexcept;
  /// Releases the lock (explicitly, so a child forked without exec that still
  /// shares the descriptor does not keep it) and closes the file.
  ~LockFile();

  /// Path of the lock file: `<socket_path>.lock`.
  [[nodiscard]] const std::string& path() const noexcept { return path_; }
  /// False only for a moved-from LockFile.
  [[nodiscard]] bool held() const noexcept { return fd_.valid(); }

 private:
  LockFile(UniqueFd fd, std::string path) noexcept : fd_(std::move(fd)), path_(std::move(path)) {}
  void release() noexcept;

  UniqueFd fd_;
  std::string path_;
};

/// Removes a stale socket file left at `socket_path` by a dead daemon. Call it
/// only while holding the LockFile for that path. Succeeds if nothing is there;
/// unlinks the path if it is a socket; refuses (kInvalidArgument) if it is
/// anything else (a regular file, a directory, a symlink), since that is not
/// ours to delete.
[[nodiscard]] Result<void> removeStaleSocket(const std::string& socket_path);

/// Pid written in a lock file, or -1 if there is none (missing, empty,
/// unreadable or garbled). Exposed for `dbufctl` and tests.
[[nodiscard]] pid_t readLockOwner(const std::string& lock_path);

}  // namespace dbuf::daemon
