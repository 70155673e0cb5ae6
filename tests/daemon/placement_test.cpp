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

/// A node with `gpus` GPUs (UUIDs 1..gpus).
GpuOffer offer(bool gpu_memory, std::uint32_t virtual_ranks, int gpus) {
  GpuOffer made{gpu_memory, virtual_ranks, {}};
  for (int d = 0; d < gpus; ++d) made.gpus.push_back(GpuUuid{0, static_cast<std::uint64_t>(d + 1)});
  return made;
}

const GpuOffer kHostBackend = offer(false, 0, 0);

TEST(Placement, TheHostBackendPutsEveryJobInHostMemoryWhateverItsRanksName) {
  ASSERT_EQ(*placeJob(hello(0, 64, 3), kHostBackend), Placement::kHost);
  const std::vector<std::int32_t> devices{-1, 5, 5};
  EXPECT_TRUE(checkRankDevice(Placement::kHost, devices, 0, hello(0, 3, -1), 0));
}

TEST(Placement, JobsUpToTheVirtualRanksShareOneGpuLargerOnesNeedAGpuPerRank) {
  const GpuOffer eight_gpus_four_virtual = offer(true, 4, 8);
  EXPECT_EQ(*placeJob(hello(0, 1, 0), eight_gpus_four_virtual), Placement::kSharedGpu);
  EXPECT_EQ(*placeJob(hello(0, 4, 0), eight_gpus_four_virtual), Placement::kSharedGpu);
  EXPECT_EQ(*placeJob(hello(0, 5, 0), eight_gpus_four_virtual), Placement::kGpuPerRank);
  EXPECT_EQ(*placeJob(hello(0, 8, 0), eight_gpus_four_virtual), Placement::kGpuPerRank);
  // Without virtual ranks even a one-rank job runs through NCCL.
  EXPECT_EQ(*placeJob(hello(0, 1, 0), offer(true, 0, 1)), Placement::kGpuPerRank);
}

TEST(Placement, MoreRanksThanGpusWithoutVirtualRanksIsRefusedSayingHowToRunIt) {
  const auto refused = placeJob(hello(0, 2, 0), offer(true, 0, 1));
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(refused.error().message.find("has 2 ranks on this node, which has 1 GPUs"), std::string::npos)
      << refused.error().message;
  EXPECT_NE(refused.error().message.find("off"), std::string::npos) << refused.error().message;
  const auto too_many = placeJob(hello(0, 9, 0), offer(true, 4, 8));
  ASSERT_FALSE(too_many);
  EXPECT_NE(too_many.error().message.find("at most 4 per GPU"), std::string::npos) << too_many.error().message;
}

TEST(Placement, AJobAcrossNodesIsPlacedByItsRanksOnThisNode) {
  ipc::Hello across = hello(2, 4, 0);  // ranks 2-3 of 4 on this node
  across.local_rank = 0;
  across.local_world_size = 2;
  EXPECT_EQ(*placeJob(across, offer(true, 0, 2)), Placement::kGpuPerRank);
  EXPECT_EQ(*placeJob(across, offer(true, 2, 1)), Placement::kSharedGpu);
  across.local_world_size = 3;
  const auto refused = placeJob(across, offer(true, 0, 2));
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message.find("has 3 ranks on this node, which has 2 GPUs"), std::string::npos)
      << refused.error().message;
}

TEST(Placement, ARankMustNameAGpuThatExists) {
  const std::vector<std::int32_t> devices(2, -1);
  for (const std::int32_t device : {-1, 2, 100}) {
    const auto refused = checkRankDevice(Placement::kSharedGpu, devices, 0, hello(0, 2, device), 2);
    ASSERT_FALSE(refused) << device;
    EXPECT_NE(refused.error().message.find("GPUs 0-1"), std::string::npos) << refused.error().message;
  }
  EXPECT_TRUE(checkRankDevice(Placement::kSharedGpu, devices, 0, hello(0, 2, 1), 2));
}

TEST(Placement, VirtualRanksMustAllBeOnTheGpuTheFirstOneNamed) {
  const std::vector<std::int32_t> devices{1, -1, -1};
  EXPECT_TRUE(checkRankDevice(Placement::kSharedGpu, devices, 0, hello(2, 3, 1), 4));
  const auto refused = checkRankDevice(Placement::kSharedGpu, devices, 0, hello(2, 3, 0), 4);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message.find("share GPU 1"), std::string::npos) << refused.error().message;
}

TEST(Placement, WithAGpuPerRankNoTwoRanksShareOne) {
  const std::vector<std::int32_t> devices{0, 3, -1};
  EXPECT_TRUE(checkRankDevice(Placement::kGpuPerRank, devices, 0, hello(2, 3, 1), 4));
  const auto refused = checkRankDevice(Placement::kGpuPerRank, devices, 0, hello(2, 3, 3), 4);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message.find("which rank 1 already has"), std::string::npos) << refused.error().message;
}

TEST(Placement, ARankAttachingAgainMustComeBackToTheGpuItsMemoryIsOn) {
  const std::vector<std::int32_t> devices{0, 1};
  EXPECT_TRUE(checkRankDevice(Placement::kGpuPerRank, devices, 0, hello(1, 2, 1), 2));  // its own GPU again
  const auto moved = checkRankDevice(Placement::kGpuPerRank, std::vector<std::int32_t>{-1, 1}, 0, hello(1, 2, 0), 2);
  ASSERT_FALSE(moved);
  EXPECT_NE(moved.error().message.find("attached on GPU 1 before"), std::string::npos) << moved.error().message;
}

// A job across nodes: this node holds ranks 2 and 3 of 4, and `devices`
// only theirs. (Found on a GPU: rank 3 was checked against the entry of
// rank 3 of the world, past the end of the two.)
TEST(Placement, RanksOfAJobAcrossNodesAreCheckedAgainstThisNodesRanks) {
  const std::vector<std::int32_t> devices{0, -1};  // rank 2 on GPU 0, rank 3 not seen
  ipc::Hello third = hello(3, 4, 1);
  third.local_world_size = 2;
  EXPECT_TRUE(checkRankDevice(Placement::kGpuPerRank, devices, 2, third, 2));
  third.device = 0;
  const auto shared = checkRankDevice(Placement::kGpuPerRank, devices, 2, third, 2);
  ASSERT_FALSE(shared);
  EXPECT_NE(shared.error().message.find("which rank 2 already has"), std::string::npos) << shared.error().message;
  const auto elsewhere = checkRankDevice(Placement::kGpuPerRank, devices, 2, hello(1, 4, 1), 2);
  ASSERT_FALSE(elsewhere);
  EXPECT_EQ(elsewhere.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(elsewhere.error().message.find("not one of its ranks on this node (2 to 3)"), std::string::npos)
      << elsewhere.error().message;
}

TEST(GpuUuid, ReadsTheRuntimesSixteenBytesInOrderAndPrintsThemAsNvidiaSmiDoes) {
  const std::array<std::uint8_t, 16> bytes{0x5f, 0x2b, 0x1c, 0x3d, 0x4e, 0x5a, 0x6b, 0x7c,
                                           0x8d, 0x9e, 0xaf, 0xb0, 0xc1, 0xd2, 0xe3, 0xf4};
  const GpuUuid uuid = GpuUuid::fromBytes(bytes);
  EXPECT_EQ(uuid, (GpuUuid{0x5f2b1c3d4e5a6b7cULL, 0x8d9eafb0c1d2e3f4ULL}));
  EXPECT_EQ(uuid.text(), "GPU-5f2b1c3d-4e5a-6b7c-8d9e-afb0c1d2e3f4");
  EXPECT_TRUE(uuid.known());
  EXPECT_FALSE(GpuUuid{}.known());
}

TEST(Placement, ARanksGpuIsFoundByItsUuidWhateverIndexTheTrainerGivesIt) {
  const GpuOffer node = offer(true, 0, 4);
  ipc::Hello sees_one_gpu = hello(0, 1, 0);  // CUDA_VISIBLE_DEVICES=2: its GPU 0 is dbufd's GPU 2
  sees_one_gpu.gpu_uuid = node.gpus[2];
  EXPECT_EQ(*daemonDevice(sees_one_gpu, node.gpus), 2);
  EXPECT_EQ(*daemonDevice(hello(0, 1, 3), node.gpus), 3) << "no UUID: the index as it is";
  ipc::Hello elsewhere = hello(1, 2, 0);
  elsewhere.gpu_uuid = GpuUuid{0x0123456789abcdefULL, 0x0011223344556677ULL};
  const auto refused = daemonDevice(elsewhere, node.gpus);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message.find("rank 1 of job 'job' is on GPU-01234567-89ab-cdef-0011-223344556677, which is "
                                         "not one of dbufd's GPUs (GPU-00000000-0000-0000-0000-000000000001, "),
            std::string::npos)
      << refused.error().message;
}

}  // namespace
}  // namespace dbuf::daemon
