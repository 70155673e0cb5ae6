#include "listener.hpp"

#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "dbuf/ipc/socket.hpp"

namespace dbuf::daemon {

Result<void> Listener::bind(const std::string& path) {
  // Bound and listening under a name of its own first, then renamed into
  // place: the socket path appears only once connecting to it works (a
  // client that sees the file is never refused). Binding in place where
  // that name would be too long for a Unix socket.
  const std::string staged = stagedSocketPath(path);
  const std::string& bound = staged.empty() ? path : staged;
  // One left by a daemon that crashed with this pid (the lock file beside
  // the socket says no live daemon uses this directory).
  if (!staged.empty()) ::unlink(staged.c_str());
  asio::error_code error;
  const asio::local::stream_protocol::endpoint endpoint(bound);
  acceptor_.open(endpoint.protocol(), error);
  if (!error) acceptor_.bind(endpoint, error);
  if (!error) acceptor_.listen(asio::socket_base::max_listen_connections, error);
  if (error) {
    if (!staged.empty()) ::unlink(staged.c_str());
    return makeError(ErrorCode::kIo, "cannot listen on " + path + ": " + error.message());
  }
  ::chmod(bound.c_str(), 0666);
  if (!staged.empty() && ::rename(staged.c_str(), path.c_str()) != 0) {
    const int saved = errno;
    ::unlink(staged.c_str());
    return makeError(ErrorCode::kIo, "cannot listen on " + path + ": rename: " + std::strerror(saved));
  }
  return {};
}

std::string Listener::stagedSocketPath(const std::string& path) {
  const auto slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? std::string() : path.substr(0, slash + 1);
  std::string staged = dir + ".dbufd-" + std::to_string(::getpid()) + ".sock";
  return staged.size() < sizeof(sockaddr_un::sun_path) ? staged : std::string();
}

void Listener::start(std::chrono::milliseconds handshake_timeout) {
  handshake_timeout_ = handshake_timeout;
  accept();
}

void Listener::stop() {
  stopped_ = true;
  asio::error_code ignored;
  acceptor_.close(ignored);
}

std::vector<std::shared_ptr<Session>> Listener::open() const {
  std::vector<std::shared_ptr<Session>> open;
  for (const auto& [id, weak] : sessions_) {
    if (auto session = weak.lock()) open.push_back(std::move(session));
  }
  std::sort(open.begin(), open.end(), [](const auto& a, const auto& b) { return a->id() < b->id(); });
  return open;
}

void Listener::accept() {
  acceptor_.async_accept([this](const asio::error_code& error, asio::local::stream_protocol::socket socket) {
    if (error) {
      if (error != asio::error::operation_aborted) spdlog::warn("accept: {}", error.message());
      if (!stopped_ && error != asio::error::operation_aborted) accept();
      return;
    }
    auto peer = ipc::peerCredentials(socket.native_handle());
    if (sessions_.size() >= kMaxSessions) {
      spdlog::warn("refusing a connection: {} sessions open", sessions_.size());
    } else if (peer) {
      auto session = std::make_shared<Session>(std::move(socket), handler_, next_session_id_++, *peer);
      sessions_.emplace(session->id(), session);
      session->start(handshake_timeout_);
    } else {
      spdlog::warn("dropping a connection: {}", peer.error().message);
    }
    if (!stopped_) accept();
  });
}

}  // namespace dbuf::daemon
