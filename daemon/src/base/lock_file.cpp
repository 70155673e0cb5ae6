#include "dbuf/daemon/lock_file.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <charconv>
#include <system_error>

namespace dbuf::daemon {
namespace {

std::string errnoText(int err) {
  return std::generic_category().message(err);
}

Error ioError(std::string what, int err) {
  return makeError(ErrorCode::kIo, std::move(what) + ": " + errnoText(err));
}

/// Parses the decimal pid at the start of the lock file ("1234\n").
pid_t readPid(int fd) {
  std::array<char, 32> buffer{};
  ssize_t n = 0;
  do {
    n = ::pread(fd, buffer.data(), buffer.size() - 1, 0);
  } while (n < 0 && errno == EINTR);
  if (n <= 0) return -1;
  const char* end = buffer.data() + n;
  pid_t pid = -1;
  const auto [next, ec] = std::from_chars(buffer.data(), end, pid);
  if (ec != std::errc{} || pid <= 0 || (next != end && *next != '\n')) return -1;
  return pid;
}

}  // namespace

Result<LockFile> LockFile::acquire(const std::string& socket_path) {
  std::string path = socket_path + ".lock";
  // O_NOFOLLOW: the runtime directory may be shared; never lock (or truncate)
  // whatever a planted symlink points at.
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW,
                     0600));  // NOLINT(cppcoreguidelines-pro-type-vararg)
  if (!fd) return ioError("cannot open lock file '" + path + "'", errno);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return ioError("cannot stat lock file '" + path + "'", errno);
  if (!S_ISREG(st.st_mode)) return makeError(ErrorCode::kIo, "lock file '" + path + "' is not a regular file");

  int rc = 0;
  do {
    rc = ::flock(fd.get(), LOCK_EX | LOCK_NB);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int err = errno;
    if (err != EWOULDBLOCK) return ioError("cannot lock '" + path + "'", err);
    // The holder writes its pid right after locking; in that short window the
    // file may still be empty (or hold the previous owner's pid).
    const pid_t owner = readPid(fd.get());
    const std::string who = owner > 0 ? "pid " + std::to_string(owner) : "pid unknown";
    return makeError(ErrorCode::kConflict, "another dbufd (" + who + ") holds " + path);
  }

  const std::string pid_text = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd.get(), 0) != 0) return ioError("cannot truncate lock file '" + path + "'", errno);
  ssize_t written = 0;
  do {
    written = ::pwrite(fd.get(), pid_text.data(), pid_text.size(), 0);
  } while (written < 0 && errno == EINTR);
  if (written != static_cast<ssize_t>(pid_text.size())) {
    return ioError("cannot write pid to lock file '" + path + "'", written < 0 ? errno : EIO);
  }
  return LockFile(std::move(fd), std::move(path));
}

LockFile& LockFile::operator=(LockFile&& other) noexcept {
  if (this != &other) {
    release();
    fd_ = std::move(other.fd_);
    path_ = std::move(other.path_);
  }
  return *this;
}

LockFile::~LockFile() {
  release();
}

void LockFile::release() noexcept {
  if (!fd_) return;
  ::flock(fd_.get(), LOCK_UN);
  fd_.reset();
}

Result<void> removeStaleSocket(const std::string& socket_path) {
  struct stat st {};
  if (::lstat(socket_path.c_str(), &st) != 0) {
    if (errno == ENOENT) return {};
    return ioError("cannot inspect '" + socket_path + "'", errno);
  }
  if (!S_ISSOCK(st.st_mode)) {
    return makeError(ErrorCode::kInvalidArgument,
                     "'" + socket_path + "' exists and is not a socket; refusing to remove it");
  }
  if (::unlink(socket_path.c_str()) != 0 && errno != ENOENT) {
    return ioError("cannot remove stale socket '" + socket_path + "'", errno);
  }
  return {};
}

pid_t readLockOwner(const std::string& lock_path) {
  const UniqueFd fd(
      ::open(lock_path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));  // NOLINT(cppcoreguidelines-pro-type-vararg)
  if (!fd) return -1;
  return readPid(fd.get());
}

}  // namespace dbuf::daemon
