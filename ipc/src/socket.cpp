#include "dbuf/ipc/socket.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstring>
#include <thread>
#include <utility>

namespace dbuf::ipc {
namespace {

Error systemError(const std::string& what, int error_number) {
  return makeError(ErrorCode::kIo, what + ": " + std::strerror(error_number));
}

/// Milliseconds until `deadline`, rounded up so that we never wake just before
/// it and report a timeout early; 0 once it has passed.
int millisecondsUntil(Clock::time_point deadline) {
  const auto left = deadline - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
  return static_cast<int>(std::min<std::chrono::milliseconds::rep>(ms, INT_MAX));
}

/// Waits until `socket` is ready for `events` or the deadline passes. Errors
/// and hang-ups count as ready: the next send/recv reports them precisely.
Result<void> waitFor(int socket, short events, Clock::time_point deadline, const char* what) {
  for (;;) {
    pollfd entry{socket, events, 0};
    const int timeout = millisecondsUntil(deadline);
    const int ready = ::poll(&entry, 1, timeout);
    if (ready > 0) {
      if ((entry.revents & POLLNVAL) != 0) {
        return makeError(ErrorCode::kInvalidArgument, std::string(what) + ": not an open file descriptor");
      }
      return {};
    }
    if (ready == 0) {
      if (Clock::now() >= deadline) return makeError(ErrorCode::kTimeout, std::string(what) + ": timed out");
      continue;  // poll rounds down in places; wait out the remainder
    }
    if (errno != EINTR) return systemError(std::string(what) + ": poll", errno);
  }
}

// Control buffer big enough for the most fds the kernel passes in one message
// (SCM_MAX_FD), so a peer sending too many cannot make us lose track of any:
// we own and close every one we receive.
constexpr std::size_t kScmMaxFd = 253;
constexpr std::size_t kReceiveControlBytes = CMSG_SPACE(kScmMaxFd * sizeof(int));
constexpr std::size_t kSendControlBytes = CMSG_SPACE(kMaxFdsPerFrame * sizeof(int));

union ReceiveControl {
  cmsghdr align;
  std::array<unsigned char, kReceiveControlBytes> bytes;
};

union SendControl {
  cmsghdr align;
  std::array<unsigned char, kSendControlBytes> bytes;
};

/// Takes ownership of every fd in the control messages of `message`.
void collectFds(msghdr& message, std::vector<UniqueFd>& fds) {
  for (cmsghdr* control = CMSG_FIRSTHDR(&message); control != nullptr; control = CMSG_NXTHDR(&message, control)) {
    if (control->cmsg_level != SOL_SOCKET || control->cmsg_type != SCM_RIGHTS) continue;
    const std::size_t data_bytes = control->cmsg_len - CMSG_LEN(0);
    const std::size_t count = data_bytes / sizeof(int);
    const unsigned char* data = CMSG_DATA(control);
    for (std::size_t i = 0; i < count; ++i) {
      int fd = -1;
      std::memcpy(&fd, data + i * sizeof(int), sizeof(int));
      fds.emplace_back(fd);
    }
  }
}

/// Reads exactly `buffer.size()` bytes, adding every fd that arrives to `fds`.
/// `already` is how many bytes of the frame came before `buffer` (for messages).
Result<void> receiveExactly(int socket, std::span<std::byte> buffer, std::vector<UniqueFd>& fds,
                            Clock::time_point deadline, const char* what, std::size_t already,
                            std::size_t frame_bytes) {
  std::size_t done = 0;
  while (done < buffer.size()) {
    iovec io{buffer.data() + done, buffer.size() - done};
    ReceiveControl control{};
    msghdr message{};
    message.msg_iov = &io;
    message.msg_iovlen = 1;
    message.msg_control = control.bytes.data();
    message.msg_controllen = control.bytes.size();
    const ssize_t got = ::recvmsg(socket, &message, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (got < 0) {
      const int error_number = errno;
      if (error_number == EINTR) continue;
      if (error_number == EAGAIN || error_number == EWOULDBLOCK) {
        if (auto ready = waitFor(socket, POLLIN, deadline, what); !ready) return ready;
        continue;
      }
      return systemError(std::string(what) + ": recvmsg", error_number);
    }
    collectFds(message, fds);  // before any check, so nothing leaks
    if ((message.msg_flags & MSG_CTRUNC) != 0) {
      return makeError(ErrorCode::kIo, std::string(what) + ": control data truncated (MSG_CTRUNC)");
    }
    if (fds.size() > kMaxFdsPerFrame) {
      return makeError(ErrorCode::kInvalidArgument, std::string(what) + ": frame carries " +
                                                        std::to_string(fds.size()) + " file descriptors, at most " +
                                                        std::to_string(kMaxFdsPerFrame) + " allowed");
    }
    if (got == 0) {
      if (already + done == 0) return makeError(ErrorCode::kIo, "connection closed");
      return makeError(ErrorCode::kIo, "connection closed mid-frame after " + std::to_string(already + done) + " of " +
                                           std::to_string(frame_bytes) + " bytes");
    }
    done += static_cast<std::size_t>(got);
  }
  return {};
}

}  // namespace

Result<UniqueFd> connectUnix(const std::string& path, Clock::time_point deadline) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path.empty()) return makeError(ErrorCode::kInvalidArgument, "socket path is empty");
  if (path.find('\0') != std::string::npos) {
    return makeError(ErrorCode::kInvalidArgument,
                     "socket path '" + path.substr(0, path.find('\0')) + "...' contains a NUL byte");
  }
  if (path.size() >= sizeof(address.sun_path)) {
    return makeError(ErrorCode::kInvalidArgument, "socket path '" + path + "' is " + std::to_string(path.size()) +
                                                      " bytes; Unix sockets allow at most " +
                                                      std::to_string(sizeof(address.sun_path) - 1));
  }
  std::memcpy(address.sun_path, path.data(), path.size());
  const auto address_bytes = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path.size() + 1);

  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) return systemError("socket(AF_UNIX)", errno);
  const std::string what = "connect to " + path;
  for (;;) {
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): the sockets API
    if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&address), address_bytes) == 0) break;
    const int error_number = errno;
    if (error_number == EINTR) continue;
    if (error_number == EISCONN) break;  // an interrupted attempt completed meanwhile
    if (error_number == EAGAIN) {
      // A Unix socket whose backlog is full: nothing is in progress, so there
      // is nothing to poll for; retry shortly until the deadline.
      if (Clock::now() >= deadline) return makeError(ErrorCode::kIo, what + ": timed out (listen backlog full)");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    if (error_number == EINPROGRESS) {
      if (auto ready = waitFor(fd.get(), POLLOUT, deadline, what.c_str()); !ready) return std::move(ready).error();
      int so_error = 0;
      socklen_t length = sizeof(so_error);
      if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &so_error, &length) != 0) {
        return systemError(what + ": getsockopt(SO_ERROR)", errno);
      }
      if (so_error != 0) return systemError(what, so_error);
      break;
    }
    if (error_number == ENOENT) {
      return makeError(ErrorCode::kNotFound, what + ": no such socket (is dbufd running?)");
    }
    if (error_number == ECONNREFUSED) {
      return makeError(ErrorCode::kIo, what + ": connection refused (nobody is listening; is dbufd running?)");
    }
    return systemError(what, error_number);
  }
  // Hand back a blocking socket, the ordinary kind; our own send and receive
  // helpers use MSG_DONTWAIT and poll, so they honour deadlines either way.
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags < 0 || ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK) != 0) {
    return systemError(what + ": fcntl(O_NONBLOCK)", errno);
  }
  return fd;
}

Result<std::size_t> sendSome(int socket, std::span<const std::byte> bytes, std::span<const int> fds) {
  if (fds.size() > kMaxFdsPerFrame) {
    return makeError(ErrorCode::kInvalidArgument, "cannot send " + std::to_string(fds.size()) +
                                                      " file descriptors in one frame; at most " +
                                                      std::to_string(kMaxFdsPerFrame));
  }
  if (bytes.empty()) {
    if (!fds.empty()) {
      return makeError(ErrorCode::kInvalidArgument, "file descriptors need at least one byte to travel with");
    }
    return std::size_t{0};
  }
  iovec io{const_cast<std::byte*>(bytes.data()), bytes.size()};  // sendmsg does not write through it
  msghdr message{};
  message.msg_iov = &io;
  message.msg_iovlen = 1;
  SendControl control{};
  if (!fds.empty()) {
    message.msg_control = control.bytes.data();
    message.msg_controllen = CMSG_SPACE(fds.size() * sizeof(int));
    cmsghdr* header = CMSG_FIRSTHDR(&message);
    header->cmsg_level = SOL_SOCKET;
    header->cmsg_type = SCM_RIGHTS;
    header->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
    std::memcpy(CMSG_DATA(header), fds.data(), fds.size() * sizeof(int));
  }
  for (;;) {
    const ssize_t sent = ::sendmsg(socket, &message, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (sent >= 0) return static_cast<std::size_t>(sent);
    const int error_number = errno;
    if (error_number == EINTR) continue;
    if (error_number == EAGAIN || error_number == EWOULDBLOCK) return std::size_t{0};
    if (error_number == EPIPE || error_number == ECONNRESET) {
      return makeError(ErrorCode::kIo, "send: connection closed by peer");
    }
    return systemError("sendmsg", error_number);
  }
}

Result<void> sendAll(int socket, std::span<const std::byte> bytes, std::span<const int> fds,
                     Clock::time_point deadline) {
  std::span<const int> pending_fds = fds;
  std::size_t done = 0;
  if (bytes.empty() && !fds.empty()) {
    return makeError(ErrorCode::kInvalidArgument, "file descriptors need at least one byte to travel with");
  }
  while (done < bytes.size()) {
    auto sent = sendSome(socket, bytes.subspan(done), pending_fds);
    if (!sent) return std::move(sent).error();
    if (*sent > 0) {
      pending_fds = {};  // they went with the first byte
      done += *sent;
      continue;
    }
    if (auto ready = waitFor(socket, POLLOUT, deadline, "send"); !ready) return ready;
  }
  return {};
}

Result<void> sendMessage(int socket, const Message& message, std::uint64_t request_id, std::span<const int> fds,
                         Clock::time_point deadline) {
  auto frame = encodeFrame(message, request_id);
  if (!frame) return std::move(frame).error();
  return sendAll(socket, *frame, fds, deadline);
}

Result<ReceivedFrame> receiveMessage(int socket, Clock::time_point deadline) {
  std::vector<UniqueFd> fds;
  std::array<std::byte, kHeaderBytes> head{};
  if (auto got = receiveExactly(socket, head, fds, deadline, "receive frame header", 0, kHeaderBytes); !got) {
    return std::move(got).error();
  }
  auto header = decodeHeader(head);
  if (!header) return std::move(header).error();
  std::vector<std::byte> payload(header->payload_bytes);  // <= kMaxPayloadBytes, checked by decodeHeader
  if (auto got = receiveExactly(socket, payload, fds, deadline, "receive frame payload", kHeaderBytes,
                                kHeaderBytes + payload.size());
      !got) {
    return std::move(got).error();
  }
  auto message = decodePayload(header->type, payload);
  if (!message) return std::move(message).error();
  return ReceivedFrame{*header, std::move(*message), std::move(fds)};
}

Result<PeerCredentials> peerCredentials(int socket) {
  ucred credentials{};
  socklen_t length = sizeof(credentials);
  if (::getsockopt(socket, SOL_SOCKET, SO_PEERCRED, &credentials, &length) != 0) {
    return systemError("getsockopt(SO_PEERCRED)", errno);
  }
  if (length != sizeof(credentials)) {
    return makeError(ErrorCode::kIo, "getsockopt(SO_PEERCRED): unexpected length " + std::to_string(length));
  }
  return PeerCredentials{credentials.pid, credentials.uid, credentials.gid};
}

Result<std::vector<std::uint32_t>> peerGroups(int socket) {
  // The kernel says how much room the list needs when it is short of it (ERANGE).
  std::vector<gid_t> groups(16);
  for (int attempt = 0; attempt < 4; ++attempt) {
    auto length = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (::getsockopt(socket, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &length) == 0) {
      groups.resize(length / sizeof(gid_t));
      return std::vector<std::uint32_t>(groups.begin(), groups.end());
    }
    if (errno != ERANGE) return systemError("getsockopt(SO_PEERGROUPS)", errno);
    groups.resize(length / sizeof(gid_t) + 1);
  }
  return makeError(ErrorCode::kIo, "getsockopt(SO_PEERGROUPS): the peer's group list kept growing");
}

}  // namespace dbuf::ipc
