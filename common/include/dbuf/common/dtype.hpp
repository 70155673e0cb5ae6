#pragma once
/// \file
/// Element types known to dbuf: names as they appear in model files and on the
/// wire, and their sizes. Pure value helpers, thread-safe.

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>

namespace dbuf {

enum class DType : std::uint8_t { kF32, kF16, kBF16, kF8E4M3, kF8E5M2, kF64, kI8, kU8, kI32, kI64 };

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  std::int64_t size_bytes;
};

inline constexpr std::array<DTypeInfo, 10> kDTypes{{
    {DType::kF32, "fp32", 4},
    {DType::kF16, "fp16", 2},
    {DType::kBF16, "bf16", 2},
    {DType::kF8E4M3, "fp8_e4m3", 1},
    {DType::kF8E5M2, "fp8_e5m2", 1},
    {DType::kF64, "fp64", 8},
    {DType::kI8, "int8", 1},
    {DType::kU8, "uint8", 1},
    {DType::kI32, "int32", 4},
    {DType::kI64, "int64", 8},
}};

[[nodiscard]] constexpr const DTypeInfo& info(DType dtype) noexcept {
  for (const auto& entry : kDTypes) {
    if (entry.dtype == dtype) return entry;
  }
  return kDTypes[0];  // unreachable: every enumerator is in the table
}

[[nodiscard]] constexpr std::int64_t sizeBytes(DType dtype) noexcept {
  return info(dtype).size_bytes;
}
[[nodiscard]] constexpr std::string_view toString(DType dtype) noexcept {
  return info(dtype).name;
}

/// Parses a dtype name; accepts the canonical names above plus the common
/// aliases float32 / float16 / bfloat16 / e4m3 / e5m2.
[[nodiscard]] constexpr std::optional<DType> parseDType(std::string_view name) noexcept {
  for (const auto& entry : kDTypes) {
    if (entry.name == name) return entry.dtype;
  }
  if (name == "float32" || name == "f32") return DType::kF32;
  if (name == "float16" || name == "f16") return DType::kF16;
  if (name == "bfloat16") return DType::kBF16;
  if (name == "e4m3" || name == "fp8") return DType::kF8E4M3;
  if (name == "e5m2") return DType::kF8E5M2;
  return std::nullopt;
}

/// The dtypes dbuf computes in: casts between them, scaling, fp8
/// quantization (fp32, bf16, fp16).
[[nodiscard]] constexpr bool isComputeDType(DType dtype) noexcept {
  return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16;
}

/// The dtypes whose gradients dbuf reduces: the compute dtypes, summed in
/// fp32, and fp64, summed in fp64 (and never cast: see accumulationDType).
[[nodiscard]] constexpr bool isReducedDType(DType dtype) noexcept {
  return isComputeDType(dtype) || dtype == DType::kF64;
}

/// The dtype a reduction of `grad` sums in (its scratch, partial sums and
/// accumulation target): fp64 for fp64 gradients, otherwise fp32.
[[nodiscard]] constexpr DType accumulationDType(DType grad) noexcept {
  return grad == DType::kF64 ? DType::kF64 : DType::kF32;
}

/// How a group's all-gather makes its unsharded parameters from the shards:
///  - a sharded compute dtype gathered as fp8_e4m3 is block-quantized (with
///    scales beside the parameters; gradients are bf16);
///  - a sharded compute dtype gathered as a compute dtype is cast;
///  - one dtype on both sides that dbuf does not compute in is copied as it
///    is: fp64, whose gradients are reduced in fp64; fp8 and integers
///    (frozen parameters), which have no reductions (gather-only).
[[nodiscard]] constexpr bool isQuantizedGather(DType sharded, DType unsharded) noexcept {
  return isComputeDType(sharded) && unsharded == DType::kF8E4M3;
}
[[nodiscard]] constexpr bool isGatherOnly(DType sharded, DType unsharded) noexcept {
  return sharded == unsharded && !isReducedDType(sharded);
}
/// Whether a group of these dtypes can exist (what registration checks).
[[nodiscard]] constexpr bool isGroupDTypePair(DType sharded, DType unsharded) noexcept {
  const bool computed = isComputeDType(sharded) && (isComputeDType(unsharded) || unsharded == DType::kF8E4M3);
  return computed || sharded == unsharded;
}

/// The dtype of a group's unsharded gradients: its unsharded dtype, except
/// for quantized fp8 groups, whose parameters are gathered as fp8 but whose
/// gradients are bf16. Shared by the daemon's slot layout and libdbuf's views.
[[nodiscard]] constexpr DType gradientDType(DType sharded, DType unsharded) noexcept {
  return isQuantizedGather(sharded, unsharded) ? DType::kBF16 : unsharded;
}

}  // namespace dbuf
