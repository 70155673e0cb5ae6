// dbufctl against a real dbufd with real trainer processes: what an operator
// sees of a job whose collective waits for a rank, what each kind of peer may
// see (root, a tenant's user, a member of the [admin] group, a stranger), and
// a drain that refuses new jobs, waits for the running one and stops the
// daemon; SIGHUP re-reading tenants and quotas, and a file with errors
// changing nothing. The answers' logic alone: tests/daemon/admin_test.cpp.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>
#include <sys/wait.h>

#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dbuf/common/build_info.hpp"
#include "harness.hpp"

extern char** environ;  // NOLINT(readability-identifier-naming): POSIX name

namespace dbuf::mp {
namespace {

using nlohmann::json;
using dbuf::testing::ChildResult;
using dbuf::testing::runChild;

constexpr uid_t kNobody = 65534;    // tenant "b"
constexpr uid_t kStranger = 65533;  // in no tenant
constexpr gid_t kAdminGroup = 4242;

class Dbufctl : public ::testing::Test {
 protected:
  /// The daemon's settings; a fixture may change them.
  [[nodiscard]] virtual Daemon::Settings settings() const {
    Daemon::Settings settings;
    settings.extra_config = "[admin]\ngids = [" + std::to_string(kAdminGroup) + "]\n";
    return settings;
  }

  void SetUp() override {
    daemon_ = std::make_unique<Daemon>(dir_.path(), settings());
    ASSERT_NO_FATAL_FAILURE(daemon_->start());
    // A copy any uid may run: the build tree may be private to root.
    ctl_ = (dir_.path() / "dbufctl").string();
    std::filesystem::copy_file(DBUFCTL_EXE, ctl_);
    std::filesystem::permissions(ctl_, std::filesystem::perms(0755));
  }

  /// dbufctl ARGS against the daemon, as root or, through setpriv, as `uid`
  /// with `groups` as its supplementary groups.
  ChildResult ctl(const std::vector<std::string>& args, std::optional<uid_t> uid = std::nullopt,
                  const std::vector<gid_t>& groups = {}) {
    std::vector<std::string> argv{"--socket", daemon_->socket()};
    argv.insert(argv.end(), args.begin(), args.end());
    if (!uid) return runChild(ctl_, argv);
    std::string list;
    for (const gid_t g : groups) list += (list.empty() ? "" : ",") + std::to_string(g);
    argv.insert(argv.begin(), {"--reuid=" + std::to_string(*uid), "--regid=" + std::to_string(*uid),
                               list.empty() ? "--clear-groups" : "--groups=" + list, ctl_});
    dbuf::testing::Child::Options options;
    options.pipe_stdout = true;
    options.pipe_stderr = true;
    options.environment = environmentForOtherUsers();
    dbuf::testing::Child child("/usr/bin/setpriv", argv, options);
    ChildResult result;
    EXPECT_TRUE(child.readToEnd(result.out, result.err, Clock::now() + kReplyTimeout)) << "dbufctl hung";
    const auto status = child.waitExit(kReplyTimeout);
    if (status && WIFEXITED(*status)) result.exit_code = WEXITSTATUS(*status);
    return result;
  }

  /// This environment, for a process that starts as another user: a
  /// sanitizer's suppressions file (in a build tree only root may read) is
  /// copied where that user can read it.
  std::vector<std::string> environmentForOtherUsers() {
    std::vector<std::string> out;
    for (char** entry = environ; *entry != nullptr; ++entry) {
      std::string variable = *entry;
      const auto at = variable.find("suppressions=");
      if (variable.find("SAN_OPTIONS=") != std::string::npos && at != std::string::npos) {
        const std::size_t begin = at + std::string("suppressions=").size();
        const std::size_t end = std::min(variable.find(':', begin), variable.size());
        const std::filesystem::path original = variable.substr(begin, end - begin);
        const std::filesystem::path copy = dir_.path() / ("copy-of-" + original.filename().string());
        std::filesystem::copy_file(original, copy, std::filesystem::copy_options::overwrite_existing);
        std::filesystem::permissions(copy, std::filesystem::perms(0644));
        variable.replace(begin, end - begin, copy.string());
      }
      out.push_back(variable);
    }
    return out;
  }

  /// `dbufctl --json ARGS`, expected to succeed.
  json ask(const std::vector<std::string>& args, std::optional<uid_t> uid = std::nullopt,
           const std::vector<gid_t>& groups = {}) {
    std::vector<std::string> with_json{"--json"};
    with_json.insert(with_json.end(), args.begin(), args.end());
    const ChildResult result = ctl(with_json, uid, groups);
    EXPECT_EQ(result.exit_code, 0) << result.err;
    return json::parse(result.out, nullptr, false);
  }

  static std::vector<std::string> jobIds(const json& answer) {
    std::vector<std::string> ids;
    for (const json& job : answer["jobs"]) ids.push_back(job["id"]);
    return ids;
  }

  /// Whether this machine lets root run processes as other users (setpriv).
  bool canSwitchUsers() {
    if (::geteuid() != 0) return false;
    return runChild("/usr/bin/setpriv", {"--reuid=65534", "--regid=65534", "--clear-groups", "/bin/true"}).exit_code ==
           0;
  }

  /// Ranks 0 and 1 of a two-rank job `job`, attached, with group "g" registered.
  void attachBoth(Rank& r0, Rank& r1, const std::string& job) {
    r0.attach(daemon_->socket(), job, 0, 2);
    r1.attach(daemon_->socket(), job, 1, 2);
    r0.begin("register g");
    r1.begin("register g");
    ASSERT_TRUE(startsWith(r0.result(), "ok register"));
    ASSERT_TRUE(startsWith(r1.result(), "ok register"));
  }

  /// Replaces the daemon's config file, then SIGHUP; waits until the log
  /// says it read it (`said`).
  void reloadWith(const std::string& text, const std::string& said) {
    const std::string log_before = daemon_->log();
    {
      std::ofstream out(daemon_->configPath(), std::ios::trunc);
      out << text;
      ASSERT_TRUE(out.good());
    }
    daemon_->process().signal(SIGHUP);
    ASSERT_TRUE(eventually([&] { return daemon_->log().size() > log_before.size() && contains(
                                            daemon_->log().substr(log_before.size()), said); }))
        << daemon_->log();
  }

  /// tenant name -> {quota, max jobs}, from `dbufctl status --json`.
  std::map<std::string, std::pair<std::uint64_t, int>> tenants() {
    std::map<std::string, std::pair<std::uint64_t, int>> out;
    const json status = ask({"status"});
    for (const json& t : status["tenants"]) {
      out[t["name"]] = {t["memory_quota_bytes"].get<std::uint64_t>(), t["max_jobs"].get<int>()};
    }
    return out;
  }

  TempDir dir_{"dbuf-ctl", 0711};
  std::unique_ptr<Daemon> daemon_;
  std::string ctl_;
};

TEST_F(Dbufctl, ShowsAJobsRanksGroupsAndWhichRankItsCollectiveWaitsFor) {
  Rank r0("r0");
  Rank r1("r1");
  ASSERT_NO_FATAL_FAILURE(attachBoth(r0, r1, "job-a"));
  r0.begin("unshard g");  // waits for rank 1

  json job;
  ASSERT_TRUE(eventually([&] {
    job = ask({"job", "job-a"})["job"];
    return job["current_op"].is_object() && job["current_op"]["submitted"] == json::array({0});
  })) << job.dump(2);
  EXPECT_EQ(job["state"], "running");
  EXPECT_EQ(job["tenant"], "a");
  EXPECT_EQ(job["current_op"]["op"], "allGather");
  EXPECT_EQ(job["current_op"]["group"], "g");
  EXPECT_EQ(job["current_op"]["state"], "waiting for ranks");
  EXPECT_EQ(job["current_op"]["waiting_for"], json::array({1}));
  ASSERT_EQ(job["ranks"].size(), 2U);
  EXPECT_EQ(job["ranks"][0]["pid"], r0.pid());
  EXPECT_EQ(job["ranks"][0]["queued_ops"], 1);
  ASSERT_EQ(job["groups"].size(), 1U);
  EXPECT_EQ(job["groups"][0]["name"], "g");
  EXPECT_GT(job["groups"][0]["numel"].get<std::int64_t>(), 0);
  EXPECT_GT(job["memory_bytes"].get<std::uint64_t>(), 0U);

  // The same, in words.
  const ChildResult text = ctl({"job", "job-a"});
  EXPECT_EQ(text.exit_code, 0) << text.err;
  EXPECT_TRUE(contains(text.out, "current op: #0 allGather of g: waiting for rank 1 (")) << text.out;
  const ChildResult jobs = ctl({"jobs"});
  EXPECT_TRUE(contains(jobs.out, "job-a")) << jobs.out;
  EXPECT_TRUE(contains(jobs.out, "running")) << jobs.out;

  // The planner's report of the live group, as dbuf-plan writes it.
  const json plan = ask({"plan", "job-a", "g"});
  ASSERT_EQ(plan["plan"]["units"].size(), 1U) << plan.dump(2);
  const json& unit = plan["plan"]["units"][0];
  EXPECT_EQ(unit["shard_elems"], job["groups"][0]["shard_elems"]);
  EXPECT_EQ(unit["numel"], job["groups"][0]["numel"]);
  EXPECT_EQ(unit["tensors"].size(), job["groups"][0]["tensors"].get<std::size_t>());
  const std::string svg = (dir_.path() / "g.svg").string();
  const ChildResult table = ctl({"plan", "job-a", "g", "--svg", svg});
  EXPECT_EQ(table.exit_code, 0) << table.err;
  EXPECT_TRUE(contains(table.out, "TOTAL")) << table.out;
  EXPECT_TRUE(contains(dbuf::testing::readFile(svg), "<svg")) << svg;
  const ChildResult no_group = ctl({"plan", "job-a", "nope"});
  EXPECT_EQ(no_group.exit_code, 1);
  EXPECT_TRUE(contains(no_group.err, "job 'job-a' has no group 'nope'")) << no_group.err;

  r1.begin("unshard g");
  EXPECT_EQ(r0.result(), "ok unshard");
  EXPECT_EQ(r1.result(), "ok unshard");
  EXPECT_TRUE(eventually([&] {
    job = ask({"job", "job-a"})["job"];
    return job["collectives_completed"] == 1 && job["current_op"].is_null();
  })) << job.dump(2);

  // The flight recorder: rank 0 submitted first, rank 1 last, then it ran.
  const json trace = ask({"trace", "job-a"});
  ASSERT_EQ(trace["ops"].size(), 1U) << trace.dump(2);
  const json& op = trace["ops"][0];
  EXPECT_EQ(op["op"], "allGather");
  EXPECT_EQ(op["group"], "g");
  EXPECT_EQ(op["result"], "ok");
  ASSERT_EQ(op["ranks"].size(), 2U);
  const double submitted0 = op["ranks"][0]["submitted_seconds"];
  const double submitted1 = op["ranks"][1]["submitted_seconds"];
  EXPECT_LT(submitted0, submitted1);
  EXPECT_LE(submitted1, op["start_seconds"].get<double>());
  EXPECT_LE(op["start_seconds"].get<double>(), op["end_seconds"].get<double>());
  EXPECT_GT(op["unsharded_bytes"].get<std::uint64_t>(), 0U);

  const json status = ask({"status"});
  EXPECT_EQ(status["scope"], "everything");
  EXPECT_EQ(status["jobs"]["count"], 1);
  EXPECT_EQ(status["daemon"]["pid"], daemon_->pid());
  EXPECT_GT(status["daemon"]["memory_used_bytes"].get<std::uint64_t>(), 0U);
  const ChildResult status_text = ctl({"status"});
  EXPECT_EQ(status_text.exit_code, 0) << status_text.err;
  EXPECT_TRUE(contains(status_text.out, "jobs:     1 (1 running)")) << status_text.out;
  EXPECT_TRUE(contains(status_text.out, "state:    serving")) << status_text.out;
  // Which build answers: the one this test was built with.
  EXPECT_EQ(status["daemon"]["version"], std::string(buildInfo().version));
  EXPECT_EQ(status["daemon"]["commit"], std::string(buildInfo().commit));
  EXPECT_TRUE(contains(status_text.out, "build:    " + std::string(buildInfo().version) + ", commit " +
                                            std::string(buildInfo().commit) + "\n"))
      << status_text.out;
  const json sessions = ask({"sessions"});
  int ranks = 0;
  for (const json& s : sessions["sessions"]) ranks += s["kind"] == "rank" ? 1 : 0;
  EXPECT_EQ(ranks, 2) << sessions.dump(2);

  const ChildResult missing = ctl({"job", "job-z"});
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_TRUE(contains(missing.err, "no job 'job-z'")) << missing.err;
  const ChildResult usage = ctl({"frobnicate"});
  EXPECT_EQ(usage.exit_code, 2);
  EXPECT_TRUE(contains(usage.err, "unknown verb 'frobnicate'")) << usage.err;
  for (Rank* rank : {&r0, &r1}) {
    EXPECT_EQ(rank->call("detach"), "ok detach");
    rank->exit();
  }
  // An orderly end is no incident: the flight recorder stays out of the log.
  EXPECT_TRUE(eventually([&] { return contains(daemon_->log(), "job job-a rank 1 detached"); })) << daemon_->log();
  EXPECT_FALSE(contains(daemon_->log(), "flight recorder")) << daemon_->log();
}

TEST_F(Dbufctl, ARankThatDiesLogsItsJobsFlightRecorder) {
  Rank r0("r0");
  Rank r1("r1");
  ASSERT_NO_FATAL_FAILURE(attachBoth(r0, r1, "job-k"));
  r0.begin("unshard g");
  r1.begin("unshard g");
  EXPECT_EQ(r0.result(), "ok unshard");
  EXPECT_EQ(r1.result(), "ok unshard");
  r1.kill9();  // between collectives: nothing fails, but the rank is lost
  EXPECT_TRUE(eventually([&] { return contains(daemon_->log(), "collective(s) (flight recorder; dbufctl trace job-k)"); }))
      << daemon_->log();
  EXPECT_TRUE(contains(daemon_->log(), "#0 allGather of 'g': ok")) << daemon_->log();
  EXPECT_EQ(r0.call("detach"), "ok detach");
  r0.exit();
}

TEST_F(Dbufctl, ATenantsUserSeesItsOwnJobsTheAdminGroupEverythingAStrangerNothing) {
  if (!canSwitchUsers()) GTEST_SKIP() << "needs root and setpriv to run dbufctl as other users";
  Rank a0("a0");
  a0.attach(daemon_->socket(), "job-a", 0, 1);
  Rank b0("b0", kNobody);
  ASSERT_TRUE(startsWith(b0.ids(), "ok ids"));
  EXPECT_EQ(b0.call("connect " + daemon_->socket()), "ok connect");
  EXPECT_EQ(b0.call("attach job-b 0 1"), "ok attach reattached=0");

  EXPECT_EQ(jobIds(ask({"jobs"})), (std::vector<std::string>{"job-a", "job-b"}));
  const json tenant_view = ask({"jobs"}, kNobody);
  EXPECT_EQ(tenant_view["scope"], "tenant b");
  EXPECT_EQ(jobIds(tenant_view), std::vector<std::string>{"job-b"});
  // Another tenant's job is not found, as one that does not exist.
  const ChildResult hidden = ctl({"job", "job-a"}, kNobody);
  EXPECT_EQ(hidden.exit_code, 1);
  EXPECT_TRUE(contains(hidden.err, "no job 'job-a' on this daemon")) << hidden.err;
  const ChildResult drain = ctl({"drain"}, kNobody);
  EXPECT_EQ(drain.exit_code, 1);
  EXPECT_TRUE(contains(drain.err, "only an administrator")) << drain.err;
  // A member of the [admin] group (a supplementary group) sees everything.
  EXPECT_EQ(jobIds(ask({"jobs"}, kStranger, {kAdminGroup})), (std::vector<std::string>{"job-a", "job-b"}));
  // Anyone else gets nothing, and is told why.
  const ChildResult stranger = ctl({"status"}, kStranger);
  EXPECT_EQ(stranger.exit_code, 1);
  EXPECT_TRUE(contains(stranger.err, "uid 65533 / gid 65533 is neither an administrator")) << stranger.err;
  EXPECT_TRUE(contains(daemon_->log(), "operator request 'status' refused")) << daemon_->log();

  for (Rank* rank : {&a0, &b0}) {
    EXPECT_EQ(rank->call("detach"), "ok detach");
    rank->exit();
  }
}

TEST_F(Dbufctl, DrainRefusesNewJobsWaitsForTheRunningOneAndStopsTheDaemon) {
  Rank r0("r0");
  r0.attach(daemon_->socket(), "job-a", 0, 1);
  EXPECT_TRUE(startsWith(r0.call("register g"), "ok register"));

  dbuf::testing::Child::Options piped;
  piped.pipe_stdout = true;
  dbuf::testing::Child drain(ctl_, {"--socket", daemon_->socket(), "drain"}, piped);
  const auto first = drain.readLine(kReplyTimeout);
  ASSERT_TRUE(first) << "no answer to the drain";
  EXPECT_TRUE(contains(*first, "draining")) << *first;
  EXPECT_TRUE(contains(*first, "job-a")) << *first;

  // No new job; the running one keeps working.
  Rank late("late");
  EXPECT_EQ(late.call("connect " + daemon_->socket()), "ok connect");
  const std::string refused = late.call("attach job-new 0 1");
  EXPECT_TRUE(startsWith(refused, "err attach unavailable")) << refused;
  EXPECT_TRUE(contains(refused, "draining")) << refused;
  EXPECT_TRUE(startsWith(r0.call("write g 3"), "ok write"));
  EXPECT_TRUE(startsWith(r0.call("check g 3"), "ok check"));
  EXPECT_TRUE(drain.running()) << "dbufctl drain returned while a job still runs";

  EXPECT_EQ(r0.call("detach"), "ok detach");
  const auto stopped = drain.readLine(kReplyTimeout);
  ASSERT_TRUE(stopped);
  EXPECT_EQ(*stopped, "dbufd has stopped");
  const auto ctl_status = drain.waitExit(kReplyTimeout);
  ASSERT_TRUE(ctl_status);
  EXPECT_TRUE(WIFEXITED(*ctl_status) && WEXITSTATUS(*ctl_status) == 0) << *ctl_status;
  const auto daemon_status = daemon_->process().waitExit(kReplyTimeout);
  ASSERT_TRUE(daemon_status) << "dbufd did not stop after the drain";
  EXPECT_TRUE(WIFEXITED(*daemon_status) && WEXITSTATUS(*daemon_status) == 0) << *daemon_status;
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::symlink_status(daemon_->socket())));
  EXPECT_TRUE(contains(daemon_->log(), "drained")) << daemon_->log();
  r0.exit();
  late.exit();
}

TEST_F(Dbufctl, SighupReloadsTenantsAndQuotasAndAFileWithErrorsChangesNothing) {
  constexpr std::uint64_t kMiB = 1 << 20;
  Rank a0("a0");
  a0.attach(daemon_->socket(), "job-a", 0, 1);
  EXPECT_TRUE(startsWith(a0.call("register g"), "ok register"));
  const std::string original = dbuf::testing::readFile(daemon_->configPath());
  const std::map<std::string, std::pair<std::uint64_t, int>> before{{"a", {256 * kMiB, 16}}, {"b", {256 * kMiB, 16}}};
  ASSERT_EQ(tenants(), before);

  // uid 0 in two tenants: reported, and nothing changes.
  ASSERT_NO_FATAL_FAILURE(reloadWith(original + "[[tenant]]\nname = \"c\"\nuids = [0]\n",
                                     "SIGHUP: the configuration has errors; nothing changed"));
  EXPECT_TRUE(contains(daemon_->log(), "uid 0 already belongs to tenant 'a'")) << daemon_->log();
  EXPECT_EQ(tenants(), before);
  EXPECT_TRUE(startsWith(a0.call("write g 4"), "ok write"));

  // Tenant b runs a job (when this machine can run one as uid 65534).
  const bool other_users = canSwitchUsers();
  std::optional<Rank> b0;
  if (other_users) {
    b0.emplace("b0", kNobody);
    ASSERT_TRUE(startsWith(b0->ids(), "ok ids"));
    EXPECT_EQ(b0->call("connect " + daemon_->socket()), "ok connect");
    EXPECT_EQ(b0->call("attach job-b 0 1"), "ok attach reattached=0");
    EXPECT_TRUE(startsWith(b0->call("register g"), "ok register"));
  }

  // Tenant a's quota below what job-a already holds, b gone, c new, and a
  // key only a restart applies.
  std::string changed = original;
  const auto quota = changed.find("memory_quota = \"256MiB\"");
  changed.replace(quota, std::string("memory_quota = \"256MiB\"").size(), "memory_quota = \"4KiB\"\nmax_jobs = 2");
  const std::string tenant_b = "[[tenant]]\nname = \"b\"\nuids = [65534]\nmemory_quota = \"256MiB\"\n";
  ASSERT_NE(changed.find(tenant_b), std::string::npos) << changed;
  changed.erase(changed.find(tenant_b), tenant_b.size());
  changed.replace(changed.find("collective_ms = "), std::string("collective_ms = ").size(), "collective_ms = 1");
  changed += "[[tenant]]\nname = \"c\"\nuids = [65533]\nmemory_quota = \"64MiB\"\n";
  ASSERT_NO_FATAL_FAILURE(reloadWith(changed, "SIGHUP: configuration reloaded"));
  EXPECT_TRUE(contains(daemon_->log(), "timeouts.collective_ms changed; it takes effect when dbufd restarts"));
  EXPECT_TRUE(contains(daemon_->log(), "tenant 'a' uses")) << daemon_->log();
  std::map<std::string, std::pair<std::uint64_t, int>> after{{"a", {4096, 2}}, {"c", {64 * kMiB, 16}}};
  // A tenant no longer configured stays while it has jobs, admitting nobody.
  if (other_users) after["b"] = {256 * kMiB, 16};
  EXPECT_EQ(tenants(), after);
  if (other_users) {
    EXPECT_TRUE(contains(daemon_->log(), "tenant 'b' is no longer configured")) << daemon_->log();
  }

  // job-a keeps its memory and works; it gets no more until under the quota.
  EXPECT_TRUE(startsWith(a0.call("check g 4"), "ok check"));
  const std::string over = a0.call("register g2");
  EXPECT_TRUE(startsWith(over, "err register")) << over;
  EXPECT_TRUE(contains(over, "0 of its 4096-byte quota left")) << over;
  if (other_users) {
    Rank c0("c0", kStranger);  // tenant c now
    ASSERT_TRUE(startsWith(c0.ids(), "ok ids"));
    EXPECT_EQ(c0.call("connect " + daemon_->socket()), "ok connect");
    EXPECT_EQ(c0.call("attach job-c 0 1"), "ok attach reattached=0");
    EXPECT_EQ(c0.call("detach"), "ok detach");
    c0.exit();
    // job-b keeps working; nobody may attach to tenant b any more.
    EXPECT_TRUE(startsWith(b0->call("write g 6"), "ok write"));
    EXPECT_TRUE(startsWith(b0->call("check g 6"), "ok check"));
    Rank b1("b1", kNobody);
    ASSERT_TRUE(startsWith(b1.ids(), "ok ids"));
    EXPECT_EQ(b1.call("connect " + daemon_->socket()), "ok connect");
    EXPECT_TRUE(startsWith(b1.call("attach job-b2 0 1"), "err attach permission_denied"));
    b1.exit();
    EXPECT_EQ(b0->call("detach"), "ok detach");
    b0->exit();
  }
  EXPECT_EQ(a0.call("detach"), "ok detach");
  a0.exit();
}

/// Collectives time out after 300 ms.
class DbufctlTimeouts : public Dbufctl {
 protected:
  [[nodiscard]] Daemon::Settings settings() const override {
    Daemon::Settings settings = Dbufctl::settings();
    settings.collective_ms = 300;
    return settings;
  }
};

TEST_F(DbufctlTimeouts, ATimedOutCollectiveIsInTheFlightRecorderTheLogAndAChromeTrace) {
  Rank r0("r0");
  Rank r1("r1");
  ASSERT_NO_FATAL_FAILURE(attachBoth(r0, r1, "job-t"));
  r0.begin("unshard g");
  r1.begin("unshard g");
  EXPECT_EQ(r0.result(), "ok unshard");
  EXPECT_EQ(r1.result(), "ok unshard");
  EXPECT_EQ(r0.call("reshard g"), "ok reshard");
  EXPECT_EQ(r1.call("reshard g"), "ok reshard");
  r0.begin("unshard g");  // rank 1 never comes: it times out
  const std::string timed_out = r0.result();
  EXPECT_TRUE(startsWith(timed_out, "err unshard timeout")) << timed_out;

  const json trace = ask({"trace", "job-t"});
  ASSERT_EQ(trace["ops"].size(), 2U) << trace.dump(2);
  const json& failed = trace["ops"][1];
  EXPECT_EQ(failed["sequence"], 1);
  EXPECT_EQ(failed["result"], "timeout");
  EXPECT_TRUE(contains(failed["error"].get<std::string>(), "not submitted it")) << failed.dump(2);
  EXPECT_TRUE(failed["ranks"][0]["submitted_seconds"].is_number());
  EXPECT_TRUE(failed["ranks"][1]["submitted_seconds"].is_null());
  // Dumped into the log when it timed out.
  EXPECT_TRUE(eventually([&] { return contains(daemon_->log(), "collective(s) (flight recorder; dbufctl trace job-t)"); }))
      << daemon_->log();
  EXPECT_TRUE(contains(daemon_->log(), "#1 allGather of 'g': timeout")) << daemon_->log();

  // Words, and a Chrome trace: a track per rank, each op's wait and run.
  const std::string chrome = (dir_.path() / "job-t.json").string();
  const ChildResult text = ctl({"trace", "job-t", "--chrome", chrome});
  EXPECT_EQ(text.exit_code, 0) << text.err;
  EXPECT_TRUE(contains(text.out, "timeout: ")) << text.out;
  EXPECT_TRUE(contains(text.out, "rank 1 never")) << text.out;
  const json events = json::parse(dbuf::testing::readFile(chrome), nullptr, false);
  ASSERT_TRUE(events.is_object() && events["traceEvents"].is_array()) << dbuf::testing::readFile(chrome);
  std::map<std::string, int> phases;  // "tid/cat" -> complete events
  for (const json& event : events["traceEvents"]) {
    if (event["ph"] != "X") continue;
    EXPECT_GE(event["dur"].get<double>(), 0.0);
    EXPECT_GT(event["ts"].get<double>(), 0.0);
    ++phases[std::to_string(event["tid"].get<int>()) + "/" + event["cat"].get<std::string>()];
  }
  // Rank 0 (tid 1) waited and ran twice; rank 1 (tid 2) waited once (it never submitted #1).
  const std::map<std::string, int> expected{{"1/run", 2}, {"1/wait", 2}, {"2/run", 2}, {"2/wait", 1}};
  EXPECT_EQ(phases, expected);
  for (Rank* rank : {&r0, &r1}) {
    EXPECT_EQ(rank->call("detach"), "ok detach");
    rank->exit();
  }
}

}  // namespace
}  // namespace dbuf::mp
