// LockFile and removeStaleSocket: the single-instance guard of dbufd.
#include "dbuf/daemon/lock_file.hpp"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <optional>
#include <string>

#include "support/temp_dir.hpp"

namespace dbuf::daemon {
namespace {

using dbuf::testing::TempDir;

std::string pidText() {
  return "pid " + std::to_string(::getpid());
}

/// Creates a socket file at `path` the way a daemon that died leaves it:
/// bound, then closed without unlinking.
void leaveSocketFile(const std::string& path) {
  const UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(fd.valid());
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  ASSERT_LT(path.size(), sizeof(address.sun_path));
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  ASSERT_EQ(::bind(fd.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address)), 0)  // NOLINT
      << std::strerror(errno);
}

TEST(LockFile, AcquireWritesOurPid) {
  const TempDir dir;
  const std::string socket = dir.path("dbufd.sock");
  Result<LockFile> lock = LockFile::acquire(socket);
  ASSERT_TRUE(lock.ok()) << lock.error().message;
  EXPECT_TRUE(lock->held());
  EXPECT_EQ(lock->path(), socket + ".lock");
  EXPECT_EQ(readLockOwner(lock->path()), ::getpid());
  struct stat st {};
  ASSERT_EQ(::stat(lock->path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600U);
  EXPECT_FALSE(std::filesystem::exists(socket));  // the lock touches only the .lock file
}

TEST(LockFile, SecondAcquireInTheSameProcessFailsNamingOurPid) {
  // flock locks belong to the open file description: a second open() + flock()
  // conflicts even inside one process.
  const TempDir dir;
  const std::string socket = dir.path("dbufd.sock");
  Result<LockFile> first = LockFile::acquire(socket);
  ASSERT_TRUE(first.ok()) << first.error().message;
  Result<LockFile> second = LockFile::acquire(socket);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.error().code, ErrorCode::kConflict);
  EXPECT_EQ(second.error().message, "another dbufd (" + pidText() + ") holds " + socket + ".lock");
  // The failed attempt must not have clobbered the holder's pid.
  EXPECT_EQ(readLockOwner(socket + ".lock"), ::getpid());
}

TEST(LockFile, AnotherProcessIsRefused) {
  const TempDir dir;
  const std::string socket = dir.path("dbufd.sock");
  Result<LockFile> lock = LockFile::acquire(socket);
  ASSERT_TRUE(lock.ok()) << lock.error().message;
  const std::string expected = "another dbufd (" + pidText() + ") holds " + socket + ".lock";
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The child inherits the locked descriptor too, but its own open() is a
    // new open file description and must conflict.
    Result<LockFile> theirs = LockFile::acquire(socket);
    ::_exit(!theirs.ok() && theirs.error().message == expected ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(LockFile, ReleasedOnDestruction) {
  const TempDir dir;
  const std::string socket = dir.path("dbufd.sock");
  {
    Result<LockFile> lock = LockFile::acquire(socket);
    ASSERT_TRUE(lock.ok()) << lock.error().message;
  }
  EXPECT_TRUE(std::filesystem::exists(socket + ".lock"));  // the file is kept
  Result<LockFile> again = LockFile::acquire(socket);
  EXPECT_TRUE(again.ok()) << again.error().message;
}

TEST(LockFile, MovesKeepTheLock) {
  const TempDir dir;
  const std::string socket_a = dir.path("a.sock");
  const std::string socket_b = dir.path("b.sock");
  Result<LockFile> a = LockFile::acquire(socket_a);
  ASSERT_TRUE(a.ok());
  LockFile moved = std::move(*a);
  EXPECT_FALSE(a->held());  // NOLINT(bugprone-use-after-move): checking the moved-from state
  EXPECT_TRUE(moved.held());
  EXPECT_FALSE(LockFile::acquire(socket_a).ok());

  Result<LockFile> b = LockFile::acquire(socket_b);
  ASSERT_TRUE(b.ok());
  moved = std::move(*b);  // releases a, now holds b
  EXPECT_EQ(moved.path(), socket_b + ".lock");
  EXPECT_TRUE(LockFile::acquire(socket_a).ok());
  EXPECT_FALSE(LockFile::acquire(socket_b).ok());
}

TEST(LockFile, LeftoverPidFromADeadDaemonIsReplaced) {
  const TempDir dir;
  const std::string socket = dir.path("dbufd.sock");
  dir.write("dbufd.sock.lock", "999999999\n");
  Result<LockFile> lock = LockFile::acquire(socket);
  ASSERT_TRUE(lock.ok()) << lock.error().message;
  EXPECT_EQ(readLockOwner(lock->path()), ::getpid());
}

TEST(LockFile, MissingDirectoryIsAnIoError) {
  const TempDir dir;
  Result<LockFile> lock = LockFile::acquire(dir.path("no/such/dir/dbufd.sock"));
  ASSERT_FALSE(lock.ok());
  EXPECT_EQ(lock.error().code, ErrorCode::kIo);
  EXPECT_NE(lock.error().message.find("dbufd.sock.lock"), std::string::npos);
}

TEST(LockFile, DoesNotFollowSymlinks) {
  const TempDir dir;
  const std::string victim = dir.write("victim", "precious");
  std::filesystem::create_symlink(victim, dir.path("dbufd.sock.lock"));
  Result<LockFile> lock = LockFile::acquire(dir.path("dbufd.sock"));
  ASSERT_FALSE(lock.ok());
  EXPECT_EQ(std::filesystem::file_size(victim), 8U);
}

TEST(LockFile, ReadLockOwnerOfNothing) {
  const TempDir dir;
  EXPECT_EQ(readLockOwner(dir.path("absent")), -1);
  EXPECT_EQ(readLockOwner(dir.write("empty", "")), -1);
  EXPECT_EQ(readLockOwner(dir.write("garbled", "12ab\n")), -1);
}

TEST(RemoveStaleSocket, RemovesASocketFile) {
  const TempDir dir;
  const std::string socket = dir.path("dbufd.sock");
  leaveSocketFile(socket);
  ASSERT_TRUE(std::filesystem::is_socket(socket));
  Result<void> removed = removeStaleSocket(socket);
  EXPECT_TRUE(removed.ok()) << removed.error().message;
  EXPECT_FALSE(std::filesystem::exists(socket));
}

TEST(RemoveStaleSocket, RefusesARegularFile) {
  const TempDir dir;
  const std::string path = dir.write("dbufd.sock", "not a socket");
  Result<void> removed = removeStaleSocket(path);
  ASSERT_FALSE(removed.ok());
  EXPECT_EQ(removed.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(removed.error().message.find("is not a socket"), std::string::npos);
  EXPECT_TRUE(std::filesystem::exists(path));
}

TEST(RemoveStaleSocket, RefusesADirectoryAndASymlinkToASocket) {
  const TempDir dir;
  std::filesystem::create_directory(dir.path("d"));
  EXPECT_FALSE(removeStaleSocket(dir.path("d")).ok());
  EXPECT_TRUE(std::filesystem::exists(dir.path("d")));

  leaveSocketFile(dir.path("real.sock"));
  std::filesystem::create_symlink(dir.path("real.sock"), dir.path("link.sock"));
  EXPECT_FALSE(removeStaleSocket(dir.path("link.sock")).ok());
  EXPECT_TRUE(std::filesystem::is_socket(dir.path("real.sock")));
}

TEST(RemoveStaleSocket, MissingPathIsFine) {
  const TempDir dir;
  EXPECT_TRUE(removeStaleSocket(dir.path("absent.sock")).ok());
}

}  // namespace
}  // namespace dbuf::daemon
