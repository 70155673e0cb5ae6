// Operators' requests (admin.hpp): which verbs and arguments are accepted,
// who gets which view, and what each answer holds, over a DaemonView made
// here. The daemon and dbufctl end to end: tests/multiprocess/dbufctl_test.cpp.
#include "admin.hpp"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace dbuf::daemon::admin {
namespace {

using nlohmann::json;

constexpr std::uint32_t kDaemonUid = 990;
constexpr std::uint32_t kAlice = 1000;     // tenant "research"
constexpr std::uint32_t kBob = 2000;       // tenant "prod"
constexpr std::uint32_t kStranger = 3000;  // in no tenant
constexpr std::uint32_t kAdminGroup = 4242;

Config config() {
  Config made;
  made.tenants = {Tenant{"research", {kAlice}, {}, 1 << 20, 4}, Tenant{"prod", {kBob}, {}, 1 << 20, 4}};
  made.admin_gids = {kAdminGroup};
  return made;
}

ipc::PeerCredentials peer(std::uint32_t uid) {
  return {1234, uid, uid};
}

JobView job(const std::string& id, std::size_t tenant, std::uint32_t ranks, std::uint32_t attached) {
  JobView made;
  made.id = id;
  made.tenant = tenant;
  made.world_size = ranks;
  for (std::uint32_t r = 0; r < ranks; ++r) {
    RankView rank;
    rank.rank = r;
    rank.attached = r < attached;
    made.ranks.push_back(rank);
  }
  return made;
}

DaemonView view() {
  DaemonView made;
  made.uid = kDaemonUid;
  made.tenants = {{"research", 1 << 20, 4096, 4}, {"prod", 1 << 20, 0, 4}};
  made.memory_used_bytes = 4096;
  made.jobs = {job("alice-run", 0, 2, 2), job("bob-run", 1, 4, 3)};
  OpView op;
  op.sequence = 7;
  op.op = "allGather";
  op.group = "layers.0";
  op.state = "waiting for ranks";
  op.submitted = {0, 1, 2};
  op.waiting_for = {3};
  made.jobs[1].current = op;
  SessionView alice{1, peer(kAlice), 0, "rank", "alice-run", 0, 1.0};
  SessionView bob{2, peer(kBob), 1, "rank", "bob-run", 0, 1.0};
  SessionView bob_operator{3, peer(kBob), 1, "operator", "", 0, 0.1};
  made.sessions = {alice, bob, bob_operator};
  return made;
}

Access accessOf(std::uint32_t uid, std::vector<std::uint32_t> groups = {}) {
  auto access = authorize(config(), kDaemonUid, peer(uid), groups);
  EXPECT_TRUE(access) << access.error().message;
  return access ? *access : Access{};
}

json ask(const std::string& verb, std::vector<std::string> args, const Access& access) {
  auto query = parseRequest({verb, std::move(args)});
  EXPECT_TRUE(query) << query.error().message;
  auto text = answer(*query, access, view());
  EXPECT_TRUE(text) << text.error().message;
  return text ? json::parse(*text) : json();
}

std::vector<std::string> jobIds(const json& answer) {
  std::vector<std::string> ids;
  for (const json& j : answer["jobs"]) ids.push_back(j["id"]);
  return ids;
}

TEST(AdminRequest, KnownVerbsWithTheirArgumentsParseAndAnythingElseIsABadRequest) {
  EXPECT_EQ(parseRequest({"status", {}})->verb, Verb::kStatus);
  EXPECT_EQ(parseRequest({"job", {"run-1.a"}})->job, "run-1.a");
  EXPECT_EQ(parseRequest({"drain", {}})->verb, Verb::kDrain);
  const auto unknown = parseRequest({"reboot", {}});
  ASSERT_FALSE(unknown);
  EXPECT_EQ(unknown.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(unknown.error().message.find("unknown request 'reboot'"), std::string::npos);
  EXPECT_EQ(parseRequest({"job", {}}).error().message, "'job' takes 1 argument(s), not 0");
  EXPECT_EQ(parseRequest({"status", {"x"}}).error().message, "'status' takes 0 argument(s), not 1");
  EXPECT_FALSE(parseRequest({"job", {"../etc"}}));
}

TEST(AdminAccess, RootTheDaemonsUidAndTheAdminGroupSeeEverythingTenantsTheirOwnOthersNothing) {
  EXPECT_TRUE(accessOf(0).everything);
  EXPECT_TRUE(accessOf(kDaemonUid).everything);
  EXPECT_TRUE(accessOf(kStranger, {7, kAdminGroup}).everything) << "a supplementary group counts";
  const Access alice = accessOf(kAlice);
  EXPECT_FALSE(alice.everything);
  EXPECT_EQ(alice.tenant, 0U);
  const auto stranger = authorize(config(), kDaemonUid, peer(kStranger), {});
  ASSERT_FALSE(stranger);
  EXPECT_EQ(stranger.error().code, ErrorCode::kPermissionDenied);
  EXPECT_NE(stranger.error().message.find("uid 3000"), std::string::npos) << stranger.error().message;
}

TEST(AdminAnswer, ATenantsUserSeesItsTenantsJobsAndSessionsOnly) {
  EXPECT_EQ(jobIds(ask("jobs", {}, accessOf(0))), (std::vector<std::string>{"alice-run", "bob-run"}));
  const json bobs = ask("jobs", {}, accessOf(kBob));
  EXPECT_EQ(jobIds(bobs), std::vector<std::string>{"bob-run"});
  EXPECT_EQ(bobs["scope"], "tenant prod");
  EXPECT_EQ(ask("sessions", {}, accessOf(kBob))["sessions"].size(), 2U);
  EXPECT_EQ(ask("sessions", {}, accessOf(kAlice))["sessions"].size(), 1U);
  // Another tenant's job is "not found", exactly as a job that does not exist.
  const auto query = parseRequest({"job", {"bob-run"}});
  const auto hidden = answer(*query, accessOf(kAlice), view());
  const auto missing = answer(*parseRequest({"job", {"nobody-run"}}), accessOf(kAlice), view());
  ASSERT_FALSE(hidden);
  EXPECT_EQ(hidden.error().code, ErrorCode::kNotFound);
  EXPECT_EQ(hidden.error().message, "no job 'bob-run' on this daemon");
  EXPECT_EQ(missing.error().code, ErrorCode::kNotFound);
  // Status: its own tenant, and not the daemon's memory use (all tenants').
  const json status = ask("status", {}, accessOf(kAlice));
  ASSERT_EQ(status["tenants"].size(), 1U);
  EXPECT_EQ(status["tenants"][0]["name"], "research");
  EXPECT_FALSE(status["daemon"].contains("memory_used_bytes"));
  EXPECT_EQ(status["jobs"]["count"], 1);
}

TEST(AdminAnswer, AJobSaysWhichRanksItsCurrentCollectiveWaitsFor) {
  const json answer = ask("job", {"bob-run"}, accessOf(kBob))["job"];
  EXPECT_EQ(answer["state"], "attaching");
  EXPECT_EQ(answer["attached_ranks"], 3);
  EXPECT_EQ(answer["ranks"].size(), 4U);
  const json& op = answer["current_op"];
  EXPECT_EQ(op["op"], "allGather");
  EXPECT_EQ(op["sequence"], 7);
  EXPECT_EQ(op["waiting_for"], json::array({3}));
  EXPECT_TRUE(ask("job", {"alice-run"}, accessOf(0))["job"]["current_op"].is_null());
}

TEST(AdminAnswer, APlanIsTheGroupsReportAndAnotherTenantsJobIsNotFound) {
  const Query plan = *parseRequest({"plan", {"bob-run", "layers.0"}});
  EXPECT_EQ(plan.group, "layers.0");
  DaemonView with_report = view();
  with_report.plan_report = R"({"devices": 4, "units": []})";
  const json answered = json::parse(*answer(plan, accessOf(kBob), with_report));
  EXPECT_EQ(answered["plan"]["devices"], 4);
  EXPECT_EQ(answered["group"], "layers.0");
  EXPECT_EQ(answer(plan, accessOf(kAlice), with_report).error().message, "no job 'bob-run' on this daemon");
  EXPECT_EQ(answer(plan, accessOf(kBob), view()).error().message, "job 'bob-run' has no group 'layers.0'");
  EXPECT_EQ(parseRequest({"plan", {"bob-run"}}).error().message, "'plan' takes 2 argument(s), not 1");
}

TEST(AdminAnswer, OnlyAnAdministratorMayDrainAndTheAnswerListsTheJobsWithRanks) {
  const auto refused = answer(Query{Verb::kDrain, {}, {}}, accessOf(kAlice), view());
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code, ErrorCode::kPermissionDenied);
  DaemonView draining = view();
  draining.draining = true;
  draining.jobs.push_back(job("detached-run", 0, 2, 0));
  const json drained = json::parse(*answer(Query{Verb::kDrain, {}, {}}, accessOf(0), draining));
  EXPECT_EQ(drained["waiting_for_jobs"], json::array({"alice-run", "bob-run"}));
  EXPECT_TRUE(drained["draining"].get<bool>());
}

TEST(AdminAnswer, AnAnswerLargerThanOneReplyIsRefusedNotCut) {
  DaemonView big = view();
  for (int s = 0; s < 20000; ++s) big.sessions.push_back({std::uint64_t(10 + s), peer(0), {}, "handshake", "", 0, 0});
  const auto text = answer(Query{Verb::kSessions, {}, {}}, accessOf(0), big);
  ASSERT_FALSE(text);
  EXPECT_EQ(text.error().code, ErrorCode::kInfeasible);
  EXPECT_NE(text.error().message.find("ask about one job"), std::string::npos);
}

TEST(AdminAnswer, ANameThatIsNotUtf8CannotBreakTheAnswer) {
  DaemonView odd = view();
  odd.jobs[0].groups.push_back(GroupView{"\xff\xfe", 1, 2, 3, 4, 2, "fp32", "bf16", 64, 64});
  const auto text = answer(Query{Verb::kJob, "alice-run", {}}, accessOf(0), odd);
  ASSERT_TRUE(text) << text.error().message;
  EXPECT_FALSE(json::parse(*text, nullptr, false).is_discarded());
}

}  // namespace
}  // namespace dbuf::daemon::admin
