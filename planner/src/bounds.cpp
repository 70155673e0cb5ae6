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

}  // namespace

std::int64_t nextPlaceableShard(const LayoutProblem& problem, std::int64_t shard_elems,
                                std::vector<std::uint32_t>* blockers) {
  std::int64_t shard = roundUp(std::max<std::int64_t>(shard_elems, 1), problem.align_elems);
  for (bool moved = true; moved;) {
    moved = false;
    for (std::uint32_t index = 0; index < problem.items.size(); ++index) {
      const std::int64_t next = nextPlaceableForItem(problem.items[index], shard, problem.align_elems);
      if (next == shard) continue;
      shard = next;
      moved = true;
      if (blockers && std::find(blockers->begin(), blockers->end(), index) == blockers->end()) {
        blockers->push_back(index);
      }
    }
  }
  return shard;
}

LowerBound computeLowerBound(const LayoutProblem& problem) {
  std::int64_t aligned_total = 0;
  for (const LayoutItem& item : problem.items) aligned_total += roundUp(item.numel, problem.align_elems);
  LowerBound bound;
  bound.capacity_elems = roundUp(ceilDiv(aligned_total, problem.devices), problem.align_elems);
  bound.shard_elems = nextPlaceableShard(problem, bound.capacity_elems, &bound.forcing_items);
  std::sort(bound.forcing_items.begin(), bound.forcing_items.end());
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
