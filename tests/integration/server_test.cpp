// The embedded Server's own contract: stats() is a thread-safe snapshot, also
// while the daemon stops (dbufctl or a test may ask at any moment).

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <vector>

#include "harness.hpp"

namespace dbuf::integration {
namespace {

/// Joins `thread`, which sets `finished` when done; a thread still running
/// after `timeout` is a hang: report it and end the process (it cannot be
/// joined, and the objects it uses are about to go).
void joinOrDie(std::thread& thread, std::future<void>& finished, Clock::duration timeout, const char* what) {
  if (finished.wait_for(timeout) != std::future_status::ready) {
    std::fprintf(stderr, "FATAL: %s did not return within the deadline (hang)\n", what);
    std::fflush(stderr);
    std::_Exit(1);
  }
  thread.join();
}

TEST(Server, StatsWhileTheDaemonStopsNeverHangs) {
  // Several threads keep asking while the loop winds down; one of them asking
  // just as run() returns used to wait forever for an answer.
  constexpr int kPollers = 4;
  for (int round = 0; round < 100; ++round) {
    EmbeddedDaemon daemon;
    ASSERT_TRUE(daemon.started());
    std::atomic<bool> stopped = false;
    std::atomic<int> calls = 0;
    std::vector<std::promise<void>> done(kPollers);
    std::vector<std::future<void>> finished;
    std::vector<std::thread> pollers;
    for (int p = 0; p < kPollers; ++p) {
      finished.push_back(done[static_cast<std::size_t>(p)].get_future());
      pollers.emplace_back([&, p] {
        while (!stopped) {
          (void)daemon.stats();
          ++calls;
        }
        done[static_cast<std::size_t>(p)].set_value();
      });
    }
    ASSERT_TRUE(waitUntil([&] { return calls.load() >= kPollers; }));
    daemon.stop();  // while the pollers keep asking
    stopped = true;
    for (int p = 0; p < kPollers; ++p) {
      joinOrDie(pollers[static_cast<std::size_t>(p)], finished[static_cast<std::size_t>(p)], 10s,
                "Server::stats() racing the return of Server::run()");
    }
    EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
  }
}

TEST(Server, StatsBeforeAndAfterServing) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
  auto client = daemon.attach(rankOf("counted", 0, 1));
  ASSERT_TRUE(client.ok()) << messageOf(client);
  EXPECT_EQ(daemon.stats().sessions, 1U);
  daemon.stop();
  EXPECT_TRUE(daemonIsEmpty(daemon.stats())) << "stopping frees everything";
}

}  // namespace
}  // namespace dbuf::integration
