#pragma once
/// \file
/// Scalar element conversions on bit patterns: fp32 <-> bf16, fp32 <-> fp16,
/// fp32 <-> fp8 e4m3 (OCP / NVIDIA E4M3FN: bias 7, no infinities, max 448,
/// NaN = S.1111.111). Plain constexpr functions on uint16_t / uint8_t so the
/// CUDA kernels can share them (DBUF_HD marks them __host__ __device__ under
/// nvcc) and produce bit-identical results to the CPU kernels.
/// Thread safety: pure functions.
///
/// Rounding: every narrowing conversion is round-to-nearest-even.
///  - floatToBf16 / floatToHalf: overflow goes to +-inf, NaN stays NaN (made
///    quiet, sign and top payload bits kept).
///  - floatToE4m3: saturating (like CUDA's __nv_cvt_float_to_fp8 with
///    __NV_SATFINITE): |x| >= 448 and +-inf give +-448 (0x7e), NaN gives
///    S.1111.111 (sign kept), values at or below 2^-10 give a signed zero.
///  - bf16ToFloat / halfToFloat / e4m3ToFloat are exact.

#include <bit>
#include <cstdint>

#if defined(__CUDACC__)
#define DBUF_HD __host__ __device__
#else
#define DBUF_HD
#endif

namespace dbuf::kernels {

DBUF_HD constexpr std::uint32_t floatBits(float f) noexcept {
  return std::bit_cast<std::uint32_t>(f);
}
DBUF_HD constexpr float bitsFloat(std::uint32_t u) noexcept {
  return std::bit_cast<float>(u);
}
DBUF_HD constexpr std::uint64_t doubleBits(double d) noexcept {
  return std::bit_cast<std::uint64_t>(d);
}
DBUF_HD constexpr double bitsDouble(std::uint64_t u) noexcept {
  return std::bit_cast<double>(u);
}

// ---- bf16 -------------------------------------------------------------------

DBUF_HD constexpr float bf16ToFloat(std::uint16_t h) noexcept {
  return bitsFloat(static_cast<std::uint32_t>(h) << 16);
}

DBUF_HD constexpr std::uint16_t floatToBf16(float f) noexcept {
  // Both results computed, one selected: keeps loops over it vectorisable.
  const std::uint32_t u = floatBits(f);
  const std::uint32_t rounded = (u + 0x7fffU + ((u >> 16) & 1U)) >> 16;
  const std::uint32_t nan = (u >> 16) | 0x0040U;  // quiet NaN, sign and top payload kept
  return static_cast<std::uint16_t>((u & 0x7fffffffU) > 0x7f800000U ? nan : rounded);
}

// ---- fp16 -------------------------------------------------------------------

/// Exact; branch-free apart from selects, so loops over it vectorise.
DBUF_HD constexpr float halfToFloat(std::uint16_t h) noexcept {
  const std::uint32_t sign = (static_cast<std::uint32_t>(h) & 0x8000U) << 16;
  const std::uint32_t exp = static_cast<std::uint32_t>(h) & 0x7c00U;
  const std::uint32_t mant = static_cast<std::uint32_t>(h) & 0x03ffU;
  const std::uint32_t normal = (((exp >> 10) + 112U) << 23) | (mant << 13);
  const std::uint32_t special = 0x7f800000U | (mant << 13);  // inf / NaN, payload kept
  // Subnormal or zero: mant * 2^-24, exact in fp32 (mant < 2^10).
  const std::uint32_t sub = floatBits(static_cast<float>(mant) * 5.9604644775390625e-8F);
  std::uint32_t out = exp == 0 ? sub : normal;
  out = exp == 0x7c00U ? special : out;
  return bitsFloat(out | sign);
}

DBUF_HD constexpr std::uint16_t floatToHalf(float f) noexcept {
  // Branch-free (selects only) so loops over it vectorise.
  const std::uint32_t u = floatBits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000U;
  const std::uint32_t a = u & 0x7fffffffU;
  // Normal range: round the fp32 bits at bit 13 (ties to even; a carry moves
  // into the exponent, past 65504 to inf), then rebias 127 -> 15.
  std::uint32_t normal = ((a + 0x0fffU + ((a >> 13) & 1U)) >> 13) - (112U << 10);
  normal = normal < 0x7c00U ? normal : 0x7c00U;
  // Below 2^-14: adding 0.5 (ulp 2^-24, the fp16 subnormal step) makes the
  // fp32 adder round to a multiple of 2^-24, ties to even; the low bits count
  // the steps (2^-14 itself comes out as the smallest normal, 0x0400).
  const std::uint32_t sub = floatBits(bitsFloat(a) + 0.5F) - 0x3f000000U;
  std::uint32_t r = a < 0x38800000U ? sub : normal;
  r = a > 0x7f800000U ? (0x7e00U | ((a >> 13) & 0x03ffU)) : r;  // quiet NaN, payload kept
  return static_cast<std::uint16_t>(sign | r);
}

// ---- fp8 e4m3 (E4M3FN) ------------------------------------------------------

inline constexpr float kE4m3Max = 448.0F;

DBUF_HD constexpr float e4m3ToFloat(std::uint8_t q) noexcept {
  const std::uint32_t sign = (static_cast<std::uint32_t>(q) & 0x80U) << 24;
  const std::uint32_t exp = (static_cast<std::uint32_t>(q) >> 3) & 0x0fU;
  const std::uint32_t mant = static_cast<std::uint32_t>(q) & 0x07U;
  const std::uint32_t normal = ((exp + 120U) << 23) | (mant << 20);
  const std::uint32_t sub = floatBits(static_cast<float>(mant) * 0.001953125F);  // mant * 2^-9, exact
  std::uint32_t out = exp != 0 ? normal : sub;
  out = (static_cast<std::uint32_t>(q) & 0x7fU) == 0x7fU ? 0x7fc00000U : out;  // NaN
  return bitsFloat(out | sign);
}

DBUF_HD constexpr std::uint8_t floatToE4m3(float f) noexcept {
  // Branch-free (selects only) so loops over it vectorise.
  const std::uint32_t u = floatBits(f);
  const std::uint32_t sign = (u >> 24) & 0x80U;
  const std::uint32_t a = u & 0x7fffffffU;
  // Normal range [2^-6, 448): round the fp32 bits at bit 20 (ties to even),
  // rebias 127 -> 7. Below 448 the result never passes 0x7e.
  const std::uint32_t normal = ((a + 0x7ffffU + ((a >> 20) & 1U)) >> 20) - (120U << 3);
  // Below 2^-6: adding 2^14 (ulp 2^-9, the e4m3 subnormal step) makes the
  // fp32 adder round to a multiple of 2^-9, ties to even; the low bits count
  // the steps (2^-6 itself comes out as the smallest normal, 0x08).
  const std::uint32_t sub = floatBits(bitsFloat(a) + 16384.0F) - 0x46800000U;
  std::uint32_t r = a < 0x3c800000U ? sub : normal;
  r = a >= 0x43e00000U ? 0x7eU : r;  // >= 448 and inf saturate
  r = a > 0x7f800000U ? 0x7fU : r;   // NaN
  return static_cast<std::uint8_t>(sign | r);
}

// ---- fp32 arithmetic shared by the CPU and CUDA kernels ------------------------

/// On the CPU these are plain IEEE operations (the kernels are compiled with
/// -ffp-contract=off, so nothing is fused into an FMA). On the GPU they are
/// the round-to-nearest intrinsics, which nvcc never contracts, plus a NaN
/// fix-up: CUDA returns one canonical NaN (0x7fffffff) from every op with a
/// NaN result, whereas x86 returns the NaN operand, quieted, or its default
/// NaN 0xffc00000 for an invalid op (inf - inf, 0 * inf). The fix-up gives
/// the x86 answer, so the two backends agree bit for bit, NaNs included.
DBUF_HD constexpr float quietNan(float a) noexcept {
  return bitsFloat(floatBits(a) | 0x00400000U);
}
/// The NaN x86 gives for `a op b` when the result is NaN.
DBUF_HD constexpr float x86Nan(float a, float b) noexcept {
  // NOLINTNEXTLINE(misc-redundant-expression): NaN tests
  return a != a ? quietNan(a) : (b != b ? quietNan(b) : bitsFloat(0xffc00000U));
}

DBUF_HD inline float mulRn(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  const float r = __fmul_rn(a, b);
  return r != r ? x86Nan(a, b) : r;
#else
  return a * b;
#endif
}
DBUF_HD inline float addRn(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  const float r = __fadd_rn(a, b);
  return r != r ? x86Nan(a, b) : r;
#else
  return a + b;
#endif
}
DBUF_HD inline float divRn(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  const float r = __fdiv_rn(a, b);
  return r != r ? x86Nan(a, b) : r;
#else
  return a / b;
#endif
}

// fp64, for fp64 gradients (reduced in fp64): the same rules, x86's fp64
// default NaN being 0xfff8000000000000.
DBUF_HD constexpr double quietNan(double a) noexcept {
  return bitsDouble(doubleBits(a) | 0x0008000000000000ULL);
}
DBUF_HD constexpr double x86Nan(double a, double b) noexcept {
  // NOLINTNEXTLINE(misc-redundant-expression): NaN tests
  return a != a ? quietNan(a) : (b != b ? quietNan(b) : bitsDouble(0xfff8000000000000ULL));
}
DBUF_HD inline double mulRn(double a, double b) noexcept {
#if defined(__CUDA_ARCH__)
  const double r = __dmul_rn(a, b);
  return r != r ? x86Nan(a, b) : r;
#else
  return a * b;
#endif
}
DBUF_HD inline double addRn(double a, double b) noexcept {
#if defined(__CUDA_ARCH__)
  const double r = __dadd_rn(a, b);
  return r != r ? x86Nan(a, b) : r;
#else
  return a + b;
#endif
}

/// acc + p, where p is a product being added (x * pre, or sum * factor).
/// When both are NaN the result is p's NaN, whichever operand order the
/// compiler picks for the add (IEEE leaves it open; spelled out so the CPU
/// and GPU kernels agree). Otherwise it is acc + p. (p's second use also
/// keeps GCC from contracting x * pre + acc into an FMA.) Acc is float, or
/// double for fp64.
template <typename Acc>
DBUF_HD inline Acc addProduct(Acc acc, Acc p) noexcept {
  const Acc sum = addRn(acc, p);
  return p != p ? p : sum;  // NOLINT(misc-redundant-expression): NaN test
}

// ---- element types ------------------------------------------------------------

/// Load / store of one element of a floating-point buffer through the type
/// it is computed in (Acc: fp32, or fp64 for fp64 elements); the kernels of
/// both backends are templates over these.
struct Fp32Element {
  using T = float;
  using Acc = float;
  DBUF_HD static float load(float v) noexcept { return v; }
  DBUF_HD static float store(float f) noexcept { return f; }
};
struct Bf16Element {
  using T = std::uint16_t;
  using Acc = float;
  DBUF_HD static float load(T v) noexcept { return bf16ToFloat(v); }
  DBUF_HD static T store(float f) noexcept { return floatToBf16(f); }
};
struct Fp16Element {
  using T = std::uint16_t;
  using Acc = float;
  DBUF_HD static float load(T v) noexcept { return halfToFloat(v); }
  DBUF_HD static T store(float f) noexcept { return floatToHalf(f); }
};
/// fp64 is computed in fp64 and only with itself: it is never cast to or
/// from the other dtypes (an fp64 group holds fp64 on both sides).
struct Fp64Element {
  using T = double;
  using Acc = double;
  DBUF_HD static double load(double v) noexcept { return v; }
  DBUF_HD static double store(double d) noexcept { return d; }
};

/// The smallest amax used for a block scale, so an all-zero block has a
/// finite, positive scale (its elements quantize to 0).
inline constexpr float kAmaxFloor = 1e-12F;

/// Block scale of fp8 quantization from the largest finite magnitude's bits:
/// amax clamped below at kAmaxFloor, divided by 448.
DBUF_HD inline float blockScaleFromAmaxBits(std::uint32_t amax_bits) noexcept {
  float a = bitsFloat(amax_bits);
  a = a < kAmaxFloor ? kAmaxFloor : a;
  return divRn(a, kE4m3Max);
}

/// |x|'s bits for finite x, 0 for infinities and NaNs: for finite floats the
/// order of |x| is the order of these bits, so amax is an integer max.
DBUF_HD constexpr std::uint32_t finiteMagnitudeBits(float x) noexcept {
  const std::uint32_t bits = floatBits(x) & 0x7fffffffU;
  return bits < 0x7f800000U ? bits : 0U;
}

}  // namespace dbuf::kernels
