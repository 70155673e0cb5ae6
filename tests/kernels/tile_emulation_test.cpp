// The CUDA kernels' per-thread bodies (detail/tile_body.hpp) run on the host:
// each thread block is emulated by calling the body for every lane (256 per
// block, as the kernels launch), and fp8 quantization's warp, whose lane
// groups exchange their amax, by 32 real threads meeting at a barrier. Compared bit
// for bit with the CPU ops on the twin harness's calls, this checks the
// indexing, the alignment split and the 16-byte vector paths on a machine
// without a GPU; tests/gpu runs the same calls through the real kernels.
#include <gtest/gtest.h>

#include <array>
#include <barrier>
#include <limits>
#include <thread>
#include <vector>

#include "dbuf/kernels/detail/checks.hpp"
#include "dbuf/kernels/detail/dispatch.hpp"
#include "dbuf/kernels/detail/tile_body.hpp"
#include "twin_harness.hpp"

namespace dbuf::kernels {
namespace {

using detail::planTiles;
using detail::Tile;

constexpr int kThreads = 256;  // as in src/cuda_ops.cu
constexpr int kWarpSize = 32;
constexpr int kWarps = kThreads / kWarpSize;

template <typename Body>
void forEachLane(std::span<const Segment> segments, std::int64_t tile_elements, bool blocked, Body&& body) {
  for (const Tile& t : planTiles(segments, tile_elements, blocked)) {
    for (int lane = 0; lane < kThreads; ++lane) body(segments[static_cast<std::size_t>(t.segment)], t, lane);
  }
}

/// A warp's lanes as host threads; operator() is the group max as a
/// barrier-synchronised exchange, like the kernel's shuffles.
struct HostGroupMax {
  struct Shared {
    std::barrier<> barrier{kWarpSize};
    std::uint32_t values[kWarpSize] = {};
  };
  Shared& shared;
  int warp_lane;
  int lanes;
  std::uint32_t operator()(std::uint32_t v) const {
    shared.values[warp_lane] = v;
    shared.barrier.arrive_and_wait();
    std::uint32_t m = 0;
    const int first = warp_lane / lanes * lanes;
    for (int l = first; l < first + lanes; ++l) m = m > shared.values[l] ? m : shared.values[l];
    shared.barrier.arrive_and_wait();  // everyone has read before the next round writes
    return m;
  }
};

/// The emulated kernels (checks included, as the CUDA ops do them).
class EmulatedRunner final : public Runner {
 public:
  explicit EmulatedRunner(std::int64_t tile_elements) : tile(tile_elements) {}
  std::int64_t tile;

  template <typename Op>
  void elementwise(const Op& op, const void* src, void* dst, std::span<const Segment> g) const {
    forEachLane(g, tile, false, [&](const Segment& s, const Tile& t, int lane) {
      detail::elementwiseTile(op, s, t, src, dst, lane, kThreads);
    });
  }
  Result<void> copy(ConstBuffer s, MutBuffer d, std::span<const Segment> g) override {
    if (auto r = detail::checkCopy(s, d, g); !r) return r;
    detail::withElementBits(
        s.dtype, [&](auto raw) { elementwise(detail::CopyOp<typename decltype(raw)::Type>{}, s.data, d.data, g); });
    return {};
  }
  Result<void> cast(ConstBuffer s, MutBuffer d, std::span<const Segment> g) override {
    if (auto r = detail::checkCast(s, d, g); !r) return r;
    detail::withFloatType(s.dtype, [&](auto st) {
      detail::withFloatType(
          d.dtype, [&](auto dt) { elementwise(detail::CastOp<decltype(st), decltype(dt)>{}, s.data, d.data, g); });
    });
    return {};
  }
  Result<void> scale(MutBuffer d, float f, std::span<const Segment> g) override {
    if (auto r = detail::checkScale(d, g); !r) return r;
    detail::withReducedType(d.dtype, [&](auto t) { elementwise(detail::ScaleOp<decltype(t)>{f}, d.data, d.data, g); });
    return {};
  }
  Result<void> zero(MutBuffer d, std::span<const Segment> g) override {
    if (auto r = detail::checkZero(d, g); !r) return r;
    detail::withElementBits(
        d.dtype, [&](auto raw) { elementwise(detail::ZeroOp<typename decltype(raw)::Type>{}, d.data, d.data, g); });
    return {};
  }
  Result<void> accumulate(ConstBuffer s, MutBuffer d, float a, std::span<const Segment> g) override {
    if (auto r = detail::checkAccumulate(s, d, g); !r) return r;
    detail::withReducedType(s.dtype,
                            [&](auto t) { elementwise(detail::AccumulateOp<decltype(t)>{a}, s.data, d.data, g); });
    return {};
  }
  Result<void> reduce(std::span<const ConstBuffer> s, MutBuffer d, const ReduceOptions& r,
                      std::span<const Segment> g) override {
    if (auto c = detail::checkReduce(s, d, r, g); !c) return c;
    std::vector<const void*> pointers;
    for (const ConstBuffer& b : s) pointers.push_back(b.data);
    const detail::ReduceSources sources{pointers.data(), static_cast<int>(s.size()), r.pre, r.factor,
                                        detail::sourcesCongruent(s)};
    detail::withReduceTypes(s[0].dtype, d.dtype, r, [&](auto st, auto dt, auto out) {
      forEachLane(g, tile, false, [&](const Segment& seg, const Tile& t, int lane) {
        detail::reduceTile<decltype(st), decltype(dt), decltype(out)::value>(sources, seg, t, d.data, lane, kThreads);
      });
    });
    return {};
  }
  Result<void> quantizeE4m3(ConstBuffer s, MutBuffer d, MutBuffer sc, std::span<const Segment> g) override {
    if (auto r = detail::checkQuantize(s, d, sc, g); !r) return r;
    const std::vector<Tile> tiles = planTiles(g, tile, true);
    detail::withFloatType(s.dtype, [&](auto t) {
      HostGroupMax::Shared shared;
      std::vector<std::jthread> lanes;
      for (int lane = 0; lane < kWarpSize; ++lane) {
        lanes.emplace_back([&, lane] {
          // Every lane walks the same tiles and warps, so the barriers pair up.
          for (const Tile& tl : tiles) {
            const Segment& seg = g[static_cast<std::size_t>(tl.segment)];
            const int per_block = detail::lanesPerBlock(seg.block);
            const auto group = detail::LaneGroup::of(lane, per_block);
            for (int w = 0; w < kWarps; ++w) {
              detail::quantizeTile<decltype(t)>(detail::TileBlocks{seg, tl}, w, kWarps, group, s.data, d.data,
                                                static_cast<float*>(sc.data), HostGroupMax{shared, lane, per_block});
            }
          }
        });
      }
    });
    return {};
  }
  Result<void> dequantizeE4m3(ConstBuffer s, ConstBuffer sc, MutBuffer d, std::span<const Segment> g) override {
    if (auto r = detail::checkDequantize(s, sc, d, g); !r) return r;
    detail::withFloatType(d.dtype, [&](auto t) {
      forEachLane(g, tile, true, [&](const Segment& seg, const Tile& tl, int thread) {
        const auto group = detail::LaneGroup::of(thread % kWarpSize, detail::lanesPerBlock(seg.block));
        detail::dequantizeTile<decltype(t)>(detail::TileBlocks{seg, tl}, thread / kWarpSize, kWarps, group, s.data,
                                            static_cast<const float*>(sc.data), d.data);
      });
    });
    return {};
  }
};

TEST(TileEmulation, EveryOpMatchesTheCpuOpsBitForBit) {
  const std::vector<twin::OpCall> calls = twin::allCalls();
  int checked = 0;
  for (std::size_t i = 0; i < calls.size(); ++i) {
    const twin::OpCall& call = calls[i];
    const auto emulated = [](const twin::OpCall& c, twin::Buffers& b) {
      EmulatedRunner runner(c.tile);
      return twin::runOnHost(c, b, runner);
    };
    EXPECT_EQ(twin::compareWithCpu(call, emulated, static_cast<unsigned>(i)), "");
    ++checked;
  }
  EXPECT_GT(checked, 300);
}

TEST(TileEmulation, AlignedRangesTakeTheVectorPath) {
  alignas(16) float in[64] = {};
  alignas(16) std::uint16_t out[64] = {};
  // Both aligned: no head, 8-element units (16 bytes of bf16 out).
  const detail::VectorSplit<float, std::uint16_t> aligned(in, out, 64);
  EXPECT_EQ(aligned.head, 0);
  EXPECT_EQ(aligned.units, 8);
  // Output 1 element in: 7 head elements, then the input is aligned too.
  const detail::VectorSplit<float, std::uint16_t> shifted(in + 1, out + 1, 63);
  EXPECT_EQ(shifted.head, 7);
  EXPECT_EQ(shifted.units, 7);
  // Misaligned against each other: all scalar.
  const detail::VectorSplit<float, std::uint16_t> skewed(in + 1, out, 63);
  EXPECT_EQ(skewed.head, 63);
  EXPECT_EQ(skewed.units, 0);
  // Other sources not congruent: all scalar.
  const detail::VectorSplit<float, std::uint16_t> others(in, out, 64, false);
  EXPECT_EQ(others.units, 0);
}

TEST(TilePlan, TilesCoverEverySegmentOnceInWholeBlocks) {
  const std::int64_t huge = std::numeric_limits<std::int64_t>::max() / 2;
  const std::vector<Segment> segments{{0, 0, 10, 3, 0},  // blocks of 3, chunk 8: tiles of 3 blocks (9), then the rest
                                      {0, 0, 0, 5, 0},   // empty: no tile
                                      {0, 0, 20, huge, 0},  // a block far larger than anything: one tile, no overflow
                                      {0, 0, 17, 1, 0}};    // element blocks: tiles of 8
  const std::vector<Tile> tiles = planTiles(segments, 8, true);
  const std::vector<std::array<std::int64_t, 3>> want{{0, 0, 9}, {0, 9, 10}, {2, 0, 20},
                                                      {3, 0, 8}, {3, 8, 16}, {3, 16, 17}};
  ASSERT_EQ(tiles.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(tiles[i].segment, want[i][0]) << "tile " << i;
    EXPECT_EQ(tiles[i].begin, want[i][1]) << "tile " << i;
    EXPECT_EQ(tiles[i].end, want[i][2]) << "tile " << i;
  }
  const detail::TileBlocks blocks{segments[2], tiles[2]};
  EXPECT_EQ(blocks.count(), 1);  // ceil(20 / huge) without overflow
  EXPECT_EQ(blocks.size(0), 20);
}

}  // namespace
}  // namespace dbuf::kernels
