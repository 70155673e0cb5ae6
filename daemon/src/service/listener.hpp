#pragma once
// dbufd's Unix socket: bound so that its path appears only once connecting
// works, each accepted connection a Session of the daemon's handler, and the
// table of open sessions (for operators' views and the goodbyes at shutdown).

#include <asio.hpp>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "dbuf/common/result.hpp"
#include "session.hpp"

namespace dbuf::daemon {

class Listener {
 public:
  static constexpr std::size_t kMaxSessions = 4096;  // connections, attached or not

  Listener(asio::io_context& io, SessionHandler& handler) : acceptor_(io), handler_(handler) {}

  /// Listens on `path` (kIo naming it when it cannot). Anyone may connect;
  /// who may do what is decided per peer (SO_PEERCRED) against the tenants.
  [[nodiscard]] Result<void> bind(const std::string& path);
  /// Accepts connections until stop(); each must say Hello within `handshake_timeout`.
  void start(std::chrono::milliseconds handshake_timeout);
  /// Accepts no more connections; those open stay open.
  void stop();

  /// The session `id` closed (SessionHandler::onClosed).
  void forget(std::uint64_t id) { sessions_.erase(id); }
  /// The sessions open now, by id.
  [[nodiscard]] std::vector<std::shared_ptr<Session>> open() const;
  [[nodiscard]] bool empty() const noexcept { return sessions_.empty(); }

 private:
  /// A name beside `path` to bind under before renaming into place, or
  /// empty when it would not fit a Unix socket address.
  static std::string stagedSocketPath(const std::string& path);
  void accept();

  asio::local::stream_protocol::acceptor acceptor_;
  SessionHandler& handler_;
  std::unordered_map<std::uint64_t, std::weak_ptr<Session>> sessions_;
  std::uint64_t next_session_id_ = 1;
  std::chrono::milliseconds handshake_timeout_{0};
  bool stopped_ = false;
};

}  // namespace dbuf::daemon
