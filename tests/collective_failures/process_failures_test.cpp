// Collectives and real processes: a real dbufd, rank processes (dbuf-cf-rank)
// driven line by line, kill -9 mid-collective and SIGTERM.
//
// - kill -9 of a rank while the others wait for it in a reduce-scatter;
// - kill -9 of a rank while a large all-gather runs in the daemon;
// - SIGTERM while a rank waits for a collective.
// Each time the survivors get an error at once (collective_ms is 30 s: an
// error within seconds is not the timeout), the daemon closes the dead rank's
// memfds, and a second job keeps working.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <fstream>
#include <memory>
#include <string>

#include "cf_rank_driver.hpp"
#include "harness.hpp"

namespace dbuf::mp {
namespace {

/// The id=N of a "submit" answer.
std::string idOf(const std::string& line) {
  const auto at = line.find("id=");
  return at == std::string::npos ? std::string("0") : line.substr(at + 3);
}

constexpr int kCollectiveMs = 30000;

/// A two-rank job beside the one under test, registered before the kill and
/// exercised after it.
class OtherJob {
 public:
  OtherJob(const std::string& socket, const std::string& job) : r0_(job + "-0"), r1_(job + "-1") {
    r0_.attach(socket, job, 0, 2);
    r1_.attach(socket, job, 1, 2);
    r0_.begin("register og 4096");
    r1_.begin("register og 4096");
    EXPECT_LINE(r0_.result(), "ok register");
    EXPECT_LINE(r1_.result(), "ok register");
    EXPECT_EQ(r0_.call("acquire og"), "ok acquire");
    EXPECT_EQ(r1_.call("acquire og"), "ok acquire");
  }
  /// An all-gather and a reduce-scatter with fresh values, checked.
  void keepsWorking(float base) {
    const std::string value = std::to_string(base);
    EXPECT_EQ(r0_.call("fill og " + value), "ok fill");
    EXPECT_EQ(r1_.call("fill og " + value), "ok fill");
    for (const std::string op : {"ag", "rs"}) {
      r0_.begin("run " + op + " og");
      r1_.begin("run " + op + " og");
      const std::string a = r0_.result();
      const std::string b = r1_.result();
      EXPECT_LINE(a, "ok run");
      EXPECT_LINE(b, "ok run");
      EXPECT_LT(elapsedOf(a), 2000) << a;
    }
    EXPECT_EQ(r0_.call("checkag og " + value), "ok checkag");
    EXPECT_EQ(r1_.call("checkrs og " + value), "ok checkrs");
  }
  void finish() {
    EXPECT_EQ(r0_.call("detach"), "ok detach");
    EXPECT_EQ(r1_.call("detach"), "ok detach");
    r0_.exit();
    r1_.exit();
  }

 private:
  CfRank r0_;
  CfRank r1_;
};

class ProcessFailures : public ::testing::Test {
 protected:
  void SetUp() override {
    Daemon::Settings settings;
    settings.tenants_by_uid = false;  // the default tenant: this uid, 16 GiB
    daemon_ = std::make_unique<Daemon>(dir_.path(), settings);
    // The harness writes no [timeouts] collective_ms: write the config here.
    std::ofstream config(daemon_->configPath(), std::ios::trunc);
    config << "[daemon]\nsocket = \"" << daemon_->socket() << "\"\nlog_level = \"info\"\n"
           << "[timeouts]\ncollective_ms = " << kCollectiveMs << "\n";
    config.close();
    ASSERT_TRUE(config) << "cannot write " << daemon_->configPath();
    ASSERT_NO_FATAL_FAILURE(daemon_->start());
  }

  [[nodiscard]] const std::string& socket() const { return daemon_->socket(); }

  void expectMemfds(const std::string& job, const std::string& part, int count) {
    EXPECT_TRUE(eventually([&] { return daemon_->memfdsOf(job, part) == count; }))
        << "expected " << count << " memfds 'dbuf:" << job << ":" << part << "...'\n"
        << daemon_->fdListing();
  }

  TempDir dir_{"dbuf-cf"};
  std::unique_ptr<Daemon> daemon_;
};

TEST_F(ProcessFailures, KillNineWhileTheOthersWaitInAReduceScatter) {
  OtherJob other(socket(), "other");
  CfRank a0("a0");
  CfRank a1("a1");
  auto a2 = std::make_unique<CfRank>("a2");
  a0.attach(socket(), "ja", 0, 3);
  a1.attach(socket(), "ja", 1, 3);
  a2->attach(socket(), "ja", 2, 3);
  for (CfRank* rank : {&a0, &a1, a2.get()}) rank->begin("register g 960");
  for (CfRank* rank : {&a0, &a1, a2.get()}) EXPECT_LINE(rank->result(), "ok register");
  for (CfRank* rank : {&a0, &a1, a2.get()}) {
    EXPECT_EQ(rank->call("acquire g"), "ok acquire");
    EXPECT_EQ(rank->call("fill g 1"), "ok fill");
  }
  expectMemfds("ja", "slot:2", 1);
  expectMemfds("ja", "session:2", 1);
  expectMemfds("ja", "g:", 3);
  const int sockets = daemon_->counts().sockets;

  // Ranks 0 and 1 submitted and wait; rank 2 dies without submitting.
  a0.begin("run rs g");
  a1.begin("run rs g");
  a2->kill9();
  for (CfRank* rank : {&a0, &a1}) {
    const std::string line = rank->result();
    EXPECT_LINE(line, "err run conflict");
    EXPECT_TRUE(contains(line, "rank 2 of job ja disconnected")) << line;
    EXPECT_GE(elapsedOf(line), 0) << line;
    EXPECT_LT(elapsedOf(line), 3000) << "must not wait for collective_ms: " << line;
  }
  // The dead rank's slot and session segment are closed; the job's shards stay.
  expectMemfds("ja", "slot:2", 0);
  expectMemfds("ja", "session:2", 0);
  expectMemfds("ja", "g:", 3);
  EXPECT_TRUE(eventually([&] { return daemon_->counts().sockets == sockets - 1; })) << daemon_->counts().text();

  // Until rank 2 is back, the others' ops fail at once.
  const std::string refused = a0.call("run barrier -");
  EXPECT_LINE(refused, "err run conflict");
  EXPECT_TRUE(contains(refused, "barrier cannot run: rank 2 of job ja disconnected and has not attached again"))
      << refused;
  EXPECT_LT(elapsedOf(refused), 1000) << refused;
  const std::string refused1 = a1.call("run barrier -");
  EXPECT_LINE(refused1, "err run conflict");

  other.keepsWorking(3.0F);

  // A new process takes rank 2; the job runs a reduce-scatter again.
  a2 = std::make_unique<CfRank>("a2-again");
  a2->attach(socket(), "ja", 2, 3);
  EXPECT_LINE(a2->call("register g 960"), "ok register");
  EXPECT_EQ(a2->call("acquire g"), "ok acquire");
  EXPECT_EQ(a2->call("fill g 1"), "ok fill");
  for (CfRank* rank : {&a0, &a1, a2.get()}) rank->begin("run rs g");
  for (CfRank* rank : {&a0, &a1, a2.get()}) EXPECT_LINE(rank->result(), "ok run");
  for (CfRank* rank : {&a0, &a1, a2.get()}) EXPECT_EQ(rank->call("checkrs g 1"), "ok checkrs");

  for (CfRank* rank : {&a0, &a1, a2.get()}) {
    EXPECT_EQ(rank->call("detach"), "ok detach");
    rank->exit();
  }
  expectMemfds("ja", "", 0);
  other.finish();
}

TEST_F(ProcessFailures, KillNineWhileALargeAllGatherRuns) {
  OtherJob other(socket(), "other");
  CfRank b0("b0");
  CfRank b1("b1");
  b0.attach(socket(), "jb", 0, 2);
  b1.attach(socket(), "jb", 1, 2);
  // 2 x 16 Mi fp32 elements: 64 MiB per rank's shard, 128 MiB of params per rank.
  b0.begin("register big 33554432");
  b1.begin("register big 33554432");
  EXPECT_LINE(b0.result(), "ok register S=16777216");
  EXPECT_LINE(b1.result(), "ok register S=16777216");
  for (CfRank* rank : {&b0, &b1}) {
    EXPECT_EQ(rank->call("acquire big"), "ok acquire");
    EXPECT_EQ(rank->call("fillshard big 1"), "ok fillshard");
  }
  expectMemfds("jb", "slot:1", 1);
  expectMemfds("jb", "session:1", 1);
  const int sockets = daemon_->counts().sockets;

  const std::string submitted0 = b0.call("submit ag big");
  EXPECT_LINE(submitted0, "ok submit id=");
  EXPECT_LINE(b1.call("submit ag big"), "ok submit id=");
  // The daemon has started writing rank 0's params and not reached their end.
  EXPECT_EQ(b0.call("watch big"), "ok watch last_untouched=1");
  b1.kill9();
  const std::string line = b0.call("wait " + idOf(submitted0));
  EXPECT_LINE(line, "err wait conflict");
  EXPECT_TRUE(contains(line, "rank 1 of job jb disconnected while collective #0 was running")) << line;
  EXPECT_LT(elapsedOf(line), 2000) << line;

  expectMemfds("jb", "slot:1", 0);
  expectMemfds("jb", "session:1", 0);
  expectMemfds("jb", "big:", 2);
  EXPECT_TRUE(eventually([&] { return daemon_->counts().sockets == sockets - 1; })) << daemon_->counts().text();

  other.keepsWorking(5.0F);
  const std::string refused = b0.call("run barrier -");
  EXPECT_LINE(refused, "err run conflict");
  EXPECT_TRUE(contains(refused, "rank 1 of job jb disconnected and has not attached again")) << refused;

  EXPECT_EQ(b0.call("detach"), "ok detach");
  b0.exit();
  expectMemfds("jb", "", 0);
  other.keepsWorking(7.0F);
  other.finish();
}

TEST_F(ProcessFailures, SigtermWhileARankWaitsGivesItUnavailablePromptly) {
  CfRank t0("t0");
  CfRank t1("t1");
  t0.attach(socket(), "jt", 0, 2);
  t1.attach(socket(), "jt", 1, 2);
  t0.begin("run barrier -");  // rank 1 never submits
  const auto start = Clock::now();
  const int status = daemon_->terminate();
  const auto stop_ms = std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status << "\n" << daemon_->log();
  const std::string line = t0.result();
  EXPECT_LINE(line, "err run unavailable");
  EXPECT_TRUE(contains(line, "shutting down")) << line;
  // elapsed_ms counts from the submission, a moment before SIGTERM.
  EXPECT_GE(elapsedOf(line), 0) << line;
  EXPECT_LT(elapsedOf(line), stop_ms + 300) << "the daemon stopped in " << stop_ms << " ms: " << line;
  t0.exit();
  t1.exit();
}

}  // namespace
}  // namespace dbuf::mp
