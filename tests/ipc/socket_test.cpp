// Unix-socket helpers over socketpair(AF_UNIX) and a listening socket in a
// private temp dir: frames with 0, 1 and 3 memfds, deadlines, a peer that
// hangs up mid-frame, too many fds, peer credentials, connectUnix errors, a
// Hello / Welcome exchange with the Welcome's two fds (memfd and eventfd).
// No sleeps for synchronisation: deadlines are the only waits.

#include "dbuf/ipc/socket.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <array>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "dbuf/common/shared_memory.hpp"
#include "samples.hpp"
#include "support/temp_dir.hpp"

namespace dbuf::ipc {
namespace {

using namespace std::chrono_literals;
using dbuf::testing::TempDir;

struct Pair {
  UniqueFd a;
  UniqueFd b;
};

Pair socketPair() {
  std::array<int, 2> fds{-1, -1};
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds.data()), 0) << std::strerror(errno);
  return Pair{UniqueFd(fds[0]), UniqueFd(fds[1])};
}

Clock::time_point in(Clock::duration duration) {
  return Clock::now() + duration;
}

/// Number of open fds of this process (to check that error paths leak none).
std::size_t openFdCount() {
  std::size_t count = 0;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return 0;
  while (const dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  ::closedir(dir);
  return count - 1;  // the directory's own fd
}

void writeRaw(int fd, std::span<const std::byte> bytes) {
  ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size())) << std::strerror(errno);
}

std::vector<std::byte> frameOf(const Message& message, std::uint64_t request_id = 1) {
  auto frame = encodeFrame(message, request_id);
  EXPECT_TRUE(frame.ok());
  return frame.ok() ? *frame : std::vector<std::byte>{};
}

bool sameFile(int a, int b) {
  struct stat sa {};
  struct stat sb {};
  if (::fstat(a, &sa) != 0 || ::fstat(b, &sb) != 0) return false;
  return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

class FdCounts : public ::testing::TestWithParam<int> {};

TEST_P(FdCounts, FrameWithMemfdsArrivesWithTheSameFiles) {
  const int count = GetParam();
  Pair pair = socketPair();
  std::vector<UniqueFd> memfds;
  std::vector<int> raw;
  for (int i = 0; i < count; ++i) {
    auto memfd = createMemfd("dbuf-ipc-test-" + std::to_string(i), 4096);
    ASSERT_TRUE(memfd.ok()) << memfd.error().message;
    raw.push_back(memfd->get());
    memfds.push_back(std::move(*memfd));
  }
  const Message sent = testing::sampleGroupReady();
  ASSERT_TRUE(sendMessage(pair.a.get(), sent, 99, raw, in(5s)).ok());

  auto received = receiveMessage(pair.b.get(), in(5s));
  ASSERT_TRUE(received.ok()) << received.error().message;
  EXPECT_EQ(received->header.type, MessageType::kGroupReady);
  EXPECT_EQ(received->header.request_id, 99U);
  EXPECT_EQ(received->message, sent);
  ASSERT_EQ(received->fds.size(), static_cast<std::size_t>(count));
  for (int i = 0; i < count; ++i) {
    const int original = memfds[static_cast<std::size_t>(i)].get();
    const int arrived = received->fds[static_cast<std::size_t>(i)].get();
    EXPECT_NE(original, arrived);
    EXPECT_TRUE(sameFile(original, arrived));
    EXPECT_NE(::fcntl(arrived, F_GETFD) & FD_CLOEXEC, 0) << "received fds are close-on-exec";
    // Write through one, read through the other, both ways.
    const std::string there = "written via the sender's fd " + std::to_string(i);
    ASSERT_EQ(::pwrite(original, there.data(), there.size(), 100), static_cast<ssize_t>(there.size()));
    std::string back(there.size(), '\0');
    ASSERT_EQ(::pread(arrived, back.data(), back.size(), 100), static_cast<ssize_t>(back.size()));
    EXPECT_EQ(back, there);
    const std::string reply = "and back via the receiver's " + std::to_string(i);
    ASSERT_EQ(::pwrite(arrived, reply.data(), reply.size(), 2000), static_cast<ssize_t>(reply.size()));
    std::string seen(reply.size(), '\0');
    ASSERT_EQ(::pread(original, seen.data(), seen.size(), 2000), static_cast<ssize_t>(seen.size()));
    EXPECT_EQ(seen, reply);
  }
}

INSTANTIATE_TEST_SUITE_P(Socket, FdCounts, ::testing::Values(0, 1, 3));

TEST(Socket, EveryMessageTypeCrossesTheSocket) {
  Pair pair = socketPair();
  const auto messages = testing::sampleMessages();
  std::uint64_t id = 1000;
  for (const Message& message : messages) {
    ASSERT_TRUE(sendMessage(pair.a.get(), message, id++, {}, in(5s)).ok());
  }
  id = 1000;
  for (const Message& message : messages) {
    auto received = receiveMessage(pair.b.get(), in(5s));
    ASSERT_TRUE(received.ok()) << received.error().message;
    EXPECT_EQ(received->message, message);
    EXPECT_EQ(received->header.request_id, id++);
    EXPECT_TRUE(received->fds.empty());
  }
}

TEST(Socket, LargeFrameSurvivesPartialWritesAndReads) {
  // Bigger than the socket buffer: sendAll has to wait for the reader.
  Pair pair = socketPair();
  GroupReady big;
  big.tensors.resize(3000);
  for (std::size_t i = 0; i < big.tensors.size(); ++i) {
    big.tensors[i].name = std::string(200, static_cast<char>('a' + i % 26));
    big.tensors[i].shape = {static_cast<std::int64_t>(i), 3};
  }
  auto memfd = createMemfd("dbuf-ipc-big", 4096);
  ASSERT_TRUE(memfd.ok());
  const int raw = memfd->get();
  Result<void> sent;
  std::thread sender([&] { sent = sendMessage(pair.a.get(), big, 5, std::span(&raw, 1), in(5s)); });
  auto received = receiveMessage(pair.b.get(), in(5s));
  sender.join();
  ASSERT_TRUE(sent.ok()) << sent.error().message;
  ASSERT_TRUE(received.ok()) << received.error().message;
  EXPECT_EQ(received->message, Message(big));
  ASSERT_EQ(received->fds.size(), 1U);
  EXPECT_TRUE(sameFile(raw, received->fds[0].get()));
}

TEST(Socket, PartialHeaderThenTimeoutRespectsTheDeadline) {
  Pair pair = socketPair();
  const auto frame = frameOf(Detach{});
  writeRaw(pair.a.get(), std::span(frame).first(10));
  const auto start = Clock::now();
  auto received = receiveMessage(pair.b.get(), start + 150ms);
  const auto elapsed = Clock::now() - start;
  ASSERT_FALSE(received.ok());
  EXPECT_EQ(received.error().code, ErrorCode::kTimeout);
  EXPECT_NE(received.error().message.find("timed out"), std::string::npos) << received.error().message;
  EXPECT_GE(elapsed, 150ms);
  EXPECT_LT(elapsed, 2s);
}

TEST(Socket, NothingToReadTimesOut) {
  Pair pair = socketPair();
  const auto start = Clock::now();
  auto received = receiveMessage(pair.b.get(), start + 50ms);
  ASSERT_FALSE(received.ok());
  EXPECT_EQ(received.error().code, ErrorCode::kTimeout);
  EXPECT_NE(received.error().message.find("timed out"), std::string::npos) << received.error().message;
  EXPECT_GE(Clock::now() - start, 50ms);
  // A deadline already past still takes a frame that is there.
  ASSERT_TRUE(sendMessage(pair.a.get(), Detached{}, 3, {}, in(1s)).ok());
  auto late = receiveMessage(pair.b.get(), Clock::now() - 1s);
  ASSERT_TRUE(late.ok()) << late.error().message;
  EXPECT_EQ(late->message, Message(Detached{}));
}

TEST(Socket, PartialPayloadThenTimeout) {
  Pair pair = socketPair();
  const auto frame = frameOf(testing::sampleHello());
  writeRaw(pair.a.get(), std::span(frame).first(kHeaderBytes + 3));
  auto received = receiveMessage(pair.b.get(), in(100ms));
  ASSERT_FALSE(received.ok());
  EXPECT_NE(received.error().message.find("timed out"), std::string::npos) << received.error().message;
}

TEST(Socket, PeerClosingMidFrameIsAnErrorNotAHang) {
  for (const std::size_t cut : {std::size_t{5}, kHeaderBytes, kHeaderBytes + 7}) {
    Pair pair = socketPair();
    const auto frame = frameOf(testing::sampleRegisterGroup());
    writeRaw(pair.a.get(), std::span(frame).first(cut));
    pair.a.reset();
    const auto start = Clock::now();
    auto received = receiveMessage(pair.b.get(), in(10s));
    ASSERT_FALSE(received.ok());
    EXPECT_LT(Clock::now() - start, 2s);
    EXPECT_EQ(received.error().code, ErrorCode::kIo);
    EXPECT_NE(received.error().message.find("connection closed"), std::string::npos) << received.error().message;
    EXPECT_NE(received.error().message.find("mid-frame after " + std::to_string(cut)), std::string::npos)
        << received.error().message;
  }
}

TEST(Socket, EofBeforeAFrameSaysConnectionClosed) {
  Pair pair = socketPair();
  pair.a.reset();
  auto received = receiveMessage(pair.b.get(), in(5s));
  ASSERT_FALSE(received.ok());
  EXPECT_EQ(received.error().code, ErrorCode::kIo);
  EXPECT_EQ(received.error().message, "connection closed");
}

TEST(Socket, MalformedHeaderAndPayloadAreReportedAndLeakNoFds) {
  const std::size_t fds_before = openFdCount();
  {
    Pair pair = socketPair();
    auto memfd = createMemfd("dbuf-ipc-leak", 4096);
    ASSERT_TRUE(memfd.ok());
    const int raw = memfd->get();
    auto frame = frameOf(Shutdown{"bye"});
    frame[0] = std::byte{0};  // bad magic
    ASSERT_TRUE(sendAll(pair.a.get(), frame, std::span(&raw, 1), in(1s)).ok());
    auto received = receiveMessage(pair.b.get(), in(1s));
    ASSERT_FALSE(received.ok());
    EXPECT_EQ(received.error().code, ErrorCode::kInvalidArgument);
    EXPECT_NE(received.error().message.find("magic"), std::string::npos) << received.error().message;
  }
  {
    Pair pair = socketPair();
    auto memfd = createMemfd("dbuf-ipc-leak", 4096);
    ASSERT_TRUE(memfd.ok());
    const int raw = memfd->get();
    auto frame = frameOf(Welcome{1, 2, 3, 4, 5, true});
    frame[frame.size() - 6] = std::byte{3};  // bad bool: reattached, before the memory kind and device
    ASSERT_TRUE(sendAll(pair.a.get(), frame, std::span(&raw, 1), in(1s)).ok());
    auto received = receiveMessage(pair.b.get(), in(1s));
    ASSERT_FALSE(received.ok());
    EXPECT_EQ(received.error().message, "Welcome.reattached: bool byte 3 is neither 0 nor 1");
  }
  EXPECT_EQ(openFdCount(), fds_before);
}

TEST(Socket, TooManyFdsAreClosedAndRefused) {
  const std::size_t fds_before = openFdCount();
  {
    Pair pair = socketPair();
    std::vector<UniqueFd> memfds;
    std::vector<int> raw;
    for (std::size_t i = 0; i < kMaxFdsPerFrame + 1; ++i) {
      auto memfd = createMemfd("dbuf-ipc-many", 4096);
      ASSERT_TRUE(memfd.ok());
      raw.push_back(memfd->get());
      memfds.push_back(std::move(*memfd));
    }
    EXPECT_FALSE(sendMessage(pair.a.get(), Detach{}, 1, raw, in(1s)).ok()) << "sendAll refuses them too";

    // Hand-made sendmsg with 9 fds on the first byte of a valid frame.
    const auto frame = frameOf(Detach{});
    iovec io{const_cast<std::byte*>(frame.data()), frame.size()};
    std::array<unsigned char, CMSG_SPACE((kMaxFdsPerFrame + 1) * sizeof(int))> control{};
    msghdr message{};
    message.msg_iov = &io;
    message.msg_iovlen = 1;
    message.msg_control = control.data();
    message.msg_controllen = control.size();
    cmsghdr* header = CMSG_FIRSTHDR(&message);
    header->cmsg_level = SOL_SOCKET;
    header->cmsg_type = SCM_RIGHTS;
    header->cmsg_len = CMSG_LEN(raw.size() * sizeof(int));
    std::memcpy(CMSG_DATA(header), raw.data(), raw.size() * sizeof(int));
    ASSERT_EQ(::sendmsg(pair.a.get(), &message, MSG_NOSIGNAL), static_cast<ssize_t>(frame.size()));

    auto received = receiveMessage(pair.b.get(), in(1s));
    ASSERT_FALSE(received.ok());
    EXPECT_NE(received.error().message.find("9 file descriptors"), std::string::npos) << received.error().message;
  }
  EXPECT_EQ(openFdCount(), fds_before);
}

TEST(Socket, FdsNeedABodyToTravelWith) {
  Pair pair = socketPair();
  const int fd = pair.a.get();
  EXPECT_FALSE(sendAll(pair.a.get(), {}, std::span(&fd, 1), in(1s)).ok());
  EXPECT_TRUE(sendAll(pair.a.get(), {}, {}, in(1s)).ok());
  auto none = sendSome(pair.a.get(), {}, {});
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, 0U);
}

TEST(Socket, SendToAFullSocketTimesOut) {
  Pair pair = socketPair();
  std::vector<std::byte> chunk(std::size_t{64} * 1024, std::byte{1});
  // Fill the socket buffer without blocking.
  for (;;) {
    auto sent = sendSome(pair.a.get(), chunk, {});
    ASSERT_TRUE(sent.ok()) << sent.error().message;
    if (*sent == 0) break;
  }
  const auto start = Clock::now();
  auto result = sendAll(pair.a.get(), chunk, {}, start + 100ms);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.error().message.find("timed out"), std::string::npos) << result.error().message;
  EXPECT_GE(Clock::now() - start, 100ms);
}

TEST(Socket, SendToAClosedPeerIsAnErrorNotSigpipe) {
  Pair pair = socketPair();
  pair.b.reset();
  auto result = sendMessage(pair.a.get(), Detach{}, 1, {}, in(1s));
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.error().code, ErrorCode::kIo);
  EXPECT_NE(result.error().message.find("connection closed"), std::string::npos) << result.error().message;
}

TEST(Socket, PeerCredentialsAreOurs) {
  Pair pair = socketPair();
  auto credentials = peerCredentials(pair.b.get());
  ASSERT_TRUE(credentials.ok()) << credentials.error().message;
  EXPECT_EQ(credentials->pid, ::getpid());
  EXPECT_EQ(credentials->uid, ::getuid());
  EXPECT_EQ(credentials->gid, ::getgid());

  auto bad = peerCredentials(-1);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code, ErrorCode::kIo);
}

TEST(Socket, ConnectToANonexistentPathFailsClearly) {
  const TempDir dir;
  const std::string path = dir.path("nobody-here.sock");
  auto fd = connectUnix(path, in(1s));
  ASSERT_FALSE(fd.ok());
  EXPECT_EQ(fd.error().code, ErrorCode::kNotFound);
  EXPECT_NE(fd.error().message.find(path), std::string::npos) << fd.error().message;
  EXPECT_NE(fd.error().message.find("no such socket"), std::string::npos) << fd.error().message;
}

TEST(Socket, ConnectRejectsPathsTheKernelCannotTake) {
  auto too_long = connectUnix("/tmp/" + std::string(200, 'x'), in(1s));
  ASSERT_FALSE(too_long.ok());
  EXPECT_EQ(too_long.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(too_long.error().message.find("at most 107"), std::string::npos) << too_long.error().message;
  EXPECT_FALSE(connectUnix("", in(1s)).ok());
  EXPECT_FALSE(connectUnix(std::string("/tmp/a\0b", 8), in(1s)).ok());
}

TEST(Socket, ConnectToAListeningSocketAndTalk) {
  const TempDir dir;
  const std::string path = dir.path("dbufd.sock");
  UniqueFd listener(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(listener.valid());
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  ASSERT_LT(path.size(), sizeof(address.sun_path));
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  ASSERT_EQ(::bind(listener.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address)), 0)
      << std::strerror(errno);
  ASSERT_EQ(::listen(listener.get(), 4), 0);

  auto client = connectUnix(path, in(2s));
  ASSERT_TRUE(client.ok()) << client.error().message;
  EXPECT_NE(::fcntl(client->get(), F_GETFD) & FD_CLOEXEC, 0) << "close-on-exec";
  EXPECT_EQ(::fcntl(client->get(), F_GETFL) & O_NONBLOCK, 0) << "handed back in blocking mode";

  UniqueFd server(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
  ASSERT_TRUE(server.valid()) << std::strerror(errno);
  auto credentials = peerCredentials(server.get());
  ASSERT_TRUE(credentials.ok());
  EXPECT_EQ(credentials->pid, ::getpid());

  ASSERT_TRUE(sendMessage(client->get(), testing::sampleHello(), 1, {}, in(2s)).ok());
  auto hello = receiveMessage(server.get(), in(2s));
  ASSERT_TRUE(hello.ok()) << hello.error().message;
  EXPECT_EQ(hello->message, Message(testing::sampleHello()));

  // A protocol-2 Welcome carries two fds, as dbufd sends it: the session
  // segment (a memfd) and the daemon's eventfd, in that order.
  auto memfd = createMemfd("dbuf-ipc-welcome", 4096);
  ASSERT_TRUE(memfd.ok());
  const UniqueFd doorbell(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  ASSERT_TRUE(doorbell.valid()) << std::strerror(errno);
  const std::array<int, 2> raw{memfd->get(), doorbell.get()};
  ASSERT_TRUE(sendMessage(server.get(), testing::sampleWelcome(), 1, raw, in(2s)).ok());
  auto welcome = receiveMessage(client->get(), in(2s));
  ASSERT_TRUE(welcome.ok()) << welcome.error().message;
  EXPECT_EQ(welcome->message, Message(testing::sampleWelcome()));
  ASSERT_EQ(welcome->fds.size(), 2U);
  EXPECT_TRUE(sameFile(raw[0], welcome->fds[0].get()));
  // Every eventfd shares one anonymous inode, so sameFile() proves nothing
  // here: a count written through the received fd must be read from ours.
  const std::uint64_t rung = 5;
  ASSERT_EQ(::write(welcome->fds[1].get(), &rung, sizeof rung), static_cast<ssize_t>(sizeof rung));
  std::uint64_t heard = 0;
  ASSERT_EQ(::read(doorbell.get(), &heard, sizeof heard), static_cast<ssize_t>(sizeof heard));
  EXPECT_EQ(heard, rung);
}

}  // namespace
}  // namespace dbuf::ipc
