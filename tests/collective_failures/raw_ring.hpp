#pragma once
/// \file
/// A client of the embedded daemon that speaks the raw protocol (no libdbuf):
/// Hello -> Welcome + the session segment and the daemon's eventfd, then
/// submissions written straight into the segment with ipc::ClientRings. Lets a
/// test submit what libdbuf never would (an unknown group id, an allGather
/// without a slot, an invalid op code) and scribble over the ring's indices.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "dbuf/common/shared_memory.hpp"
#include "dbuf/common/unique_fd.hpp"
#include "dbuf/ipc/protocol.hpp"
#include "dbuf/ipc/ring.hpp"
#include "dbuf/ipc/socket.hpp"
#include "harness.hpp"

namespace dbuf::integration {

/// One completion as the raw client reaped it.
struct RawCompletion {
  ipc::Completion entry;
  std::string message;
};

class RawRingClient {
 public:
  /// Connects and attaches as (job, rank, world); nullptr (with a test
  /// failure) when the daemon does not answer with a Welcome and two fds.
  static std::unique_ptr<RawRingClient> attach(const EmbeddedDaemon& daemon, const std::string& job, std::uint32_t rank,
                                               std::uint32_t world);

  /// Sends one request frame (RegisterGroup, AcquireSlot...).
  void send(const ipc::Message& message);
  /// The next reply frame.
  [[nodiscard]] Result<ipc::ReceivedFrame> receive(std::chrono::milliseconds timeout = std::chrono::seconds(5));

  /// Writes a submission and rings the daemon's doorbell; false if the ring is full.
  bool submit(ipc::Submission entry);
  /// The next completion, or nullopt when none came in time.
  [[nodiscard]] std::optional<RawCompletion> nextCompletion(
      std::chrono::milliseconds timeout = std::chrono::seconds(5));

  /// Overwrites the submission head index in the segment (what a buggy or
  /// malicious client could do) and rings the doorbell.
  void scribbleSubmitHead(std::uint64_t head);
  /// The submission tail the daemon published.
  [[nodiscard]] std::uint64_t submitTail() const;
  /// The session's stream-ordering counters.
  [[nodiscard]] ipc::StreamCounters& streamCounters() const { return rings_.streamCounters(); }

  [[nodiscard]] int socket() const noexcept { return socket_.get(); }
  [[nodiscard]] const ipc::Welcome& welcome() const noexcept { return welcome_; }

 private:
  void ringDoorbell() const;

  UniqueFd socket_;
  UniqueFd segment_fd_;
  UniqueFd doorbell_;
  Mapping segment_;
  ipc::ClientRings rings_;
  ipc::Welcome welcome_;
  std::uint64_t next_request_ = 2;
  std::uint64_t next_handle_ = 1;
};

/// A submission in one line.
[[nodiscard]] ipc::Submission rawOp(ipc::OpCode op, std::uint32_t group_id = 0, std::uint32_t root = 0);

/// The wire form of a one-tensor fp32 group of `elements` elements.
[[nodiscard]] ipc::RegisterGroup rawGroup(const std::string& name, std::int64_t elements);

}  // namespace dbuf::integration
