// Requests sent without waiting for their replies (Connection::post, behind
// the slot release of Group::reshard), against a fake dbufd on the other end
// of a socket pair: a later call skips the posted request's reply and gets
// its own; a refused posted request loses the connection, with dbufd's
// reason, at the next call; the requests reach dbufd in the order they were
// made.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <chrono>
#include <string>
#include <variant>

#include "connection.hpp"
#include "dbuf/ipc/socket.hpp"

namespace dbuf {
namespace {

using namespace std::chrono_literals;

/// The trainer's connection and dbufd's end of its socket.
struct Pair {
  Pair() {
    int fds[2] = {-1, -1};
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    daemon = UniqueFd(fds[1]);
    connection = std::make_unique<Connection>(UniqueFd(fds[0]), 2000ms);
  }

  /// dbufd answers request `id` (replies are written ahead: the socket buffers them).
  void reply(const ipc::Message& message, std::uint64_t id) const {
    auto frame = ipc::encodeFrame(message, id);
    ASSERT_TRUE(frame.ok());
    ASSERT_TRUE(ipc::sendAll(daemon.get(), *frame, {}, ipc::Clock::now() + 1s).ok());
  }

  /// The next request dbufd reads.
  [[nodiscard]] ipc::ReceivedFrame request() const {
    auto frame = ipc::receiveMessage(daemon.get(), ipc::Clock::now() + 1s);
    EXPECT_TRUE(frame.ok());
    return frame.ok() ? std::move(*frame) : ipc::ReceivedFrame{};
  }

  UniqueFd daemon;
  std::unique_ptr<Connection> connection;
};

TEST(PostedRequests, ACallSkipsThePostedRepliesAndGetsItsOwn) {
  Pair pair;
  ASSERT_TRUE(pair.connection->post(ipc::ReleaseSlot{7}).ok());  // request 1
  ASSERT_TRUE(pair.connection->post(ipc::ReleaseSlot{8}).ok());  // request 2
  pair.reply(ipc::SlotReleased{7}, 1);
  pair.reply(ipc::SlotReleased{8}, 2);
  pair.reply(ipc::SlotReleased{9}, 3);
  auto answered = pair.connection->call(ipc::ReleaseSlot{9}, std::nullopt);
  ASSERT_TRUE(answered.ok()) << answered.error().message;
  EXPECT_EQ(answered->header.request_id, 3U);
  EXPECT_EQ(std::get<ipc::SlotReleased>(answered->message).group_id, 9U);

  // In the order they were made.
  for (const std::uint32_t group : {7U, 8U, 9U}) {
    const auto request = pair.request();
    EXPECT_EQ(std::get<ipc::ReleaseSlot>(request.message).group_id, group);
  }
  // Nothing left unread: the next call's reply is the next frame.
  pair.reply(ipc::SlotReleased{10}, 4);
  auto next = pair.connection->call(ipc::ReleaseSlot{10}, std::nullopt);
  ASSERT_TRUE(next.ok()) << next.error().message;
  EXPECT_EQ(next->header.request_id, 4U);
}

TEST(PostedRequests, ARefusedPostedRequestLosesTheConnectionWithDbufdsReason) {
  Pair pair;
  ASSERT_TRUE(pair.connection->post(ipc::ReleaseSlot{7}).ok());
  pair.reply(ipc::ErrorReply{ipc::WireError::kConflict, "group 7 has collectives in flight", {}}, 1);
  pair.reply(ipc::SlotReleased{8}, 2);
  auto answered = pair.connection->call(ipc::ReleaseSlot{8}, std::nullopt);
  ASSERT_FALSE(answered.ok());
  EXPECT_EQ(answered.error().code, ErrorCode::kInternal);
  EXPECT_NE(answered.error().message.find("did not wait for"), std::string::npos) << answered.error().message;
  EXPECT_NE(answered.error().message.find("group 7 has collectives in flight"), std::string::npos);
  EXPECT_FALSE(pair.connection->open());
  auto later = pair.connection->call(ipc::ReleaseSlot{9}, std::nullopt);
  ASSERT_FALSE(later.ok());
  EXPECT_EQ(later.error().code, ErrorCode::kUnavailable);
  EXPECT_FALSE(pair.connection->post(ipc::ReleaseSlot{9}).ok());
}

TEST(PostedRequests, AGoodbyeAfterAPostedReplyStillSaysWhy) {
  Pair pair;
  ASSERT_TRUE(pair.connection->post(ipc::ReleaseSlot{7}).ok());
  pair.reply(ipc::SlotReleased{7}, 1);
  pair.reply(ipc::Shutdown{"SIGTERM"}, 0);
  auto answered = pair.connection->call(ipc::ReleaseSlot{8}, std::nullopt);
  ASSERT_FALSE(answered.ok());
  EXPECT_EQ(answered.error().code, ErrorCode::kUnavailable);
  EXPECT_NE(answered.error().message.find("shutting down: SIGTERM"), std::string::npos) << answered.error().message;
}

}  // namespace
}  // namespace dbuf
