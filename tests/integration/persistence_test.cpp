// Persistence within one daemon: a persistent job outlives its ranks for the
// grace period, a rank that reattaches finds its shards as it left them, and
// the memory is freed once the grace period passes with nobody back.

#include <optional>

#include "harness.hpp"

namespace dbuf::integration {
namespace {

float pattern(std::uint32_t rank, std::size_t tensor, std::int64_t element) {
  return static_cast<float>(std::size_t{rank} * 100'000 + tensor * 1'000 + static_cast<std::size_t>(element)) + 0.5F;
}

GroupSpec persistentGroup() {
  GroupSpec spec = smallGroup("weights", 3, 20);
  spec.tensors.push_back({"bias", {11}, "", -1});
  return spec;
}

void writePattern(const Group& group, std::uint32_t rank) {
  for (std::size_t t = 0; t < group.plan().tensors.size(); ++t) {
    const TensorView view = group.shardView(t);
    const TensorView grad = group.shardGradView(t);
    for (std::int64_t e = view.begin; e < view.end; ++e) {
      view.data<float>()[e - view.begin] = pattern(rank, t, e);
      grad.data<float>()[e - view.begin] = -pattern(rank, t, e);
    }
  }
}

/// Elements of the group's shard (and gradient) that do not hold the pattern.
std::int64_t patternMismatches(const Group& group, std::uint32_t rank) {
  std::int64_t wrong = 0;
  for (std::size_t t = 0; t < group.plan().tensors.size(); ++t) {
    const TensorView view = group.shardView(t);
    const TensorView grad = group.shardGradView(t);
    for (std::int64_t e = view.begin; e < view.end; ++e) {
      wrong += view.data<float>()[e - view.begin] != pattern(rank, t, e) ? 1 : 0;
      wrong += grad.data<float>()[e - view.begin] != -pattern(rank, t, e) ? 1 : 0;
    }
  }
  return wrong;
}

TEST(Persistence, ReattachedRankFindsItsShardsIntact) {
  EmbeddedDaemon daemon;  // default grace: minutes, longer than this test
  ASSERT_TRUE(daemon.started());
  constexpr std::uint32_t kWorld = 2;
  std::vector<std::string> plans(kWorld);
  std::vector<std::size_t> shard_bytes(kWorld);
  onRanks(kWorld, [&](std::uint32_t rank) {
    auto client = daemon.attach(rankOf("keep-me", rank, kWorld, /*persistent=*/true));
    ASSERT_TRUE(client.ok()) << messageOf(client);
    EXPECT_FALSE(client->reattached());
    auto group = client->registerGroup(persistentGroup());
    ASSERT_TRUE(group.ok()) << messageOf(group);
    plans[rank] = describe(group->plan());
    shard_bytes[rank] = group->shardBytes();
    if (rank == 0) writePattern(*group, rank);  // rank 1 leaves its shard untouched
    ASSERT_TRUE(group->unshard().ok());         // a slot, to see it freed
    ASSERT_TRUE(client->detach().ok());
  });
  // Every rank is gone; the job stays with its shard files, not its slots.
  daemon::ServerStats kept = daemon.stats();
  EXPECT_EQ(kept.sessions, 0U);
  EXPECT_EQ(kept.jobs, 1U);
  EXPECT_EQ(kept.memfds, kWorld);
  EXPECT_EQ(kept.bytes_in_use, shard_bytes[0] + shard_bytes[1]);

  // Rank 0 comes back alone: same group, same plan, same contents, at once
  // (no collective: the group exists).
  {
    auto client = daemon.attach(rankOf("keep-me", 0, kWorld, true));
    ASSERT_TRUE(client.ok()) << messageOf(client);
    EXPECT_TRUE(client->reattached());
    auto group = client->registerGroup(persistentGroup());
    ASSERT_TRUE(group.ok()) << messageOf(group);
    EXPECT_EQ(describe(group->plan()), plans[0]);
    EXPECT_EQ(patternMismatches(*group, 0), 0);
    // A different spec under the same name is refused, naming the difference.
    GroupSpec changed = persistentGroup();
    changed.tensors[3].shape = {12};
    auto refused = client->registerGroup(changed);
    EXPECT_FAILS_WITH(refused, ErrorCode::kConflict);
    EXPECT_NE(refused.error().message.find("'bias'"), std::string::npos) << refused.error().message;
    // Write something new, leave again.
    group->shardView(0).data<float>()[0] = 42.0F;
    ASSERT_TRUE(client->detach().ok());
  }
  EXPECT_EQ(daemon.stats().jobs, 1U);

  // Both come back: rank 0 sees its latest write, rank 1 its zeros.
  onRanks(kWorld, [&](std::uint32_t rank) {
    auto client = daemon.attach(rankOf("keep-me", rank, kWorld, true));
    ASSERT_TRUE(client.ok()) << messageOf(client);
    EXPECT_TRUE(client->reattached());
    auto group = client->registerGroup(persistentGroup());
    ASSERT_TRUE(group.ok()) << messageOf(group);
    const TensorView first = group->shardView(0);
    if (rank == 0) {
      ASSERT_GT(first.numel(), 0);
      EXPECT_EQ(first.data<float>()[0], 42.0F);
      first.data<float>()[0] = pattern(0, 0, first.begin);
      EXPECT_EQ(patternMismatches(*group, 0), 0);
    } else {
      for (std::size_t t = 0; t < group->plan().tensors.size(); ++t) {
        const TensorView view = group->shardView(t);
        for (std::int64_t e = 0; e < view.numel(); ++e) ASSERT_EQ(view.data<float>()[e], 0.0F);
      }
    }
    ASSERT_TRUE(client->detach().ok());
  });
  EXPECT_EQ(daemon.stats().jobs, 1U);
  // The grace period is long here: stopping the daemon frees the job.
  daemon.stop();
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Persistence, ReattachingSurvivesAFailedConnectionNotADetach) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  {
    auto client = daemon.attach(rankOf("crashy", 0, 1, true));
    ASSERT_TRUE(client.ok()) << messageOf(client);
    auto group = client->registerGroup(persistentGroup());
    ASSERT_TRUE(group.ok()) << messageOf(group);
    writePattern(*group, 0);
  }  // the connection just closes, as in a crash
  EXPECT_TRUE(waitUntil([&] { return daemon.stats().sessions == 0; }));
  EXPECT_EQ(daemon.stats().jobs, 1U);
  auto client = daemon.attach(rankOf("crashy", 0, 1, true));
  ASSERT_TRUE(client.ok()) << messageOf(client);
  EXPECT_TRUE(client->reattached());
  auto group = client->registerGroup(persistentGroup());
  ASSERT_TRUE(group.ok()) << messageOf(group);
  EXPECT_EQ(patternMismatches(*group, 0), 0);
  ASSERT_TRUE(client->detach().ok());
}

TEST(Persistence, JobIsFreedAfterTheGracePeriod) {
  daemon::Config config;
  config.persistence_grace = std::chrono::seconds(1);  // the config's unit is seconds
  EmbeddedDaemon daemon(config);
  ASSERT_TRUE(daemon.started());
  {
    auto client = daemon.attach(rankOf("graceful", 0, 1, true));
    ASSERT_TRUE(client.ok()) << messageOf(client);
    auto group = client->registerGroup(persistentGroup());
    ASSERT_TRUE(group.ok()) << messageOf(group);
    writePattern(*group, 0);
    ASSERT_TRUE(client->detach().ok());
  }
  const auto left = Clock::now();
  EXPECT_EQ(daemon.stats().jobs, 1U);
  // Back within the grace period: the timer is cancelled, the job stays even
  // past the old deadline.
  auto client = daemon.attach(rankOf("graceful", 0, 1, true));
  ASSERT_TRUE(client.ok()) << messageOf(client);
  EXPECT_TRUE(client->reattached());
  EXPECT_FALSE(waitUntil([&] { return daemon.stats().jobs == 0; }, 1500ms)) << "freed while a rank was attached";
  ASSERT_TRUE(client->detach().ok());
  // Gone for good: freed after the grace period, not before.
  const auto second_leave = Clock::now();
  EXPECT_EQ(daemon.stats().jobs, 1U);
  EXPECT_TRUE(waitUntil([&] { return daemon.stats().jobs == 0; }, 10s)) << "the grace period never ended";
  EXPECT_GE(Clock::now() - second_leave, 900ms) << "freed before the grace period";
  EXPECT_GE(Clock::now() - left, 2s);
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
  // A new life of the job starts from scratch.
  auto fresh = daemon.attach(rankOf("graceful", 0, 1, true));
  ASSERT_TRUE(fresh.ok()) << messageOf(fresh);
  EXPECT_FALSE(fresh->reattached());
  auto group = fresh->registerGroup(persistentGroup());
  ASSERT_TRUE(group.ok()) << messageOf(group);
  EXPECT_EQ(group->shardView(0).data<float>()[0], 0.0F);
  ASSERT_TRUE(fresh->detach().ok());
}

TEST(Persistence, PersistentJobWithoutGroupsIsFreedAtOnce) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto client = daemon.attach(rankOf("nothing-to-keep", 0, 1, true));
  ASSERT_TRUE(client.ok()) << messageOf(client);
  EXPECT_EQ(daemon.stats().jobs, 1U);
  ASSERT_TRUE(client->detach().ok());
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

}  // namespace
}  // namespace dbuf::integration
