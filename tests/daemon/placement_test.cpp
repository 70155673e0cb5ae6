// Where dbufd puts a job: host memory, virtual ranks on one GPU, or a GPU per
// rank (NCCL); and which GPU each rank may attach on. Pure functions, so the
// GPU rules are checked here, on machines without a GPU.
#include "placement.hpp"

#include <gtest/gtest.h>

#include <vector>

namespace dbuf::daemon {
namespace {

ipc::Hello hello(std::uint32_t rank, std::uint32_t world, std::int32_t device) {
  ipc::Hello h;
  h.job_id = "job";
  h.rank = rank;
  h.world_size = world;
  h.device = device;
  return h;
}

constexpr GpuOffer kHostBackend{false, 0, 0};

TEST(Placement, TheHostBackendPutsEveryJobInHostMemoryWhateverItsRanksName) {
  ASSERT_EQ(*placeJob(hello(0, 64, 3), kHostBackend), Placement::kHost);
  const std::vector<std::int32_t> devices{-1, 5, 5};
  EXPECT_TRUE(checkRankDevice(Placement::kHost, devices, hello(0, 3, -1), 0));
}

TEST(Placement, JobsUpToTheVirtualRanksShareOneGpuLargerOnesNeedAGpuPerRank) {
  const GpuOffer eight_gpus_four_virtual{true, 4, 8};
  EXPECT_EQ(*placeJob(hello(0, 1, 0), eight_gpus_four_virtual), Placement::kSharedGpu);
  EXPECT_EQ(*placeJob(hello(0, 4, 0), eight_gpus_four_virtual), Placement::kSharedGpu);
  EXPECT_EQ(*placeJob(hello(0, 5, 0), eight_gpus_four_virtual), Placement::kGpuPerRank);
  EXPECT_EQ(*placeJob(hello(0, 8, 0), eight_gpus_four_virtual), Placement::kGpuPerRank);
  // Without virtual ranks even a one-rank job runs through NCCL.
  EXPECT_EQ(*placeJob(hello(0, 1, 0), GpuOffer{true, 0, 1}), Placement::kGpuPerRank);
}

TEST(Placement, MoreRanksThanGpusWithoutVirtualRanksIsRefusedSayingHowToRunIt) {
  const auto refused = placeJob(hello(0, 2, 0), GpuOffer{true, 0, 1});
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(refused.error().message.find("has 2 ranks but this node has 1 GPUs"), std::string::npos)
      << refused.error().message;
  EXPECT_NE(refused.error().message.find("off"), std::string::npos) << refused.error().message;
  const auto too_many = placeJob(hello(0, 9, 0), GpuOffer{true, 4, 8});
  ASSERT_FALSE(too_many);
  EXPECT_NE(too_many.error().message.find("at most 4 per GPU"), std::string::npos) << too_many.error().message;
}

TEST(Placement, ARankMustNameAGpuThatExists) {
  const std::vector<std::int32_t> devices(2, -1);
  for (const std::int32_t device : {-1, 2, 100}) {
    const auto refused = checkRankDevice(Placement::kSharedGpu, devices, hello(0, 2, device), 2);
    ASSERT_FALSE(refused) << device;
    EXPECT_NE(refused.error().message.find("GPUs 0-1"), std::string::npos) << refused.error().message;
  }
  EXPECT_TRUE(checkRankDevice(Placement::kSharedGpu, devices, hello(0, 2, 1), 2));
}

TEST(Placement, VirtualRanksMustAllBeOnTheGpuTheFirstOneNamed) {
  const std::vector<std::int32_t> devices{1, -1, -1};
  EXPECT_TRUE(checkRankDevice(Placement::kSharedGpu, devices, hello(2, 3, 1), 4));
  const auto refused = checkRankDevice(Placement::kSharedGpu, devices, hello(2, 3, 0), 4);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message.find("share GPU 1"), std::string::npos) << refused.error().message;
}

TEST(Placement, WithAGpuPerRankNoTwoRanksShareOne) {
  const std::vector<std::int32_t> devices{0, 3, -1};
  EXPECT_TRUE(checkRankDevice(Placement::kGpuPerRank, devices, hello(2, 3, 1), 4));
  const auto refused = checkRankDevice(Placement::kGpuPerRank, devices, hello(2, 3, 3), 4);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message.find("which rank 1 already has"), std::string::npos) << refused.error().message;
}

TEST(Placement, ARankAttachingAgainMustComeBackToTheGpuItsMemoryIsOn) {
  const std::vector<std::int32_t> devices{0, 1};
  EXPECT_TRUE(checkRankDevice(Placement::kGpuPerRank, devices, hello(1, 2, 1), 2));  // its own GPU again
  const auto moved = checkRankDevice(Placement::kGpuPerRank, std::vector<std::int32_t>{-1, 1}, hello(1, 2, 0), 2);
  ASSERT_FALSE(moved);
  EXPECT_NE(moved.error().message.find("attached on GPU 1 before"), std::string::npos) << moved.error().message;
}

}  // namespace
}  // namespace dbuf::daemon
