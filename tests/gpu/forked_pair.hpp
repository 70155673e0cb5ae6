#pragma once
// Two processes sharing GPU memory or events, the way dbufd and a trainer
// do: both forked before anything touches CUDA (a CUDA context does not
// survive fork), joined by a socket pair, each returning a step code (0:
// done; kNoGpu: no usable device here). Header-only helpers for tests/gpu.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <utility>

namespace dbuf::testing {

inline constexpr int kNoGpu = 77;

/// One SCM_RIGHTS message: a 64-bit value with room for one fd beside it.
/// Not copyable: the header points into the object.
struct FdMessage {
  std::uint64_t value = 0;
  iovec iov{&value, sizeof value};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};

  FdMessage() {
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
  }
  FdMessage(const FdMessage&) = delete;
  FdMessage& operator=(const FdMessage&) = delete;
};

/// Sends one fd and a 64-bit value (its size) in one SCM_RIGHTS message.
inline bool sendFd(int socket, int fd, std::uint64_t value) {
  FdMessage m;
  m.value = value;
  msghdr& msg = m.msg;
  cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(cmsg), &fd, sizeof fd);
  return sendmsg(socket, &msg, 0) == static_cast<ssize_t>(sizeof value);
}

inline bool receiveFd(int socket, int& fd, std::uint64_t& value) {
  FdMessage m;
  if (recvmsg(socket, &m.msg, 0) != static_cast<ssize_t>(sizeof value)) return false;
  cmsghdr* cmsg = CMSG_FIRSTHDR(&m.msg);
  if (cmsg == nullptr || cmsg->cmsg_type != SCM_RIGHTS) return false;
  std::memcpy(&fd, CMSG_DATA(cmsg), sizeof fd);
  value = m.value;
  return true;
}

/// Runs first(socket) and second(socket) in two forked processes joined by a
/// SOCK_SEQPACKET pair and returns their exit codes (-1: did not exit). Each
/// child closes the other's end, so a child that fails early is EOF to the
/// other, not a hang.
inline std::pair<int, int> runForkedPair(const std::function<int(int)>& first, const std::function<int(int)>& second) {
  int sockets[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sockets) != 0) return {-1, -1};
  const pid_t a = fork();
  if (a == 0) {
    close(sockets[1]);
    _exit(first(sockets[0]));
  }
  const pid_t b = fork();
  if (b == 0) {
    close(sockets[0]);
    _exit(second(sockets[1]));
  }
  close(sockets[0]);
  close(sockets[1]);
  const auto code = [](pid_t pid) {
    int status = 0;
    return waitpid(pid, &status, 0) == pid && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  const int first_code = code(a);
  return {first_code, code(b)};
}

/// The verdict on a pair from runForkedPair: skipped when the first side
/// found no GPU, else both sides must have done every step (`hint`, if any,
/// says what the second side's codes mean).
inline void expectBothDone(std::pair<int, int> codes, const std::string& first, const std::string& second,
                           const std::string& hint = {}) {
  if (codes.first == kNoGpu) GTEST_SKIP() << "no usable CUDA device (cudaGetDeviceCount found none)";
  EXPECT_EQ(codes.first, 0) << first << " failed at step " << codes.first;
  EXPECT_EQ(codes.second, 0) << second << " failed at step " << codes.second << hint;
}

}  // namespace dbuf::testing
