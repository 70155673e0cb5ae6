#pragma once
/// \file
/// The RaggedShard layout problem in its bare numeric form, and the placement
/// rules every other part of the planner builds on.
///
/// A group of `items` (tensors) is packed into one global buffer of V*S
/// elements; rank r owns [r*S, (r+1)*S). A layout is valid when
///   1. items do not overlap and lie in [0, V*S); every offset is a multiple of
///      the alignment `a` (and so is S, so every rank's chunk is aligned too);
///   2. every shard boundary b = k*S with o < b < o+n has (b - o) % g == 0,
///      i.e. no block of g elements is split across two ranks.
/// Plain value types; every function here is pure and thread-safe.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace dbuf::planner {

/// One tensor as the layout sees it: its length and its block length, both in
/// elements. `granularity` is clamped to [1, numel]: a tensor no longer than
/// its block cannot be split at all.
struct LayoutItem {
  std::int64_t numel = 0;
  std::int64_t granularity = 1;
};

struct LayoutProblem {
  std::vector<LayoutItem> items;
  std::int64_t devices = 1;      ///< V
  std::int64_t align_elems = 1;  ///< a: offsets and S are multiples of it
};

/// Offsets are indexed like `LayoutProblem::items`.
struct Layout {
  std::int64_t shard_elems = 0;  ///< S
  std::vector<std::int64_t> offsets;
};

/// Earliest offset >= `position` at which `item` may start for shard size `S`
/// (S a multiple of align). Feasibility of an offset depends only on the offset
/// itself, never on other items, which is why earliest placement is optimal
/// for a fixed order. Returns nullopt when no offset works for this S at all.
[[nodiscard]] std::optional<std::int64_t> earliestFeasibleOffset(std::int64_t position, const LayoutItem& item,
                                                                 std::int64_t shard_elems,
                                                                 std::int64_t align_elems) noexcept;

/// True if `item` can be placed somewhere in a buffer of shard size S, ignoring
/// the others. A necessary condition on S for every order.
[[nodiscard]] bool placeable(const LayoutItem& item, std::int64_t shard_elems, std::int64_t align_elems) noexcept;

/// Places items in `order` at their earliest feasible offsets for shard size S.
/// Returns the offsets (indexed by item) when everything fits in V*S, nullopt
/// otherwise. Gives up as soon as the remaining items cannot fit, so failing
/// shard sizes are cheap to reject.
[[nodiscard]] std::optional<std::vector<std::int64_t>> placeInOrder(const LayoutProblem& problem,
                                                                    std::span<const std::uint32_t> order,
                                                                    std::int64_t shard_elems);

/// Number of blocks of `item` at `offset` that some shard boundary cuts through.
[[nodiscard]] std::int64_t splitBlocks(const LayoutItem& item, std::int64_t offset, std::int64_t shard_elems) noexcept;

/// Number of distinct blocks of `item` cut by cuts at first_cut, first_cut +
/// cut_step, ... (positions relative to the item's start, inside (0, numel)).
[[nodiscard]] std::int64_t countSplitBlocks(const LayoutItem& item, std::int64_t first_cut,
                                            std::int64_t cut_step) noexcept;

/// Checks every rule of a valid layout. Returns an empty string when valid,
/// else a description of the first violation (for tests and assertions).
[[nodiscard]] std::string describeViolation(const LayoutProblem& problem, const Layout& layout);

/// Sum of items' lengths (the useful payload, N).
[[nodiscard]] std::int64_t totalNumel(const LayoutProblem& problem) noexcept;

}  // namespace dbuf::planner
