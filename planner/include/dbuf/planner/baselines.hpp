#pragma once
/// \file
/// Shard sizes of the layouts other FSDP implementations would use for the
/// same unit, re-implemented as formulas so comparisons run side by side on the
/// same input. Each also counts the blocks its cuts would split.

#include <cstdint>
#include <span>
#include <vector>

#include "dbuf/planner/layout.hpp"

namespace dbuf::planner {

struct BaselineResult {
  std::int64_t shard_elems = 0;
  std::int64_t split_blocks = 0;
};

struct Baselines {
  BaselineResult fsdp2;     ///< per-parameter dim-0 sharding, dim 0 padded to ceil(d0/V)
  BaselineResult fsdp1;     ///< flat parameter, 16-byte aligned params, total padded to a multiple of V
  BaselineResult zero3;     ///< every parameter split into ceil(n/V)
  BaselineResult megatron;  ///< bucket padded to a multiple of V x lcm(row sizes)
};

/// `shapes[i]` and `items[i]` describe the same tensor; `align_elems` is the
/// 16-byte alignment FSDP1 uses, in elements.
[[nodiscard]] Baselines computeBaselines(std::span<const std::vector<std::int64_t>> shapes,
                                         std::span<const LayoutItem> items, std::int64_t devices,
                                         std::int64_t align_elems);

}  // namespace dbuf::planner
