#include "dbuf/planner/search.hpp"

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>
#include <unordered_map>
#include <utility>

#include "dbuf/common/int_math.hpp"
#include "dbuf/planner/bounds.hpp"

namespace dbuf::planner {
namespace {

/// Items with the same (numel, granularity) are interchangeable; the order
/// search chooses among classes, not items, which keeps a node O(classes) and
/// the memo small even for MoE units with hundreds of identical experts.
struct ItemClass {
  LayoutItem item;
  std::vector<std::uint32_t> members;  // in declaration order
};

std::vector<ItemClass> classify(const LayoutProblem& problem) {
  std::map<std::pair<std::int64_t, std::int64_t>, std::size_t> index_of;
  std::vector<ItemClass> classes;
  for (std::uint32_t i = 0; i < problem.items.size(); ++i) {
    const LayoutItem& item = problem.items[i];
    const auto [it, inserted] = index_of.try_emplace({item.numel, item.granularity}, classes.size());
    if (inserted) classes.push_back({item, {}});
    classes[it->second].members.push_back(i);
  }
  // Largest first, so ties in the search favour big tensors (as in first-fit
  // decreasing), leaving small ones to fill gaps late.
  std::stable_sort(classes.begin(), classes.end(),
                   [](const ItemClass& x, const ItemClass& y) { return x.item.numel > y.item.numel; });
  return classes;
}

/// Depth-first search over orders for one shard size, on item classes.
///
/// A node is a multiset of placed classes plus the end position of the best
/// order found for it; since earliest placement is monotone in the start
/// position, only the smallest end per multiset matters, so revisits with a
/// later end are cut (memo). Children are tried least-waste first, largest
/// first on ties, so the first descent is a best-fit construction and
/// backtracking only starts where that construction wastes more than the
/// slack V*S - N allows. With the memo and no node limit the search is exact
/// for this S; the node budget bounds it for units with many classes.
/// Built once per problem, run once per shard size; not thread-safe.
class OrderSearch {
 public:
  explicit OrderSearch(const LayoutProblem& problem) : problem_(problem), classes_(classify(problem)) {
    // State = mixed-radix number: digit c counts the placed members of class c.
    std::uint64_t states = 1;
    for (const ItemClass& item_class : classes_) {
      radix_.push_back(states);
      const std::uint64_t base = item_class.members.size() + 1;
      memo_possible_ = memo_possible_ && states <= (std::uint64_t{1} << 62) / base;
      states *= base;
    }
    children_.resize((problem.items.size() + 1) * classes_.size());
    path_.reserve(problem.items.size());
  }

  std::optional<std::vector<std::int64_t>> run(std::int64_t shard, std::int64_t node_budget, bool* exact) {
    shard_ = shard;
    budget_ = node_budget;
    capacity_ = problem_.devices * shard;
    remaining_ = totalNumel(problem_);
    left_.clear();
    for (const ItemClass& item_class : classes_) left_.push_back(item_class.members.size());
    best_end_.clear();
    path_.clear();
    const bool found = descend(0, 0);
    nodes_used_ = node_budget - std::max<std::int64_t>(budget_, 0);
    if (exact) *exact = budget_ >= 0;
    if (!found) return std::nullopt;
    std::vector<std::int64_t> offsets(problem_.items.size(), 0);
    std::vector<std::size_t> next(classes_.size(), 0);
    for (const auto& [cls, offset] : path_) offsets[classes_[cls].members[next[cls]++]] = offset;
    return offsets;
  }

  /// Nodes visited by the last run.
  [[nodiscard]] std::int64_t nodesUsed() const noexcept { return nodes_used_; }

  /// Lengths of the blocks (with alignment) of the classes that carry most of
  /// the bytes: shard sizes that are multiples of these let those classes
  /// straddle every boundary without a gap.
  [[nodiscard]] std::vector<std::int64_t> heavyPeriods(std::size_t count) const {
    std::vector<std::pair<std::int64_t, std::int64_t>> mass_period;
    for (const ItemClass& item_class : classes_) {
      const std::int64_t period = lcm64(problem_.align_elems, item_class.item.granularity);
      if (period <= problem_.align_elems) continue;
      const auto mass = item_class.item.numel * static_cast<std::int64_t>(item_class.members.size());
      mass_period.emplace_back(mass, period);
    }
    std::sort(mass_period.rbegin(), mass_period.rend());
    std::vector<std::int64_t> periods;
    for (const auto& [mass, period] : mass_period) {
      if (periods.size() == count) break;
      if (std::find(periods.begin(), periods.end(), period) == periods.end()) periods.push_back(period);
    }
    return periods;
  }

 private:
  struct Child {
    std::int64_t waste;
    std::size_t cls;
    std::int64_t offset;
  };

  bool descend(std::uint64_t state, std::int64_t position) {
    const std::size_t depth = path_.size();
    if (depth == problem_.items.size()) return true;
    if (--budget_ < 0) return false;
    if (memo_possible_) {
      const auto [it, inserted] = best_end_.try_emplace(state, position);
      if (!inserted) {
        if (it->second <= position) return false;
        it->second = position;
      }
    }
    Child* const first = children_.data() + depth * classes_.size();
    Child* last = first;
    for (std::size_t c = 0; c < classes_.size(); ++c) {
      if (left_[c] == 0) continue;
      const auto offset = earliestFeasibleOffset(position, classes_[c].item, shard_, problem_.align_elems);
      if (!offset || *offset + remaining_ > capacity_) continue;  // cannot finish from here
      *last++ = {*offset - position, c, *offset};
    }
    // Classes are size-sorted and the sort is stable: ties go to the largest.
    std::stable_sort(first, last, [](const Child& x, const Child& y) { return x.waste < y.waste; });
    for (const Child* child = first; child != last; ++child) {
      const std::int64_t numel = classes_[child->cls].item.numel;
      --left_[child->cls];
      remaining_ -= numel;
      path_.emplace_back(child->cls, child->offset);
      if (descend(state + radix_[child->cls], child->offset + numel)) return true;
      path_.pop_back();
      remaining_ += numel;
      ++left_[child->cls];
      if (budget_ < 0) return false;
    }
    return false;
  }

  const LayoutProblem& problem_;
  std::vector<ItemClass> classes_;
  std::vector<std::uint64_t> radix_;
  bool memo_possible_ = true;
  std::vector<Child> children_;  // one row of classes_.size() per depth
  std::vector<std::size_t> left_;
  std::unordered_map<std::uint64_t, std::int64_t> best_end_;
  std::vector<std::pair<std::size_t, std::int64_t>> path_;
  std::int64_t shard_ = 0;
  std::int64_t capacity_ = 0;
  std::int64_t remaining_ = 0;
  std::int64_t budget_ = 0;
  std::int64_t nodes_used_ = 0;
};

/// Shard sizes at which the (comparatively expensive) order search runs:
/// every size while its total spend is small, then the first few above the
/// lower bound and those where a heavy class straddles boundaries cleanly.
/// The fixed orders run at every size.
class SearchSchedule {
 public:
  SearchSchedule(std::vector<std::int64_t> periods, const SearchOptions& options)
      : periods_(std::move(periods)), leading_(options.leading_searches), node_cap_(options.search_nodes_total) {}

  [[nodiscard]] bool worthSearching(std::int64_t shard, std::int64_t sizes_tried) const {
    if (nodes_spent_ < node_cap_ || sizes_tried <= leading_) return true;
    return std::any_of(periods_.begin(), periods_.end(), [&](std::int64_t period) { return shard % period == 0; });
  }
  void spent(std::int64_t nodes) { nodes_spent_ += nodes; }

 private:
  std::vector<std::int64_t> periods_;
  std::int64_t leading_;
  std::int64_t node_cap_;
  std::int64_t nodes_spent_ = 0;
};

}  // namespace

std::string_view toString(Strategy strategy) noexcept {
  switch (strategy) {
    case Strategy::kGivenOrder:
      return "given";
    case Strategy::kSizeDescending:
      return "size-desc";
    case Strategy::kGranularityDescending:
      return "granularity-desc";
    case Strategy::kOrderSearch:
      return "order-search";
  }
  return "unknown";
}

std::vector<std::uint32_t> fixedOrder(const LayoutProblem& problem, Strategy strategy) {
  std::vector<std::uint32_t> order(problem.items.size());
  std::iota(order.begin(), order.end(), 0U);
  const auto& items = problem.items;
  if (strategy == Strategy::kSizeDescending) {
    std::stable_sort(order.begin(), order.end(),
                     [&](std::uint32_t x, std::uint32_t y) { return items[x].numel > items[y].numel; });
  } else if (strategy == Strategy::kGranularityDescending) {
    std::stable_sort(order.begin(), order.end(),
                     [&](std::uint32_t x, std::uint32_t y) { return items[x].granularity > items[y].granularity; });
  }
  return order;
}

std::optional<std::vector<std::int64_t>> placeBySearch(const LayoutProblem& problem, std::int64_t shard_elems,
                                                       std::int64_t node_budget, bool* exact) {
  return OrderSearch(problem).run(shard_elems, node_budget, exact);
}

SearchResult solveLayout(const LayoutProblem& problem, const SearchOptions& options) {
  std::vector<Strategy> portfolio = options.strategies;
  if (portfolio.empty()) {
    portfolio = {Strategy::kOrderSearch, Strategy::kGivenOrder, Strategy::kSizeDescending,
                 Strategy::kGranularityDescending};
  }
  std::vector<std::vector<std::uint32_t>> orders;  // empty for kOrderSearch, which orders per S
  orders.reserve(portfolio.size());
  for (const Strategy strategy : portfolio) {
    orders.push_back(strategy == Strategy::kOrderSearch ? std::vector<std::uint32_t>{} : fixedOrder(problem, strategy));
  }
  OrderSearch order_search(problem);
  SearchSchedule schedule(order_search.heavyPeriods(3), options);

  SearchResult result;
  const std::int64_t lower_bound = computeLowerBound(problem).shard_elems;
  bool smaller_sizes_refuted = true;  // an exact order search failed at every size tried so far
  std::int64_t shard = lower_bound;
  std::int64_t step = problem.align_elems;
  for (;;) {
    ++result.shard_sizes_tried;
    bool refuted = false;
    for (std::size_t s = 0; s < portfolio.size(); ++s) {
      std::optional<std::vector<std::int64_t>> offsets;
      if (portfolio[s] != Strategy::kOrderSearch) {
        offsets = placeInOrder(problem, orders[s], shard);
      } else if (schedule.worthSearching(shard, result.shard_sizes_tried)) {
        bool exact = false;
        offsets = order_search.run(shard, options.node_budget, &exact);
        schedule.spent(order_search.nodesUsed());
        refuted = exact && !offsets;
      }
      if (offsets) {
        result.layout = Layout{shard, std::move(*offsets)};
        result.strategy = portfolio[s];
        result.proven_optimal = shard == lower_bound || smaller_sizes_refuted;
        return result;
      }
    }
    smaller_sizes_refuted = smaller_sizes_refuted && refuted;
    if (result.shard_sizes_tried >= options.max_scan_steps) {
      // Out of budget: keep going, but coarser. Still valid; sizes get skipped.
      result.scan_complete = false;
      smaller_sizes_refuted = false;
      step *= 2;
    }
    shard = nextPlaceableShard(problem, shard + step);
  }
}

}  // namespace dbuf::planner
