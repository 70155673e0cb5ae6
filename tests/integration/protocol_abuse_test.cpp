// Raw protocol abuse over a plain socket: bad magic, wrong version, oversize
// length, truncated payload, a request before Hello, garbage, silence past the
// handshake deadline. Each time the daemon answers what it can, closes that
// connection, leaks no session, and keeps serving a real client.

#include <sys/socket.h>

#include <random>
#include <span>
#include <thread>

#include "dbuf/ipc/protocol.hpp"
#include "dbuf/ipc/socket.hpp"
#include "harness.hpp"
#include "raw.hpp"

namespace dbuf::integration {
namespace {

/// A real client attaches, registers, unshards and detaches; then nothing of
/// it (or of the abuse before it) is left in the daemon.
void expectServingAndClean(EmbeddedDaemon& daemon) {
  auto client = daemon.attach(rankOf("honest", 0, 1));
  ASSERT_TRUE(client.ok()) << "daemon stopped serving: " << messageOf(client);
  auto group = client->registerGroup(smallGroup("g"));
  ASSERT_TRUE(group.ok()) << "daemon stopped serving: " << messageOf(group);
  ASSERT_TRUE(group->unshard().ok());
  ASSERT_TRUE(client->detach().ok());
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

class ProtocolAbuse : public ::testing::Test {
 protected:
  ProtocolAbuse() : daemon_(config()) {}
  static daemon::Config config() {
    daemon::Config config;
    config.handshake_timeout = 200ms;
    return config;
  }
  void SetUp() override {
    ASSERT_TRUE(daemon_.started());
    fds_before_ = openFdCount();
  }
  // stats() counts attached sessions only. The daemon runs in this process, so
  // a connection it failed to close, attached or not, shows up as an open fd.
  void TearDown() override {
    EXPECT_TRUE(waitUntil([&] { return openFdCount() == fds_before_; }))
        << openFdCount() - fds_before_ << " fds more than before the test: the daemon kept a connection open";
  }
  EmbeddedDaemon daemon_;
  std::size_t fds_before_ = 0;
};

TEST_F(ProtocolAbuse, BadMagic) {
  const UniqueFd fd = daemon_.rawConnect();
  ipc::FrameHeader header;
  header.magic = 0xDEADBEEF;
  header.type = ipc::MessageType::kHello;
  writeAll(fd.get(), headerOf(header));
  const std::string message = expectErrorReply(fd.get(), ipc::WireError::kBadRequest);
  EXPECT_NE(message.find("magic"), std::string::npos) << message;
  EXPECT_TRUE(closedByDaemon(fd.get()));
  expectServingAndClean(daemon_);
}

TEST_F(ProtocolAbuse, WrongProtocolVersionInTheHeader) {
  const UniqueFd fd = daemon_.rawConnect();
  auto frame = frameOf(helloFor("versioned"));
  ipc::FrameHeader header;
  header.version = ipc::kProtocolVersion + 1;
  header.type = ipc::MessageType::kHello;
  header.payload_bytes = static_cast<std::uint32_t>(frame.size() - ipc::kHeaderBytes);
  const auto bytes = headerOf(header);
  std::copy(bytes.begin(), bytes.end(), frame.begin());
  writeAll(fd.get(), frame);
  const std::string message = expectErrorReply(fd.get(), ipc::WireError::kVersionMismatch);
  EXPECT_NE(message.find("protocol version"), std::string::npos) << message;
  EXPECT_TRUE(closedByDaemon(fd.get()));
  expectServingAndClean(daemon_);
}

TEST_F(ProtocolAbuse, WrongProtocolVersionInTheHello) {
  const UniqueFd fd = daemon_.rawConnect();
  ipc::Hello hello = helloFor("versioned");
  hello.protocol_version = ipc::kProtocolVersion + 1;
  writeAll(fd.get(), frameOf(hello));
  const std::string message = expectErrorReply(fd.get(), ipc::WireError::kVersionMismatch);
  const std::string named = "protocol version " + std::to_string(ipc::kProtocolVersion + 1);
  EXPECT_NE(message.find(named), std::string::npos) << message;
  EXPECT_TRUE(closedByDaemon(fd.get()));
  expectServingAndClean(daemon_);
}

TEST_F(ProtocolAbuse, OversizeLength) {
  const UniqueFd fd = daemon_.rawConnect();
  ipc::FrameHeader header;
  header.type = ipc::MessageType::kRegisterGroup;
  header.payload_bytes = ipc::kMaxPayloadBytes + 1;
  writeAll(fd.get(), headerOf(header));
  expectErrorReply(fd.get(), ipc::WireError::kBadRequest);
  EXPECT_TRUE(closedByDaemon(fd.get()));
  expectServingAndClean(daemon_);
}

TEST_F(ProtocolAbuse, UnknownMessageType) {
  const UniqueFd fd = daemon_.rawConnect();
  ipc::FrameHeader header;
  header.type = static_cast<ipc::MessageType>(999);
  writeAll(fd.get(), headerOf(header));
  expectErrorReply(fd.get(), ipc::WireError::kBadRequest);
  EXPECT_TRUE(closedByDaemon(fd.get()));
  expectServingAndClean(daemon_);
}

TEST_F(ProtocolAbuse, TruncatedPayloadThenClose) {
  {
    const UniqueFd fd = daemon_.rawConnect();
    const auto frame = frameOf(helloFor("truncated"));
    writeAll(fd.get(), std::span(frame).first(frame.size() - 5));
    ASSERT_EQ(::shutdown(fd.get(), SHUT_WR), 0);
    EXPECT_TRUE(closedByDaemon(fd.get())) << "the daemon keeps a half-sent frame open";
  }
  {
    // Same after attaching: the session goes, with its job.
    const UniqueFd fd = daemon_.rawConnect();
    writeAll(fd.get(), frameOf(helloFor("truncated")));
    auto welcome = ipc::receiveMessage(fd.get(), ipc::Clock::now() + 5s);
    ASSERT_TRUE(welcome.ok()) << welcome.error().message;
    ASSERT_TRUE(std::holds_alternative<ipc::Welcome>(welcome->message));
    EXPECT_EQ(daemon_.stats().sessions, 1U);
    ipc::RegisterGroup spec;
    spec.name = "g";
    spec.tensors = {{"t", {8, 8}, "", -1}};
    const auto frame = frameOf(spec);
    writeAll(fd.get(), std::span(frame).first(frame.size() - 3));
  }  // closed mid-frame
  EXPECT_TRUE(waitUntil([&] { return daemon_.stats().sessions == 0 && daemon_.stats().jobs == 0; }));
  expectServingAndClean(daemon_);
}

TEST_F(ProtocolAbuse, RequestBeforeHello) {
  const UniqueFd fd = daemon_.rawConnect();
  ipc::RegisterGroup spec;
  spec.name = "g";
  spec.tensors = {{"t", {8, 8}, "", -1}};
  writeAll(fd.get(), frameOf(spec));
  const std::string message = expectErrorReply(fd.get(), ipc::WireError::kBadRequest);
  EXPECT_NE(message.find("Hello"), std::string::npos) << message;
  EXPECT_TRUE(closedByDaemon(fd.get()));
  expectServingAndClean(daemon_);
}

TEST_F(ProtocolAbuse, DaemonMessagesFromAClient) {
  // Before Hello: refused and closed.
  {
    const UniqueFd fd = daemon_.rawConnect();
    writeAll(fd.get(), frameOf(ipc::Welcome{}));
    expectErrorReply(fd.get(), ipc::WireError::kBadRequest);
    EXPECT_TRUE(closedByDaemon(fd.get()));
  }
  // After Hello: refused, the session goes on.
  const UniqueFd fd = daemon_.rawConnect();
  writeAll(fd.get(), frameOf(helloFor("confused")));
  auto welcome = ipc::receiveMessage(fd.get(), ipc::Clock::now() + 5s);
  ASSERT_TRUE(welcome.ok()) << welcome.error().message;
  writeAll(fd.get(), frameOf(ipc::GroupReady{}, 2));
  expectErrorReply(fd.get(), ipc::WireError::kBadRequest);
  writeAll(fd.get(), frameOf(helloFor("confused"), 3));
  expectErrorReply(fd.get(), ipc::WireError::kBadRequest);  // a second Hello: refused and closed
  EXPECT_TRUE(closedByDaemon(fd.get()));
  EXPECT_TRUE(waitUntil([&] { return daemon_.stats().sessions == 0; }));
  expectServingAndClean(daemon_);
}

TEST_F(ProtocolAbuse, UnknownGroupIdsAreRefused) {
  const UniqueFd fd = daemon_.rawConnect();
  writeAll(fd.get(), frameOf(helloFor("ids")));
  ASSERT_TRUE(ipc::receiveMessage(fd.get(), ipc::Clock::now() + 5s).ok());
  writeAll(fd.get(), frameOf(ipc::AcquireSlot{12345}, 2));
  expectErrorReply(fd.get(), ipc::WireError::kNotFound);
  writeAll(fd.get(), frameOf(ipc::ReleaseSlot{12345}, 3));
  expectErrorReply(fd.get(), ipc::WireError::kNotFound);
  writeAll(fd.get(), frameOf(ipc::Detach{}, 4));
  auto detached = ipc::receiveMessage(fd.get(), ipc::Clock::now() + 5s);
  ASSERT_TRUE(detached.ok()) << detached.error().message;
  EXPECT_TRUE(std::holds_alternative<ipc::Detached>(detached->message));
  EXPECT_TRUE(closedByDaemon(fd.get()));
  expectServingAndClean(daemon_);
}

TEST_F(ProtocolAbuse, UnregisteringIsRefusedWhileASlotIsHeldAndAfterwardsTheGroupIsGone) {
  const UniqueFd fd = daemon_.rawConnect();
  writeAll(fd.get(), frameOf(helloFor("unregister")));
  ASSERT_TRUE(ipc::receiveMessage(fd.get(), ipc::Clock::now() + 5s).ok());
  ipc::RegisterGroup spec;
  spec.name = "g";
  spec.tensors.push_back(ipc::TensorDecl{"w", {64}, "", -1});
  writeAll(fd.get(), frameOf(spec, 2));
  auto ready = ipc::receiveMessage(fd.get(), ipc::Clock::now() + 5s);
  ASSERT_TRUE(ready.ok()) << ready.error().message;
  const std::uint32_t id = std::get<ipc::GroupReady>(ready->message).group_id;
  writeAll(fd.get(), frameOf(ipc::AcquireSlot{id, false}, 3));
  ASSERT_TRUE(ipc::receiveMessage(fd.get(), ipc::Clock::now() + 5s).ok());
  const std::uint64_t with_group = daemon_.stats().bytes_in_use;  // its shard and the pool's slot
  writeAll(fd.get(), frameOf(ipc::UnregisterGroup{id}, 4));
  expectErrorReply(fd.get(), ipc::WireError::kConflict);  // its slot is held
  writeAll(fd.get(), frameOf(ipc::ReleaseSlot{id}, 5));
  ASSERT_TRUE(ipc::receiveMessage(fd.get(), ipc::Clock::now() + 5s).ok());
  writeAll(fd.get(), frameOf(ipc::UnregisterGroup{id}, 6));
  auto unregistered = ipc::receiveMessage(fd.get(), ipc::Clock::now() + 5s);
  ASSERT_TRUE(unregistered.ok()) << unregistered.error().message;
  EXPECT_TRUE(std::holds_alternative<ipc::GroupUnregistered>(unregistered->message));
  EXPECT_LT(daemon_.stats().bytes_in_use, with_group) << "the only rank unregistered it: its shards are freed";
  writeAll(fd.get(), frameOf(ipc::AcquireSlot{id, true}, 7));
  expectErrorReply(fd.get(), ipc::WireError::kNotFound);
  writeAll(fd.get(), frameOf(ipc::UnregisterGroup{id}, 8));
  expectErrorReply(fd.get(), ipc::WireError::kNotFound);
  writeAll(fd.get(), frameOf(spec, 10));  // the name is free again
  auto again = ipc::receiveMessage(fd.get(), ipc::Clock::now() + 5s);
  ASSERT_TRUE(again.ok()) << again.error().message;
  ASSERT_TRUE(std::holds_alternative<ipc::GroupReady>(again->message));
  EXPECT_NE(std::get<ipc::GroupReady>(again->message).group_id, id);
  writeAll(fd.get(), frameOf(ipc::Detach{}, 11));
  ASSERT_TRUE(ipc::receiveMessage(fd.get(), ipc::Clock::now() + 5s).ok());
  EXPECT_TRUE(closedByDaemon(fd.get()));
  expectServingAndClean(daemon_);
}

TEST_F(ProtocolAbuse, GarbageBytes) {
  std::mt19937_64 rng(12345);
  for (int round = 0; round < 8; ++round) {
    const UniqueFd fd = daemon_.rawConnect();
    std::vector<std::byte> garbage(64 + static_cast<std::size_t>(round) * 97);
    for (std::byte& b : garbage) b = static_cast<std::byte>(rng());
    writeAll(fd.get(), garbage);
    EXPECT_TRUE(closedByDaemon(fd.get())) << "round " << round;
  }
  expectServingAndClean(daemon_);
}

TEST_F(ProtocolAbuse, GarbageAfterAttachingReclaimsTheSession) {
  const UniqueFd fd = daemon_.rawConnect();
  writeAll(fd.get(), frameOf(helloFor("garbled")));
  ASSERT_TRUE(ipc::receiveMessage(fd.get(), ipc::Clock::now() + 5s).ok());
  EXPECT_EQ(daemon_.stats().sessions, 1U);
  const std::vector<std::byte> garbage(100, std::byte{0xAB});
  writeAll(fd.get(), garbage);
  expectErrorReply(fd.get(), ipc::WireError::kBadRequest);
  EXPECT_TRUE(closedByDaemon(fd.get()));
  EXPECT_TRUE(waitUntil([&] { return daemon_.stats().sessions == 0 && daemon_.stats().jobs == 0; }));
  expectServingAndClean(daemon_);
}

TEST_F(ProtocolAbuse, SilentConnectionIsClosedAfterTheHandshakeDeadline) {
  const auto started = Clock::now();
  const UniqueFd fd = daemon_.rawConnect();
  const std::string message = expectErrorReply(fd.get(), ipc::WireError::kTimeout);
  EXPECT_NE(message.find("handshake"), std::string::npos) << message;
  EXPECT_TRUE(closedByDaemon(fd.get()));
  const auto waited = Clock::now() - started;
  EXPECT_GE(waited, 150ms) << "closed before the deadline";
  EXPECT_LT(waited, 4s) << "closed long after the deadline";
  EXPECT_EQ(daemon_.stats().sessions, 0U);
  expectServingAndClean(daemon_);
}

TEST_F(ProtocolAbuse, AClientThatAttachesAfterTheHandshakeDeadlineConnectsAgain) {
  auto client = daemon_.connect();
  ASSERT_TRUE(client.ok()) << messageOf(client);
  std::this_thread::sleep_for(500ms);  // past the 200 ms handshake deadline: dbufd closed the connection
  auto attached = client->attach(rankOf("late", 0, 1));
  ASSERT_TRUE(attached.ok()) << messageOf(attached);
  ASSERT_TRUE(client->detach().ok());
  expectServingAndClean(daemon_);
}

TEST_F(ProtocolAbuse, HalfAHeaderIsClosedAfterTheHandshakeDeadline) {
  const UniqueFd fd = daemon_.rawConnect();
  const auto header = frameOf(helloFor("slow"));
  writeAll(fd.get(), std::span(header).first(10));
  expectErrorReply(fd.get(), ipc::WireError::kTimeout);
  EXPECT_TRUE(closedByDaemon(fd.get()));
  expectServingAndClean(daemon_);
}

TEST_F(ProtocolAbuse, ManySilentConnectionsAtOnceAreAllClosed) {
  std::vector<UniqueFd> fds;
  fds.reserve(32);
  for (int i = 0; i < 32; ++i) fds.push_back(daemon_.rawConnect());
  // Meanwhile a real client is served.
  expectServingAndClean(daemon_);
  for (const UniqueFd& fd : fds) EXPECT_TRUE(closedByDaemon(fd.get()));
  EXPECT_TRUE(daemonIsEmpty(daemon_.stats()));
}

}  // namespace
}  // namespace dbuf::integration
