// Scalar conversions against an independent slow reference: decoding from
// the format's fields with ldexp in long double, encoding by searching the
// sorted table of every finite code for the nearest value (ties to the even
// code). Decoders are checked exhaustively; encoders on every midpoint between
// adjacent codes (and its neighbours), specials and millions of random fp32.
#include "dbuf/kernels/convert.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

namespace dbuf::kernels {
namespace {

struct Format {
  const char* name;
  int exp_bits;
  int mant_bits;
  int bias;
  bool has_inf;            // IEEE-like: all-ones exponent is inf / NaN
  std::uint32_t max_code;  // largest positive finite code
};

constexpr Format kBf16{"bf16", 8, 7, 127, true, 0x7f7f};
constexpr Format kHalf{"fp16", 5, 10, 15, true, 0x7bff};
constexpr Format kE4m3{"e4m3", 4, 3, 7, false, 0x7e};

/// Value of a code from its fields; NaN for NaN codes.
long double refDecode(const Format& f, std::uint32_t code) {
  const std::uint32_t sign = code >> (f.exp_bits + f.mant_bits);
  const std::uint32_t exp = (code >> f.mant_bits) & ((1U << f.exp_bits) - 1U);
  const std::uint32_t mant = code & ((1U << f.mant_bits) - 1U);
  const std::uint32_t exp_max = (1U << f.exp_bits) - 1U;
  long double v = 0;
  if (f.has_inf && exp == exp_max) {
    v = mant == 0 ? std::numeric_limits<long double>::infinity() : std::numeric_limits<long double>::quiet_NaN();
  } else if (!f.has_inf && exp == exp_max && mant == (1U << f.mant_bits) - 1U) {
    v = std::numeric_limits<long double>::quiet_NaN();
  } else if (exp == 0) {
    v = std::ldexp(static_cast<long double>(mant), 1 - f.bias - f.mant_bits);
  } else {
    v = std::ldexp(static_cast<long double>(mant + (1U << f.mant_bits)), static_cast<int>(exp) - f.bias - f.mant_bits);
  }
  return sign != 0 ? -v : v;
}

/// Encoder reference: nearest finite code, ties to even; beyond max + ulp/2
/// (the tie going to the odd max code's even successor) -> inf, or 448 when
/// the format saturates (e4m3 here).
class RefEncoder {
 public:
  explicit RefEncoder(const Format& f) : f_(f) {
    for (std::uint32_t c = 0; c <= f.max_code; ++c) values_.push_back(refDecode(f, c));
    const long double ulp = values_[f.max_code] - values_[f.max_code - 1];
    values_.push_back(values_[f.max_code] + ulp);  // virtual successor of max
  }
  std::uint32_t encode(float x) const {
    const std::uint32_t sign_bit = 1U << (f_.exp_bits + f_.mant_bits);
    const std::uint32_t sign = std::signbit(x) ? sign_bit : 0U;
    const long double a = std::fabs(static_cast<long double>(x));
    auto it = std::upper_bound(values_.begin(), values_.end(), a);
    std::size_t lo = static_cast<std::size_t>(it - values_.begin()) - 1;
    std::uint32_t code = 0;
    if (lo >= f_.max_code + 1U) {
      code = f_.max_code + 1U;  // at or past the virtual successor
    } else {
      const long double dl = a - values_[lo];
      const long double dh = values_[lo + 1] - a;
      code = static_cast<std::uint32_t>(dl < dh ? lo : dh < dl ? lo + 1 : (lo % 2 == 0 ? lo : lo + 1));
    }
    if (code > f_.max_code) code = f_.has_inf ? (((1U << f_.exp_bits) - 1U) << f_.mant_bits) : f_.max_code;
    return sign | code;
  }
  const std::vector<long double>& values() const { return values_; }

 private:
  Format f_;
  std::vector<long double> values_;
};

float fromBits(std::uint32_t u) {
  return std::bit_cast<float>(u);
}

TEST(KernelsConvert, Bf16ToFloatExhaustive) {
  for (std::uint32_t h = 0; h < 0x10000U; ++h) {
    const float got = bf16ToFloat(static_cast<std::uint16_t>(h));
    const long double want = refDecode(kBf16, h);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << h;
      ASSERT_EQ(std::signbit(got), (h & 0x8000U) != 0) << h;
    } else {
      ASSERT_EQ(static_cast<long double>(got), want) << h;
      ASSERT_EQ(std::signbit(got), (h & 0x8000U) != 0) << h;
    }
  }
}

TEST(KernelsConvert, HalfToFloatExhaustive) {
  for (std::uint32_t h = 0; h < 0x10000U; ++h) {
    const float got = halfToFloat(static_cast<std::uint16_t>(h));
    const long double want = refDecode(kHalf, h);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << h;
      // payload kept: fp16 mantissa in the top fp32 mantissa bits
      ASSERT_EQ(std::bit_cast<std::uint32_t>(got), ((h & 0x8000U) << 16) | 0x7f800000U | ((h & 0x3ffU) << 13)) << h;
    } else {
      ASSERT_EQ(static_cast<long double>(got), want) << h;
      ASSERT_EQ(std::signbit(got), (h & 0x8000U) != 0) << h;
    }
  }
}

TEST(KernelsConvert, E4m3ToFloatAllCodes) {
  int nans = 0;
  for (std::uint32_t q = 0; q < 256; ++q) {
    const float got = e4m3ToFloat(static_cast<std::uint8_t>(q));
    const long double want = refDecode(kE4m3, q);
    if (std::isnan(want)) {
      ++nans;
      ASSERT_TRUE(std::isnan(got)) << q;
    } else {
      ASSERT_EQ(static_cast<long double>(got), want) << q;
      ASSERT_EQ(std::signbit(got), (q & 0x80U) != 0) << q;
    }
  }
  EXPECT_EQ(nans, 2);  // 0x7f and 0xff only
  EXPECT_EQ(e4m3ToFloat(0x7e), 448.0F);
  EXPECT_EQ(e4m3ToFloat(0x01), std::ldexp(1.0F, -9));
  EXPECT_EQ(e4m3ToFloat(0x08), std::ldexp(1.0F, -6));
}

/// Inputs for an encoder: each midpoint between adjacent codes and its fp32
/// neighbours, both signs; specials; random bit patterns (NaN, inf,
/// subnormals included) and random values in and around the format's range.
std::vector<float> encoderInputs(const RefEncoder& ref, int extra_exp) {
  std::vector<float> xs;
  const auto& v = ref.values();
  for (std::size_t i = 0; i + 1 < v.size(); ++i) {
    for (const long double p : {v[i], (v[i] + v[i + 1]) / 2}) {
      const auto f = static_cast<float>(p);
      EXPECT_EQ(static_cast<long double>(f), p);  // midpoints are exact in fp32
      for (const float g : {f, std::nextafter(f, 0.0F), std::nextafter(f, std::numeric_limits<float>::infinity())}) {
        xs.push_back(g);
        xs.push_back(-g);
      }
    }
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (const float s :
       {0.0F, -0.0F, inf, -inf, std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
        fromBits(0x7f800001U), fromBits(0xffbfffffU), std::numeric_limits<float>::max(),
        std::numeric_limits<float>::min(), std::numeric_limits<float>::denorm_min(), 448.0F, 464.0F, -464.0F, 480.0F,
        65504.0F, 65520.0F, 65519.996F}) {
    xs.push_back(s);
  }
  std::mt19937_64 rng(42);
  for (int i = 0; i < 2'000'000; ++i) xs.push_back(fromBits(static_cast<std::uint32_t>(rng())));
  std::uniform_real_distribution<float> mant(1.0F, 2.0F);
  std::uniform_int_distribution<int> ex(-extra_exp, extra_exp);
  for (int i = 0; i < 2'000'000; ++i) {
    const float x = std::ldexp(mant(rng), ex(rng));
    xs.push_back((rng() & 1U) != 0 ? -x : x);
  }
  return xs;
}

template <typename Enc>
void checkEncoder(const Format& f, Enc enc, bool saturating, int extra_exp) {
  const RefEncoder ref(f);
  const std::uint32_t nan_exp = ((1U << f.exp_bits) - 1U) << f.mant_bits;
  std::size_t checked = 0;
  for (const float x : encoderInputs(ref, extra_exp)) {
    const std::uint32_t got = enc(x);
    if (std::isnan(x)) {
      const std::uint32_t sign_bit = 1U << (f.exp_bits + f.mant_bits);
      if (saturating) {
        ASSERT_EQ(got & ~sign_bit, 0x7fU) << f.name;
      } else {
        ASSERT_EQ(got & nan_exp, nan_exp) << f.name;
        ASSERT_NE(got & (1U << (f.mant_bits - 1)), 0U) << f.name << ": NaN not quiet";
      }
      ASSERT_EQ((got & sign_bit) != 0, std::signbit(x)) << f.name;
      continue;
    }
    ASSERT_EQ(got, ref.encode(x)) << f.name << " x=" << x << " bits=0x" << std::hex << std::bit_cast<std::uint32_t>(x);
    ++checked;
  }
  EXPECT_GT(checked, 3'900'000U);
}

TEST(KernelsConvert, FloatToBf16) {
  checkEncoder(
      kBf16, [](float x) { return std::uint32_t{floatToBf16(x)}; }, false, 130);
}

TEST(KernelsConvert, FloatToHalf) {
  checkEncoder(
      kHalf, [](float x) { return std::uint32_t{floatToHalf(x)}; }, false, 26);
}

TEST(KernelsConvert, FloatToE4m3Saturating) {
  checkEncoder(
      kE4m3, [](float x) { return std::uint32_t{floatToE4m3(x)}; }, true, 12);
  EXPECT_EQ(floatToE4m3(448.0F), 0x7e);
  EXPECT_EQ(floatToE4m3(463.99F), 0x7e);
  EXPECT_EQ(floatToE4m3(464.0F), 0x7e);
  EXPECT_EQ(floatToE4m3(1e30F), 0x7e);
  EXPECT_EQ(floatToE4m3(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(floatToE4m3(std::ldexp(1.0F, -10)), 0x00);                        // tie to even zero
  EXPECT_EQ(floatToE4m3(std::nextafter(std::ldexp(1.0F, -10), 1.0F)), 0x01);  // just above: min subnormal
  EXPECT_EQ(floatToE4m3(-0.0F), 0x80);
}

TEST(KernelsConvert, RoundTripsAreIdentity) {
  for (std::uint32_t h = 0; h < 0x10000U; ++h) {
    const auto c = static_cast<std::uint16_t>(h);
    if (!std::isnan(bf16ToFloat(c))) {
      ASSERT_EQ(floatToBf16(bf16ToFloat(c)), c);
    }
    if (!std::isnan(halfToFloat(c))) {
      ASSERT_EQ(floatToHalf(halfToFloat(c)), c);
    }
  }
  for (std::uint32_t q = 0; q < 256; ++q) {
    const auto c = static_cast<std::uint8_t>(q);
    ASSERT_EQ(floatToE4m3(e4m3ToFloat(c)), c);  // NaN codes map back to themselves too
  }
}

static_assert(floatToBf16(1.0F) == 0x3f80);
static_assert(floatToHalf(1.0F) == 0x3c00);
static_assert(floatToE4m3(1.0F) == 0x38);
static_assert(e4m3ToFloat(0x7e) == 448.0F);

}  // namespace
}  // namespace dbuf::kernels
