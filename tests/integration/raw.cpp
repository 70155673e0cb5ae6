#include "raw.hpp"

#include <poll.h>
#include <sys/socket.h>

#include <array>
#include <cerrno>
#include <cstring>

#include "dbuf/ipc/socket.hpp"

namespace dbuf::integration {

void writeAll(int fd, std::span<const std::byte> bytes) {
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t wrote = ::send(fd, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    ASSERT_GT(wrote, 0) << std::strerror(errno);
    done += static_cast<std::size_t>(wrote);
  }
}

std::vector<std::byte> frameOf(const ipc::Message& message, std::uint64_t request_id) {
  auto frame = ipc::encodeFrame(message, request_id);
  EXPECT_TRUE(frame.ok()) << messageOf(frame);
  return frame.ok() ? *frame : std::vector<std::byte>{};
}

std::vector<std::byte> headerOf(const ipc::FrameHeader& header) {
  const auto bytes = ipc::encodeHeader(header);
  return {bytes.begin(), bytes.end()};
}

ipc::Hello helloFor(const std::string& job, std::uint32_t rank, std::uint32_t world_size) {
  ipc::Hello hello;
  hello.job_id = job;
  hello.rank = rank;
  hello.world_size = world_size;
  hello.nonce = 7;
  return hello;
}

bool rawAttach(int fd, const std::string& job, std::uint32_t rank, std::uint32_t world_size) {
  writeAll(fd, frameOf(helloFor(job, rank, world_size)));
  auto welcome = ipc::receiveMessage(fd, ipc::Clock::now() + 5s);
  if (!welcome.ok()) {
    ADD_FAILURE() << "no Welcome: " << welcome.error().message;
    return false;
  }
  if (!std::holds_alternative<ipc::Welcome>(welcome->message)) {
    ADD_FAILURE() << "reply of type " << static_cast<int>(welcome->header.type) << " instead of Welcome";
    return false;
  }
  return true;
}

bool closedByDaemon(int fd, Clock::duration timeout) {
  const auto deadline = Clock::now() + timeout;
  std::array<std::byte, 4096> sink{};
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return false;
    pollfd waiting{fd, POLLIN, 0};
    const int ready = ::poll(&waiting, 1, static_cast<int>(left.count()) + 1);
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return false;
    const ssize_t got = ::recv(fd, sink.data(), sink.size(), MSG_DONTWAIT);
    if (got == 0) return true;
    if (got < 0 && errno == ECONNRESET) return true;
    if (got < 0 && errno != EAGAIN && errno != EINTR) return false;
  }
}

ipc::ErrorReply nextErrorReply(int fd, std::optional<std::uint64_t> request_id) {
  auto frame = ipc::receiveMessage(fd, ipc::Clock::now() + 5s);
  if (!frame.ok()) {
    ADD_FAILURE() << "no reply: " << frame.error().message;
    return {};
  }
  const auto* error = std::get_if<ipc::ErrorReply>(&frame->message);
  if (error == nullptr) {
    ADD_FAILURE() << "reply of type " << static_cast<int>(frame->header.type) << " instead of an error";
    return {};
  }
  if (request_id) {
    EXPECT_EQ(frame->header.request_id, *request_id) << error->message;
  }
  return *error;
}

std::string expectErrorReply(int fd, ipc::WireError code, std::optional<std::uint64_t> request_id) {
  const ipc::ErrorReply error = nextErrorReply(fd, request_id);
  EXPECT_EQ(error.code, code) << error.message;
  EXPECT_FALSE(error.message.empty());
  return error.message;
}

}  // namespace dbuf::integration
