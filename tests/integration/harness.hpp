#pragma once
/// \file
/// Integration-test harness: dbufd embedded in the test process (a Server on
/// its own thread, listening in a unique mkdtemp directory) and real clients
/// over the real socket. No sleeps: waits are the blocking calls themselves,
/// barriers, or `waitUntil` polling a predicate (usually on stats()) against a
/// deadline while yielding.

#include <gtest/gtest.h>

#include <barrier>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dbuf/client.hpp"
#include "dbuf/common/result.hpp"
#include "dbuf/common/unique_fd.hpp"
#include "dbuf/daemon/config.hpp"
#include "dbuf/daemon/server.hpp"
#include "support/temp_dir.hpp"

namespace dbuf::integration {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

/// A unique directory under $TMPDIR (or /tmp), removed with its contents.
using dbuf::testing::TempDir;

/// dbufd on a thread. The config's socket path is replaced by one in a fresh
/// temp dir. stop() (also run by the destructor) asks the loop to stop and
/// joins it. stats() may be called from any thread at any time.
class EmbeddedDaemon {
 public:
  explicit EmbeddedDaemon(daemon::Config config = {});
  EmbeddedDaemon(const EmbeddedDaemon&) = delete;
  EmbeddedDaemon& operator=(const EmbeddedDaemon&) = delete;
  ~EmbeddedDaemon();

  [[nodiscard]] bool started() const noexcept { return server_ != nullptr; }
  [[nodiscard]] const std::string& socketPath() const noexcept { return socket_path_; }
  [[nodiscard]] daemon::ServerStats stats();
  void stop();

  /// A connected, not yet attached client.
  [[nodiscard]] Result<Client> connect(std::chrono::milliseconds timeout = 10s) const;
  /// Connects and attaches.
  [[nodiscard]] Result<Client> attach(const AttachOptions& options, std::chrono::milliseconds timeout = 10s) const;
  /// A raw stream socket connected to the daemon (for protocol abuse).
  [[nodiscard]] UniqueFd rawConnect() const;

 private:
  TempDir dir_;
  std::string socket_path_;
  std::unique_ptr<daemon::Server> server_;
  std::thread thread_;
};

/// Attach options in one line.
[[nodiscard]] AttachOptions rankOf(const std::string& job, std::uint32_t rank, std::uint32_t world_size,
                                   bool persistent = false, std::uint32_t prefetch_depth = 1);

/// Runs fn(rank) for rank in [0, n) on n threads and joins them.
void onRanks(std::uint32_t n, const std::function<void(std::uint32_t)>& fn);

/// A thread's walk through a sequence of barriers shared with other threads:
/// next() waits at the next one; whatever is left when the walk ends early (a
/// failed ASSERT returned) is dropped, so the other threads never hang.
class Phases {
 public:
  explicit Phases(std::vector<std::barrier<>*> barriers) : barriers_(std::move(barriers)) {}
  Phases(const Phases&) = delete;
  Phases& operator=(const Phases&) = delete;
  ~Phases() {
    while (done_ < barriers_.size()) barriers_[done_++]->arrive_and_drop();
  }
  void next() { barriers_[done_++]->arrive_and_wait(); }

 private:
  std::vector<std::barrier<>*> barriers_;
  std::size_t done_ = 0;
};

/// Polls `predicate` until it holds or `timeout` passes (yielding between
/// tries); returns its last value.
bool waitUntil(const std::function<bool()>& predicate, Clock::duration timeout = 10s);

/// Every session, job, memfd and byte of the daemon is gone.
[[nodiscard]] ::testing::AssertionResult daemonIsEmpty(const daemon::ServerStats& stats);

/// Mappings of dbuf memfds ("memfd:dbuf:...") in this process (the daemon and
/// the clients share it). `job` narrows to one job's files.
[[nodiscard]] std::size_t dbufMappings(const std::string& job = "");

/// Bytes of memory actually allocated (st_blocks) to the dbuf memfds this
/// process holds open whose name starts with "dbuf:" + `prefix` (the daemon's
/// files: it runs in this process).
[[nodiscard]] std::uint64_t dbufMemfdAllocatedBytes(const std::string& prefix);

/// Open fds of this process.
[[nodiscard]] std::size_t openFdCount();

/// Plan as text, for comparing ranks' plans and for failure messages.
[[nodiscard]] std::string describe(const GroupPlan& plan);

/// A daemon configuration with one tenant, `name`, of this process's user, whose memory quota is
/// `quota_bytes`.
[[nodiscard]] daemon::Config oneTenantWithQuota(const std::string& name, std::uint64_t quota_bytes);

/// A small group: `tensors` x {rows, 8} fp32 tensors named t0, t1, ...
[[nodiscard]] GroupSpec smallGroup(const std::string& name, std::size_t tensors = 1, std::int64_t rows = 16);

/// Message of a failed Result, or "(ok)".
template <typename T>
[[nodiscard]] std::string messageOf(const Result<T>& result) {
  return result.ok() ? std::string("(ok)") : result.error().message;
}

/// Expects `result` to have failed with `code`; prints the message either way.
#define EXPECT_FAILS_WITH(result, expected_code)                                                \
  do {                                                                                          \
    const auto& dbuf_result_ = (result);                                                        \
    ASSERT_FALSE(dbuf_result_.ok()) << "expected " << ::dbuf::toString(expected_code);          \
    EXPECT_EQ(dbuf_result_.error().code, (expected_code))                                       \
        << ::dbuf::toString(dbuf_result_.error().code) << ": " << dbuf_result_.error().message; \
  } while (false)

}  // namespace dbuf::integration
