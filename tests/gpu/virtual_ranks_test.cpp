// Virtual ranks at the engine level: the daemon's collective engine
// (LocalCollective) driven through CUDA kernels over W ranks' buffers in one
// GPU's memory, against the same engine through the CPU kernels over host
// copies of the same bytes: every buffer of every rank must come out bit
// for bit equal. Covers all-gather (cast fp32 -> bf16, plain bf16, fp8
// block quantization with scales), reduce-scatter (sum, avg with pre / post
// scales, accumulate into fp32), all-reduce and broadcast, with shards
// larger than one engine step (4 Mi elements) and odd sizes. Label `gpu`.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dbuf/kernels/cuda_ops.hpp"
#include "dbuf/kernels/cuda_runner.hpp"
#include "dbuf/kernels/runner.hpp"
#include "gpu_test_support.hpp"
#include "group_layout.hpp"
#include "local_collective.hpp"

namespace dbuf::daemon {
namespace {

constexpr std::int64_t kBlock = 128;

/// A group of one tensor split evenly over `world` ranks.
GroupGeometry geometry(std::uint32_t world, std::int64_t shard, DType sharded, DType unsharded) {
  GroupGeometry g;
  g.world = world;
  g.shard_elems = shard;
  g.sharded = sharded;
  g.unsharded = unsharded;
  g.grad = gradientDType(sharded, unsharded);
  if (g.quantized()) {
    const std::int64_t blocks = (shard + kBlock - 1) / kBlock;
    g.total_blocks = blocks * world;
    for (std::uint32_t r = 0; r < world; ++r) {
      GroupGeometry::RankBlocks rank;
      rank.segments.push_back({0, r * shard, shard, kBlock, r * blocks});
      rank.first_scale = r * blocks;
      rank.scales = blocks;
      g.ranks.push_back(rank);
    }
  }
  return g;
}

/// A group as dbufd plans it: tensors of several shapes and granularity
/// rules (rows of a matrix, single elements, 2x8 blocks), packed by the
/// planner over `world` ranks, so that fp8 ranks get several segments with
/// different block lengths, cut where the plan cuts them.
GroupGeometry plannedGeometry(std::uint32_t world, const std::string& sharded, const std::string& unsharded) {
  ipc::RegisterGroup spec;
  spec.name = "layer";
  spec.sharded_dtype = sharded;
  spec.unsharded_dtype = unsharded;
  spec.granularity = "rows:1";
  spec.tensors = {{"wq", {1000, 64}, "", -1},
                  {"norm", {777}, "element", -1},
                  {"w2", {300, 130}, "", -1},
                  {"experts", {64, 96}, "block:2x8", -1}};
  auto plan = planGroup(spec, world);
  EXPECT_TRUE(plan.ok()) << plan.error().message;
  return groupGeometry(describeGroup(spec, *plan, 1));
}

/// One rank's five buffers as byte vectors (host side of the comparison).
struct HostRank {
  std::vector<std::byte> shard, shard_grad, params, grads, scales;
};

std::vector<std::byte> randomBytes(std::size_t n, std::mt19937& rng) {
  std::vector<std::byte> bytes(n);
  // Finite values only where the engine reads them as numbers: random bits
  // would make NaN-heavy sums; the kernel tests cover NaN bit patterns.
  std::uniform_real_distribution<float> value(-4.0F, 4.0F);
  for (std::size_t i = 0; i + 4 <= n; i += 4) {
    const float v = value(rng);
    std::memcpy(&bytes[i], &v, 4);
  }
  return bytes;
}

/// Bytes of each buffer, in the buffer's dtype, filled so that whatever the
/// dtype the values are finite (fp32 patterns cast down on the host side).
std::vector<HostRank> makeRanks(const GroupGeometry& g, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<HostRank> ranks(g.world);
  const auto elems = static_cast<std::size_t>(g.shard_elems);
  const auto all = elems * g.world;
  for (HostRank& r : ranks) {
    std::vector<std::byte> fp32 = randomBytes(all * 4, rng);
    const auto castTo = [&](DType t, std::size_t n) {
      std::vector<std::byte> out(n * static_cast<std::size_t>(sizeBytes(t)));
      kernels::Segment s{0, 0, static_cast<std::int64_t>(n), 0, 0};
      if (t == DType::kF8E4M3) {
        std::vector<float> scales((n + kBlock - 1) / kBlock);
        s.block = kBlock;
        EXPECT_TRUE(kernels::quantizeE4m3({fp32.data(), DType::kF32, static_cast<std::int64_t>(all)},
                                          {out.data(), t, static_cast<std::int64_t>(n)},
                                          {scales.data(), DType::kF32, static_cast<std::int64_t>(scales.size())},
                                          {&s, 1})
                        .ok());
      } else {
        EXPECT_TRUE(kernels::cast({fp32.data(), DType::kF32, static_cast<std::int64_t>(all)},
                                  {out.data(), t, static_cast<std::int64_t>(n)}, {&s, 1})
                        .ok());
      }
      return out;
    };
    r.shard = castTo(g.sharded, elems);
    r.shard_grad = castTo(g.sharded, elems);
    r.params = castTo(g.unsharded, all);
    r.grads = castTo(g.grad, all);
    r.scales = randomBytes(static_cast<std::size_t>(std::max<std::int64_t>(g.total_blocks, 1)) * 4, rng);
  }
  return ranks;
}

RankBuffers viewOf(HostRank& r) {
  return {r.shard.data(), r.shard_grad.data(), r.params.data(), r.grads.data(),
          reinterpret_cast<float*>(r.scales.data())};
}

/// Runs `args` to completion through `runner` over `buffers`.
void runEngine(const CollectiveArgs& args, const GroupGeometry& g, std::span<const RankBuffers> buffers,
               std::span<float> scratch, kernels::Runner& runner) {
  std::vector<kernels::ConstBuffer> sources(g.world);
  LocalCollective op(args, &g, buffers, sources, scratch, runner);
  for (int steps = 0; steps < 100000; ++steps) {
    auto done = op.step();
    ASSERT_TRUE(done.ok()) << done.error().message;
    if (*done) return;
  }
  FAIL() << "the collective did not finish";
}

/// Device copies of the ranks' buffers.
struct DeviceRanks {
  std::vector<void*> allocations;
  std::vector<RankBuffers> buffers;

  explicit DeviceRanks(const std::vector<HostRank>& host) {
    for (const HostRank& r : host) {
      RankBuffers b;
      b.shard = upload(r.shard);
      b.shard_grad = upload(r.shard_grad);
      b.params = upload(r.params);
      b.grads = upload(r.grads);
      b.scales = reinterpret_cast<float*>(upload(r.scales));
      buffers.push_back(b);
    }
    // A cudaMemcpy from pageable memory may return before its data has
    // landed, and the engine's stream does not wait for the legacy one.
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  ~DeviceRanks() {
    for (void* p : allocations) cudaFree(p);
  }
  DeviceRanks(const DeviceRanks&) = delete;
  DeviceRanks& operator=(const DeviceRanks&) = delete;

  std::byte* upload(const std::vector<std::byte>& bytes) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, bytes.size()), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
    allocations.push_back(p);
    return static_cast<std::byte*>(p);
  }
};

std::string firstDifference(const std::vector<std::byte>& want, const void* device, const char* what,
                            std::size_t rank) {
  std::vector<std::byte> got(want.size());
  if (cudaMemcpy(got.data(), device, got.size(), cudaMemcpyDeviceToHost) != cudaSuccess) return "download failed";
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (want[i] != got[i]) {
      return std::string("rank ") + std::to_string(rank) + " " + what + " byte " + std::to_string(i) + " differs";
    }
  }
  return {};
}

/// The host engine over `host`'s buffers (the reference side).
void runOnHost(const CollectiveArgs& args, const GroupGeometry& g, std::vector<HostRank>& host) {
  std::vector<RankBuffers> host_buffers;
  for (HostRank& r : host) host_buffers.push_back(viewOf(r));
  std::vector<float> scratch(static_cast<std::size_t>(LocalCollective::kStepElements));
  kernels::CpuRunner cpu(kernels::Options{2});
  runEngine(args, g, host_buffers, scratch, cpu);
}

void checkTwins(const CollectiveArgs& args, const GroupGeometry& g, unsigned seed) {
  std::vector<HostRank> host = makeRanks(g, seed);
  DeviceRanks device(host);  // the same starting bytes
  runOnHost(args, g, host);
  const std::vector<float> host_scratch(static_cast<std::size_t>(LocalCollective::kStepElements));

  float* device_scratch = nullptr;
  ASSERT_EQ(cudaMalloc(&device_scratch, host_scratch.size() * sizeof(float)), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  {
    kernels::cuda::CudaRunner gpu(stream);
    runEngine(args, g, device.buffers, {device_scratch, host_scratch.size()}, gpu);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  }
  for (std::size_t r = 0; r < host.size(); ++r) {
    EXPECT_EQ(firstDifference(host[r].shard, device.buffers[r].shard, "shard", r), "");
    EXPECT_EQ(firstDifference(host[r].shard_grad, device.buffers[r].shard_grad, "shard_grad", r), "");
    EXPECT_EQ(firstDifference(host[r].params, device.buffers[r].params, "params", r), "");
    EXPECT_EQ(firstDifference(host[r].grads, device.buffers[r].grads, "grads", r), "");
    EXPECT_EQ(firstDifference(host[r].scales, device.buffers[r].scales, "scales", r), "");
  }
  cudaStreamDestroy(stream);
  cudaFree(device_scratch);
}

CollectiveArgs op(ipc::OpCode code) {
  CollectiveArgs a;
  a.op = code;
  return a;
}

// Shards past one engine step, odd (and, for fp8, with a partial last block).
constexpr std::int64_t kLargeShard = LocalCollective::kStepElements + 1001;

TEST(VirtualRanks, AllGatherCastQuantizeAndCopyMatchTheHostEngine) {
  DBUF_SKIP_WITHOUT_GPU();
  for (const std::uint32_t world : {2U, 4U}) {
    SCOPED_TRACE("world " + std::to_string(world));
    checkTwins(op(ipc::OpCode::kAllGather), geometry(world, kLargeShard, DType::kF32, DType::kBF16), 1);
    checkTwins(op(ipc::OpCode::kAllGather), geometry(world, 777, DType::kBF16, DType::kBF16), 2);
    checkTwins(op(ipc::OpCode::kAllGather), geometry(world, kLargeShard, DType::kF32, DType::kF8E4M3), 3);
  }
}

TEST(VirtualRanks, ReduceScatterSumAvgAndAccumulateMatchTheHostEngine) {
  DBUF_SKIP_WITHOUT_GPU();
  for (const std::uint32_t world : {2U, 4U}) {
    SCOPED_TRACE("world " + std::to_string(world));
    checkTwins(op(ipc::OpCode::kReduceScatter), geometry(world, kLargeShard, DType::kF32, DType::kBF16), 4);
    CollectiveArgs avg = op(ipc::OpCode::kReduceScatter);
    avg.reduce = ipc::ReduceMode::kAvg;
    avg.pre_scale = 0.5F;
    avg.post_scale = 3.0F;
    checkTwins(avg, geometry(world, 4099, DType::kBF16, DType::kBF16), 5);
    CollectiveArgs accumulate = op(ipc::OpCode::kReduceScatter);
    accumulate.accumulate = true;
    checkTwins(accumulate, geometry(world, 4099, DType::kF32, DType::kF8E4M3), 6);  // bf16 grads into fp32
  }
}

TEST(VirtualRanks, AllReduceAndBroadcastMatchTheHostEngine) {
  DBUF_SKIP_WITHOUT_GPU();
  for (const std::uint32_t world : {2U, 4U}) {
    SCOPED_TRACE("world " + std::to_string(world));
    checkTwins(op(ipc::OpCode::kAllReduce), geometry(world, kLargeShard / world + 3, DType::kF32, DType::kBF16), 7);
    CollectiveArgs broadcast = op(ipc::OpCode::kBroadcast);
    broadcast.root = 1;
    checkTwins(broadcast, geometry(world, 5000, DType::kF32, DType::kF8E4M3), 8);
  }
}

TEST(VirtualRanks, PlannedGroupsOfMixedTensorsMatchTheHostEngine) {
  DBUF_SKIP_WITHOUT_GPU();
  for (const std::uint32_t world : {2U, 4U}) {
    SCOPED_TRACE("world " + std::to_string(world));
    checkTwins(op(ipc::OpCode::kAllGather), plannedGeometry(world, "fp32", "fp8_e4m3"), 9);
    checkTwins(op(ipc::OpCode::kAllGather), plannedGeometry(world, "fp32", "bf16"), 10);
    CollectiveArgs avg = op(ipc::OpCode::kReduceScatter);
    avg.reduce = ipc::ReduceMode::kAvg;
    checkTwins(avg, plannedGeometry(world, "fp32", "fp8_e4m3"), 11);  // bf16 gradients into fp32
  }
}

TEST(VirtualRanks, TheHostSideOfEveryCaseRuns) {
  // No device needed: the reference side of each case above completes, so a
  // GPU run fails only on the GPU side.
  for (const std::uint32_t world : {2U, 4U}) {
    SCOPED_TRACE("world " + std::to_string(world));
    CollectiveArgs avg = op(ipc::OpCode::kReduceScatter);
    avg.reduce = ipc::ReduceMode::kAvg;
    CollectiveArgs broadcast = op(ipc::OpCode::kBroadcast);
    broadcast.root = 1;
    const std::pair<CollectiveArgs, GroupGeometry> cases[] = {
        {op(ipc::OpCode::kAllGather), geometry(world, 777, DType::kBF16, DType::kBF16)},
        {op(ipc::OpCode::kAllGather), plannedGeometry(world, "fp32", "fp8_e4m3")},
        {avg, plannedGeometry(world, "fp32", "fp8_e4m3")},
        {op(ipc::OpCode::kAllReduce), geometry(world, 4099, DType::kF32, DType::kBF16)},
        {broadcast, geometry(world, 5000, DType::kF32, DType::kF8E4M3)}};
    for (const auto& [args, g] : cases) {
      std::vector<HostRank> host = makeRanks(g, 1);
      runOnHost(args, g, host);
    }
  }
}

TEST(VirtualRanks, PlannedGeometryHasSeveralBlockLengthsPerRank) {
  // No device needed: the fp8 case above really cuts ranks into segments of
  // different block lengths (else it would test nothing new).
  const GroupGeometry g = plannedGeometry(4, "fp32", "fp8_e4m3");
  ASSERT_TRUE(g.quantized());
  ASSERT_EQ(g.ranks.size(), 4U);
  std::set<std::int64_t> blocks;
  std::size_t segments = 0;
  for (const auto& rank : g.ranks) {
    segments += rank.segments.size();
    for (const auto& s : rank.segments) blocks.insert(s.block);
  }
  EXPECT_GE(segments, 5U);
  EXPECT_GE(blocks.size(), 3U) << "block lengths seen: " << blocks.size();
}

}  // namespace
}  // namespace dbuf::daemon
