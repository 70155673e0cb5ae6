#pragma once
// The one socket a Client and its Groups share: request / reply with request
// ids, daemon errors turned into dbuf::Error values. Not thread-safe.

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dbuf/common/result.hpp"
#include "dbuf/common/unique_fd.hpp"
#include "dbuf/ipc/socket.hpp"

namespace dbuf {

class Connection {
 public:
  Connection(UniqueFd socket, std::chrono::milliseconds timeout) : socket_(std::move(socket)), timeout_(timeout) {}

  /// Sends `request` and waits for its reply (frames for other request ids are
  /// not expected: one request at a time). An ErrorReply becomes an Error.
  [[nodiscard]] Result<ipc::ReceivedFrame> call(const ipc::Message& request,
                                                std::optional<std::chrono::milliseconds> timeout);

  [[nodiscard]] std::chrono::milliseconds defaultTimeout() const noexcept { return timeout_; }
  void close() noexcept { socket_.reset(); }

  /// Called on detach, after the daemon was told: every group of this
  /// connection unmaps its memory (registered by the groups themselves).
  std::vector<std::function<void()>*> on_detach;

  // Filled by attach().
  std::uint32_t rank = 0;
  std::uint64_t instance_id = 0;
  bool attached = false;
  bool reattached = false;

 private:
  UniqueFd socket_;
  std::chrono::milliseconds timeout_;
  std::uint64_t next_request_ = 1;
  std::string lost_;  // why the connection is unusable, once it is
};

}  // namespace dbuf
