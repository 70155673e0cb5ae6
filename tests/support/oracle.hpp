#pragma once
/// \file
/// Exhaustive oracle for tiny RaggedShard layout problems, used only by tests.
///
/// Everything here is written from the rules of a valid layout alone (see
/// dbuf/planner/layout.hpp) and calls nothing from the planner, so that it is
/// an independent check of it:
///   - offsets and S are multiples of the alignment a;
///   - items do not overlap and lie in [0, V*S);
///   - every boundary b = k*S with o < b < o+n has (b - o) % g == 0.
/// The functions scan offsets and shard sizes one by one; keep instances tiny
/// (a few items, a few dozen elements).

#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "dbuf/planner/layout.hpp"

namespace dbuf::planner::testing {

/// Item at `offset` respects alignment and no shard boundary splits one of its
/// blocks (boundaries at every positive multiple of S; the buffer's end is not
/// checked here).
[[nodiscard]] bool offsetValid(const LayoutItem& item, std::int64_t offset, std::int64_t shard, std::int64_t align);

/// Number of distinct blocks of `item` at `offset` that a boundary k*S cuts,
/// counted by walking the boundaries.
[[nodiscard]] std::int64_t bruteSplitBlocks(const LayoutItem& item, std::int64_t offset, std::int64_t shard);

/// Smallest aligned offset >= position that is valid on its own, found by
/// scanning one full period; nullopt when no offset is valid for this S.
[[nodiscard]] std::optional<std::int64_t> bruteEarliestOffset(std::int64_t position, const LayoutItem& item,
                                                              std::int64_t shard, std::int64_t align);

/// Some aligned offset in [0, V*S) is valid on its own for any V, i.e. the
/// item could be placed in a long enough buffer of shard size S.
[[nodiscard]] bool brutePlaceable(const LayoutItem& item, std::int64_t shard, std::int64_t align);

/// Checks every rule directly; empty string when valid.
[[nodiscard]] std::string checkLayout(const LayoutProblem& problem, std::int64_t shard,
                                      std::span<const std::int64_t> offsets);

/// True if some placement with o_{order[k+1]} >= o_{order[k]} + n_{order[k]}
/// is valid at shard size S, trying every aligned offset of every item (a
/// memoised exhaustive search; it assumes nothing about earliest placement).
/// `offsets` (indexed by item) receives one such placement when given.
[[nodiscard]] bool fixedOrderFeasible(const LayoutProblem& problem, std::span<const std::uint32_t> order,
                                      std::int64_t shard, std::vector<std::int64_t>* offsets = nullptr);

/// Minimal S (a multiple of a, scanned upward from a) for which some placement
/// respecting `order` is valid.
[[nodiscard]] std::int64_t bruteForceFixedOrder(const LayoutProblem& problem, std::span<const std::uint32_t> order);

/// Earliest-placement feasibility of one order at S, with the oracle's own
/// offset scan (not the planner's). Offsets indexed by item when given.
[[nodiscard]] bool earliestPlacementFits(const LayoutProblem& problem, std::span<const std::uint32_t> order,
                                         std::int64_t shard, std::vector<std::int64_t>* offsets = nullptr);

/// Some order of the items places (earliest placement) within V*S. Enumerates
/// every permutation, sharing prefixes and abandoning a prefix that already
/// fails.
[[nodiscard]] bool anyOrderFits(const LayoutProblem& problem, std::int64_t shard,
                                std::vector<std::int64_t>* offsets = nullptr);

struct OracleResult {
  std::int64_t shard_elems = 0;
  std::vector<std::int64_t> offsets;  ///< one optimal layout, indexed by item
};

/// Minimal S over all orders and all S (multiples of a). Up to ~7 items.
[[nodiscard]] OracleResult oracleSolve(const LayoutProblem& problem);
[[nodiscard]] std::int64_t oracleShard(const LayoutProblem& problem);

struct GeneratorOptions {
  int min_items = 1;
  int max_items = 4;
  std::int64_t max_total = 40;  ///< cap on the sum of numel
  std::int64_t max_devices = 6;
  std::vector<std::int64_t> aligns{1, 2, 4};
  /// Percentage of items made unsplittable (g = n), on top of the mix below;
  /// high values give bin-packing-like instances where the order matters most.
  int whole_percent = 0;
};

/// Random small instances: sizes in [1, max_total], granularities that divide
/// numel, that do not, equal to it, or 1; V in [1, max_devices]; a from
/// `aligns`. Deterministic for a given engine state.
[[nodiscard]] LayoutProblem randomProblem(std::mt19937_64& rng, const GeneratorOptions& options = {});

/// A random item (granularity already clamped to [1, numel]).
[[nodiscard]] LayoutItem randomItem(std::mt19937_64& rng, std::int64_t max_numel);

/// Uniform integer in [lo, hi].
[[nodiscard]] std::int64_t uniform(std::mt19937_64& rng, std::int64_t lo, std::int64_t hi);

/// Human-readable instance, for failure messages.
[[nodiscard]] std::string describe(const LayoutProblem& problem);
[[nodiscard]] std::string describe(std::span<const std::int64_t> values);

}  // namespace dbuf::planner::testing
