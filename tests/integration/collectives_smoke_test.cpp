// Smoke test of the data plane with an embedded daemon and ranks on threads:
// all-gather, reduce-scatter and a barrier through the rings.
#include <gtest/gtest.h>
#include <sched.h>

#include "harness.hpp"
#include "support/thread_cpu_time.hpp"

namespace dbuf::integration {
namespace {

GroupSpec smallGroup() {
  GroupSpec spec;
  spec.name = "g";
  spec.tensors = {{"w", {8, 16}, "", -1}, {"b", {37}, "", -1}};
  spec.granularity = "rows:2";
  spec.sharded_dtype = DType::kF32;
  spec.unsharded_dtype = DType::kF32;
  return spec;
}

TEST(CollectivesSmoke, AllGatherReduceScatterBarrier) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  constexpr std::uint32_t kWorld = 3;
  onRanks(kWorld, [&](std::uint32_t rank) {
    auto client = daemon.attach(rankOf("smoke", rank, kWorld));
    ASSERT_TRUE(client.ok()) << client.error().message;
    auto group = client->registerGroup(smallGroup());
    ASSERT_TRUE(group.ok()) << group.error().message;
    for (std::size_t t = 0; t < group->plan().tensors.size(); ++t) {
      const TensorView shard = group->shardView(t);
      for (std::int64_t i = 0; i < shard.numel(); ++i) {
        shard.data<float>()[i] = static_cast<float>(static_cast<std::int64_t>(t) * 1000 + shard.begin + i);
      }
    }
    auto gathered = group->unshard();
    ASSERT_TRUE(gathered.ok()) << gathered.error().message;
    for (std::size_t t = 0; t < group->plan().tensors.size(); ++t) {
      auto full = group->unshardedView(t);
      ASSERT_TRUE(full.ok());
      for (std::int64_t i = 0; i < full->numel(); ++i) {
        ASSERT_EQ(full->data<float>()[i], static_cast<float>(static_cast<std::int64_t>(t) * 1000 + i))
            << "tensor " << t << " element " << i;
      }
      auto grad = group->unshardedGradView(t);
      ASSERT_TRUE(grad.ok());
      for (std::int64_t i = 0; i < grad->numel(); ++i) grad->data<float>()[i] = static_cast<float>(rank + 1);
    }
    auto reduced = group->reduceScatter({ReduceMode::kAvg, 1.0F, 2.0F, false});
    ASSERT_TRUE(reduced.ok()) << reduced.error().message;
    for (std::size_t t = 0; t < group->plan().tensors.size(); ++t) {
      const TensorView grad = group->shardGradView(t);
      for (std::int64_t i = 0; i < grad.numel(); ++i) ASSERT_EQ(grad.data<float>()[i], 4.0F);  // 2 * (1+2+3)/3
    }
    auto barrier = client->barrier();
    ASSERT_TRUE(barrier.ok()) << barrier.error().message;
    ASSERT_TRUE(group->reshard().ok());
    ASSERT_TRUE(client->detach().ok());
  });
}

using dbuf::testing::threadCpuTime;

TEST(CollectivesSmoke, ARankWaitingOnAnOversubscribedNodeSleepsRatherThanSpins) {
  // dbufd made on one CPU: with a rank attached, ranks and dbufd outnumber
  // the CPUs, so it tells the ranks not to spin, however long
  // rings.busy_poll_us is (here 300 ms).
  cpu_set_t all;
  ASSERT_EQ(::sched_getaffinity(0, sizeof(all), &all), 0);
  std::size_t first = 0;
  while (!CPU_ISSET(first, &all)) ++first;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  ASSERT_EQ(::sched_setaffinity(0, sizeof(one), &one), 0);
  daemon::Config config;
  config.busy_poll = 300ms;
  EmbeddedDaemon daemon(config);
  ASSERT_EQ(::sched_setaffinity(0, sizeof(all), &all), 0);  // the ranks run anywhere
  ASSERT_TRUE(daemon.started());

  std::barrier attached(2);
  onRanks(2, [&](std::uint32_t rank) {
    Phases phases({&attached});
    auto client = daemon.attach(rankOf("oversubscribed", rank, 2));
    ASSERT_TRUE(client.ok()) << client.error().message;
    phases.next();
    if (rank == 1) std::this_thread::sleep_for(150ms);  // rank 0 waits this long at the barrier
    const auto before = threadCpuTime();
    const auto began = Clock::now();
    auto barrier = client->barrier();
    ASSERT_TRUE(barrier.ok()) << barrier.error().message;
    if (rank == 0) {
      EXPECT_GE(Clock::now() - began, 100ms);
      // Spinning would cost up to a liveness-check slice (kInterruptPeriod, 20 ms) of CPU.
      EXPECT_LT(threadCpuTime() - before, 5ms) << "rank 0 spun in its wait";
    }
    ASSERT_TRUE(client->detach().ok());
  });
}

}  // namespace
}  // namespace dbuf::integration
