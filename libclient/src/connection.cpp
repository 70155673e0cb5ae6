#include "connection.hpp"

namespace dbuf {
namespace {

ErrorCode fromWire(ipc::WireError code) {
  switch (code) {
    case ipc::WireError::kBadRequest:
    case ipc::WireError::kVersionMismatch:
      return ErrorCode::kInvalidArgument;
    case ipc::WireError::kPermissionDenied:
      return ErrorCode::kPermissionDenied;
    case ipc::WireError::kConflict:
      return ErrorCode::kConflict;
    case ipc::WireError::kQuotaExceeded:
      return ErrorCode::kInfeasible;
    case ipc::WireError::kTimeout:
      return ErrorCode::kTimeout;
    case ipc::WireError::kNotFound:
      return ErrorCode::kNotFound;
    case ipc::WireError::kShuttingDown:
      return ErrorCode::kUnavailable;
    case ipc::WireError::kInternal:
      return ErrorCode::kInternal;
  }
  return ErrorCode::kInternal;
}

}  // namespace

Result<ipc::ReceivedFrame> Connection::call(const ipc::Message& request,
                                            std::optional<std::chrono::milliseconds> timeout) {
  if (!lost_.empty()) return makeError(ErrorCode::kUnavailable, lost_);
  if (!socket_) return makeError(ErrorCode::kUnavailable, "not connected to dbufd");
  const auto deadline = ipc::Clock::now() + timeout.value_or(timeout_);
  const std::uint64_t id = next_request_++;
  // Encode first: a request over a protocol limit (a tp_dim outside the shape,
  // a name too long...) is the caller's mistake and leaves the connection usable.
  auto encoded = ipc::encodeFrame(request, id);
  if (!encoded) return makeError(ErrorCode::kInvalidArgument, encoded.error().message);
  if (auto sent = ipc::sendAll(socket_.get(), *encoded, {}, deadline); !sent) {
    lost_ = "lost the connection to dbufd: " + sent.error().message;
    // A daemon that stopped said goodbye before closing: pass on its reason.
    if (auto goodbye = ipc::receiveMessage(socket_.get(), ipc::Clock::now()); goodbye) {
      if (const auto* shutdown = std::get_if<ipc::Shutdown>(&goodbye->message)) {
        lost_ = "dbufd is shutting down: " + shutdown->reason;
      }
    }
    socket_.reset();
    return makeError(ErrorCode::kUnavailable, lost_);
  }
  for (;;) {
    auto frame = ipc::receiveMessage(socket_.get(), deadline);
    if (!frame) {
      const bool timed_out = frame.error().message.find("timed out") != std::string::npos;
      // A late reply would desynchronise the stream: the connection is done either way.
      lost_ = timed_out ? "dbufd did not answer in time; connection closed"
                        : "lost the connection to dbufd: " + frame.error().message;
      socket_.reset();
      return makeError(timed_out ? ErrorCode::kTimeout : ErrorCode::kUnavailable, lost_);
    }
    if (const auto* shutdown = std::get_if<ipc::Shutdown>(&frame->message)) {
      lost_ = "dbufd is shutting down: " + shutdown->reason;
      socket_.reset();
      return makeError(ErrorCode::kUnavailable, lost_);
    }
    if (frame->header.request_id != id) continue;  // stale reply of an abandoned call
    if (const auto* error = std::get_if<ipc::ErrorReply>(&frame->message)) {
      return makeError(fromWire(error->code), "dbufd: " + error->message);
    }
    return std::move(*frame);
  }
}

}  // namespace dbuf
