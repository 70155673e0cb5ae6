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

template <ReduceOut kOut>
using ReduceOutTag = std::integral_constant<ReduceOut, kOut>;

/// Returns fn(DstElement{}, ReduceOutTag<kOut>{}) for how reduce writes to
/// dst: accumulate into fp32, store scaled (factor != 1) or store.
template <typename Fn>
decltype(auto) withReduceOutput(DType dst, const ReduceOptions& reduction, Fn&& fn) {
  if (reduction.accumulate) return fn(Fp32Element{}, ReduceOutTag<ReduceOut::kAccumulate>{});
  return withFloatType(dst, [&](auto d) {
    if (reduction.factor != 1.0F) return fn(d, ReduceOutTag<ReduceOut::kScaleStore>{});
    return fn(d, ReduceOutTag<ReduceOut::kStore>{});
  });
}

}  // namespace dbuf::kernels::detail
