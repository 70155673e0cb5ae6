#include "session.hpp"

#include <fcntl.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

namespace dbuf::daemon {

Session::Session(asio::local::stream_protocol::socket socket, SessionHandler& handler, std::uint64_t id,
                 ipc::PeerCredentials peer)
    : socket_(std::move(socket)), handler_(handler), id_(id), peer_(peer), handshake_timer_(socket_.get_executor()) {}

void Session::start(std::chrono::milliseconds handshake_timeout) {
  socket_.non_blocking(true);
  handshake_timer_.expires_after(handshake_timeout);
  handshake_timer_.async_wait([self = shared_from_this()](const asio::error_code& error) {
    if (error || self->attached_ || self->operator_ || self->closed_) return;
    self->sendError(ipc::WireError::kTimeout, "handshake not completed in time", 0);
    self->closeAfterSending();
  });
  readHeader();
}

void Session::markOperator() {
  operator_ = true;
  handshake_timer_.cancel();
}

Result<std::vector<std::uint32_t>> Session::peerGroups() {
  return ipc::peerGroups(socket_.native_handle());
}

void Session::readHeader() {
  asio::async_read(socket_, asio::buffer(header_bytes_),
                   [self = shared_from_this()](const asio::error_code& error, std::size_t) {
                     if (self->closed_) return;
                     if (error) {
                       self->close();
                       return;
                     }
                     auto header = ipc::decodeHeader(self->header_bytes_);
                     if (!header) {
                       // Answer what we can (version mismatch in particular), then drop
                       // the connection: the stream cannot be resynchronised.
                       const bool version = header.error().message.find("protocol version") != std::string::npos;
                       self->sendError(version ? ipc::WireError::kVersionMismatch : ipc::WireError::kBadRequest,
                                       header.error().message, 0);
                       self->closeAfterSending();
                       return;
                     }
                     self->readPayload(*header);
                   });
}

void Session::readPayload(ipc::FrameHeader header) {
  // Before the handshake only a Hello may come, and it is small: do not let an
  // unauthenticated peer make us hold a megabyte per connection.
  if (!attached_ && header.payload_bytes > kMaxHandshakePayload) {
    sendError(ipc::WireError::kBadRequest, "frame too large before the handshake", header.request_id);
    closeAfterSending();
    return;
  }
  payload_.resize(header.payload_bytes);  // bounded by kMaxPayloadBytes in decodeHeader
  asio::async_read(socket_, asio::buffer(payload_),
                   [self = shared_from_this(), header](const asio::error_code& error, std::size_t) {
                     if (self->closed_) return;
                     if (error) {
                       self->close();
                       return;
                     }
                     auto message = ipc::decodePayload(header.type, self->payload_);
                     if (!message) {
                       self->sendError(message.error(), header.request_id);  // kInvalidArgument: kBadRequest
                       self->closeAfterSending();
                       return;
                     }
                     self->handler_.onMessage(self, header, std::move(*message));
                     if (!self->closed_ && !self->close_when_flushed_) self->readHeader();
                   });
}

void Session::send(const ipc::Message& message, std::uint64_t request_id, std::vector<int> fds) {
  if (closed_) return;
  auto frame = ipc::encodeFrame(message, request_id);
  if (!frame) {
    // Our own reply is over a limit: a daemon bug, but never a crash.
    frame = ipc::encodeFrame(ipc::ErrorReply{ipc::WireError::kInternal, "reply too large", {}}, request_id);
    fds.clear();
  }
  Outgoing outgoing{std::move(*frame), {}, 0};
  for (const int fd : fds) outgoing.fds.emplace_back(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
  outgoing_.push_back(std::move(outgoing));
  flush();
}

void Session::sendError(ipc::WireError code, const std::string& message, std::uint64_t request_id) {
  send(ipc::ErrorReply{code, message.substr(0, ipc::kMaxStringBytes), {}}, request_id);
}

void Session::sendError(const Error& error, std::uint64_t request_id) {
  std::vector<std::uint32_t> ranks = error.ranks;
  // Only a daemon bug could name more ranks than a job has; cut rather than
  // have the reply refused as too large.
  if (ranks.size() > ipc::kMaxErrorRanks) ranks.resize(ipc::kMaxErrorRanks);
  send(ipc::ErrorReply{ipc::toWire(error.code), error.message.substr(0, ipc::kMaxStringBytes), std::move(ranks)},
       request_id);
}

void Session::flush() {
  while (!writing_ && !outgoing_.empty() && !closed_) {
    Outgoing& front = outgoing_.front();
    const std::span<const std::byte> rest(front.bytes.data() + front.sent, front.bytes.size() - front.sent);
    std::vector<int> raw_fds;
    for (const UniqueFd& fd : front.fds) raw_fds.push_back(fd.get());
    // Non-blocking: send what the socket takes now, wait for writability for the rest.
    auto sent = ipc::sendSome(socket_.native_handle(), rest, raw_fds);
    if (!sent) {
      close();
      return;
    }
    if (*sent > 0) front.fds.clear();  // the fds went with the first byte
    front.sent += *sent;
    if (front.sent == front.bytes.size()) {
      outgoing_.pop_front();
      continue;
    }
    writing_ = true;
    socket_.async_wait(asio::socket_base::wait_write, [self = shared_from_this()](const asio::error_code& error) {
      self->writing_ = false;
      if (error) {
        self->close();
        return;
      }
      self->flush();
    });
  }
  if (outgoing_.empty() && close_when_flushed_) close();
}

void Session::closeAfterSending() {
  close_when_flushed_ = true;
  flush();
}

void Session::close() {
  if (closed_) return;
  closed_ = true;
  handshake_timer_.cancel();
  asio::error_code ignored;
  socket_.shutdown(asio::socket_base::shutdown_both, ignored);
  socket_.close(ignored);
  outgoing_.clear();
  handler_.onClosed(shared_from_this());
}

}  // namespace dbuf::daemon
