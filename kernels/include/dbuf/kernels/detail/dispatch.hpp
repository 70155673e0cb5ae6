#pragma once
/// \file
/// Run-time dtype -> compile-time element type dispatch, shared by the CPU
/// ops and the CUDA twins (host code only).

#include <cstdint>
#include <type_traits>

#include "dbuf/common/dtype.hpp"
#include "dbuf/kernels/convert.hpp"
#include "dbuf/kernels/detail/tiles.hpp"

namespace dbuf::kernels::detail {

/// Returns fn(Element{}) with Fp32Element, Bf16Element or Fp16Element; the
/// caller has checked that t is one of the three (anything else is fp32).
template <typename Fn>
decltype(auto) withFloatType(DType t, Fn&& fn) {
  switch (t) {
    case DType::kBF16:
      return fn(Bf16Element{});
    case DType::kF16:
      return fn(Fp16Element{});
    default:
      return fn(Fp32Element{});
  }
}

template <typename T>
struct Raw {
  using Type = T;
};

/// Returns fn(Raw<U>{}) with the unsigned integer type of t's size: copies and
/// zeroing move bits, whatever the elements mean.
template <typename Fn>
decltype(auto) withElementBits(DType t, Fn&& fn) {
  switch (sizeBytes(t)) {
    case 1:
      return fn(Raw<std::uint8_t>{});
    case 2:
      return fn(Raw<std::uint16_t>{});
    case 8:
      return fn(Raw<std::uint64_t>{});
    default:
      return fn(Raw<std::uint32_t>{});
  }
}

/// Returns fn(Element{}) for the dtypes computed in (withFloatType) and fp64:
/// what scale, accumulate and reduce take (checked by their checks).
template <typename Fn>
decltype(auto) withReducedType(DType t, Fn&& fn) {
  if (t == DType::kF64) return fn(Fp64Element{});
  return withFloatType(t, fn);
}

/// The element an accumulation into S's computed type writes: fp32, or fp64
/// for fp64 sources (accumulate's and reduce's accumulate destinations).
template <typename S>
using AccumulatorElement = std::conditional_t<std::is_same_v<typename S::Acc, double>, Fp64Element, Fp32Element>;

template <ReduceOut kOut>
using ReduceOutTag = std::integral_constant<ReduceOut, kOut>;

/// Returns fn(SrcElement{}, DstElement{}, ReduceOutTag<kOut>{}) for the pairs
/// reduce takes (checkReduce): a source of fp32, bf16 or fp16 stored to one
/// of them or accumulated into fp32; fp64 stored or accumulated into fp64.
/// The output is stored scaled when factor != 1.
template <typename Fn>
decltype(auto) withReduceTypes(DType src, DType dst, const ReduceOptions& reduction, Fn&& fn) {
  return withReducedType(src, [&](auto s) {
    using S = decltype(s);
    const auto stored = [&](auto d) {
      if (reduction.factor != 1.0) return fn(s, d, ReduceOutTag<ReduceOut::kScaleStore>{});
      return fn(s, d, ReduceOutTag<ReduceOut::kStore>{});
    };
    if (reduction.accumulate) return fn(s, AccumulatorElement<S>{}, ReduceOutTag<ReduceOut::kAccumulate>{});
    if constexpr (std::is_same_v<S, Fp64Element>) {
      return stored(Fp64Element{});
    } else {
      return withFloatType(dst, stored);
    }
  });
}

}  // namespace dbuf::kernels::detail
