// The fused ops on random data against scalar reference loops: many
// segments with odd sizes, unaligned offsets and gaps (which must stay
// untouched), every dtype pair, 1 / 2 / 4 threads with small chunks so large
// segments are split; validation errors; the FSDP property of block
// quantization.
#include "dbuf/kernels/ops.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "dbuf/kernels/convert.hpp"

namespace dbuf::kernels {
namespace {

constexpr std::array<DType, 3> kFloatTypes{DType::kF32, DType::kBF16, DType::kF16};
constexpr std::array<int, 3> kThreadCounts{1, 2, 4};

/// A typed byte buffer with values read / written as fp32 through the
/// conversions under test elsewhere.
struct Buf {
  DType dtype = DType::kF32;
  std::vector<unsigned char> bytes;

  Buf(DType t, std::int64_t n) : dtype(t), bytes(static_cast<std::size_t>(n * sizeBytes(t))) {}
  std::int64_t elements() const { return static_cast<std::int64_t>(bytes.size()) / sizeBytes(dtype); }
  ConstBuffer in() const { return {bytes.data(), dtype, elements()}; }
  MutBuffer out() { return {bytes.data(), dtype, elements()}; }

  float get(std::int64_t i) const {
    const auto k = static_cast<std::size_t>(i);
    switch (dtype) {
      case DType::kF32: {
        float f = 0;
        std::memcpy(&f, &bytes[k * 4], 4);
        return f;
      }
      case DType::kBF16:
      case DType::kF16: {
        std::uint16_t h = 0;
        std::memcpy(&h, &bytes[k * 2], 2);
        return dtype == DType::kBF16 ? bf16ToFloat(h) : halfToFloat(h);
      }
      default:
        return e4m3ToFloat(bytes[k]);
    }
  }
  void set(std::int64_t i, float f) {
    const auto k = static_cast<std::size_t>(i);
    switch (dtype) {
      case DType::kF32:
        std::memcpy(&bytes[k * 4], &f, 4);
        return;
      case DType::kBF16:
      case DType::kF16: {
        const std::uint16_t h = dtype == DType::kBF16 ? floatToBf16(f) : floatToHalf(f);
        std::memcpy(&bytes[k * 2], &h, 2);
        return;
      }
      default:
        bytes[k] = floatToE4m3(f);
    }
  }
};

/// Random values: mostly normal-range, some zeros, subnormal-ish, large and
/// (optionally) non-finite ones.
void fillRandom(Buf& b, std::mt19937_64& rng, bool specials) {
  std::normal_distribution<float> normal(0.0F, 3.0F);
  std::uniform_int_distribution<int> pick(0, 99);
  for (std::int64_t i = 0; i < b.elements(); ++i) {
    float x = normal(rng);
    const int p = pick(rng);
    if (p < 3) x = 0.0F;
    if (p == 3) x = x * 1e-6F;
    if (p == 4) x = x * 1e4F;
    if (specials && p == 5) x = std::numeric_limits<float>::infinity();
    if (specials && p == 6) x = std::numeric_limits<float>::quiet_NaN();
    b.set(i, x);
  }
}

/// `n` segments of random (often odd, sometimes 0 or large) counts, packed
/// with random gaps in src and, in shuffled order, in dst; block is set for
/// quantization and scale offsets are packed in dst order.
struct Table {
  std::vector<Segment> segs;
  std::int64_t src_len = 0;
  std::int64_t dst_len = 0;
  std::int64_t scales_len = 0;
};

Table randomTable(std::mt19937_64& rng, int n, std::int64_t block) {
  Table t;
  std::uniform_int_distribution<int> kind(0, 9);
  std::uniform_int_distribution<std::int64_t> small(0, 700);
  std::uniform_int_distribution<std::int64_t> large(10'000, 60'000);
  std::uniform_int_distribution<std::int64_t> gap(0, 9);
  std::vector<std::int64_t> counts(static_cast<std::size_t>(n));
  for (auto& c : counts) c = kind(rng) == 0 ? large(rng) : small(rng);
  for (std::size_t i = 0; i < counts.size(); ++i) {
    t.src_len += gap(rng);
    t.segs.push_back({t.src_len, 0, counts[i], block, 0});
    t.src_len += counts[i];
  }
  t.src_len += gap(rng);
  std::vector<std::size_t> order(counts.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  for (const std::size_t i : order) {
    t.dst_len += gap(rng);
    t.segs[i].dst_offset = t.dst_len;
    t.dst_len += counts[i];
    if (block > 0) {
      t.segs[i].scale_offset = t.scales_len;
      t.scales_len += (counts[i] + block - 1) / block + gap(rng);
    }
  }
  t.dst_len += gap(rng);
  return t;
}

Options opts(int threads) {
  return Options{threads, 1000};
}

void expectSameBytes(const Buf& got, const Buf& want, const char* what) {
  ASSERT_EQ(got.bytes.size(), want.bytes.size()) << what;
  for (std::size_t i = 0; i < got.bytes.size(); ++i) {
    ASSERT_EQ(got.bytes[i], want.bytes[i]) << what << ": byte " << i << " (" << toString(got.dtype) << ")";
  }
}

TEST(KernelsOps, CopyEveryDtype) {
  std::mt19937_64 rng(1);
  for (const DType t : {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3, DType::kF64}) {
    const Table tab = randomTable(rng, 150, 0);
    Buf src(t, tab.src_len);
    for (auto& b : src.bytes) b = static_cast<unsigned char>(rng());
    Buf want(t, tab.dst_len);
    for (auto& b : want.bytes) b = static_cast<unsigned char>(rng());
    const Buf init = want;
    const auto size = static_cast<std::size_t>(sizeBytes(t));
    for (const Segment& s : tab.segs) {
      std::memcpy(&want.bytes[static_cast<std::size_t>(s.dst_offset) * size],
                  &src.bytes[static_cast<std::size_t>(s.src_offset) * size], static_cast<std::size_t>(s.count) * size);
    }
    for (const int th : kThreadCounts) {
      Buf got = init;
      ASSERT_TRUE(copy(src.in(), got.out(), tab.segs, opts(th)).ok());
      expectSameBytes(got, want, "copy");
    }
  }
}

TEST(KernelsOps, CastEveryPair) {
  std::mt19937_64 rng(2);
  for (const DType from : kFloatTypes) {
    for (const DType to : kFloatTypes) {
      const Table tab = randomTable(rng, 120, 0);
      Buf src(from, tab.src_len);
      fillRandom(src, rng, true);
      Buf init(to, tab.dst_len);
      fillRandom(init, rng, false);
      Buf want = init;
      for (const Segment& s : tab.segs) {
        for (std::int64_t i = 0; i < s.count; ++i) {
          if (from == to) {
            const auto size = static_cast<std::size_t>(sizeBytes(to));
            std::memcpy(&want.bytes[static_cast<std::size_t>(s.dst_offset + i) * size],
                        &src.bytes[static_cast<std::size_t>(s.src_offset + i) * size], size);
          } else {
            want.set(s.dst_offset + i, src.get(s.src_offset + i));
          }
        }
      }
      for (const int th : kThreadCounts) {
        Buf got = init;
        ASSERT_TRUE(cast(src.in(), got.out(), tab.segs, opts(th)).ok());
        expectSameBytes(got, want, "cast");
      }
    }
  }
}

TEST(KernelsOps, CastOfOneDtypeIsACopyOfAnyDtypeAndOtherPairsStayRefused) {
  // A gather-only group (fp64, fp8, integers) all-gathers through cast with one dtype on both sides.
  std::mt19937_64 rng(7);
  for (const DType t : {DType::kF64, DType::kF8E4M3, DType::kF8E5M2, DType::kI8, DType::kU8, DType::kI32,
                        DType::kI64}) {
    const Table tab = randomTable(rng, 110, 0);
    Buf src(t, tab.src_len);
    for (auto& b : src.bytes) b = static_cast<unsigned char>(rng());
    Buf init(t, tab.dst_len);
    for (auto& b : init.bytes) b = static_cast<unsigned char>(rng());
    Buf want = init;
    ASSERT_TRUE(copy(src.in(), want.out(), tab.segs, opts(1)).ok());
    for (const int th : kThreadCounts) {
      Buf got = init;
      ASSERT_TRUE(cast(src.in(), got.out(), tab.segs, opts(th)).ok()) << toString(t);
      expectSameBytes(got, want, "cast of one dtype");
    }
  }
  const Table tab = randomTable(rng, 20, 0);
  Buf wide(DType::kF64, tab.src_len);
  Buf narrow(DType::kF32, tab.dst_len);
  const auto refused = cast(wide.in(), narrow.out(), tab.segs, opts(1));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message.find("fp64 -> fp32"), std::string::npos) << refused.error().message;
}

TEST(KernelsOps, ScaleAndZero) {
  std::mt19937_64 rng(3);
  for (const DType t : kFloatTypes) {
    const Table tab = randomTable(rng, 130, 0);
    Buf init(t, tab.dst_len);
    fillRandom(init, rng, true);
    Buf want = init;
    Buf want_zero = init;
    const float factor = 0.3F;
    for (const Segment& s : tab.segs) {
      for (std::int64_t i = 0; i < s.count; ++i) {
        want.set(s.dst_offset + i, init.get(s.dst_offset + i) * factor);
        want_zero.set(s.dst_offset + i, 0.0F);
      }
    }
    for (const int th : kThreadCounts) {
      Buf got = init;
      ASSERT_TRUE(scale(got.out(), factor, tab.segs, opts(th)).ok());
      expectSameBytes(got, want, "scale");
      Buf z = init;
      ASSERT_TRUE(zero(z.out(), tab.segs, opts(th)).ok());
      expectSameBytes(z, want_zero, "zero");
    }
  }
}

TEST(KernelsOps, Accumulate) {
  std::mt19937_64 rng(4);
  for (const DType t : kFloatTypes) {
    const Table tab = randomTable(rng, 130, 0);
    Buf src(t, tab.src_len);
    fillRandom(src, rng, true);
    Buf init(DType::kF32, tab.dst_len);
    fillRandom(init, rng, false);
    Buf want = init;
    const float alpha = 0.125F / 3.0F;
    for (const Segment& s : tab.segs) {
      for (std::int64_t i = 0; i < s.count; ++i) {
        const volatile float prod = src.get(s.src_offset + i) * alpha;  // two roundings, no FMA
        want.set(s.dst_offset + i, init.get(s.dst_offset + i) + prod);
      }
    }
    for (const int th : kThreadCounts) {
      Buf got = init;
      ASSERT_TRUE(accumulate(src.in(), got.out(), alpha, tab.segs, opts(th)).ok());
      expectSameBytes(got, want, "accumulate");
    }
  }
}

/// Scalar reference of block quantization written without the bit tricks of
/// the kernel: float comparisons on |x| of finite elements.
void refQuantize(const Buf& src, Buf& dst, Buf& scales, const Segment& s) {
  for (std::int64_t b0 = 0; b0 < s.count; b0 += s.block) {
    const std::int64_t n = std::min(s.block, s.count - b0);
    float amax = 0.0F;
    for (std::int64_t i = 0; i < n; ++i) {
      const float x = src.get(s.src_offset + b0 + i);
      if (std::isfinite(x) && std::fabs(x) > amax) amax = std::fabs(x);
    }
    const float sc = std::max(amax, kAmaxFloor) / 448.0F;
    scales.set(s.scale_offset + b0 / s.block, sc);
    for (std::int64_t i = 0; i < n; ++i) dst.set(s.dst_offset + b0 + i, src.get(s.src_offset + b0 + i) / sc);
  }
}

TEST(KernelsOps, QuantizeDequantize) {
  std::mt19937_64 rng(5);
  for (const DType t : kFloatTypes) {
    for (const std::int64_t block : {std::int64_t{1}, std::int64_t{32}, std::int64_t{128}, std::int64_t{777}}) {
      const Table tab = randomTable(rng, 100, block);
      Buf src(t, tab.src_len);
      fillRandom(src, rng, true);
      Buf q_init(DType::kF8E4M3, tab.dst_len);
      for (auto& b : q_init.bytes) b = static_cast<unsigned char>(rng());
      Buf sc_init(DType::kF32, tab.scales_len);
      fillRandom(sc_init, rng, false);
      Buf q_want = q_init;
      Buf sc_want = sc_init;
      for (const Segment& s : tab.segs) refQuantize(src, q_want, sc_want, s);
      for (const DType out : kFloatTypes) {
        Buf d_init(out, tab.src_len);
        fillRandom(d_init, rng, false);
        Buf d_want = d_init;
        for (const Segment& s : tab.segs) {
          for (std::int64_t i = 0; i < s.count; ++i) {
            d_want.set(s.src_offset + i, q_want.get(s.dst_offset + i) * sc_want.get(s.scale_offset + i / s.block));
          }
        }
        // dequantize maps dst -> src positions: swap the offsets
        std::vector<Segment> back = tab.segs;
        for (Segment& s : back) std::swap(s.src_offset, s.dst_offset);
        for (const int th : kThreadCounts) {
          Buf d = d_init;
          ASSERT_TRUE(dequantizeE4m3(q_want.in(), sc_want.in(), d.out(), back, opts(th)).ok());
          expectSameBytes(d, d_want, "dequantize");
        }
      }
      for (const int th : kThreadCounts) {
        Buf q = q_init;
        Buf sc = sc_init;
        ASSERT_TRUE(quantizeE4m3(src.in(), q.out(), sc.out(), tab.segs, opts(th)).ok());
        expectSameBytes(q, q_want, "quantize data");
        expectSameBytes(sc, sc_want, "quantize scales");
      }
    }
  }
}

TEST(KernelsOps, QuantizeSpecialBlocks) {
  // block 0: all zero; block 1: NaN and inf among normal values.
  std::vector<float> x(8, 0.0F);
  x[4] = 1.0F;
  x[5] = std::numeric_limits<float>::quiet_NaN();
  x[6] = -std::numeric_limits<float>::infinity();
  x[7] = -0.5F;
  std::vector<std::uint8_t> q(8, 0xAA);
  std::vector<float> sc(2, -1.0F);
  const Segment seg{0, 0, 8, 4, 0};
  ASSERT_TRUE(quantizeE4m3({x.data(), DType::kF32, 8}, {q.data(), DType::kF8E4M3, 8}, {sc.data(), DType::kF32, 2},
                           std::span(&seg, 1))
                  .ok());
  EXPECT_EQ(sc[0], kAmaxFloor / 448.0F);
  EXPECT_TRUE(std::isfinite(sc[0]) && sc[0] > 0.0F);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(q[static_cast<std::size_t>(i)], 0x00);
  EXPECT_EQ(sc[1], 1.0F / 448.0F);
  EXPECT_EQ(q[4], 0x7e);  // amax -> 448
  EXPECT_EQ(q[5], 0x7f);  // NaN stays NaN
  EXPECT_EQ(q[6], 0xfe);  // -inf saturates
  EXPECT_EQ(e4m3ToFloat(q[7]) * sc[1], -0.5F);
}

TEST(KernelsOps, FsdpShardsQuantizeLikeTheWholeTensor) {
  // A group of tensors; each rank owns a block-aligned slice of each one (the
  // last rank the remainder). Quantizing rank by rank into its own buffers
  // must give exactly the bytes and scales of quantizing the whole group.
  std::mt19937_64 rng(6);
  const std::int64_t block = 128;
  const std::vector<std::int64_t> sizes{4096 * 3 + 5, 128, 77, 65536 + 1000, 1, 129 * 128};
  for (const int ranks : {1, 2, 3, 4, 8}) {
    std::int64_t total = 0;
    for (const auto n : sizes) total += n;
    Buf src(DType::kF32, total);
    fillRandom(src, rng, false);
    std::vector<Segment> whole;
    std::int64_t off = 0;
    std::int64_t scale_off = 0;
    std::vector<std::vector<Segment>> per_rank(static_cast<std::size_t>(ranks));
    std::vector<std::int64_t> rank_len(static_cast<std::size_t>(ranks), 0);
    std::vector<std::int64_t> rank_scales(static_cast<std::size_t>(ranks), 0);
    // where each rank's output lands in the whole output, to compare
    std::vector<std::vector<std::pair<Segment, Segment>>> map(static_cast<std::size_t>(ranks));
    for (const auto n : sizes) {
      const std::int64_t blocks = (n + block - 1) / block;
      whole.push_back({off, off, n, block, scale_off});
      const std::int64_t per = (blocks + ranks - 1) / ranks * block;  // block-aligned shard length
      for (int r = 0; r < ranks; ++r) {
        const std::int64_t b = std::min(n, r * per);
        const std::int64_t e = std::min(n, b + per);
        const auto k = static_cast<std::size_t>(r);
        const Segment mine{off + b, rank_len[k], e - b, block, rank_scales[k]};
        per_rank[k].push_back(mine);
        map[k].push_back({mine, Segment{off + b, off + b, e - b, block, scale_off + b / block}});
        rank_len[k] += e - b;
        rank_scales[k] += (e - b + block - 1) / block;
      }
      off += n;
      scale_off += blocks;
    }
    Buf q_whole(DType::kF8E4M3, total);
    Buf s_whole(DType::kF32, scale_off);
    ASSERT_TRUE(quantizeE4m3(src.in(), q_whole.out(), s_whole.out(), whole, opts(4)).ok());
    for (int r = 0; r < ranks; ++r) {
      const auto k = static_cast<std::size_t>(r);
      Buf q(DType::kF8E4M3, rank_len[k]);
      Buf s(DType::kF32, rank_scales[k]);
      ASSERT_TRUE(quantizeE4m3(src.in(), q.out(), s.out(), per_rank[k], opts(1 + r % 3)).ok());
      for (const auto& [mine, ref] : map[k]) {
        for (std::int64_t i = 0; i < mine.count; ++i) {
          ASSERT_EQ(q.bytes[static_cast<std::size_t>(mine.dst_offset + i)],
                    q_whole.bytes[static_cast<std::size_t>(ref.dst_offset + i)]);
        }
        for (std::int64_t b = 0; b < (mine.count + block - 1) / block; ++b) {
          const float a = s.get(mine.scale_offset + b);
          const float w = s_whole.get(ref.scale_offset + b);
          ASSERT_EQ(std::memcmp(&a, &w, sizeof a), 0);
        }
      }
    }
  }
}

TEST(KernelsOps, ValidationErrors) {
  std::vector<float> a(100, 1.0F);
  std::vector<float> b(100, 0.0F);
  std::vector<std::uint8_t> q(100);
  std::vector<float> sc(10);
  const ConstBuffer src{a.data(), DType::kF32, 100};
  const MutBuffer dst{b.data(), DType::kF32, 100};
  auto bad = [&](Segment s) {
    const std::span<const Segment> t(&s, 1);
    EXPECT_FALSE(copy(src, dst, t).ok());
    EXPECT_FALSE(cast(src, {b.data(), DType::kBF16, 100}, t).ok());
    EXPECT_FALSE(accumulate(src, dst, 1.0F, t).ok());
  };
  bad({0, 0, -1, 0, 0});
  bad({-1, 0, 10, 0, 0});
  bad({0, -5, 10, 0, 0});
  bad({95, 0, 10, 0, 0});
  bad({0, 91, 10, 0, 0});
  bad({std::numeric_limits<std::int64_t>::max(), 0, 10, 0, 0});
  bad({0, 0, std::numeric_limits<std::int64_t>::max(), 0, 0});
  Segment ok_seg{0, 0, 10, 0, 0};
  const std::span<const Segment> ok(&ok_seg, 1);
  EXPECT_TRUE(copy(src, dst, ok).ok());
  EXPECT_FALSE(copy({nullptr, DType::kF32, 100}, dst, ok).ok());
  EXPECT_FALSE(zero({nullptr, DType::kF32, 100}, ok).ok());
  EXPECT_FALSE(scale({b.data(), DType::kF8E4M3, 100}, 2.0F, ok).ok());
  EXPECT_FALSE(copy(src, {b.data(), DType::kBF16, 100}, ok).ok());
  EXPECT_FALSE(cast(src, {b.data(), DType::kF8E4M3, 100}, ok).ok());
  EXPECT_FALSE(accumulate(src, {b.data(), DType::kBF16, 100}, 1.0F, ok).ok());
  EXPECT_FALSE(copy(src, {b.data(), DType::kF32, -1}, ok).ok());
  // empty tables and zero counts are fine even with null buffers
  EXPECT_TRUE(copy({nullptr, DType::kF32, 0}, {nullptr, DType::kF32, 0}, {}).ok());
  Segment empty{0, 0, 0, 0, 0};
  EXPECT_TRUE(zero({nullptr, DType::kF32, 0}, std::span<const Segment>(&empty, 1)).ok());

  const MutBuffer qb{q.data(), DType::kF8E4M3, 100};
  const MutBuffer sb{sc.data(), DType::kF32, 10};
  auto quant = [&](Segment s) { return quantizeE4m3(src, qb, sb, std::span<const Segment>(&s, 1)).ok(); };
  EXPECT_TRUE(quant({0, 0, 100, 10, 0}));
  EXPECT_FALSE(quant({0, 0, 100, 0, 0}));   // block 0
  EXPECT_FALSE(quant({0, 0, 100, -4, 0}));  // negative block
  EXPECT_FALSE(quant({0, 0, 100, 9, 0}));   // 12 scales > 10
  EXPECT_FALSE(quant({0, 0, 10, 10, 10}));  // scale offset past the end
  EXPECT_FALSE(quant({0, 0, 10, 10, -1}));  // negative scale offset
  EXPECT_FALSE(quantizeE4m3(src, qb, {nullptr, DType::kF32, 10}, std::span<const Segment>(&ok_seg, 1)).ok());
  EXPECT_FALSE(quantizeE4m3(src, dst, sb, std::span<const Segment>(&ok_seg, 1)).ok());  // dst not fp8
  const Segment dq{0, 0, 100, 0, 0};
  EXPECT_FALSE(dequantizeE4m3({q.data(), DType::kF8E4M3, 100}, {sc.data(), DType::kF32, 10}, dst,
                              std::span<const Segment>(&dq, 1))
                   .ok());
  const auto r = copy(src, dst, std::vector<Segment>{ok_seg, {0, 0, -3, 0, 0}});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("segment 1"), std::string::npos) << r.error().message;
}

TEST(KernelsOps, ThreadCountsGiveIdenticalBytesOnLargeSegments) {
  // default chunking (64Ki elements) with segments of several MiB
  std::mt19937_64 rng(7);
  const std::vector<Segment> segs{{0, 0, 1'000'003, 128, 0}, {1'000'003, 1'000'003, 777'777, 128, 7813}};
  Buf src(DType::kF32, 1'777'780);
  fillRandom(src, rng, true);
  Buf q1(DType::kF8E4M3, src.elements());
  Buf s1(DType::kF32, 20000);
  ASSERT_TRUE(quantizeE4m3(src.in(), q1.out(), s1.out(), segs, Options{1}).ok());
  Buf c1(DType::kBF16, src.elements());
  ASSERT_TRUE(cast(src.in(), c1.out(), segs, Options{1}).ok());
  for (const int th : {2, 3, 4, 8}) {
    Buf q(DType::kF8E4M3, src.elements());
    Buf s(DType::kF32, 20000);
    ASSERT_TRUE(quantizeE4m3(src.in(), q.out(), s.out(), segs, Options{th}).ok());
    expectSameBytes(q, q1, "quantize");
    expectSameBytes(s, s1, "scales");
    Buf c(DType::kBF16, src.elements());
    ASSERT_TRUE(cast(src.in(), c.out(), segs, Options{th}).ok());
    expectSameBytes(c, c1, "cast");
  }
}

}  // namespace
}  // namespace dbuf::kernels
