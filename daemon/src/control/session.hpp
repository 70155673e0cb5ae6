#pragma once
// One client connection: reads whole frames, writes replies (with fds)
// without ever blocking the event loop, and reports messages and its end to
// a SessionHandler. Lives on the server's loop thread only.

#include <sys/types.h>

#include <array>
#include <asio.hpp>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "dbuf/common/unique_fd.hpp"
#include "dbuf/ipc/protocol.hpp"
#include "dbuf/ipc/socket.hpp"

namespace dbuf::daemon {

class Session;

class SessionHandler {
 public:
  virtual ~SessionHandler() = default;
  virtual void onMessage(const std::shared_ptr<Session>& session, const ipc::FrameHeader& header,
                         ipc::Message message) = 0;
  /// The connection is gone (EOF, error, protocol violation or close()).
  /// Called exactly once per session.
  virtual void onClosed(const std::shared_ptr<Session>& session) = 0;
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  static constexpr std::uint32_t kMaxHandshakePayload = 4096;

  Session(asio::local::stream_protocol::socket socket, SessionHandler& handler, std::uint64_t id,
          ipc::PeerCredentials peer);

  /// Starts reading; the handshake must complete before `handshake_deadline`.
  void start(std::chrono::milliseconds handshake_timeout);

  /// Queues a frame; `fds` are dup'ed now and closed once sent.
  void send(const ipc::Message& message, std::uint64_t request_id, std::vector<int> fds = {});
  /// Sends an error reply of a code the protocol itself picks (a bad frame,
  /// another protocol version, a daemon shutting down).
  void sendError(ipc::WireError code, const std::string& message, std::uint64_t request_id);
  /// Sends `error` as a reply: its code through ipc::toWire, its message (cut
  /// to a wire string) and its ranks.
  void sendError(const Error& error, std::uint64_t request_id);
  /// Sends what is queued, then closes (the handler's onClosed runs once).
  void closeAfterSending();
  /// Closes at once.
  void close();

  void markAttached() { attached_ = true; }
  [[nodiscard]] bool attached() const noexcept { return attached_; }
  /// The client asked to detach: its end is orderly, not a loss.
  void markDetaching() { detaching_ = true; }
  [[nodiscard]] bool detaching() const noexcept { return detaching_; }
  /// An operator's connection (dbufctl): no handshake deadline, no rank.
  void markOperator();
  [[nodiscard]] bool isOperator() const noexcept { return operator_; }
  /// The peer's supplementary groups (SO_PEERGROUPS).
  [[nodiscard]] Result<std::vector<std::uint32_t>> peerGroups();
  [[nodiscard]] std::chrono::steady_clock::time_point openedAt() const noexcept { return opened_; }
  [[nodiscard]] std::uint64_t id() const noexcept { return id_; }
  [[nodiscard]] const ipc::PeerCredentials& peer() const noexcept { return peer_; }
  [[nodiscard]] bool open() const noexcept { return !closed_; }

 private:
  struct Outgoing {
    std::vector<std::byte> bytes;
    std::vector<UniqueFd> fds;  // sent with the first chunk
    std::size_t sent = 0;
  };

  void readHeader();
  void readPayload(ipc::FrameHeader header);
  void flush();
  void finish();

  asio::local::stream_protocol::socket socket_;
  SessionHandler& handler_;
  std::uint64_t id_;
  ipc::PeerCredentials peer_;
  asio::steady_timer handshake_timer_;
  std::array<std::byte, ipc::kHeaderBytes> header_bytes_{};
  std::vector<std::byte> payload_;
  std::deque<Outgoing> outgoing_;
  bool writing_ = false;
  std::chrono::steady_clock::time_point opened_ = std::chrono::steady_clock::now();
  bool attached_ = false;
  bool detaching_ = false;
  bool operator_ = false;
  bool close_when_flushed_ = false;
  bool closed_ = false;
};

}  // namespace dbuf::daemon
