#include "dbuf/planner/layout.hpp"

#include <algorithm>
#include <numeric>

#include "dbuf/common/int_math.hpp"

namespace dbuf::planner {

std::int64_t blockPeriod(const LayoutItem& item, std::int64_t align_elems) noexcept {
  const std::int64_t period = lcm64(align_elems, item.granularity);
  return period < item.numel ? period : item.numel;
}

std::optional<std::int64_t> earliestFeasibleOffset(std::int64_t position, const LayoutItem& item,
                                                   std::int64_t shard_elems, std::int64_t align_elems) noexcept {
  return ShardPlacer(shard_elems, align_elems).earliestOffset(position, item);
}

bool placeable(const LayoutItem& item, std::int64_t shard_elems, std::int64_t align_elems) noexcept {
  const auto period_of = [&] { return Divisor(blockPeriod(item, align_elems)); };
  return ShardPlacer(shard_elems, align_elems).startInShard(0, item.numel, period_of) != ShardPlacer::kNowhere;
}

std::optional<std::vector<std::int64_t>> placeInOrder(const LayoutProblem& problem,
                                                      std::span<const std::uint32_t> order, std::int64_t shard_elems) {
  const std::int64_t capacity = problem.devices * shard_elems;
  std::int64_t remaining = totalNumel(problem);
  std::vector<std::int64_t> offsets(problem.items.size(), 0);
  std::int64_t position = 0;
  const ShardPlacer placer(shard_elems, problem.align_elems);
  for (const std::uint32_t index : order) {
    const LayoutItem& item = problem.items[index];
    const auto offset = placer.earliestOffset(position, item);
    if (!offset) return std::nullopt;
    offsets[index] = *offset;
    position = *offset + item.numel;
    remaining -= item.numel;
    // Early exit: what is left cannot fit even packed without a gap.
    if (position + remaining > capacity) return std::nullopt;
  }
  return offsets;
}

std::int64_t splitBlocks(const LayoutItem& item, std::int64_t offset, std::int64_t shard_elems) noexcept {
  const std::int64_t first_cut = (offset / shard_elems + 1) * shard_elems - offset;
  return countSplitBlocks(item, first_cut, shard_elems);
}

std::int64_t countSplitBlocks(const LayoutItem& item, std::int64_t first_cut, std::int64_t cut_step) noexcept {
  const std::int64_t block = item.granularity;
  if (first_cut <= 0) first_cut += ceilDiv(1 - first_cut, cut_step) * cut_step;  // cuts at or before 0 split nothing
  if (block == 1 || first_cut >= item.numel) return 0;
  std::int64_t split = 0;
  if (cut_step >= block) {
    // Consecutive cuts land in different blocks: count the cuts off an edge.
    for (std::int64_t cut = first_cut; cut < item.numel; cut += cut_step) split += cut % block != 0 ? 1 : 0;
    return split;
  }
  // Cuts are denser than blocks: walk the blocks instead and ask whether a cut
  // falls strictly inside each one (cost n / g, not n / step).
  for (std::int64_t begin = (first_cut / block) * block; begin < item.numel; begin += block) {
    const std::int64_t end = std::min(begin + block, item.numel);
    const std::int64_t first_inside =
        begin < first_cut ? first_cut : first_cut + ((begin - first_cut) / cut_step + 1) * cut_step;
    split += first_inside < end ? 1 : 0;
  }
  return split;
}

std::int64_t totalNumel(const LayoutProblem& problem) noexcept {
  return std::accumulate(problem.items.begin(), problem.items.end(), std::int64_t{0},
                         [](std::int64_t sum, const LayoutItem& item) { return sum + item.numel; });
}

std::string describeViolation(const LayoutProblem& problem, const Layout& layout) {
  const std::int64_t shard = layout.shard_elems;
  if (shard <= 0) return "shard size must be positive";
  if (shard % problem.align_elems != 0) return "shard size is not a multiple of the alignment";
  if (layout.offsets.size() != problem.items.size()) return "offset count differs from item count";
  std::vector<std::uint32_t> by_offset(problem.items.size());
  std::iota(by_offset.begin(), by_offset.end(), 0U);
  std::sort(by_offset.begin(), by_offset.end(),
            [&](std::uint32_t x, std::uint32_t y) { return layout.offsets[x] < layout.offsets[y]; });
  std::int64_t previous_end = 0;
  for (const std::uint32_t index : by_offset) {
    const LayoutItem& item = problem.items[index];
    const std::int64_t offset = layout.offsets[index];
    const std::string which = "item " + std::to_string(index);
    if (offset % problem.align_elems != 0) return which + " is not aligned";
    if (offset < previous_end) return which + " overlaps the previous item";
    if (offset + item.numel > problem.devices * shard) return which + " ends past V*S";
    if (splitBlocks(item, offset, shard) != 0) return which + " has a block split across ranks";
    previous_end = offset + item.numel;
  }
  return {};
}

}  // namespace dbuf::planner
