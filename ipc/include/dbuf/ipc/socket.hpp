#pragma once
/// \file
/// Blocking Unix-socket helpers used by libdbuf and by tests: connect, send and
/// receive whole frames with file descriptors (SCM_RIGHTS), peer credentials.
/// Every blocking call takes a deadline. The daemon does its own non-blocking
/// I/O with Asio but shares the frame codec and `sendSome`.
/// Thread safety: a socket must be used by one thread at a time.

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dbuf/common/result.hpp"
#include "dbuf/common/unique_fd.hpp"
#include "dbuf/ipc/protocol.hpp"

namespace dbuf::ipc {

using Clock = std::chrono::steady_clock;

struct ReceivedFrame {
  FrameHeader header;
  Message message;
  std::vector<UniqueFd> fds;
};

struct PeerCredentials {
  std::int32_t pid = 0;
  std::uint32_t uid = 0;
  std::uint32_t gid = 0;
};

/// Connects to the Unix stream socket at `path` (close-on-exec).
[[nodiscard]] Result<UniqueFd> connectUnix(const std::string& path, Clock::time_point deadline);

/// Sends all of `bytes`, with `fds` attached to the first byte.
[[nodiscard]] Result<void> sendAll(int socket, std::span<const std::byte> bytes, std::span<const int> fds,
                                   Clock::time_point deadline);

/// One non-blocking sendmsg: sends as much of `bytes` as the socket takes now
/// (possibly 0 on EAGAIN), with `fds` attached to the first byte. For event
/// loops that wait for writability themselves.
[[nodiscard]] Result<std::size_t> sendSome(int socket, std::span<const std::byte> bytes, std::span<const int> fds);

/// Encodes and sends one frame.
[[nodiscard]] Result<void> sendMessage(int socket, const Message& message, std::uint64_t request_id,
                                       std::span<const int> fds, Clock::time_point deadline);

/// Receives one whole frame (header, payload, up to kMaxFdsPerFrame fds) and
/// decodes it. EOF before a frame is an error with code kIo ("connection closed").
[[nodiscard]] Result<ReceivedFrame> receiveMessage(int socket, Clock::time_point deadline);

/// SO_PEERCRED of a connected Unix socket.
[[nodiscard]] Result<PeerCredentials> peerCredentials(int socket);

/// SO_PEERGROUPS of a connected Unix socket: the peer's supplementary groups
/// when it connected (the primary one is PeerCredentials::gid).
[[nodiscard]] Result<std::vector<std::uint32_t>> peerGroups(int socket);

}  // namespace dbuf::ipc
