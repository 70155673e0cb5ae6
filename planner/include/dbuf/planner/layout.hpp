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

/// An item's block period: cuts fall on multiples of it from the item's start
/// (offsets and S are multiples of the alignment), lcm(align, granularity);
/// the length itself where that is not shorter (no cut falls inside).
[[nodiscard]] std::int64_t blockPeriod(const LayoutItem& item, std::int64_t align_elems) noexcept;

/// Division by a fixed positive divisor without the hardware divide (whose
/// latency dominated the searches, which place millions of items per shard
/// size): a quotient estimated in double precision, then corrected, exact
/// for dividends in [0, 2^50); larger ones divide the ordinary way.
class Divisor {
 public:
  explicit Divisor(std::int64_t divisor) noexcept
      : divisor_(divisor), reciprocal_(1.0 / static_cast<double>(divisor)) {}

  [[nodiscard]] std::int64_t value() const noexcept { return divisor_; }

  /// floor(x / divisor) for x >= 0.
  [[nodiscard]] std::int64_t quotient(std::int64_t x) const noexcept {
    if (x >= kExactBelow) return x / divisor_;
    auto q = static_cast<std::int64_t>(static_cast<double>(x) * reciprocal_);
    std::int64_t r = x - q * divisor_;
    while (r < 0) {
      --q;
      r += divisor_;
    }
    while (r >= divisor_) {
      ++q;
      r -= divisor_;
    }
    return q;
  }
  /// x mod divisor for x >= 0.
  [[nodiscard]] std::int64_t remainder(std::int64_t x) const noexcept { return x - quotient(x) * divisor_; }

 private:
  static constexpr std::int64_t kExactBelow = std::int64_t{1} << 50;
  std::int64_t divisor_;
  double reciprocal_;
};

/// The placement rule of earliestFeasibleOffset for one shard size and
/// alignment, for callers that place many items at one size: S's and the
/// alignment's divisions are prepared once, items come with their block
/// period (blockPeriod). earliestFeasibleOffset is this, so both always agree.
class ShardPlacer {
 public:
  ShardPlacer(std::int64_t shard_elems, std::int64_t align_elems) noexcept : shard_(shard_elems), align_(align_elems) {}

  /// No offset works (what the raw functions return instead of nullopt).
  static constexpr std::int64_t kNowhere = -1;

  /// Earliest offset >= `position` (>= 0) for `item`; nullopt when no offset
  /// works at this S. Its period is computed only if it must cross a boundary.
  [[nodiscard]] std::optional<std::int64_t> earliestOffset(std::int64_t position,
                                                           const LayoutItem& item) const noexcept {
    const std::int64_t offset =
        earliestOffsetWith(position, item.numel, [&] { return Divisor(blockPeriod(item, align_.value())); });
    if (offset == kNowhere) return std::nullopt;
    return offset;
  }
  /// The same for an item of `numel` elements and block period `period`
  /// (blockPeriod, its division prepared), kNowhere for nullopt: the
  /// searches' inner loops.
  [[nodiscard]] std::int64_t earliestOffsetOrNowhere(std::int64_t position, std::int64_t numel,
                                                     const Divisor& period) const noexcept {
    return earliestOffsetWith(position, numel, [&period]() -> const Divisor& { return period; });
  }

  /// Where in one shard [0, S) an item may start, at or after `start` (a
  /// multiple of the alignment, below S), or kNowhere if nowhere in it.
  /// Starting at r, the item crosses the boundary at S when r + n > S; it
  /// must then start at r = S (mod g) so that the boundary falls on a block
  /// edge, and if it reaches past 2S as well, S itself must be a multiple of
  /// g. `period_of()`: the item's block period, as a Divisor.
  template <typename PeriodOf>
  [[nodiscard]] std::int64_t startInShard(std::int64_t start, std::int64_t numel, PeriodOf period_of) const noexcept {
    const std::int64_t shard = shard_.value();
    if (start + numel <= shard) return start;  // fits without crossing
    // Offsets are multiples of align and must be = S (mod g); S = 0 (mod
    // align) so both congruences merge into r = S (mod lcm(align, g)).
    const Divisor& period = period_of();
    const std::int64_t crossing_start = start + period.remainder(shard - start);
    if (crossing_start >= shard) return kNowhere;
    // S is a multiple of align: of g exactly when of the period.
    const bool crosses_twice = crossing_start + numel > 2 * shard;
    if (crosses_twice && period.remainder(shard) != 0) return kNowhere;
    return crossing_start;
  }

 private:
  template <typename PeriodOf>
  [[nodiscard]] std::int64_t earliestOffsetWith(std::int64_t position, std::int64_t numel,
                                                PeriodOf period_of) const noexcept {
    const std::int64_t shard = shard_.value();
    std::int64_t shard_begin = shard_.quotient(position) * shard;
    std::int64_t start = roundUpToAlign(position - shard_begin);
    if (start >= shard) {
      shard_begin += shard;
      start = 0;
    }
    if (const std::int64_t in_shard = startInShard(start, numel, period_of); in_shard != kNowhere) {
      return shard_begin + in_shard;
    }
    // Every later shard looks like a fresh one starting at 0, so one more try
    // settles it.
    if (start == 0) return kNowhere;
    if (const std::int64_t in_next = startInShard(0, numel, period_of); in_next != kNowhere) {
      return shard_begin + shard + in_next;
    }
    return kNowhere;
  }

  [[nodiscard]] std::int64_t roundUpToAlign(std::int64_t x) const noexcept {
    const std::int64_t align = align_.value();
    if ((align & (align - 1)) == 0) return (x + align - 1) & ~(align - 1);
    return align_.quotient(x + align - 1) * align;
  }

  Divisor shard_;
  Divisor align_;
};

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
