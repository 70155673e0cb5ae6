// kernels::reduce against the unfused composition it replaces (zero an fp32
// scratch, one accumulate per source, then scale + cast or an accumulate into
// dst), byte for byte: every source / destination dtype pair, 1, 2, 3 and 8
// sources, sum / scaled / accumulate modes, random data with zeros of both
// signs, subnormals, exact binary values whose sums are rounding ties,
// overflow, inf and NaN, odd segments at unaligned offsets with gaps that
// must stay untouched, 1 to 8 threads. Also against a scalar two-rounding
// reference on data where an FMA would give other bits, and validation.
// Compiled with -ffp-contract=off (tests/kernels/CMakeLists.txt) so the
// scalar reference itself has no FMA either.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "dbuf/kernels/convert.hpp"
#include "dbuf/kernels/ops.hpp"

namespace dbuf::kernels {
namespace {

constexpr std::array<DType, 3> kFloatTypes{DType::kF32, DType::kBF16, DType::kF16};

struct Buf {
  DType dtype = DType::kF32;
  std::vector<unsigned char> bytes;

  Buf(DType t, std::int64_t n) : dtype(t), bytes(static_cast<std::size_t>(n * sizeBytes(t))) {}
  std::int64_t elements() const { return static_cast<std::int64_t>(bytes.size()) / sizeBytes(dtype); }
  ConstBuffer in() const { return {bytes.data(), dtype, elements()}; }
  MutBuffer out() { return {bytes.data(), dtype, elements()}; }

  float get(std::int64_t i) const {
    const auto k = static_cast<std::size_t>(i);
    if (dtype == DType::kF32) {
      float f = 0;
      std::memcpy(&f, &bytes[k * 4], 4);
      return f;
    }
    std::uint16_t h = 0;
    std::memcpy(&h, &bytes[k * 2], 2);
    return dtype == DType::kBF16 ? bf16ToFloat(h) : halfToFloat(h);
  }
  void set(std::int64_t i, float f) {
    const auto k = static_cast<std::size_t>(i);
    if (dtype == DType::kF32) {
      std::memcpy(&bytes[k * 4], &f, 4);
      return;
    }
    const std::uint16_t h = dtype == DType::kBF16 ? floatToBf16(f) : floatToHalf(f);
    std::memcpy(&bytes[k * 2], &h, 2);
  }
};

/// Values that stress the rounding: exact powers of two and short binary
/// fractions (their sums land on ties of bf16 / fp16 / fp32), zeros of both
/// signs, fp16 and fp32 subnormals, huge values whose sums overflow, and
/// (with specials) infinities and NaNs of both signs and several payloads.
float randomValue(std::mt19937_64& rng, bool specials) {
  std::normal_distribution<float> normal(0.0F, 3.0F);
  std::uniform_int_distribution<int> pick(0, 99);
  std::uniform_int_distribution<int> exponent(-12, 12);
  std::uniform_int_distribution<int> steps(0, 255);
  const float sign = (rng() & 1U) != 0 ? -1.0F : 1.0F;
  const int p = pick(rng);
  const float x = normal(rng);
  if (p < 3) return sign * 0.0F;
  if (p < 5) return x * 1e-6F;   // fp16 subnormal range
  if (p < 7) return x * 1e-39F;  // fp32 / bf16 subnormals
  if (p < 9) return x * 1e4F;
  if (p < 20) return sign * std::ldexp(1.0F, exponent(rng));
  if (p < 30) return sign * std::ldexp(1.0F + static_cast<float>(steps(rng)) / 256.0F, exponent(rng));
  if (p < 32) return x * 1e38F;  // sums overflow to inf (fp16: already inf)
  if (specials && p == 32) return sign * std::numeric_limits<float>::infinity();
  if (specials && p == 33) {
    const std::uint32_t payload = static_cast<std::uint32_t>(rng()) & 0x003fffffU;
    return bitsFloat(((rng() & 1U) != 0 ? 0xffc00000U : 0x7fc00000U) | payload);
  }
  return x;
}

void fill(Buf& b, std::mt19937_64& rng, bool specials) {
  for (std::int64_t i = 0; i < b.elements(); ++i) b.set(i, randomValue(rng, specials));
}

/// `n` segments of random odd counts (some 0, some past the 1000-element test
/// chunk and the 1024-element reduce block), at gapped offsets, dst in
/// shuffled order.
struct Table {
  std::vector<Segment> segs;
  std::int64_t src_len = 0;
  std::int64_t dst_len = 0;
};

Table randomTable(std::mt19937_64& rng, int n) {
  Table t;
  std::uniform_int_distribution<int> kind(0, 9);
  std::uniform_int_distribution<std::int64_t> small(0, 700);
  std::uniform_int_distribution<std::int64_t> large(1'000, 9'000);
  std::uniform_int_distribution<std::int64_t> gap(0, 9);
  std::vector<std::int64_t> counts(static_cast<std::size_t>(n));
  for (auto& c : counts) c = kind(rng) < 2 ? large(rng) : small(rng);
  for (const std::int64_t c : counts) {
    t.src_len += gap(rng);
    t.segs.push_back({t.src_len, 0, c, 0, 0});
    t.src_len += c;
  }
  t.src_len += gap(rng);
  std::vector<std::size_t> order(counts.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  for (const std::size_t i : order) {
    t.dst_len += gap(rng);
    t.segs[i].dst_offset = t.dst_len;
    t.dst_len += counts[i];
  }
  t.dst_len += gap(rng);
  return t;
}

void expectSameBytes(const Buf& got, const Buf& want, const std::string& what) {
  ASSERT_EQ(got.bytes.size(), want.bytes.size()) << what;
  const auto size = static_cast<std::size_t>(sizeBytes(got.dtype));
  for (std::size_t i = 0; i < got.bytes.size(); ++i) {
    if (got.bytes[i] == want.bytes[i]) continue;
    const auto e = static_cast<std::int64_t>(i / size);
    const auto bits = [&](const Buf& b) {
      std::uint32_t u = 0;
      std::memcpy(&u, &b.bytes[static_cast<std::size_t>(e) * size], size);
      return u;
    };
    FAIL() << what << ": element " << e << ": got " << got.get(e) << " (0x" << std::hex << bits(got) << "), want "
           << std::dec << want.get(e) << " (0x" << std::hex << bits(want) << ")";
  }
}

std::vector<ConstBuffer> inputs(const std::vector<Buf>& srcs) {
  std::vector<ConstBuffer> in;
  in.reserve(srcs.size());
  for (const Buf& b : srcs) in.push_back(b.in());
  return in;
}

/// What the daemon did before reduce(): zero an fp32 scratch (indexed like
/// dst), accumulate each source into it with alpha = pre, then
/// accumulate(scratch -> dst, factor), or scale(scratch, factor) when
/// factor != 1 and cast(scratch -> dst). One thread: the reference.
void composition(const std::vector<Buf>& srcs, Buf& dst, const ReduceOptions& how, std::span<const Segment> segs) {
  const Options one{1};
  Buf scratch(DType::kF32, dst.elements());
  const auto factor = static_cast<float>(how.factor);  // an fp32 sum takes the factor as a float
  std::vector<Segment> in_place(segs.begin(), segs.end());
  for (Segment& s : in_place) s.src_offset = s.dst_offset;
  for (auto& b : scratch.bytes) b = 0xA5;  // the zero pass must matter
  ASSERT_TRUE(zero(scratch.out(), in_place, one).ok());
  for (const Buf& src : srcs) ASSERT_TRUE(accumulate(src.in(), scratch.out(), how.pre, segs, one).ok());
  if (how.accumulate) {
    ASSERT_TRUE(accumulate(scratch.in(), dst.out(), factor, in_place, one).ok());
    return;
  }
  if (how.factor != 1.0) {
    ASSERT_TRUE(scale(scratch.out(), factor, in_place, one).ok());
  }
  ASSERT_TRUE(cast(scratch.in(), dst.out(), in_place, one).ok());
}

std::string describe(DType from, DType to, std::size_t w, const ReduceOptions& how, int threads) {
  return std::string(toString(from)) + " x" + std::to_string(w) + " -> " + std::string(toString(to)) + " pre " +
         std::to_string(how.pre) + " factor " + std::to_string(how.factor) + (how.accumulate ? " accumulate" : "") +
         ", " + std::to_string(threads) + " threads";
}

TEST(KernelsReduce, MatchesTheUnfusedCompositionBitForBit) {
  std::mt19937_64 rng(11);
  const std::vector<ReduceOptions> modes{
      {1.0F, 1.0F, false}, {0.1F, 1.0F, false},       {1.0F, 1.0F / 3.0F, false}, {0.3F, 0.125F, false},
      {1.0F, 1.0F, true},  {0.1F, 1.0F / 3.0F, true}, {3e37F, 1e-30F, false},  // products overflow
  };
  for (const DType from : kFloatTypes) {
    for (const DType to : kFloatTypes) {
      for (const std::size_t w : {1U, 2U, 3U, 8U}) {
        const Table tab = randomTable(rng, 40);
        std::vector<Buf> srcs;
        for (std::size_t r = 0; r < w; ++r) {
          srcs.emplace_back(from, tab.src_len + static_cast<std::int64_t>(r));  // lengths differ
          fill(srcs.back(), rng, true);
        }
        const std::vector<ConstBuffer> in = inputs(srcs);
        for (const ReduceOptions& how : modes) {
          if (how.accumulate && to != DType::kF32) continue;
          Buf init(to, tab.dst_len);
          fill(init, rng, how.accumulate);
          Buf want = init;
          composition(srcs, want, how, tab.segs);
          for (const int th : {1, 2, 3, 4}) {
            Buf got = init;
            ASSERT_TRUE(reduce(in, got.out(), how, tab.segs, Options{th, 1000}).ok());
            expectSameBytes(got, want, describe(from, to, w, how, th));
          }
        }
      }
    }
  }
}

TEST(KernelsReduce, TwoRoundingsPerStepNeverAnFma) {
  // fp32 sources and pre = 0.1: x * pre is inexact, so an FMA anywhere in the
  // chain (acc + x * pre, dst + acc * factor) gives other bits for many
  // elements. The reference rounds through volatiles.
  std::mt19937_64 rng(12);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  const std::int64_t n = 4099;
  const std::size_t w = 3;
  std::vector<Buf> srcs(w, Buf(DType::kF32, n));
  for (Buf& b : srcs) {
    for (std::int64_t i = 0; i < n; ++i) b.set(i, normal(rng));
  }
  Buf init(DType::kF32, n);
  for (std::int64_t i = 0; i < n; ++i) init.set(i, normal(rng));
  const float pre = 0.1F;
  const float factor = 1.0F / 3.0F;
  Buf want_store = init;
  Buf want_acc = init;
  std::int64_t fma_differs = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    volatile float acc = 0.0F;
    float fused = 0.0F;
    for (const Buf& b : srcs) {
      const volatile float prod = b.get(i) * pre;
      acc = acc + prod;
      fused = std::fma(b.get(i), pre, fused);
    }
    const volatile float scaled = acc * factor;
    want_store.set(i, scaled);
    want_acc.set(i, init.get(i) + scaled);
    const float fused_acc = std::fma(acc, factor, init.get(i));
    if (fused != acc || fused_acc != init.get(i) + scaled) ++fma_differs;
  }
  ASSERT_GT(fma_differs, n / 10) << "the data would not expose an FMA";
  const std::vector<ConstBuffer> in = inputs(srcs);
  const Segment seg{0, 0, n, 0, 0};
  for (const int th : {1, 2}) {
    Buf got = init;
    ASSERT_TRUE(reduce(in, got.out(), {pre, factor, false}, {&seg, 1}, Options{th, 1000}).ok());
    expectSameBytes(got, want_store, "scaled sum");
    Buf got_acc = init;
    ASSERT_TRUE(reduce(in, got_acc.out(), {pre, factor, true}, {&seg, 1}, Options{th, 1000}).ok());
    expectSameBytes(got_acc, want_acc, "accumulate");
  }
}

TEST(KernelsReduce, ZerosTiesAndFactorOne) {
  // -0 + -0 sums from +0 (the zeroed scratch), so it is +0.
  std::vector<float> a{-0.0F, 1.0F, 1.0F + 0x1p-7F, 1.0F, 3.0F};
  std::vector<float> b{-0.0F, 0x1p-8F, 0x1p-8F, 0x1p-8F + 0x1p-16F, -1.0F};
  std::vector<std::uint16_t> out(5, 0xAAAA);
  const std::vector<ConstBuffer> in{{a.data(), DType::kF32, 5}, {b.data(), DType::kF32, 5}};
  const Segment seg{0, 0, 5, 0, 0};
  ASSERT_TRUE(reduce(in, {out.data(), DType::kBF16, 5}, {}, {&seg, 1}).ok());
  EXPECT_EQ(out[0], 0x0000);                   // +0, not -0
  EXPECT_EQ(out[1], floatToBf16(1.0F));        // 1 + 2^-8: a tie, to even (down)
  EXPECT_EQ(out[2], 0x3f82);                   // 1 + 2^-7 + 2^-8: a tie, to even (up)
  EXPECT_EQ(out[3], floatToBf16(1.0078125F));  // just past the tie: up
  EXPECT_EQ(out[4], floatToBf16(2.0F));
  // accumulate: dst + (sum * factor), factor 1 included
  std::vector<float> d{-0.0F, 5.0F, 0.0F, 0.0F, 0.0F};
  ASSERT_TRUE(reduce(in, {d.data(), DType::kF32, 5}, {1.0F, 1.0F, true}, {&seg, 1}).ok());
  EXPECT_EQ(d[0], 0.0F);
  EXPECT_FALSE(std::signbit(d[0]));  // -0 + (+0 * 1) = +0
  EXPECT_EQ(d[1], 5.0F + 1.00390625F);
  EXPECT_EQ(d[4], 2.0F);
}

TEST(KernelsReduce, TwoNaNsGiveTheNaNOfTheLaterSource) {
  // When the running sum and the next product are both NaN, the unfused ops
  // give the product's NaN (x86, the product being the add's first operand);
  // reduce() makes that explicit. Payloads and signs differ here on purpose.
  const std::vector<float> a{bitsFloat(0x7fc00001U), bitsFloat(0xffc00002U), 1.0F, bitsFloat(0x7fc00003U)};
  const std::vector<float> b{bitsFloat(0xffc00004U), 2.0F, bitsFloat(0x7fc00005U), bitsFloat(0x7fc00006U)};
  const std::vector<float> c{3.0F, bitsFloat(0x7fc00007U), 4.0F, 5.0F};
  std::vector<Buf> srcs(3, Buf(DType::kF32, 4));
  for (std::int64_t i = 0; i < 4; ++i) {
    const auto k = static_cast<std::size_t>(i);
    srcs[0].set(i, a[k]);
    srcs[1].set(i, b[k]);
    srcs[2].set(i, c[k]);
  }
  const Segment seg{0, 0, 4, 0, 0};
  for (const ReduceOptions how : {ReduceOptions{}, ReduceOptions{1.0F, 0.5F, true}}) {
    Buf init(DType::kF32, 4);
    init.set(0, bitsFloat(0x7fc00009U));  // accumulate: dst's NaN loses to the sum's
    Buf want = init;
    composition(srcs, want, how, {&seg, 1});
    Buf got = init;
    ASSERT_TRUE(reduce(inputs(srcs), got.out(), how, {&seg, 1}).ok());
    expectSameBytes(got, want, how.accumulate ? "accumulate" : "sum");
    EXPECT_EQ(floatBits(got.get(0)), 0xffc00004U);
    EXPECT_EQ(floatBits(got.get(1)), 0x7fc00007U);
    EXPECT_EQ(floatBits(got.get(2)), 0x7fc00005U);
    EXPECT_EQ(floatBits(got.get(3)), 0x7fc00006U);
  }
}

TEST(KernelsReduce, ThreadCountsGiveIdenticalBytesOnLargeSegments) {
  // default chunking (64Ki elements) over segments of about a million
  std::mt19937_64 rng(13);
  const std::vector<Segment> segs{{0, 0, 1'000'003, 0, 0}, {1'000'003, 1'000'010, 477'777, 0, 0}};
  std::vector<Buf> srcs;
  for (int r = 0; r < 5; ++r) {
    srcs.emplace_back(DType::kBF16, 1'477'780);
    fill(srcs.back(), rng, true);
  }
  const std::vector<ConstBuffer> in = inputs(srcs);
  for (const ReduceOptions how : {ReduceOptions{0.5F, 1.0F / 5.0F, false}, ReduceOptions{1.0F, 0.2F, true}}) {
    for (const DType to : {DType::kBF16, DType::kF32}) {
      if (how.accumulate && to != DType::kF32) continue;
      Buf init(to, 1'477'787);
      fill(init, rng, false);
      Buf want = init;
      composition(srcs, want, how, segs);
      for (const int th : {1, 2, 3, 4, 8}) {
        Buf got = init;
        ASSERT_TRUE(reduce(in, got.out(), how, segs, Options{th}).ok());
        expectSameBytes(got, want, describe(DType::kBF16, to, srcs.size(), how, th));
      }
    }
  }
}

TEST(KernelsReduce, Fp64SumsInFp64WithTwoRoundingsPerStep) {
  // fp64 gradients are summed in fp64: values 1 + k * 2^-40 differ below
  // fp32's precision, so an fp32 accumulator would lose them. The reference
  // rounds each product and sum through volatiles (no FMA), sources in order.
  std::mt19937_64 rng(14);
  std::uniform_int_distribution<int> k(-1000, 1000);
  std::normal_distribution<double> normal(0.0, 1.0);
  const std::int64_t n = 70'001;  // past one 64Ki-element chunk: threads split it
  const std::size_t w = 5;
  std::vector<std::vector<double>> srcs(w, std::vector<double>(static_cast<std::size_t>(n)));
  for (auto& src : srcs) {
    for (std::size_t i = 0; i < src.size(); ++i) src[i] = i % 2 == 0 ? 1.0 + k(rng) * 0x1p-40 : normal(rng);
  }
  srcs[1][7] = bitsDouble(0x7ff8000000000011ULL);  // NaNs: the later source's wins, as for fp32
  srcs[3][7] = bitsDouble(0xfff8000000000022ULL);
  srcs[2][9] = std::numeric_limits<double>::infinity();
  std::vector<double> init(static_cast<std::size_t>(n));
  for (double& x : init) x = normal(rng);
  const float pre = 0.1F;
  const double factor = 1.0 / 5.0;  // not a float: an fp64 sum takes the factor whole
  std::vector<double> want_store(init.size());
  std::vector<double> want_acc(init.size());
  std::int64_t below_fp32 = 0;
  for (std::size_t i = 0; i < init.size(); ++i) {
    volatile double acc = 0.0;
    float acc32 = 0.0F;
    for (const auto& src : srcs) {
      const volatile double prod = src[i] * static_cast<double>(pre);
      acc = acc + prod;
      acc32 += static_cast<float>(src[i]) * pre;
    }
    if (i == 7) acc = bitsDouble(0xfff8000000000022ULL);  // x86: the product's NaN, quieted
    const volatile double scaled = acc * factor;
    want_store[i] = scaled;
    want_acc[i] = init[i] + scaled;
    if (static_cast<double>(acc32 * static_cast<float>(factor)) != scaled) ++below_fp32;
  }
  ASSERT_GT(below_fp32, n / 4) << "the data would not tell fp64 sums from fp32 ones";
  std::vector<ConstBuffer> in;
  for (const auto& src : srcs) in.push_back({src.data(), DType::kF64, n});
  const Segment seg{0, 0, n, 0, 0};
  const auto same = [](const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
    for (std::size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(doubleBits(got[i]), doubleBits(want[i])) << what << ": element " << i;
    }
  };
  for (const int th : {1, 2, 3}) {
    std::vector<double> got(init);
    ASSERT_TRUE(reduce(in, {got.data(), DType::kF64, n}, {pre, factor, false}, {&seg, 1}, Options{th}).ok());
    same(got, want_store, "scaled sum, " + std::to_string(th) + " threads");
    std::vector<double> got_acc(init);
    ASSERT_TRUE(reduce(in, {got_acc.data(), DType::kF64, n}, {pre, factor, true}, {&seg, 1}, Options{th}).ok());
    same(got_acc, want_acc, "accumulate, " + std::to_string(th) + " threads");
  }
  // fp64 is never mixed with the other dtypes, and accumulates into fp64 only
  std::vector<float> f32(static_cast<std::size_t>(n));
  const MutBuffer f32_out{f32.data(), DType::kF32, n};
  for (const bool accumulate : {false, true}) {
    const auto mixed = reduce(in, f32_out, {1.0F, 1.0F, accumulate}, {&seg, 1});
    ASSERT_FALSE(mixed.ok());
    EXPECT_NE(mixed.error().message.find("or all fp64"), std::string::npos) << mixed.error().message;
  }
  std::vector<double> out64(static_cast<std::size_t>(n));
  const std::vector<ConstBuffer> f32_in{{f32.data(), DType::kF32, n}};
  EXPECT_FALSE(reduce(f32_in, {out64.data(), DType::kF64, n}, {}, {&seg, 1}).ok());
  EXPECT_FALSE(reduce(f32_in, {out64.data(), DType::kF64, n}, {1.0F, 1.0F, true}, {&seg, 1}).ok());
}

TEST(KernelsReduce, ValidationErrorsTouchNothing) {
  std::vector<float> a(100, 1.0F);
  std::vector<float> b(100, 2.0F);
  std::vector<float> shorter(50, 3.0F);
  std::vector<float> d(100, 7.0F);
  const MutBuffer dst{d.data(), DType::kF32, 100};
  const std::vector<ConstBuffer> two{{a.data(), DType::kF32, 100}, {b.data(), DType::kF32, 100}};
  const Segment ok_seg{0, 0, 100, 0, 0};
  const std::span<const Segment> ok(&ok_seg, 1);
  auto fails = [&](std::span<const ConstBuffer> srcs, MutBuffer out, ReduceOptions how, std::span<const Segment> t,
                   const std::string& says) {
    const auto r = reduce(srcs, out, how, t);
    ASSERT_FALSE(r.ok()) << says;
    EXPECT_NE(r.error().message.find(says), std::string::npos) << r.error().message;
    EXPECT_EQ(d, std::vector<float>(100, 7.0F)) << says;
  };
  fails({}, dst, {}, ok, "1 to 4096 sources");
  const std::vector<ConstBuffer> too_many(kMaxReduceSources + 1, two[0]);
  fails(too_many, dst, {}, ok, "got 4097");
  fails(std::vector<ConstBuffer>{two[0], {b.data(), DType::kBF16, 100}}, dst, {}, ok, "source 1 has another dtype");
  fails(std::vector<ConstBuffer>{{a.data(), DType::kF8E4M3, 100}}, dst, {}, ok, "fp32, bf16 or fp16");
  fails(two, {d.data(), DType::kF8E4M3, 100}, {}, ok, "fp32, bf16 or fp16");
  fails(two, {d.data(), DType::kBF16, 100}, {1.0F, 1.0F, true}, ok, "accumulate needs an fp32");
  fails(std::vector<ConstBuffer>{two[0], {b.data(), DType::kF32, -1}}, dst, {}, ok, "source 1: negative");
  // the shortest source bounds every segment, and is named
  const std::vector<ConstBuffer> three{two[0], two[1], {shorter.data(), DType::kF32, 50}};
  fails(three, dst, {}, ok, "segment 0: source 2 [0, +100) outside the buffer of 50");
  const std::vector<Segment> tail{{0, 0, 50, 0, 0}, {45, 50, 10, 0, 0}};
  fails(three, dst, {}, tail, "segment 1: source 2");
  for (const Segment s :
       {Segment{0, 0, -1, 0, 0}, Segment{-1, 0, 10, 0, 0}, Segment{0, -5, 10, 0, 0}, Segment{95, 0, 10, 0, 0},
        Segment{0, 91, 10, 0, 0}, Segment{std::numeric_limits<std::int64_t>::max(), 0, 10, 0, 0},
        Segment{0, 0, std::numeric_limits<std::int64_t>::max(), 0, 0}}) {
    fails(two, dst, {}, {&s, 1}, "segment 0");
  }
  fails(std::vector<ConstBuffer>{two[0], {nullptr, DType::kF32, 100}}, dst, {}, ok, "source 1: null");
  fails(two, {nullptr, DType::kF32, 100}, {}, ok, "null buffer");
  // empty tables and zero counts need no buffers
  EXPECT_TRUE(reduce(std::vector<ConstBuffer>{{nullptr, DType::kF32, 0}}, {nullptr, DType::kF32, 0}, {}, {}).ok());
  const Segment empty{0, 0, 0, 0, 0};
  EXPECT_TRUE(
      reduce(std::vector<ConstBuffer>{{nullptr, DType::kF32, 0}}, {nullptr, DType::kF32, 0}, {}, {&empty, 1}).ok());
  // and a good call works, with the maximum number of sources
  const std::vector<ConstBuffer> most(kMaxReduceSources, two[0]);
  ASSERT_TRUE(reduce(most, dst, {}, ok).ok());
  EXPECT_EQ(d[0], 4096.0F);
}

}  // namespace
}  // namespace dbuf::kernels
