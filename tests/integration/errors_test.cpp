// Error paths through real clients: each failure has a clear code and message,
// reaches every rank it concerns, and leaves the daemon serving (a fresh
// client attaches and registers afterwards).

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <mutex>
#include <optional>

#include "dbuf/ipc/socket.hpp"
#include "dbuf/kernels/convert.hpp"
#include "harness.hpp"
#include "raw.hpp"
#include "support/text.hpp"

namespace dbuf::integration {
namespace {

using dbuf::testing::contains;
using Ranks = std::vector<std::uint32_t>;

/// A fresh job attaches, registers, unshards and detaches: the daemon serves.
void expectStillServing(EmbeddedDaemon& daemon, const std::string& job = "afterwards") {
  auto client = daemon.attach(rankOf(job, 0, 1));
  ASSERT_TRUE(client.ok()) << "daemon no longer serves: " << messageOf(client);
  auto group = client->registerGroup(smallGroup("check"));
  ASSERT_TRUE(group.ok()) << "daemon no longer serves: " << messageOf(group);
  ASSERT_TRUE(group->unshard().ok());
  ASSERT_TRUE(client->detach().ok());
}

TEST(Errors, SpecMismatchNamesBothRanksAndTheFirstDifferingTensorOnEveryRank) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  std::vector<std::optional<Client>> clients(2);
  std::vector<std::string> messages(2);
  onRanks(2, [&](std::uint32_t rank) {
    auto client = daemon.attach(rankOf("mismatch", rank, 2));
    ASSERT_TRUE(client.ok()) << messageOf(client);
    GroupSpec spec = smallGroup("layer", 3);
    if (rank == 1) spec.tensors[1].shape = {16, 9};  // t1 differs; t2 is the same again
    auto group = client->registerGroup(spec);
    ASSERT_FALSE(group.ok()) << "rank " << rank << " registered a mismatched group";
    EXPECT_EQ(group.error().code, ErrorCode::kConflict) << group.error().message;
    EXPECT_EQ(group.error().ranks, (Ranks{0, 1})) << "the two ranks that disagree, as data";
    messages[rank] = group.error().message;
    clients[rank].emplace(std::move(*client));
  });
  for (const std::string& message : messages) {
    EXPECT_TRUE(contains(message, "rank 0")) << message;
    EXPECT_TRUE(contains(message, "rank 1")) << message;
    EXPECT_TRUE(contains(message, "'t1'")) << message;
    EXPECT_FALSE(contains(message, "'t2'")) << message;
    EXPECT_TRUE(contains(message, "[16, 8]") && contains(message, "[16, 9]")) << message;
  }
  EXPECT_EQ(messages[0], messages[1]) << "every rank hears the same story";
  // The job is intact: the ranks agree on a retry and it works.
  onRanks(2, [&](std::uint32_t rank) {
    ASSERT_TRUE(clients[rank]);
    auto group = clients[rank]->registerGroup(smallGroup("layer", 3));
    EXPECT_TRUE(group.ok()) << "retry on rank " << rank << ": " << messageOf(group);
    EXPECT_TRUE(clients[rank]->detach().ok());
  });
  expectStillServing(daemon);
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Errors, SpecMismatchAmongFourRanksFailsEveryWaitingRank) {
  // Every rank's spec differs from every other's, so however the arrivals
  // interleave, the first two to meet disagree, and every rank hears of it
  // (those arriving later get the same error at once).
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  std::atomic<int> conflicts = 0;
  std::barrier answered(4);  // every rank stays attached until all have their answer
  onRanks(4, [&](std::uint32_t rank) {
    Phases phases({&answered});
    auto client = daemon.attach(rankOf("mismatch4", rank, 4));
    ASSERT_TRUE(client.ok()) << messageOf(client);
    GroupSpec spec = smallGroup("layer", 2);
    spec.tensors[1].shape = {16, 8 + static_cast<std::int64_t>(rank)};
    auto group = client->registerGroup(spec);
    ASSERT_FALSE(group.ok());
    EXPECT_EQ(group.error().code, ErrorCode::kConflict) << group.error().message;
    EXPECT_TRUE(contains(group.error().message, "'t1'")) << group.error().message;
    EXPECT_TRUE(contains(group.error().message, "disagree")) << group.error().message;
    // Whichever two met first: two ranks, ascending, both named in the message.
    const Ranks& named = group.error().ranks;
    EXPECT_TRUE(named.size() == 2 && named[0] < named[1] && named[1] < 4) << ::testing::PrintToString(named);
    for (const std::uint32_t r : named) {
      EXPECT_TRUE(contains(group.error().message, "rank " + std::to_string(r))) << group.error().message;
    }
    ++conflicts;
    phases.next();
  });
  EXPECT_EQ(conflicts.load(), 4);
  expectStillServing(daemon);
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Errors, QuotaExceededSaysWhatWasAskedAndWhatIsLeftAndDisturbsNothing) {
  const daemon::Config config = oneTenantWithQuota("small", std::uint64_t{64} << 10);
  const daemon::Tenant& tenant = config.tenants.front();
  EmbeddedDaemon daemon(config);
  ASSERT_TRUE(daemon.started());

  auto first = daemon.attach(rankOf("within-quota", 0, 1));
  ASSERT_TRUE(first.ok()) << messageOf(first);
  auto kept = first->registerGroup(smallGroup("kept", 1, 128));  // 1024 fp32: 8 KiB shard file
  ASSERT_TRUE(kept.ok()) << messageOf(kept);
  const TensorView view = kept->shardView(0);
  for (std::int64_t e = 0; e < view.numel(); ++e) view.data<float>()[e] = static_cast<float>(e);
  const daemon::ServerStats before = daemon.stats();
  EXPECT_EQ(before.memfds, 2U) << "kept's shard file and first's session segment";
  const std::uint64_t left = tenant.memory_quota_bytes - before.bytes_in_use;

  auto greedy = daemon.attach(rankOf("over-quota", 0, 1));
  ASSERT_TRUE(greedy.ok()) << messageOf(greedy);
  auto big = greedy->registerGroup(smallGroup("big", 1, 8192));  // 64 Ki fp32: 512 KiB shard file
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.error().code, ErrorCode::kInfeasible) << big.error().message;
  const std::string& message = big.error().message;
  EXPECT_TRUE(contains(message, "needs 524288 bytes")) << message;
  EXPECT_TRUE(contains(message, "has " + std::to_string(left) + " of its 65536-byte quota left")) << message;
  EXPECT_TRUE(contains(message, "'small'")) << message;
  EXPECT_TRUE(contains(message, "'big'")) << message;

  // Nothing else moved: same counters, the first job's group works and kept its data.
  const daemon::ServerStats after = daemon.stats();
  EXPECT_EQ(after.bytes_in_use, before.bytes_in_use);
  // One memfd more: greedy's session segment (it attached after `before`);
  // the refused group created none.
  EXPECT_EQ(after.memfds, before.memfds + 1);
  EXPECT_EQ(after.sessions, 2U);
  ASSERT_TRUE(kept->unshard().ok());
  ASSERT_TRUE(kept->reshard().ok());
  EXPECT_EQ(view.data<float>()[view.numel() - 1], static_cast<float>(view.numel() - 1));
  // The refused client may still register something that fits.
  auto small = greedy->registerGroup(smallGroup("small", 1, 16));
  EXPECT_TRUE(small.ok()) << messageOf(small);
  ASSERT_TRUE(greedy->detach().ok());
  ASSERT_TRUE(first->detach().ok());
  expectStillServing(daemon);
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Errors, AGroupTooLargeForAnyPlanIsRefusedBeforePlanning) {
  // 2^50 elements: no plan's shards could fit the quota, and planning them
  // would hold the daemon's loop for seconds. Refused at once, with the size.
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto client = daemon.attach(rankOf("huge", 0, 2));
  auto peer = daemon.attach(rankOf("huge", 1, 2));
  ASSERT_TRUE(client.ok()) << messageOf(client);
  ASSERT_TRUE(peer.ok()) << messageOf(peer);
  GroupSpec huge;
  huge.name = "huge";
  huge.tensors = {{"w", {std::int64_t{1} << 25, std::int64_t{1} << 25}, "rows:3", -1}};
  std::vector<Client*> clients{&*client, &*peer};
  onRanks(2, [&](std::uint32_t rank) {
    const auto started = std::chrono::steady_clock::now();
    auto refused = clients[rank]->registerGroup(huge);
    EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(1));
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.error().code, ErrorCode::kInfeasible) << refused.error().message;
    EXPECT_TRUE(contains(refused.error().message, "group 'huge' needs ")) << refused.error().message;
  });
  EXPECT_EQ(daemon.stats().bytes_in_use, 0U);
  ASSERT_TRUE(client->detach().ok());
  ASSERT_TRUE(peer->detach().ok());
  expectStillServing(daemon);
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Errors, UnshardOverQuotaFailsCleanly) {
  EmbeddedDaemon daemon(oneTenantWithQuota("tight", 8192));  // exactly the shard file of the group below
  ASSERT_TRUE(daemon.started());
  auto client = daemon.attach(rankOf("tight", 0, 1));
  ASSERT_TRUE(client.ok()) << messageOf(client);
  auto group = client->registerGroup(smallGroup("g", 1, 128));
  ASSERT_TRUE(group.ok()) << messageOf(group);
  auto slot = group->unshard();
  EXPECT_FAILS_WITH(slot, ErrorCode::kInfeasible);
  EXPECT_TRUE(contains(slot.error().message, "has 0 of its 8192-byte quota left")) << slot.error().message;
  EXPECT_FALSE(group->unsharded());
  EXPECT_EQ(daemon.stats().bytes_in_use, 8192U);
  ASSERT_TRUE(client->detach().ok());
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Errors, DaemonMemoryLimitExceeded) {
  daemon::Config config;
  config.memory_limit_bytes = std::uint64_t{32} << 10;
  EmbeddedDaemon daemon(config);
  ASSERT_TRUE(daemon.started());
  auto client = daemon.attach(rankOf("over-limit", 0, 2));
  auto peer = daemon.attach(rankOf("over-limit", 1, 2));
  ASSERT_TRUE(client.ok()) << messageOf(client);
  ASSERT_TRUE(peer.ok()) << messageOf(peer);
  std::vector<std::string> messages(2);
  std::vector<Client*> clients{&*client, &*peer};
  onRanks(2, [&](std::uint32_t rank) {
    auto big = clients[rank]->registerGroup(smallGroup("big", 1, 1024));  // 2 x 16 KiB + grads
    ASSERT_FALSE(big.ok());
    EXPECT_EQ(big.error().code, ErrorCode::kInfeasible) << big.error().message;
    messages[rank] = big.error().message;
  });
  for (const std::string& message : messages) {
    EXPECT_TRUE(contains(message, "memory limit")) << message;
    EXPECT_TRUE(contains(message, "needs ")) << message;
    EXPECT_TRUE(contains(message, "has 32768 of its 32768-byte memory limit left")) << message;
  }
  EXPECT_EQ(daemon.stats().bytes_in_use, 0U);
  ASSERT_TRUE(client->detach().ok());
  ASSERT_TRUE(peer->detach().ok());
  expectStillServing(daemon);
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Errors, TwoClientsClaimingTheSameRank) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto first = daemon.attach(rankOf("claimed", 0, 1));
  ASSERT_TRUE(first.ok()) << messageOf(first);
  auto second = daemon.connect();
  ASSERT_TRUE(second.ok()) << messageOf(second);
  auto refused = second->attach(rankOf("claimed", 0, 1));
  EXPECT_FAILS_WITH(refused, ErrorCode::kConflict);
  EXPECT_TRUE(contains(refused.error().message, "rank 0 of job 'claimed' is already attached"))
      << refused.error().message;
  EXPECT_TRUE(contains(refused.error().message, "pid " + std::to_string(::getpid()))) << refused.error().message;
  // The holder is undisturbed.
  auto group = first->registerGroup(smallGroup("g"));
  EXPECT_TRUE(group.ok()) << messageOf(group);
  EXPECT_EQ(daemon.stats().sessions, 1U);
  ASSERT_TRUE(first->detach().ok());
  expectStillServing(daemon);
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Errors, TenantJobLimit) {
  daemon::Config config;
  daemon::Tenant tenant;
  tenant.name = "one-job";
  tenant.uids = {static_cast<std::uint32_t>(::getuid())};
  tenant.max_jobs = 1;
  config.tenants = {tenant};
  EmbeddedDaemon daemon(config);
  ASSERT_TRUE(daemon.started());
  auto first = daemon.attach(rankOf("first", 0, 1));
  ASSERT_TRUE(first.ok()) << messageOf(first);
  auto second = daemon.connect();
  ASSERT_TRUE(second.ok());
  auto refused = second->attach(rankOf("second", 0, 1));
  EXPECT_FAILS_WITH(refused, ErrorCode::kInfeasible);
  EXPECT_TRUE(contains(refused.error().message, "tenant 'one-job' already runs 1 jobs")) << refused.error().message;
  ASSERT_TRUE(first->detach().ok());
  expectStillServing(daemon, "second");  // the slot is free again
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Errors, UserOfNoTenantIsRefused) {
  daemon::Config config;
  daemon::Tenant tenant;
  tenant.name = "somebody-else";
  tenant.uids = {static_cast<std::uint32_t>(::getuid()) + 1};
  tenant.gids = {static_cast<std::uint32_t>(::getgid()) + 1};
  config.tenants = {tenant};
  EmbeddedDaemon daemon(config);
  ASSERT_TRUE(daemon.started());
  auto client = daemon.connect();
  ASSERT_TRUE(client.ok());
  auto refused = client->attach(rankOf("intruder", 0, 1));
  EXPECT_FAILS_WITH(refused, ErrorCode::kPermissionDenied);
  EXPECT_TRUE(contains(refused.error().message, "uid " + std::to_string(::getuid()))) << refused.error().message;
  EXPECT_TRUE(contains(refused.error().message, "no tenant")) << refused.error().message;
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Errors, ClientTimeoutEndsTheCallAndTheConnection) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto client = daemon.attach(rankOf("impatient", 0, 2));  // rank 1 never comes
  ASSERT_TRUE(client.ok()) << messageOf(client);
  const auto started = Clock::now();
  auto group = client->registerGroup(smallGroup("g"), 100ms);
  EXPECT_FAILS_WITH(group, ErrorCode::kTimeout);
  EXPECT_GE(Clock::now() - started, 90ms);
  EXPECT_LT(Clock::now() - started, 5s);
  // A late reply would desynchronise the stream: the client is done.
  EXPECT_FAILS_WITH(client->registerGroup(smallGroup("g")), ErrorCode::kUnavailable);
  // The daemon saw the connection close and let the rank and its job go.
  EXPECT_TRUE(waitUntil([&] { return daemon.stats().sessions == 0 && daemon.stats().jobs == 0; }));
  expectStillServing(daemon);
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Errors, RankOutsideTheWorldSize) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto client = daemon.connect();
  ASSERT_TRUE(client.ok()) << messageOf(client);
  auto refused = client->attach(rankOf("world", 4, 4));
  EXPECT_FAILS_WITH(refused, ErrorCode::kInvalidArgument);
  EXPECT_TRUE(contains(refused.error().message, "rank 4 of world size 4")) << refused.error().message;
  auto zero = daemon.connect();
  ASSERT_TRUE(zero.ok());
  EXPECT_FAILS_WITH(zero->attach(rankOf("world", 0, 0)), ErrorCode::kInvalidArgument);
  EXPECT_EQ(daemon.stats().jobs, 0U);
  // The refused client stays usable: a corrected attach connects again.
  auto corrected = client->attach(rankOf("world", 3, 4));
  ASSERT_TRUE(corrected.ok()) << messageOf(corrected);
  EXPECT_EQ(daemon.stats().jobs, 1U);
  ASSERT_TRUE(client->detach().ok());
  // A detached client attaches again, on a connection of its own.
  auto again = client->attach(rankOf("world", 3, 4));
  ASSERT_TRUE(again.ok()) << messageOf(again);
  ASSERT_TRUE(client->detach().ok());
  expectStillServing(daemon);
  EXPECT_TRUE(waitUntil([&] { return daemonIsEmpty(daemon.stats()); }));
}

TEST(Errors, WorldSizeDifferingFromTheJobs) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto first = daemon.attach(rankOf("sized", 0, 2));
  ASSERT_TRUE(first.ok()) << messageOf(first);
  auto other = daemon.connect();
  ASSERT_TRUE(other.ok());
  auto refused = other->attach(rankOf("sized", 1, 4));
  EXPECT_FAILS_WITH(refused, ErrorCode::kConflict);
  EXPECT_TRUE(contains(refused.error().message, "job 'sized' has world size 2, not 4")) << refused.error().message;
  // The right world size still gets in, and the job works.
  std::optional<Client> second;
  {
    auto attached = daemon.attach(rankOf("sized", 1, 2));
    ASSERT_TRUE(attached.ok()) << messageOf(attached);
    second.emplace(std::move(*attached));
  }
  std::vector<Client*> clients{&*first, &*second};
  onRanks(2, [&](std::uint32_t rank) {
    auto group = clients[rank]->registerGroup(smallGroup("g"));
    EXPECT_TRUE(group.ok()) << messageOf(group);
    EXPECT_TRUE(clients[rank]->detach().ok());
  });
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Errors, RegistrationTimeoutListsTheMissingRanks) {
  daemon::Config config;
  config.register_timeout = 200ms;
  EmbeddedDaemon daemon(config);
  ASSERT_TRUE(daemon.started());
  std::vector<std::optional<Client>> clients(4);
  onRanks(4, [&](std::uint32_t rank) {
    auto client = daemon.attach(rankOf("late", rank, 4));
    ASSERT_TRUE(client.ok()) << messageOf(client);
    clients[rank].emplace(std::move(*client));
  });
  ASSERT_TRUE(clients[0] && clients[1] && clients[2] && clients[3]);
  // Ranks 0 and 2 register; 1 and 3 never do.
  std::vector<std::string> messages(4);
  std::vector<Ranks> missing(4);
  std::vector<Clock::duration> waited(4);
  onRanks(4, [&](std::uint32_t rank) {
    if (rank % 2 == 1) return;
    const auto started = Clock::now();
    auto group = clients[rank]->registerGroup(smallGroup("layer"), 10s);
    waited[rank] = Clock::now() - started;
    ASSERT_FALSE(group.ok());
    EXPECT_EQ(group.error().code, ErrorCode::kTimeout) << group.error().message;
    messages[rank] = group.error().message;
    missing[rank] = group.error().ranks;
  });
  for (const std::uint32_t rank : {0U, 2U}) {
    EXPECT_TRUE(contains(messages[rank], "ranks 1, 3 did not register within 200 ms")) << messages[rank];
    EXPECT_EQ(missing[rank], (Ranks{1, 3})) << "rank " << rank << ": the missing ranks, as data";
    EXPECT_LT(waited[rank], 5s) << "the daemon's timeout, not the client's";
  }
  // The ranks are still attached and a complete registration succeeds.
  onRanks(4, [&](std::uint32_t rank) {
    auto group = clients[rank]->registerGroup(smallGroup("layer"));
    EXPECT_TRUE(group.ok()) << "rank " << rank << ": " << messageOf(group);
    EXPECT_TRUE(clients[rank]->detach().ok());
  });
  expectStillServing(daemon);
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

/// Sends RegisterGroup (request 2), then a request that must fail
/// (AcquireSlot of an unknown group, request 3): its reply proves the daemon
/// took the registration (frames of a connection are handled in order), which
/// itself stays unanswered while the collective waits.
void registerAndConfirm(int fd, const std::string& group, std::vector<std::int64_t> shape = {8, 8}) {
  ipc::RegisterGroup spec;
  spec.name = group;
  spec.tensors = {{"t", std::move(shape), "", -1}};
  writeAll(fd, frameOf(spec, 2));
  writeAll(fd, frameOf(ipc::AcquireSlot{999}, 3));
  expectErrorReply(fd, ipc::WireError::kNotFound, 3);
}

TEST(Errors, RankLeavingMidRegistrationFailsTheWaitingRanksAtOnce) {
  EmbeddedDaemon daemon;  // register_timeout: 30 s, far beyond this test
  ASSERT_TRUE(daemon.started());
  UniqueFd rank0 = daemon.rawConnect();
  const UniqueFd rank1 = daemon.rawConnect();
  ASSERT_TRUE(rawAttach(rank0.get(), "leaver", 0, 3));
  ASSERT_TRUE(rawAttach(rank1.get(), "leaver", 1, 3));
  registerAndConfirm(rank0.get(), "layer");
  registerAndConfirm(rank1.get(), "layer");
  // Registering the same group twice from one rank is refused; the first stays.
  {
    ipc::RegisterGroup again;
    again.name = "layer";
    again.tensors = {{"t", {8, 8}, "", -1}};
    writeAll(rank1.get(), frameOf(again, 4));
    const std::string twice = expectErrorReply(rank1.get(), ipc::WireError::kConflict, 4);
    EXPECT_TRUE(contains(twice, "rank 1 is already registering 'layer'")) << twice;
  }
  const auto started = Clock::now();
  rank0.reset();  // rank 0 dies while registering
  const ipc::ErrorReply reply = nextErrorReply(rank1.get(), 2);
  EXPECT_EQ(reply.code, ipc::WireError::kConflict) << reply.message;
  EXPECT_TRUE(contains(reply.message, "rank 0 disconnected")) << reply.message;
  EXPECT_EQ(reply.ranks, Ranks{0}) << "the rank that died, on the wire";
  EXPECT_LT(Clock::now() - started, 5s);
  EXPECT_TRUE(waitUntil([&] { return daemon.stats().sessions == 1; }));
  // Rank 1's session segment; no group was planned, so there is no shard file.
  EXPECT_EQ(daemon.stats().memfds, 1U);
  expectStillServing(daemon);
}

// Every rank of the collective hears of a spec mismatch, also those that
// register after it was detected (here ranks 1 and 2, after rank 3's spec met
// rank 0's). Order made deterministic with raw connections and
// registerAndConfirm().
TEST(Errors, RanksArrivingAfterASpecMismatchHearOfIt) {
  daemon::Config config;
  config.register_timeout = 300ms;  // keeps the failing case short
  EmbeddedDaemon daemon(config);
  ASSERT_TRUE(daemon.started());
  std::vector<UniqueFd> ranks;
  for (std::uint32_t rank = 0; rank < 4; ++rank) {
    ranks.push_back(daemon.rawConnect());
    ASSERT_TRUE(rawAttach(ranks.back().get(), "late-mismatch", rank, 4));
  }
  registerAndConfirm(ranks[3].get(), "layer", {8, 9});  // the odd one, first
  ipc::RegisterGroup spec;
  spec.name = "layer";
  spec.tensors = {{"t", {8, 8}, "", -1}};
  writeAll(ranks[0].get(), frameOf(spec, 2));
  for (const std::uint32_t rank : {3U, 0U}) {
    const ipc::ErrorReply reply = nextErrorReply(ranks[rank].get(), 2);
    EXPECT_EQ(reply.code, ipc::WireError::kConflict) << reply.message;
    EXPECT_TRUE(contains(reply.message, "'t'")) << reply.message;
    EXPECT_EQ(reply.ranks, (Ranks{0, 3})) << "rank " << rank;
  }
  for (const std::uint32_t rank : {1U, 2U}) {
    writeAll(ranks[rank].get(), frameOf(spec, 2));
    const ipc::ErrorReply reply = nextErrorReply(ranks[rank].get(), 2);
    EXPECT_EQ(reply.code, ipc::WireError::kConflict) << reply.message;
    EXPECT_TRUE(contains(reply.message, "rank 0") && contains(reply.message, "rank 3") &&
                contains(reply.message, "'t'"))
        << "rank " << rank << ": " << reply.message;
    EXPECT_EQ(reply.ranks, (Ranks{0, 3})) << "rank " << rank << " hears the same ranks as data";
  }
}

TEST(Errors, MoreUnshardedGroupsThanSlots) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto client = daemon.attach(rankOf("slots", 0, 1, false, /*prefetch_depth=*/1));
  ASSERT_TRUE(client.ok()) << messageOf(client);
  std::vector<Group> groups;
  for (const char* name : {"a", "b", "c"}) {
    auto group = client->registerGroup(smallGroup(name));
    ASSERT_TRUE(group.ok()) << messageOf(group);
    groups.push_back(std::move(*group));
  }
  ASSERT_TRUE(groups[0].unshard().ok());
  ASSERT_TRUE(groups[1].unshard().ok());
  auto third = groups[2].unshard();
  EXPECT_FAILS_WITH(third, ErrorCode::kConflict);
  EXPECT_TRUE(contains(third.error().message, "all 2 unsharded slots")) << third.error().message;
  EXPECT_TRUE(contains(third.error().message, "prefetch depth 1")) << third.error().message;
  EXPECT_FALSE(groups[2].unsharded());
  // Resharding one frees a slot for the third.
  ASSERT_TRUE(groups[0].reshard().ok());
  EXPECT_TRUE(groups[2].unshard().ok());
  EXPECT_FAILS_WITH(groups[0].unshard(), ErrorCode::kConflict);
  ASSERT_TRUE(client->detach().ok());
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Errors, PrefetchDepthZeroMeansOneSlot) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto client = daemon.attach(rankOf("no-prefetch", 0, 1, false, /*prefetch_depth=*/0));
  ASSERT_TRUE(client.ok()) << messageOf(client);
  auto a = client->registerGroup(smallGroup("a"));
  auto b = client->registerGroup(smallGroup("b"));
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(a->unshard().ok());
  EXPECT_FAILS_WITH(b->unshard(), ErrorCode::kConflict);
  ASSERT_TRUE(a->reshard().ok());
  EXPECT_TRUE(b->unshard().ok());
  ASSERT_TRUE(client->detach().ok());
  // And a depth beyond the daemon's cap is refused at attach.
  auto greedy = daemon.connect();
  ASSERT_TRUE(greedy.ok());
  auto refused = greedy->attach(rankOf("deep", 0, 1, false, 1000));
  EXPECT_FAILS_WITH(refused, ErrorCode::kInvalidArgument);
  EXPECT_TRUE(contains(refused.error().message, "prefetch depth 1000")) << refused.error().message;
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Errors, BadShapesAndRulesAreInvalidArguments) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto client = daemon.attach(rankOf("bad-shapes", 0, 1));
  ASSERT_TRUE(client.ok()) << messageOf(client);
  struct Case {
    const char* what;
    GroupSpec spec;
    const char* expected;  // in the message
  };
  std::vector<Case> cases;
  {
    GroupSpec spec = smallGroup("zero-dim", 2);
    spec.tensors[1].shape = {0, 8};
    cases.push_back({"zero dimension", spec, "'t1'"});
  }
  {
    GroupSpec spec = smallGroup("negative-dim", 2);
    spec.tensors[0].shape = {-4, 8};
    cases.push_back({"negative dimension", spec, "'t0'"});
  }
  {
    GroupSpec spec = smallGroup("empty-shape", 1);
    spec.tensors[0].shape = {};
    cases.push_back({"empty shape", spec, "'t0'"});
  }
  {
    GroupSpec spec = smallGroup("bad-rule", 1);
    spec.granularity = "rows:banana";
    cases.push_back({"bad group rule", spec, "rows:banana"});
  }
  {
    GroupSpec spec = smallGroup("bad-tensor-rule", 2);
    spec.tensors[1].granularity = "diagonal";
    cases.push_back({"bad tensor rule", spec, "'t1'"});
  }
  {
    GroupSpec spec = smallGroup("count-not-dividing", 1);
    spec.tensors[0].granularity = "7";  // 128 elements
    cases.push_back({"count that does not divide numel", spec, "'t0'"});
  }
  {
    GroupSpec spec = smallGroup("tp-dim", 1);
    spec.tensors[0].tp_dim = 5;
    cases.push_back({"tp_dim out of range", spec, "tp_dim"});
  }
  {
    GroupSpec spec = smallGroup("no-tensors", 0);
    cases.push_back({"no tensors", spec, "at least one tensor"});
  }
  {
    GroupSpec spec = smallGroup("", 1);
    cases.push_back({"no name", spec, "name"});
  }
  {
    GroupSpec spec = smallGroup("alignment", 1);
    spec.align_bytes = 3;
    cases.push_back({"alignment", spec, "alignment"});
  }
  {
    GroupSpec spec = smallGroup("twice", 3);
    spec.tensors[2].name = spec.tensors[0].name;
    spec.tensors[2].shape = {6};
    cases.push_back({"a name used twice", spec, "tensor 't0' is named twice"});
  }
  for (const Case& c : cases) {
    auto group = client->registerGroup(c.spec);
    ASSERT_FALSE(group.ok()) << c.what << " was accepted";
    EXPECT_EQ(group.error().code, ErrorCode::kInvalidArgument) << c.what << ": " << group.error().message;
    EXPECT_TRUE(contains(group.error().message, c.expected)) << c.what << ": " << group.error().message;
  }
  // Still attached, still served.
  auto good = client->registerGroup(smallGroup("good"));
  EXPECT_TRUE(good.ok()) << messageOf(good);
  // The good group's shard file and the session segment: the refused groups hold nothing.
  EXPECT_EQ(daemon.stats().memfds, 2U) << "only the good group holds memory";
  ASSERT_TRUE(client->detach().ok());
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Errors, CallsAfterTheDaemonStoppedFailFast) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto client = daemon.attach(rankOf("stopping", 0, 1));
  ASSERT_TRUE(client.ok()) << messageOf(client);
  auto group = client->registerGroup(smallGroup("g"));
  ASSERT_TRUE(group.ok()) << messageOf(group);
  daemon.stop();
  const auto started = Clock::now();
  auto after = group->unshard(30s);
  EXPECT_FAILS_WITH(after, ErrorCode::kUnavailable);
  // The daemon said goodbye before closing; the client passes on why.
  EXPECT_TRUE(contains(after.error().message, "shutting down")) << after.error().message;
  EXPECT_FAILS_WITH(client->registerGroup(smallGroup("h"), 30s), ErrorCode::kUnavailable);
  EXPECT_FAILS_WITH(client->detach(30s), ErrorCode::kUnavailable);
  EXPECT_LT(Clock::now() - started, 5s) << "a stopped daemon must not make clients wait for their timeouts";
  // A new connection finds nobody.
  auto late = daemon.connect();
  EXPECT_FAILS_WITH(late, ErrorCode::kUnavailable);
}

TEST(Errors, CollectiveOnTheRingsAfterTheDaemonStoppedFailsFast) {
  // The ring is shared memory: nothing on it tells the client that the daemon
  // is gone. The wait must notice the socket (the goodbye) instead of waiting
  // for its timeout.
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto client = daemon.attach(rankOf("stopping-rings", 0, 1));
  ASSERT_TRUE(client.ok()) << messageOf(client);
  auto group = client->registerGroup(smallGroup("g"));
  ASSERT_TRUE(group.ok()) << messageOf(group);
  ASSERT_TRUE(group->acquireSlot().ok());
  ASSERT_TRUE(client->barrier().ok()) << "the rings work before the stop";
  daemon.stop();
  const auto started = Clock::now();
  auto gathered = group->allGather(30s);
  EXPECT_FAILS_WITH(gathered, ErrorCode::kUnavailable);
  EXPECT_TRUE(contains(gathered.error().message, "shutting down")) << gathered.error().message;
  EXPECT_FAILS_WITH(client->barrier(30s), ErrorCode::kUnavailable);
  EXPECT_LT(Clock::now() - started, 5s) << "a stopped daemon must not make ring waits run to their timeouts";
}

TEST(Errors, UnshardOnOneRankIsACollectiveThatTimesOutNamingTheMissingRank) {
  daemon::Config config;
  config.collective_timeout = 300ms;
  EmbeddedDaemon daemon(config);
  ASSERT_TRUE(daemon.started());
  std::vector<std::optional<Client>> clients(2);
  std::vector<std::optional<Group>> groups(2);
  onRanks(2, [&](std::uint32_t rank) {
    auto client = daemon.attach(rankOf("lonely", rank, 2));
    ASSERT_TRUE(client.ok()) << messageOf(client);
    auto group = client->registerGroup(smallGroup("g"));
    ASSERT_TRUE(group.ok()) << messageOf(group);
    for (std::size_t t = 0; t < group->plan().tensors.size(); ++t) {
      const TensorView shard = group->shardView(t);
      std::fill_n(shard.data<float>(), shard.numel(), static_cast<float>(rank + 1));
    }
    clients[rank].emplace(std::move(*client));
    groups[rank].emplace(std::move(*group));
  });
  ASSERT_TRUE(groups[0] && groups[1]);
  // acquireSlot is not a collective: rank 0 alone gets its slot at once.
  ASSERT_TRUE(groups[0]->acquireSlot(2s).ok());
  EXPECT_TRUE(groups[0]->unsharded());
  // unshard is: alone, rank 0 waits for rank 1 until the daemon's collective
  // timeout, whose error names the rank that never came.
  const auto started = Clock::now();
  auto alone = groups[0]->unshard(10s);
  EXPECT_FAILS_WITH(alone, ErrorCode::kTimeout);
  EXPECT_GE(Clock::now() - started, 250ms) << "failed before the collective timeout: " << alone.error().message;
  // The job's first collective (#0): registration and acquireSlot are not ops on the rings.
  EXPECT_EQ(alone.error().message,
            "dbufd: collective #0 allGather(group 'g') timed out after 300 ms: rank 1 of job lonely has not "
            "submitted it");
  EXPECT_EQ(alone.error().ranks, Ranks{1});
  EXPECT_TRUE(groups[0]->unsharded()) << "the slot stays acquired";
  // Rank 1's next collective is the one it missed: it fails at once with the
  // same story, so the k-th op of every rank stays the same op.
  auto late = groups[1]->unshard(10s);
  EXPECT_FAILS_WITH(late, ErrorCode::kTimeout);
  EXPECT_EQ(late.error().message, alone.error().message);
  EXPECT_EQ(late.error().ranks, Ranks{1}) << "the late rank hears which ranks were missing, itself included";
  EXPECT_TRUE(groups[1]->unsharded()) << "the slot was acquired before the gather failed";
  // Together, it gathers.
  onRanks(2, [&](std::uint32_t rank) {
    Group& group = *groups[rank];
    auto together = group.unshard(10s);
    ASSERT_TRUE(together.ok()) << "rank " << rank << ": " << messageOf(together);
    for (std::size_t t = 0; t < group.plan().tensors.size(); ++t) {
      auto full = group.unshardedView(t);
      ASSERT_TRUE(full.ok());
      for (std::int64_t e = 0; e < full->numel(); ++e) {
        const auto owner = (group.plan().tensors[t].offset + e) / group.plan().shard_elems;
        ASSERT_EQ(full->data<std::uint16_t>()[e], kernels::floatToBf16(static_cast<float>(owner + 1)))
            << "rank " << rank << " tensor " << t << " element " << e;
      }
    }
    EXPECT_TRUE(group.reshard().ok());
    EXPECT_TRUE(clients[rank]->detach().ok());
  });
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Errors, RanksWaitingInACollectiveHearOfTheShutdown) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto client = daemon.attach(rankOf("stopping", 0, 2));  // rank 1 never comes
  ASSERT_TRUE(client.ok()) << messageOf(client);
  std::optional<Result<Group>> result;
  Clock::duration waited{};
  std::thread waiter([&] {
    const auto started = Clock::now();
    result.emplace(client->registerGroup(smallGroup("g"), 30s));
    waited = Clock::now() - started;
  });
  daemon.stop();  // whether the request arrived before or after, the answer is "unavailable"
  waiter.join();
  ASSERT_TRUE(result.has_value());
  EXPECT_FAILS_WITH(*result, ErrorCode::kUnavailable);
  EXPECT_TRUE(contains(result->error().message, "shutting down")) << result->error().message;
  EXPECT_LT(waited, 10s);
}

TEST(Errors, NoDaemonBehindTheSocketPath) {
  TempDir dir;
  ClientOptions options;
  options.socket_path = dir.path("nobody.sock");
  options.timeout = 2s;
  const auto started = Clock::now();
  auto client = Client::connect(options);
  EXPECT_FAILS_WITH(client, ErrorCode::kUnavailable);
  EXPECT_TRUE(contains(client.error().message, "cannot reach dbufd at " + options.socket_path))
      << client.error().message;
  EXPECT_LT(Clock::now() - started, 2s) << "a missing socket is not worth waiting for";
}

}  // namespace
TEST(Errors, RanksOfOneJobMustAgreeOnPersistenceAndPrefetchDepth) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto first = daemon.attach(rankOf("agree", 0, 2, /*persistent=*/false, /*prefetch_depth=*/1));
  ASSERT_TRUE(first.ok()) << messageOf(first);
  for (const auto& [persistent, depth] : {std::pair{false, 2U}, std::pair{true, 1U}}) {
    auto second = daemon.attach(rankOf("agree", 1, 2, persistent, depth));
    ASSERT_FALSE(second.ok());
    EXPECT_EQ(second.error().code, ErrorCode::kConflict) << second.error().message;
    EXPECT_TRUE(contains(second.error().message, "prefetch depth 1")) << second.error().message;
  }
  auto agreeing = daemon.attach(rankOf("agree", 1, 2, false, 1));
  EXPECT_TRUE(agreeing.ok()) << messageOf(agreeing);
}

}  // namespace dbuf::integration
