#pragma once
/// \file
/// Raw-socket helpers for talking to the embedded daemon without libdbuf:
/// hand-made frames, replies read with ipc::receiveMessage, and a wait for the
/// daemon to close the connection.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dbuf/ipc/protocol.hpp"
#include "harness.hpp"

namespace dbuf::integration {

/// Writes all of `bytes` (a failure is a test failure).
void writeAll(int fd, std::span<const std::byte> bytes);

/// One encoded frame.
[[nodiscard]] std::vector<std::byte> frameOf(const ipc::Message& message, std::uint64_t request_id = 1);

/// A header alone (any field may be wrong on purpose).
[[nodiscard]] std::vector<std::byte> headerOf(const ipc::FrameHeader& header);

[[nodiscard]] ipc::Hello helloFor(const std::string& job, std::uint32_t rank = 0, std::uint32_t world_size = 1);

/// Sends Hello and expects Welcome; false (with a test failure) otherwise.
bool rawAttach(int fd, const std::string& job, std::uint32_t rank, std::uint32_t world_size);

/// Reads until the daemon closes the connection (or the deadline passes):
/// true on EOF (or a reset, which also means closed).
[[nodiscard]] bool closedByDaemon(int fd, Clock::duration timeout = 5s);

/// The next frame of `fd`, which must be an ErrorReply (to `request_id`, if
/// given); a failure is recorded otherwise, and an empty reply returned.
ipc::ErrorReply nextErrorReply(int fd, std::optional<std::uint64_t> request_id = std::nullopt);

/// The next frame must be an ErrorReply of `code` (and of `request_id` when
/// given); returns its message.
std::string expectErrorReply(int fd, ipc::WireError code, std::optional<std::uint64_t> request_id = std::nullopt);

}  // namespace dbuf::integration
