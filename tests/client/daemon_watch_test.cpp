// libdbuf's watch on its connection to dbufd (stream ordering's last line of
// defence: a stream must not wait for a daemon that is gone), over a real
// socket pair: the peer's end closing poisons the word, stopping first does
// not, the daemon's replies are neither consumed nor taken for a hang-up,
// and a signal the process takes is not the watcher's.
#include "daemon_watch.hpp"

#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "dbuf/common/stream_counter_word.hpp"

namespace dbuf {
namespace {

using std::chrono::milliseconds;

struct SocketPair {
  SocketPair() { EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0); }
  ~SocketPair() {
    for (const int fd : fds) {
      if (fd >= 0) ::close(fd);
    }
  }
  void close(int which) {
    ::close(fds[which]);
    fds[which] = -1;
  }
  int fds[2] = {-1, -1};
};

bool eventuallyPoisoned(std::uint64_t& word) {
  const auto deadline = std::chrono::steady_clock::now() + milliseconds(5000);
  while (!isPoisoned(counterValue(word))) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(milliseconds(1));
  }
  return true;
}

TEST(DaemonWatch, TheDaemonsEndClosingPoisonsTheWord) {
  SocketPair pair;
  std::uint64_t done = 41;
  auto watch = DaemonWatch::start([&done] { poisonCounter(done); }, pair.fds[0]);
  ASSERT_TRUE(watch) << watch.error().message;
  std::this_thread::sleep_for(milliseconds(20));
  EXPECT_EQ(counterValue(done), 41U) << "poisoned while dbufd was still there";
  pair.close(1);  // dbufd died
  EXPECT_TRUE(eventuallyPoisoned(done));
  EXPECT_EQ(counterValue(done), 41U + kPoisonOffset);
  (*watch)->stop();
}

TEST(DaemonWatch, StoppingEndsTheWatchWithoutPoisoningAndTwiceIsHarmless) {
  SocketPair pair;
  std::uint64_t done = 7;
  auto watch = DaemonWatch::start([&done] { poisonCounter(done); }, pair.fds[0]);
  ASSERT_TRUE(watch) << watch.error().message;
  const auto start = std::chrono::steady_clock::now();
  (*watch)->stop();
  (*watch)->stop();
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(1000));
  pair.close(1);
  std::this_thread::sleep_for(milliseconds(20));
  EXPECT_EQ(counterValue(done), 7U) << "a stopped watch must not act";
}

TEST(DaemonWatch, DataFromTheDaemonIsNotConsumedNorMistakenForAHangUp) {
  SocketPair pair;
  std::uint64_t done = 3;
  auto watch = DaemonWatch::start([&done] { poisonCounter(done); }, pair.fds[0]);
  ASSERT_TRUE(watch) << watch.error().message;
  const char reply = 'r';
  ASSERT_EQ(::write(pair.fds[1], &reply, 1), 1);
  std::this_thread::sleep_for(milliseconds(20));
  EXPECT_EQ(counterValue(done), 3U);
  char got = 0;
  EXPECT_EQ(::read(pair.fds[0], &got, 1), 1) << "the reply stays the connection's";
  EXPECT_EQ(got, 'r');
  (*watch)->stop();
}

TEST(DaemonWatch, ASignalToTheProcessIsNotDeliveredToTheWatcher) {
  // With the signal blocked here, the watcher is the only other thread that
  // could take it: it must stay pending until this thread unblocks it.
  static std::atomic<int> handled{0};
  static std::atomic<bool> on_this_thread{false};
  static std::thread::id this_id;
  this_id = std::this_thread::get_id();
  handled = 0;
  struct sigaction action {};
  action.sa_handler = [](int) {
    on_this_thread = std::this_thread::get_id() == this_id;
    ++handled;
  };
  struct sigaction previous {};
  ASSERT_EQ(sigaction(SIGUSR1, &action, &previous), 0);
  SocketPair pair;
  std::uint64_t done = 0;
  auto watch = DaemonWatch::start([&done] { poisonCounter(done); }, pair.fds[0]);  // started with SIGUSR1 open here: it must close its own
  ASSERT_TRUE(watch) << watch.error().message;
  sigset_t usr1;
  sigemptyset(&usr1);
  sigaddset(&usr1, SIGUSR1);
  ASSERT_EQ(pthread_sigmask(SIG_BLOCK, &usr1, nullptr), 0);
  ASSERT_EQ(::kill(::getpid(), SIGUSR1), 0);
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_EQ(handled.load(), 0) << "the watcher thread took the trainer's signal";
  ASSERT_EQ(pthread_sigmask(SIG_UNBLOCK, &usr1, nullptr), 0);
  EXPECT_EQ(handled.load(), 1);
  EXPECT_TRUE(on_this_thread);
  (*watch)->stop();
  sigaction(SIGUSR1, &previous, nullptr);
}

}  // namespace
}  // namespace dbuf
