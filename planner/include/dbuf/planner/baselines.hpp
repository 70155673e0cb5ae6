#pragma once
/// \file
/// Shard sizes of the layouts other FSDP implementations would use for the
/// same unit, re-implemented as formulas so comparisons run side by side on the
/// same input. Each also counts the blocks its cuts would split.

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dbuf/planner/layout.hpp"

namespace dbuf::planner {

struct BaselineResult {
  std::int64_t shard_elems = 0;
  std::int64_t split_blocks = 0;
};

struct Baselines {
  BaselineResult fsdp2;  ///< per-parameter dim-0 sharding, dim 0 padded to ceil(d0/V)
  BaselineResult fsdp1;  ///< flat parameter, 16-byte aligned params, total padded to a multiple of V
  BaselineResult zero3;  ///< every parameter split into ceil(n/V)
  /// Megatron-FSDP: expert and non-expert parameters in separate buckets, each
  /// padded to a multiple of V x lcm(row sizes of its parameters), where a row
  /// size is prod(shape[1:]). Its shard_elems saturates at INT64_MAX when
  /// that padding does not fit in 64 bits.
  BaselineResult megatron;
};

/// True for a routed-expert parameter (a ".experts." path component, as in
/// HuggingFace MoE models; shared experts are dense). Megatron-FSDP keeps
/// expert-parallel parameters in buckets of their own.
[[nodiscard]] bool isExpertParameter(std::string_view name) noexcept;

/// `shapes[i]`, `items[i]` and `names[i]` describe the same tensor;
/// `align_elems` is the 16-byte alignment FSDP1 uses, in elements. Names only
/// matter for Megatron-FSDP's expert buckets; without them every tensor is
/// treated as dense.
[[nodiscard]] Baselines computeBaselines(std::span<const std::vector<std::int64_t>> shapes,
                                         std::span<const LayoutItem> items, std::int64_t devices,
                                         std::int64_t align_elems, std::span<const std::string> names = {});

}  // namespace dbuf::planner
