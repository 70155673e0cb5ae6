// Multi-process tests: a real dbufd and real trainer processes.
//
// - kill -9 of a rank at every stage (handshake: connected / half a Hello;
//   blocked in a registration; after mapping its shard; after unshard(), the
//   collective): the other ranks of its job get an error naming it instead of
//   hanging (registrations and collectives alike), a second job is served
//   throughout (collectives included), and the daemon's fds and mappings go
//   back to their baseline;
// - SIGTERM with clients attached (one waiting in a collective on the
//   rings), a second daemon on the same socket, a stale socket of a SIGKILLed
//   daemon;
// - isolation between uids / tenants;
// - persistence of a job's shards across a crash, and their release after the
//   grace period.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <filesystem>
#include <memory>
#include <ostream>
#include <string>

#include "harness.hpp"

namespace dbuf::mp {
namespace {

::testing::AssertionResult lineStartsWith(const std::string& line, const std::string& prefix) {
  if (startsWith(line, prefix)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected a line starting with '" << prefix << "', got '" << line << "'";
}

// Evaluates `line` once (it is usually a command sent to a rank).
#define EXPECT_LINE(line, prefix) EXPECT_TRUE(lineStartsWith((line), (prefix)))

/// A two-rank job that runs beside the job under test: it attaches and
/// registers before the kill, keeps working after it, and finishes cleanly.
class OtherJob {
 public:
  OtherJob(const std::string& socket, const std::string& job) : r0_(job + "-0"), r1_(job + "-1") {
    r0_.attach(socket, job, 0, 2);
    r1_.attach(socket, job, 1, 2);
    registerBoth("og");
    EXPECT_LINE(r0_.call("write og 11"), "ok write");
    EXPECT_LINE(r1_.call("write og 21"), "ok write");
  }

  /// Reads back what it wrote, unshards (the collective: both ranks) and
  /// checks that both got both shards, reshards, writes again.
  void keepsWorking() {
    EXPECT_LINE(r0_.call("check og 11"), "ok check");
    EXPECT_LINE(r1_.call("check og 21"), "ok check");
    r0_.begin("unshard og");
    r1_.begin("unshard og");
    EXPECT_EQ(r0_.result(), "ok unshard");
    EXPECT_EQ(r1_.result(), "ok unshard");
    EXPECT_LINE(r0_.call("gathered og 11 21"), "ok gathered");
    EXPECT_LINE(r1_.call("gathered og 11 21"), "ok gathered");
    EXPECT_EQ(r0_.call("reshard og"), "ok reshard");
    EXPECT_EQ(r1_.call("reshard og"), "ok reshard");
    EXPECT_LINE(r1_.call("write og 22"), "ok write");
    EXPECT_LINE(r1_.call("check og 22"), "ok check");
  }

  /// Registers a second group, then detaches and exits.
  void finish() {
    registerBoth("og2");
    EXPECT_LINE(r0_.call("write og2 31"), "ok write");
    EXPECT_LINE(r0_.call("check og2 31"), "ok check");
    EXPECT_EQ(r0_.call("detach"), "ok detach");
    EXPECT_EQ(r1_.call("detach"), "ok detach");
    r0_.exit();
    r1_.exit();
  }

 private:
  void registerBoth(const std::string& group) {
    r0_.begin("register " + group);
    r1_.begin("register " + group);
    EXPECT_LINE(r0_.result(), "ok register");
    EXPECT_LINE(r1_.result(), "ok register");
  }

  Rank r0_;
  Rank r1_;
};

class MultiProcess : public ::testing::Test {
 protected:
  void startDaemon(const Daemon::Settings& settings = {}) {
    daemon_ = std::make_unique<Daemon>(dir_.path(), settings);
    ASSERT_NO_FATAL_FAILURE(daemon_->start());
    ASSERT_NO_FATAL_FAILURE(daemon_->warmUpAndTakeBaseline());
  }

  [[nodiscard]] const std::string& socket() const { return daemon_->socket(); }

  /// Polls until the daemon holds no dbuf memfd, no socket but its listener,
  /// and no more file mappings or threads than after the warm-up job. (Not
  /// all lines of its maps: a sanitizer runtime maps more heap and shadow as
  /// the daemon runs, and those are not the daemon's.)
  void expectBackToBaseline(const std::string& when) {
    const DaemonCounts& base = daemon_->baseline();
    DaemonCounts now;
    const bool idle = eventually([&] {
      now = daemon_->counts();
      return now.memfds == 0 && now.memfd_maps == 0 && now.sockets == base.sockets &&
             now.file_maps <= base.file_maps && now.threads <= base.threads;
    });
    EXPECT_TRUE(idle) << when << ": " << now.text() << "; baseline " << base.text() << "\nfds:\n"
                      << daemon_->fdListing() << "log:\n"
                      << daemon_->log();
  }

  /// Expects the daemon to hold `count` memfds of `job` whose name continues
  /// with `part`. Polled: the daemon closes its copy of an fd it sent right
  /// after sendmsg, which may be a moment after the rank has read the reply.
  void expectMemfds(const std::string& job, const std::string& part, int count) {
    EXPECT_TRUE(eventually([&] { return daemon_->memfdsOf(job, part) == count; }))
        << "expected " << count << " memfds 'dbuf:" << job << ":" << part << "...'\n"
        << daemon_->fdListing();
  }

  /// A job started and finished after the events under test.
  void runJobAfterwards(const std::string& job) {
    OtherJob after(socket(), job);
    after.keepsWorking();
    after.finish();
  }

  /// SIGTERM; dbufd must exit 0 and remove its socket.
  void expectCleanStop() {
    const int status = daemon_->terminate();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status << "\n" << daemon_->log();
    EXPECT_FALSE(std::filesystem::exists(std::filesystem::symlink_status(socket()))) << socket();
  }

  /// Mode 0711: other users (ranks running as uid 65534) may reach a socket in
  /// it, not list it.
  TempDir dir_{"dbuf-mp", 0711};
  std::unique_ptr<Daemon> daemon_;
};

// ------------------------------------------------------------ kill -9 of a rank

enum class HandshakeStage { kConnected, kHalfHello };
void PrintTo(HandshakeStage stage, std::ostream* out) {  // NOLINT(readability-identifier-naming): gtest's name
  *out << (stage == HandshakeStage::kConnected ? "connected, no Hello" : "half a Hello frame sent");
}

class KillInHandshake : public MultiProcess, public ::testing::WithParamInterface<HandshakeStage> {};

TEST_P(KillInHandshake, SessionIsReclaimedAndTheRankSlotStaysFree) {
  ASSERT_NO_FATAL_FAILURE(startDaemon());
  OtherJob other(socket(), "other");
  Rank a0("a0");
  a0.attach(socket(), "job-a", 0, 2);
  const int sockets_before = daemon_->counts().sockets;

  Rank victim("victim");
  if (GetParam() == HandshakeStage::kConnected) {
    EXPECT_EQ(victim.call("connect " + socket()), "ok connect");  // libdbuf connected, Hello not sent
  } else {
    EXPECT_EQ(victim.call("raw-connect " + socket()), "ok raw-connect");
    EXPECT_LINE(victim.call("raw-half-hello job-a 1 2"), "ok raw-half-hello");
  }
  // The daemon has accepted the connection (handshake_ms is 20 s: it waits).
  EXPECT_TRUE(eventually([&] { return daemon_->counts().sockets == sockets_before + 1; })) << daemon_->counts().text();
  victim.kill9();
  // Reclaimed on EOF, long before the handshake deadline would have closed it.
  EXPECT_TRUE(eventually([&] { return daemon_->counts().sockets == sockets_before; }, milliseconds(5000)))
      << daemon_->counts().text();

  other.keepsWorking();
  // The dead connection claimed nothing: a new process takes rank 1 and the
  // job registers as if nothing happened.
  Rank a1("a1");
  EXPECT_EQ(a1.attach(socket(), "job-a", 1, 2), "ok attach reattached=0");
  a0.begin("register g");
  a1.begin("register g");
  EXPECT_LINE(a0.result(), "ok register");
  EXPECT_LINE(a1.result(), "ok register");
  EXPECT_LINE(a1.call("write g 5"), "ok write");
  EXPECT_LINE(a1.call("check g 5"), "ok check");
  EXPECT_EQ(a0.call("detach"), "ok detach");
  EXPECT_EQ(a1.call("detach"), "ok detach");
  a0.exit();
  a1.exit();
  other.finish();
  runJobAfterwards("after");
  expectBackToBaseline("after the job");
}

INSTANTIATE_TEST_SUITE_P(Stages, KillInHandshake,
                         ::testing::Values(HandshakeStage::kConnected, HandshakeStage::kHalfHello),
                         [](const ::testing::TestParamInfo<HandshakeStage>& stage) {
                           return stage.param == HandshakeStage::kConnected ? "ConnectedNoHello" : "HalfAHelloFrame";
                         });

TEST_F(MultiProcess, KillWhileRegisteringFailsThePendingRegistrationNamingTheRank) {
  ASSERT_NO_FATAL_FAILURE(startDaemon());  // register_ms 30 s: an error within 5 s is not the timeout
  OtherJob other(socket(), "other");
  Rank a0("a0");
  Rank a1("a1");
  Rank a2("a2");
  a0.attach(socket(), "job-a", 0, 3);
  a1.attach(socket(), "job-a", 1, 3);
  a2.attach(socket(), "job-a", 2, 3);
  a0.begin("register g");  // both block: rank 2 has not registered
  a1.begin("register g");
  a1.kill9();

  const std::string failed = a0.result(milliseconds(5000));
  EXPECT_LINE(failed, "err register conflict");
  EXPECT_TRUE(contains(failed, "rank 1")) << failed;
  // A rank that joins the registration now is told at once as well.
  const std::string late = a2.call("register g", milliseconds(5000));
  EXPECT_LINE(late, "err register conflict");
  EXPECT_TRUE(contains(late, "rank 1")) << late;

  other.keepsWorking();
  // Rank 1's session is gone: a restarted rank 1 takes its place and the job
  // registers again.
  Rank a1_again("a1-again");
  a1_again.attach(socket(), "job-a", 1, 3);
  a0.begin("register g");
  a1_again.begin("register g");
  a2.begin("register g");
  EXPECT_LINE(a0.result(), "ok register");
  EXPECT_LINE(a1_again.result(), "ok register");
  EXPECT_LINE(a2.result(), "ok register");
  EXPECT_LINE(a2.call("write g 8"), "ok write");
  EXPECT_LINE(a2.call("check g 8"), "ok check");
  for (Rank* rank : {&a0, &a1_again, &a2}) {
    EXPECT_EQ(rank->call("detach"), "ok detach") << rank->name();
    rank->exit();
  }
  other.finish();
  runJobAfterwards("after");
  expectBackToBaseline("after the job");
}

enum class MappedStage { kShardMapped, kUnsharded };
void PrintTo(MappedStage stage, std::ostream* out) {  // NOLINT(readability-identifier-naming): gtest's name
  *out << (stage == MappedStage::kShardMapped ? "shard mapped" : "after unshard()");
}

class KillAfterMapping : public MultiProcess, public ::testing::WithParamInterface<MappedStage> {};

TEST_P(KillAfterMapping, DeadRankMemoryIsReclaimedAndPeersAreTold) {
  ASSERT_NO_FATAL_FAILURE(startDaemon());
  OtherJob other(socket(), "other");
  Rank a0("a0");
  Rank a1("a1");
  a0.attach(socket(), "job-a", 0, 2);
  a1.attach(socket(), "job-a", 1, 2);
  a0.begin("register g");
  a1.begin("register g");
  EXPECT_LINE(a0.result(), "ok register");
  EXPECT_LINE(a1.result(), "ok register");
  EXPECT_LINE(a0.call("write g 3"), "ok write");
  EXPECT_LINE(a1.call("write g 4"), "ok write");
  expectMemfds("job-a", "g:", 2);        // one shard file per rank
  expectMemfds("job-a", "session:", 2);  // one session segment per rank
  expectMemfds("job-a", "", 4);          // and nothing else
  if (GetParam() == MappedStage::kUnsharded) {
    a0.begin("unshard g");  // a collective: both ranks
    a1.begin("unshard g");
    EXPECT_EQ(a0.result(), "ok unshard");
    EXPECT_EQ(a1.result(), "ok unshard");
    EXPECT_LINE(a1.call("gathered g 3 4"), "ok gathered");
    expectMemfds("job-a", "slot:1", 1);
  }
  const int sockets_before = daemon_->counts().sockets;
  a1.kill9();

  // Its session (socket and session segment) and its unsharded slot go at once.
  EXPECT_TRUE(eventually([&] {
    return daemon_->counts().sockets == sockets_before - 1 && daemon_->memfdsOf("job-a", "slot:1") == 0 &&
           daemon_->memfdsOf("job-a", "session:1") == 0;
  })) << daemon_->fdListing();
  // Rank 0 is told instead of being left to hang in its next collective.
  const std::string next = a0.call("register g2", milliseconds(5000));
  EXPECT_LINE(next, "err register conflict");
  EXPECT_TRUE(contains(next, "rank 1")) << next;
  // Its own memory is untouched and its slots work.
  EXPECT_LINE(a0.call("check g 3"), "ok check");
  EXPECT_EQ(a0.call("acquire g"), "ok acquire");
  // A collective on the rings needs rank 1 too: it fails at once, naming it
  // (not after the collective timeout).
  const std::string gather = a0.call("unshard g", milliseconds(5000));
  EXPECT_LINE(gather, "err unshard conflict");
  EXPECT_TRUE(contains(gather, "rank 1 of job job-a disconnected")) << gather;
  EXPECT_EQ(a0.call("reshard g"), "ok reshard");
  other.keepsWorking();

  // The last rank leaves: the job and all its memory are gone.
  EXPECT_EQ(a0.call("detach"), "ok detach");
  a0.exit();
  expectMemfds("job-a", "", 0);
  other.finish();
  runJobAfterwards("after");
  expectBackToBaseline("after the job");
}

INSTANTIATE_TEST_SUITE_P(Stages, KillAfterMapping,
                         ::testing::Values(MappedStage::kShardMapped, MappedStage::kUnsharded),
                         [](const ::testing::TestParamInfo<MappedStage>& stage) {
                           return stage.param == MappedStage::kShardMapped ? "ShardMapped" : "AfterUnshard";
                         });

// ------------------------------------------------------------ daemon lifecycle

TEST_F(MultiProcess, SigtermWithClientsAttachedGivesThemUnavailableAndExitsZero) {
  ASSERT_NO_FATAL_FAILURE(startDaemon());
  Rank a0("a0");
  Rank a1("a1");
  a0.attach(socket(), "job-a", 0, 2);
  a1.attach(socket(), "job-a", 1, 2);
  a0.begin("register g");
  a1.begin("register g");
  EXPECT_LINE(a0.result(), "ok register");
  EXPECT_LINE(a1.result(), "ok register");
  EXPECT_LINE(a1.call("write g 6"), "ok write");
  EXPECT_EQ(a1.call("acquire g"), "ok acquire");  // a slot mapped
  EXPECT_EQ(a0.call("acquire g"), "ok acquire");
  a0.begin("gather g");     // waits on the rings in an all-gather rank 1 never joins
  Rank blocked("blocked");  // waits in a registration its peer never joins
  blocked.attach(socket(), "job-c", 0, 2);
  blocked.begin("register g");
  Rank fresh("fresh");  // connected, not attached
  EXPECT_EQ(fresh.call("connect " + socket()), "ok connect");

  expectCleanStop();

  // The blocked calls return with kUnavailable (the one on the rings too,
  // though nothing on the rings says so); every next call does too.
  EXPECT_LINE(blocked.result(milliseconds(5000)), "err register unavailable");
  EXPECT_LINE(a0.result(milliseconds(5000)), "err gather unavailable");
  EXPECT_LINE(a0.call("register g2", milliseconds(5000)), "err register unavailable");
  EXPECT_LINE(a1.call("reshard g", milliseconds(5000)), "err reshard unavailable");
  EXPECT_LINE(fresh.call("attach job-x 0 1", milliseconds(5000)), "err attach unavailable");
  // What a rank had mapped stays readable in the rank.
  EXPECT_LINE(a1.call("check g 6"), "ok check");
  for (Rank* rank : {&a0, &a1, &blocked, &fresh}) rank->exit();

  // The lock went with the daemon: a new one starts on the same socket.
  ASSERT_NO_FATAL_FAILURE(daemon_->start());
  Rank again("again");
  again.attach(socket(), "job-a", 0, 1);
  EXPECT_EQ(again.call("detach"), "ok detach");
  again.exit();
  expectCleanStop();
}

TEST_F(MultiProcess, SecondDaemonOnTheSameSocketRefusesAndNamesThePid) {
  ASSERT_NO_FATAL_FAILURE(startDaemon());
  const auto [status, error] = daemon_->startSecond();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << "status " << status;
  EXPECT_TRUE(contains(error, "pid " + std::to_string(daemon_->pid()))) << error;
  // The first one never noticed.
  Rank rank("rank");
  rank.attach(socket(), "job-a", 0, 1);
  EXPECT_LINE(rank.call("register g"), "ok register");
  EXPECT_EQ(rank.call("detach"), "ok detach");
  rank.exit();
  expectBackToBaseline("after the job");
  expectCleanStop();
}

TEST(DbufdStart, TheCudaBackendWithoutAGpuIsRefusedWithAReason) {
  // Here (CI) there is no GPU: asking for GPU memory must fail at start,
  // saying why, before any socket is made. (Where a GPU is usable the
  // backend is accepted and the bad socket directory is what fails.)
  const auto result = dbuf::testing::runChild(DBUFD_EXE, {"--backend", "cuda", "--socket", "/nonexistent/dbufd.sock"});
  EXPECT_EQ(result.exit_code, 1) << result.err;
  EXPECT_TRUE(contains(result.err, "backend \"cuda\": no usable CUDA device") ||
              contains(result.err, "backend \"cuda\": this dbufd was built without CUDA") ||
              contains(result.err, "/nonexistent"))
      << result.err;
}

TEST_F(MultiProcess, StaleSocketOfAKilledDaemonIsReplaced) {
  ASSERT_NO_FATAL_FAILURE(startDaemon());
  Rank orphan("orphan");
  orphan.attach(socket(), "job-a", 0, 1);
  EXPECT_LINE(orphan.call("register g"), "ok register");
  daemon_->kill9();
  struct stat info {};
  ASSERT_EQ(::lstat(socket().c_str(), &info), 0) << "a SIGKILLed dbufd leaves its socket behind";
  EXPECT_TRUE(S_ISSOCK(info.st_mode));
  // Its rank notices on the next call.
  EXPECT_LINE(orphan.call("unshard g", milliseconds(5000)), "err unshard unavailable");
  orphan.exit();

  ASSERT_NO_FATAL_FAILURE(daemon_->start());
  Rank rank("rank");
  rank.attach(socket(), "job-a", 0, 1);
  EXPECT_LINE(rank.call("register g"), "ok register");
  EXPECT_EQ(rank.call("detach"), "ok detach");
  rank.exit();
  expectCleanStop();
}

// ------------------------------------------------------------ isolation

constexpr uid_t kNobody = 65534;    // tenant "b"
constexpr uid_t kStranger = 65533;  // in no tenant

TEST_F(MultiProcess, OtherUidCannotAttachToOrOpenAnotherTenantsJob) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run ranks under other uids";
  ASSERT_NO_FATAL_FAILURE(startDaemon());
  Rank nobody("nobody", kNobody);
  const std::string ids = nobody.ids();
  if (!startsWith(ids, "ok ids")) GTEST_SKIP() << "cannot switch to uid " << kNobody << " here: " << ids;

  // Tenant "a" (uid 0): one job with memory, one with a free rank.
  Rank a0("a0");
  a0.attach(socket(), "job-a", 0, 1);
  EXPECT_LINE(a0.call("register g"), "ok register");
  EXPECT_LINE(a0.call("write g 9"), "ok write");
  Rank wide0("wide0");
  wide0.attach(socket(), "job-wide", 0, 2);

  // uid 65534 (tenant "b") may not join tenant a's jobs, free rank or not.
  EXPECT_EQ(nobody.call("connect " + socket()), "ok connect");
  EXPECT_LINE(nobody.call("attach job-wide 1 2"), "err attach permission_denied");
  EXPECT_EQ(nobody.call("connect " + socket()), "ok connect");
  EXPECT_LINE(nobody.call("attach job-a 0 1"), "err attach permission_denied");
  // ... but runs its own job in tenant b.
  EXPECT_EQ(nobody.call("connect " + socket()), "ok connect");
  EXPECT_EQ(nobody.call("attach job-b 0 1"), "ok attach reattached=0");
  EXPECT_LINE(nobody.call("register g"), "ok register");
  EXPECT_LINE(nobody.call("write g 10"), "ok write");
  EXPECT_LINE(nobody.call("check g 10"), "ok check");

  // Tenant a's memory is not reachable by name: nothing in /dev/shm, and the
  // daemon's fds are closed to other users.
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", error)) {
    EXPECT_FALSE(contains(entry.path().filename().string(), "dbuf")) << entry.path();
  }
  // Job a's memfds: its shard file and its session segment (the rings).
  expectMemfds("job-a", "g:", 1);
  expectMemfds("job-a", "session:", 1);
  const std::vector<int> fds = daemon_->memfdNumbers("job-a");
  ASSERT_EQ(fds.size(), 2U) << daemon_->fdListing();
  for (const int fd : fds) {
    const std::string path = "/proc/" + std::to_string(daemon_->pid()) + "/fd/" + std::to_string(fd);
    const std::string opened = nobody.call("open " + path);
    EXPECT_TRUE(startsWith(opened, "err open errno=EACCES") || startsWith(opened, "err open errno=EPERM"))
        << path << ": " << opened;
    EXPECT_EQ(a0.call("open " + path), "ok open") << "the same path is fine for root: the check means something";
  }

  // A uid in no tenant is refused at attach, by uid.
  Rank stranger("stranger", kStranger);
  EXPECT_LINE(stranger.ids(), "ok ids");
  EXPECT_EQ(stranger.call("connect " + socket()), "ok connect");
  const std::string refused = stranger.call("attach job-s 0 1");
  EXPECT_LINE(refused, "err attach permission_denied");
  EXPECT_TRUE(contains(refused, "uid 65533")) << refused;

  EXPECT_LINE(a0.call("check g 9"), "ok check");
  for (Rank* rank : {&a0, &nobody}) EXPECT_EQ(rank->call("detach"), "ok detach") << rank->name();
  for (Rank* rank : {&a0, &wide0, &nobody, &stranger}) rank->exit();
  expectBackToBaseline("after the jobs");
}

// ------------------------------------------------------------ persistence

TEST_F(MultiProcess, PersistentShardsSurviveACrashAndAreFreedAfterTheGracePeriod) {
  Daemon::Settings settings;
  settings.grace_period_s = 1;
  ASSERT_NO_FATAL_FAILURE(startDaemon(settings));
  Rank first("first-life");
  EXPECT_EQ(first.attach(socket(), "job-p", 0, 1, /*persistent=*/true), "ok attach reattached=0");
  EXPECT_LINE(first.call("register g"), "ok register");
  EXPECT_LINE(first.call("write g 77"), "ok write");
  expectMemfds("job-p", "g:", 1);
  expectMemfds("job-p", "session:", 1);
  expectMemfds("job-p", "", 2);
  // The restarted process is ready before the crash, so the 1 s grace period
  // is plenty: it attaches as soon as the daemon has seen the first one go.
  Rank second("second-life");
  EXPECT_EQ(second.call("connect " + socket()), "ok connect");
  const int sockets_with_both = daemon_->baseline().sockets + 2;
  EXPECT_TRUE(eventually([&] { return daemon_->counts().sockets == sockets_with_both; }));

  first.kill9();
  EXPECT_TRUE(eventually([&] { return daemon_->counts().sockets == sockets_with_both - 1; }));
  // The session segment goes with the session (polled: the daemon releases
  // the rank just after it closed the socket); the shard stays.
  expectMemfds("job-p", "session:", 0);
  EXPECT_EQ(daemon_->memfdsOf("job-p"), 1) << "the shard must outlive its rank";
  EXPECT_EQ(daemon_->memfdsOf("job-p", "g:"), 1) << daemon_->fdListing();
  EXPECT_EQ(second.call("attach job-p 0 1 persistent"), "ok attach reattached=1");
  EXPECT_LINE(second.call("register g"), "ok register");
  EXPECT_LINE(second.call("check g 77"), "ok check");  // every element as the first life left it

  // The second life crashes too; nobody comes back: freed after the grace period.
  const auto crashed = Clock::now();
  second.kill9();
  EXPECT_TRUE(eventually([&] { return daemon_->memfdsOf("job-p") == 0; }, milliseconds(8000))) << daemon_->fdListing();
  EXPECT_GE(Clock::now() - crashed, milliseconds(900)) << "freed before the 1 s grace period ended";
  expectBackToBaseline("after the grace period");
}

TEST_F(MultiProcess, NonPersistentJobIsFreedAtOnceWhenItsLastRankDies) {
  Daemon::Settings settings;
  settings.grace_period_s = 60;  // would show as a timeout if it applied
  ASSERT_NO_FATAL_FAILURE(startDaemon(settings));
  Rank rank("rank");
  rank.attach(socket(), "job-n", 0, 1);
  EXPECT_LINE(rank.call("register g"), "ok register");
  EXPECT_EQ(rank.call("unshard g"), "ok unshard");  // one rank: the collective is its own
  expectMemfds("job-n", "g:", 1);
  expectMemfds("job-n", "slot:0", 1);
  expectMemfds("job-n", "session:0", 1);
  expectMemfds("job-n", "", 3);
  rank.kill9();
  expectBackToBaseline("after the crash");
}

}  // namespace
}  // namespace dbuf::mp
