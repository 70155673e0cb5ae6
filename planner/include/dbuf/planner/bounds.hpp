#pragma once
/// \file
/// Proven lower bound on the shard size S of any valid layout, and the
/// enumeration of shard sizes that pass every per-tensor necessary condition.

#include <cstdint>
#include <vector>

#include "dbuf/planner/layout.hpp"

namespace dbuf::planner {

struct LowerBound {
  /// ceil(sum of aligned lengths / V) rounded up to the alignment: what the
  /// bytes alone demand.
  std::int64_t capacity_elems = 0;
  /// Smallest S >= capacity_elems at which every item is placeable on its own
  /// (see `placeable`). This contains the design brief's bound (S >= min(g, n)
  /// for every tensor; S a multiple of g for every tensor longer than 2S) and is
  /// at least as tight.
  std::int64_t shard_elems = 0;
  /// Every item that, on its own, rules out some size in [capacity, shard):
  /// the tensors that lift the bound above what the bytes demand.
  std::vector<std::uint32_t> forcing_items;
};

[[nodiscard]] LowerBound computeLowerBound(const LayoutProblem& problem);

/// The design brief's bound, for comparison: the smallest S >= max(ceil(N/V),
/// max_i min(g_i, n_i)) that is a multiple of g_i for every tensor with
/// n_i > 2S. Ignores alignment; never above `computeLowerBound`.
[[nodiscard]] std::int64_t briefLowerBound(const LayoutProblem& problem);

/// Smallest S' >= S (S a multiple of the alignment) at which every item is
/// placeable. Jumps straight over sizes some item rules out; each item's next
/// placeable size is computed exactly, so nothing feasible is skipped.
[[nodiscard]] std::int64_t nextPlaceableShard(const LayoutProblem& problem, std::int64_t shard_elems);

}  // namespace dbuf::planner
