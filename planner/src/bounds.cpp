#include "dbuf/planner/bounds.hpp"

#include <algorithm>
#include <numeric>

#include "dbuf/common/int_math.hpp"

namespace dbuf::planner {
namespace {

/// Smallest S' >= S (both multiples of align) at which `item` is placeable.
/// An item is placeable at S' iff n <= S' (it fits in one shard), or S' is a
/// multiple of g (start on a shard boundary), or it can straddle exactly one
/// boundary: start at r0 = S' mod lcm(align, g) with r0 < S' and r0 + n <= 2S'.
std::int64_t nextPlaceableForItem(const LayoutItem& item, std::int64_t shard, std::int64_t align) {
  if (placeable(item, shard, align)) return shard;
  const std::int64_t period = lcm64(align, item.granularity);
  std::int64_t best = std::max(shard, roundUp(item.numel, align));  // fits in one shard
  best = std::min(best, roundUp(shard, period));                    // boundary on a block edge
  const std::int64_t period_begin = (shard / period) * period;
  if (period_begin >= period) {
    // Inside [period_begin, period_begin + period) the crossing start is
    // S' - period_begin, so r0 + n <= 2S' reads S' >= n - period_begin.
    const std::int64_t candidate = roundUp(std::max(shard, item.numel - period_begin), align);
    if (candidate < period_begin + period) best = std::min(best, candidate);
  }
  return best;
}

/// True if some size in [from, to) (multiples of align) rules `item` out.
/// Below L = lcm(align, g) an item is unplaceable exactly when S < n. Inside
/// a period [kL, (k+1)L) with k >= 1 the unplaceable sizes are those strictly
/// between kL and n - kL, a window that shrinks as k grows. So if `from` is
/// fine, the only places left to look are just after `from` (when it sits on
/// kL itself) and just after the start of the next period.
bool unplaceableSomewhere(const LayoutItem& item, std::int64_t from, std::int64_t to, std::int64_t align) {
  const std::int64_t period = lcm64(align, item.granularity);
  const std::int64_t next_period = (from / period + 1) * period;
  for (const std::int64_t probe : {from, from + align, next_period + align}) {
    if (probe < to && !placeable(item, probe, align)) return true;
  }
  return false;
}

}  // namespace

std::int64_t nextPlaceableShard(const LayoutProblem& problem, std::int64_t shard_elems) {
  std::int64_t shard = roundUp(std::max<std::int64_t>(shard_elems, 1), problem.align_elems);
  for (bool moved = true; moved;) {
    moved = false;
    for (const LayoutItem& item : problem.items) {
      const std::int64_t next = nextPlaceableForItem(item, shard, problem.align_elems);
      moved = moved || next != shard;
      shard = next;
    }
  }
  return shard;
}

LowerBound computeLowerBound(const LayoutProblem& problem) {
  std::int64_t aligned_total = 0;
  for (const LayoutItem& item : problem.items) aligned_total += roundUp(item.numel, problem.align_elems);
  LowerBound bound;
  bound.capacity_elems = roundUp(ceilDiv(aligned_total, problem.devices), problem.align_elems);
  bound.shard_elems = nextPlaceableShard(problem, bound.capacity_elems);
  for (std::uint32_t index = 0; index < problem.items.size(); ++index) {
    if (unplaceableSomewhere(problem.items[index], bound.capacity_elems, bound.shard_elems, problem.align_elems)) {
      bound.forcing_items.push_back(index);
    }
  }
  return bound;
}

std::int64_t briefLowerBound(const LayoutProblem& problem) {
  std::int64_t shard = ceilDiv(totalNumel(problem), problem.devices);
  for (const LayoutItem& item : problem.items) shard = std::max(shard, std::min(item.granularity, item.numel));
  // Tensor i forces S to a multiple of g_i while S < n_i / 2, i.e. up to
  // release_i = floor((n_i - 1) / 2). Walk the intervals between releases in
  // increasing S, each with a fixed forcing set, and take the first multiple of
  // that set's lcm that falls inside its interval.
  std::vector<std::pair<std::int64_t, std::int64_t>> releases;  // (first S not forced, g)
  for (const LayoutItem& item : problem.items) releases.emplace_back((item.numel - 1) / 2 + 1, item.granularity);
  std::sort(releases.begin(), releases.end());
  std::size_t next = 0;
  while (next < releases.size() && releases[next].first <= shard) ++next;
  for (;;) {
    std::int64_t forced = 1;
    for (std::size_t i = next; i < releases.size(); ++i) forced = std::lcm(forced, releases[i].second);
    const std::int64_t candidate = roundUp(shard, forced);
    const std::int64_t interval_end = next < releases.size() ? releases[next].first : candidate + 1;
    if (candidate < interval_end) return candidate;
    shard = interval_end;
    while (next < releases.size() && releases[next].first <= shard) ++next;
  }
}

}  // namespace dbuf::planner
