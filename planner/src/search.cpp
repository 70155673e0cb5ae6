#include "dbuf/planner/search.hpp"

#include <algorithm>
#include <array>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <unordered_map>
#include <utility>

#include "dbuf/common/int_math.hpp"
#include "dbuf/planner/bounds.hpp"

namespace dbuf::planner {
namespace {

/// Items the searches may place interchangeably form a class: they choose
/// among classes, not items, which keeps a step O(classes) and the state
/// space small even for MoE units with hundreds of identical experts.
///
/// Items of one length whose blocks differ (an expert's gate and up
/// projections cut in 128-row blocks, its down projection in 128-column
/// ones) differ only where a shard boundary cuts them, and at most V - 1
/// items are cut: a block with that many items never runs short. So the
/// items of one length whose block is that plentiful, or whose cuts such a
/// block allows as well (its block a multiple of the other's, or no cut at
/// all), are one pooled class: a placement cutting it may use any of those
/// plentiful blocks, and the members are matched to the placements
/// afterwards (offsetsOf). The rest of that length (few items of a finer
/// block) stay classes of their own. Exact: the searches see every layout
/// they saw before, and only layouts the members can fill.
struct ItemClass {
  LayoutItem item;  ///< the length, and the block of the first of `blocks`
  /// The blocks a placement may be cut on: one for a plain class, the
  /// plentiful ones (the finest of them) for a pooled one, the length
  /// itself where no member can be cut.
  std::vector<Divisor> blocks;
  std::vector<std::uint32_t> members;  ///< in declaration order
  /// Members of several blocks (a pooled class): offsetsOf matches them to
  /// the placements.
  bool mixed = false;
  /// Not a class: items placed in this order, each with its own length and
  /// block (the interleaved search's column of light items).
  bool chain = false;
};

/// `pooled_lengths`: lengths whose items are pooled whatever their counts (a
/// relaxation: a layout may then need more items of a block than there are).
std::vector<ItemClass> classify(const LayoutProblem& problem, const std::set<std::int64_t>& pooled_lengths = {}) {
  // Items of one length and block period behave identically.
  std::map<std::pair<std::int64_t, std::int64_t>, std::vector<std::uint32_t>> same;
  for (std::uint32_t i = 0; i < problem.items.size(); ++i) {
    same[{problem.items[i].numel, blockPeriod(problem.items[i], problem.align_elems)}].push_back(i);
  }
  const auto plentiful = [&](std::int64_t numel, const std::vector<std::uint32_t>& members) {
    return static_cast<std::int64_t>(members.size()) >= problem.devices - 1 || pooled_lengths.count(numel) != 0;
  };
  std::vector<ItemClass> classes;
  for (auto group = same.begin(); group != same.end();) {
    const std::int64_t numel = group->first.first;
    const auto group_end = same.lower_bound({numel + 1, 0});
    // The finest plentiful blocks (none a multiple of another).
    std::vector<std::int64_t> blocks;
    for (auto it = group; it != group_end; ++it) {
      const std::int64_t period = it->first.second;
      if (period >= numel || !plentiful(numel, it->second)) continue;
      if (std::none_of(blocks.begin(), blocks.end(), [&](std::int64_t b) { return period % b == 0; })) {
        std::erase_if(blocks, [&](std::int64_t b) { return b % period == 0; });
        blocks.push_back(period);
      }
    }
    if (blocks.empty()) blocks.push_back(numel);
    ItemClass pooled{{numel, blocks.front()}, {blocks.begin(), blocks.end()}, {}};
    int joined = 0;  // groups of one block period in the pooled class
    for (auto it = group; it != group_end; ++it) {
      const std::int64_t period = it->first.second;
      const bool joins = period >= numel || plentiful(numel, it->second) ||
                         std::any_of(blocks.begin(), blocks.end(), [&](std::int64_t b) { return period % b == 0; });
      if (joins) {
        ++joined;
        pooled.members.insert(pooled.members.end(), it->second.begin(), it->second.end());
      } else {
        classes.push_back({{numel, period}, {Divisor(period)}, it->second});
      }
    }
    if (!pooled.members.empty()) {
      std::sort(pooled.members.begin(), pooled.members.end());
      pooled.mixed = joined > 1;
      classes.push_back(std::move(pooled));
    }
    group = group_end;
  }
  // In order of first appearance, then largest first, so that ties in the
  // searches favour big tensors (as in first-fit decreasing), leaving small
  // ones to fill gaps late.
  std::sort(classes.begin(), classes.end(),
            [](const ItemClass& x, const ItemClass& y) { return x.members.front() < y.members.front(); });
  std::stable_sort(classes.begin(), classes.end(),
                   [](const ItemClass& x, const ItemClass& y) { return x.item.numel > y.item.numel; });
  return classes;
}

/// Earliest offset at or after `position` at which a member of `item_class`
/// may start (for a pooled class: the earliest any of its blocks allows), or
/// ShardPlacer::kNowhere.
std::int64_t earliestOffset(const ItemClass& item_class, std::int64_t position, const ShardPlacer& placer) {
  const std::int64_t numel = item_class.item.numel;
  std::int64_t best = ShardPlacer::kNowhere;
  for (const Divisor& block : item_class.blocks) {
    const std::int64_t offset = placer.earliestOffsetOrNowhere(position, numel, block);
    if (offset == position) return offset;  // nothing starts earlier (the common case: no cut)
    if (offset != ShardPlacer::kNowhere && (best == ShardPlacer::kNowhere || offset < best)) best = offset;
  }
  return best;
}

/// Offsets of the items from a sequence of (class, offset) placements: the
/// k-th placement of a plain class or chain goes to its k-th member; in a
/// pooled class the placements a boundary cuts go first, each to a member
/// whose blocks allow that cut, then the others in order. Nullopt only
/// where classes pooled as a relaxation lack such members.
std::optional<std::vector<std::int64_t>> offsetsOf(const LayoutProblem& problem, const std::vector<ItemClass>& classes,
                                                   const std::vector<std::pair<std::size_t, std::int64_t>>& placements,
                                                   std::int64_t shard) {
  std::vector<std::int64_t> offsets(problem.items.size(), 0);
  std::vector<std::vector<std::int64_t>> placed(classes.size());
  for (const auto& [cls, offset] : placements) placed[cls].push_back(offset);
  for (std::size_t c = 0; c < classes.size(); ++c) {
    const ItemClass& item_class = classes[c];
    if (!item_class.mixed) {
      for (std::size_t k = 0; k < placed[c].size(); ++k) offsets[item_class.members[k]] = placed[c][k];
      continue;
    }
    // The members by block period (pooled ones first: the largest groups).
    struct Pool {
      std::int64_t period;
      std::vector<std::uint32_t> members;
      std::size_t next = 0;
    };
    std::vector<Pool> pools;
    for (const std::uint32_t member : item_class.members) {
      const std::int64_t period = blockPeriod(problem.items[member], problem.align_elems);
      auto pool = std::find_if(pools.begin(), pools.end(), [&](const Pool& p) { return p.period == period; });
      if (pool == pools.end()) pool = pools.insert(pools.end(), Pool{period, {}});
      pool->members.push_back(member);
    }
    std::stable_sort(pools.begin(), pools.end(),
                     [](const Pool& x, const Pool& y) { return x.members.size() > y.members.size(); });
    const std::int64_t numel = item_class.item.numel;
    std::vector<char> taken(problem.items.size(), 0);
    std::vector<std::int64_t> uncut;  // placements no boundary cuts
    for (const std::int64_t offset : placed[c]) {
      if ((offset / shard + 1) * shard >= offset + numel) {
        uncut.push_back(offset);
        continue;
      }
      const auto pool = std::find_if(pools.begin(), pools.end(), [&](const Pool& p) {
        return p.next < p.members.size() && splitBlocks({numel, p.period}, offset, shard) == 0;
      });
      if (pool == pools.end()) return std::nullopt;
      const std::uint32_t member = pool->members[pool->next++];
      taken[member] = 1;
      offsets[member] = offset;
    }
    auto member = item_class.members.begin();
    for (const std::int64_t offset : uncut) {
      while (taken[*member] != 0) ++member;
      offsets[*member++] = offset;
    }
  }
  return offsets;
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
  OrderSearch(const LayoutProblem& problem, const std::vector<ItemClass>& classes)
      : problem_(problem), classes_(classes) {
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
    placer_ = ShardPlacer(shard, problem_.align_elems);
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
    return offsetsOf(problem_, classes_, path_, shard);
  }

  /// Nodes visited by the last run.
  [[nodiscard]] std::int64_t nodesUsed() const noexcept { return nodes_used_; }

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
      const std::int64_t offset = earliestOffset(classes_[c], position, placer_);
      if (offset == ShardPlacer::kNowhere || offset + remaining_ > capacity_) continue;  // cannot finish from here
      *last++ = {offset - position, c, offset};
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
  const std::vector<ItemClass>& classes_;
  std::vector<std::uint64_t> radix_;
  bool memo_possible_ = true;
  std::vector<Child> children_;  // one row of classes_.size() per depth
  std::vector<std::size_t> left_;
  std::unordered_map<std::uint64_t, std::int64_t> best_end_;
  std::vector<std::pair<std::size_t, std::int64_t>> path_;
  ShardPlacer placer_{1, 1};
  std::int64_t capacity_ = 0;
  std::int64_t remaining_ = 0;
  std::int64_t budget_ = 0;
  std::int64_t nodes_used_ = 0;
};

/// Beam search over orders for one shard size: the order search's states
/// (multisets of placed classes, each with its earliest end), expanded depth
/// by depth, keeping the `width` states that have wasted least so far (end
/// minus the elements placed). Where the depth-first search spends its budget
/// backtracking near the bottom of one descent, the beam keeps alternatives
/// at every depth, which is what units of hundreds of tensors need. Not exact;
/// cost O(items x width x classes) per size.
class BeamSearch {
 public:
  BeamSearch(const LayoutProblem& problem, const std::vector<ItemClass>& classes, std::size_t width)
      : problem_(problem), classes_(classes), width_(width) {
    // Zobrist-style keys: a multiset's key is the sum of its classes' keys.
    // A collision only merges two states (the beam loses one), never breaks a
    // layout, which is rebuilt from parent links.
    std::uint64_t x = 0x9e3779b97f4a7c15ULL;
    for (std::size_t c = 0; c < classes_.size(); ++c) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      keys_.push_back(x);
    }
  }

  std::optional<std::vector<std::int64_t>> run(std::int64_t shard) {
    const std::size_t class_count = classes_.size();
    const std::int64_t capacity = problem_.devices * shard;
    const std::int64_t total = totalNumel(problem_);
    const ShardPlacer placer(shard, problem_.align_elems);
    levels_.assign(problem_.items.size() + 1, {});
    levels_[0].push_back(Node{});
    placed_.assign(class_count, 0);  // row per beam entry of the current level
    for (std::size_t depth = 0; depth < problem_.items.size(); ++depth) {
      candidates_.clear();
      index_of_.clear();
      const std::vector<Node>& level = levels_[depth];
      for (std::uint32_t b = 0; b < level.size(); ++b) {
        const Node& node = level[b];
        for (std::size_t c = 0; c < class_count; ++c) {
          if (placed_[b * class_count + c] == classes_[c].members.size()) continue;
          const std::int64_t numel = classes_[c].item.numel;
          const std::int64_t offset = earliestOffset(classes_[c], node.end, placer);
          if (offset == ShardPlacer::kNowhere) continue;
          const Node child{node.key + keys_[c],          offset + numel, node.placed + numel, offset, b,
                           static_cast<std::uint32_t>(c)};
          ++work_;
          if (child.end + (total - child.placed) > capacity) continue;  // cannot finish from here
          const auto [it, inserted] = index_of_.try_emplace(child.key, candidates_.size());
          if (inserted) {
            candidates_.push_back(child);
          } else if (candidates_[it->second].end > child.end) {
            candidates_[it->second] = child;
          }
        }
      }
      if (candidates_.empty()) return std::nullopt;
      keepLeastWasteful();
      advance(depth);
    }
    std::vector<std::pair<std::size_t, std::int64_t>> placements(problem_.items.size());
    std::uint32_t entry = 0;
    for (std::size_t depth = problem_.items.size(); depth > 0; --depth) {
      const Node& node = levels_[depth][entry];
      placements[depth - 1] = {node.cls, node.offset};
      entry = node.parent;
    }
    return offsetsOf(problem_, classes_, placements, shard);
  }

  /// Candidate states generated so far, over every run.
  [[nodiscard]] std::int64_t work() const noexcept { return work_; }

 private:
  struct Node {
    std::uint64_t key = 0;
    std::int64_t end = 0;
    std::int64_t placed = 0;  // elements placed
    std::int64_t offset = 0;  // of the last item placed
    std::uint32_t parent = 0;
    std::uint32_t cls = 0;
  };

  void keepLeastWasteful() {
    if (candidates_.size() <= width_) return;
    const auto wastes_less = [](const Node& x, const Node& y) {
      const std::int64_t wx = x.end - x.placed;
      const std::int64_t wy = y.end - y.placed;
      return wx != wy ? wx < wy : x.key < y.key;  // the key breaks ties deterministically
    };
    std::nth_element(candidates_.begin(), candidates_.begin() + static_cast<std::ptrdiff_t>(width_) - 1,
                     candidates_.end(), wastes_less);
    candidates_.resize(width_);
  }

  void advance(std::size_t depth) {
    const std::size_t class_count = classes_.size();
    next_placed_.assign(candidates_.size() * class_count, 0);
    for (std::size_t i = 0; i < candidates_.size(); ++i) {
      const Node& node = candidates_[i];
      std::copy_n(placed_.begin() + static_cast<std::ptrdiff_t>(node.parent * class_count), class_count,
                  next_placed_.begin() + static_cast<std::ptrdiff_t>(i * class_count));
      ++next_placed_[i * class_count + node.cls];
    }
    placed_.swap(next_placed_);
    levels_[depth + 1] = candidates_;
  }

  const LayoutProblem& problem_;
  const std::vector<ItemClass>& classes_;
  std::size_t width_;
  std::vector<std::uint64_t> keys_;
  std::vector<std::vector<Node>> levels_;
  std::vector<Node> candidates_;
  std::unordered_map<std::uint64_t, std::size_t> index_of_;
  std::vector<std::size_t> placed_;
  std::vector<std::size_t> next_placed_;
  std::int64_t work_ = 0;
};

/// Multisets of placed classes (the exhaustive search's states), as a double:
/// it may be astronomically many.
double multisets(const std::vector<ItemClass>& classes) {
  double states = 1;
  for (const ItemClass& c : classes) states *= static_cast<double>(c.members.size() + 1);
  return states;
}

/// Every order at once for one S: a dynamic program over all multisets of
/// placed classes, each keeping the earliest end any order of it reaches
/// (by fact 1 of docs/planner.md the only one that matters). Exact, with
/// no budget inside a run: it visits every multiset, so it is only built for
/// units with at most kExhaustiveStates of them (a MoE layer's experts are
/// one pooled class: a layer of 512 experts at V = 256 has about 200,000
/// multisets). The multisets are numbered
/// in mixed radix (digit c: placed members of class c), so a multiset's
/// predecessors have smaller numbers and one pass in order computes them all.
/// Each keeps its end as the waste before it (end minus the elements
/// placed): never above the slack V*S - N, or the rest could not fit, so
/// 4 bytes a multiset where the slack is below 2^32 elements.
class ExhaustiveSearch {
 public:
  /// Multisets it may hold: 64 MiB of 4-byte wastes (128 MiB of 8-byte
  /// ones where the slack needs them).
  static constexpr std::int64_t kExhaustiveStates = std::int64_t{1} << 24;

  /// `columns`: the classes of the problem, or (interleavedColumns) some of
  /// them and one chain of the other items, placed in its given order.
  ExhaustiveSearch(const LayoutProblem& problem, std::vector<ItemClass> columns)
      : problem_(problem), classes_(std::move(columns)), total_(totalNumel(problem)) {
    std::int64_t states = 1;
    for (const ItemClass& column : classes_) {
      stride_.push_back(states);
      const auto digits = static_cast<std::int64_t>(column.members.size()) + 1;
      states = states > kExhaustiveStates / digits ? kExhaustiveStates + 1 : states * digits;
      std::vector<std::int64_t>& prefix = prefix_.emplace_back(1, 0);
      for (const std::uint32_t member : column.members) prefix.push_back(prefix.back() + problem.items[member].numel);
      std::vector<Divisor>& periods = chain_periods_.emplace_back();
      if (column.chain) {
        for (const std::uint32_t member : column.members) {
          periods.emplace_back(blockPeriod(problem.items[member], problem.align_elems));
        }
      }
    }
    states_ = states;
  }

  /// Multisets of a run (over kExhaustiveStates: too many, run() must not be called).
  [[nodiscard]] std::int64_t states() const noexcept { return states_; }
  /// Placements a run tries, for budgets.
  [[nodiscard]] std::int64_t cost() const noexcept { return states_ * static_cast<std::int64_t>(classes_.size()); }

  /// A layout at `shard` if any order has one; nullopt proves none does.
  std::optional<std::vector<std::int64_t>> run(std::int64_t shard) {
    if (!fits(shard)) return std::nullopt;
    return layout();
  }

  /// Whether any order fits at `shard` (false proves none does).
  bool fits(std::int64_t shard) {
    shard_ = shard;
    slack_ = problem_.devices * shard - total_;
    narrow_.clear();
    wide_.clear();
    if (slack_ < 0) return false;
    if (slack_ < std::numeric_limits<std::uint32_t>::max()) return fill(narrow_);
    return fill(wide_);
  }

  /// After fits() returned true, one order's layout; nullopt only where the
  /// columns pool classes as a relaxation (classify) and members lack.
  [[nodiscard]] std::optional<std::vector<std::int64_t>> layout() const {
    return offsetsOf(problem_, classes_, narrow_.empty() ? walkBack(wide_) : walkBack(narrow_), shard_);
  }

 private:
  template <typename Waste>
  bool fill(std::vector<Waste>& waste) {
    constexpr Waste kUnreachable = std::numeric_limits<Waste>::max();
    constexpr std::int64_t kNone = std::numeric_limits<std::int64_t>::max();
    const std::size_t class_count = classes_.size();
    const ShardPlacer placer(shard_, problem_.align_elems);
    waste.assign(static_cast<std::size_t>(states_), kUnreachable);
    waste[0] = 0;
    std::vector<std::int64_t> placed_of(class_count, 0);  // the current multiset's digits
    std::int64_t placed = 0;                              // its elements
    for (std::int64_t state = 1; state < states_; ++state) {
      placed += increment(placed_of);
      std::int64_t best = kNone;
      for (std::size_t c = 0; c < class_count; ++c) {
        if (placed_of[c] == 0) continue;
        const Waste before_waste = waste[static_cast<std::size_t>(state - stride_[c])];
        if (before_waste == kUnreachable) continue;
        const std::int64_t numel = numelAt(c, placed_of[c]);
        const std::int64_t offset = offsetAt(c, placed_of[c], placed - numel + before_waste, placer);
        if (offset != ShardPlacer::kNowhere) best = std::min(best, offset + numel);
      }
      // The rest, back to back at the least, must still fit.
      if (best != kNone && best - placed <= slack_)
        waste[static_cast<std::size_t>(state)] = static_cast<Waste>(best - placed);
    }
    return waste.back() != kUnreachable;
  }

  /// Next multiset in mixed radix; returns the change in elements placed.
  std::int64_t increment(std::vector<std::int64_t>& digits) const {
    std::int64_t change = 0;
    for (std::size_t c = 0; c < digits.size(); ++c) {
      const std::vector<std::int64_t>& prefix = prefix_[c];
      if (digits[c] < static_cast<std::int64_t>(classes_[c].members.size())) {
        ++digits[c];
        return change + prefix[static_cast<std::size_t>(digits[c])] - prefix[static_cast<std::size_t>(digits[c]) - 1];
      }
      change -= prefix[static_cast<std::size_t>(digits[c])];
      digits[c] = 0;
    }
    return change;
  }

  /// Where a column places its item when its digit becomes `digit` (1-based),
  /// from `position` on, and that item's length.
  std::int64_t offsetAt(std::size_t column, std::int64_t digit, std::int64_t position,
                        const ShardPlacer& placer) const {
    const ItemClass& c = classes_[column];
    if (!c.chain) return earliestOffset(c, position, placer);
    const auto member = static_cast<std::size_t>(digit) - 1;
    return placer.earliestOffsetOrNowhere(position, problem_.items[c.members[member]].numel,
                                          chain_periods_[column][member]);
  }
  std::int64_t numelAt(std::size_t column, std::int64_t digit) const {
    const ItemClass& c = classes_[column];
    return c.chain ? problem_.items[c.members[static_cast<std::size_t>(digit) - 1]].numel : c.item.numel;
  }

  /// The placements of one order reaching the full multiset's end, rebuilt
  /// from the wastes (a predecessor whose earliest placement gives this end).
  template <typename Waste>
  std::vector<std::pair<std::size_t, std::int64_t>> walkBack(const std::vector<Waste>& waste) const {
    const ShardPlacer placer(shard_, problem_.align_elems);
    std::vector<std::pair<std::size_t, std::int64_t>> placements;
    std::vector<std::int64_t> digits;
    for (const ItemClass& item_class : classes_) digits.push_back(static_cast<std::int64_t>(item_class.members.size()));
    std::int64_t placed = total_;
    for (std::int64_t state = states_ - 1; state > 0;) {
      const std::int64_t end = placed + waste[static_cast<std::size_t>(state)];
      for (std::size_t c = 0; c < classes_.size(); ++c) {
        if (digits[c] == 0) continue;
        const Waste before_waste = waste[static_cast<std::size_t>(state - stride_[c])];
        if (before_waste == std::numeric_limits<Waste>::max()) continue;
        const std::int64_t numel = numelAt(c, digits[c]);
        const std::int64_t offset = offsetAt(c, digits[c], placed - numel + before_waste, placer);
        if (offset == ShardPlacer::kNowhere || offset + numel != end) continue;
        placements.emplace_back(c, offset);
        --digits[c];
        state -= stride_[c];
        placed -= numel;
        break;
      }
    }
    std::reverse(placements.begin(), placements.end());
    return placements;
  }

  const LayoutProblem& problem_;
  std::vector<ItemClass> classes_;                   // columns
  std::int64_t total_;                               // elements of the problem
  std::vector<std::vector<std::int64_t>> prefix_;    // per column: elements of its first k members
  std::vector<std::vector<Divisor>> chain_periods_;  // per chain column: its members' block periods
  std::vector<std::int64_t> stride_;
  std::int64_t states_ = 1;
  std::int64_t shard_ = 0;             // of the last run
  std::int64_t slack_ = 0;             // V*S - N at it
  std::vector<std::uint32_t> narrow_;  // per multiset, its waste; one of the two holds the last run's
  std::vector<std::int64_t> wide_;
};

/// Columns for an exhaustive search affordable where the full one is not:
/// the heaviest classes (most elements) as they are, every other item in one
/// chain that keeps its order (largest first, declaration order on ties).
/// The search then tries every interleaving of the chain with every order of
/// the heavy classes: exact over those orders, a heuristic over all of them.
/// Empty when no such split costs at most `work` a run.
std::vector<ItemClass> interleavedColumns(const std::vector<ItemClass>& classes, std::int64_t work) {
  const auto mass = [](const ItemClass& c) { return c.item.numel * static_cast<std::int64_t>(c.members.size()); };
  std::vector<ItemClass> heavy = classes;
  std::stable_sort(heavy.begin(), heavy.end(),
                   [&](const ItemClass& x, const ItemClass& y) { return mass(x) > mass(y); });
  double heavy_states = 1;
  for (const ItemClass& c : heavy) heavy_states *= static_cast<double>(c.members.size() + 1);
  std::size_t chained = 0;  // items in the chain
  while (heavy.size() > 1) {
    chained += heavy.back().members.size();
    heavy_states /= static_cast<double>(heavy.back().members.size() + 1);
    heavy.pop_back();
    const double cost = heavy_states * static_cast<double>(chained + 1) * static_cast<double>(heavy.size() + 1);
    if (cost <= static_cast<double>(work)) break;
  }
  const double cost = heavy_states * static_cast<double>(chained + 1) * static_cast<double>(heavy.size() + 1);
  if (chained == 0 || cost > static_cast<double>(work)) return {};
  ItemClass chain{{}, {}, {}, false, true};  // its item: the first member's (it places each member's own)
  for (const ItemClass& c : classes) {       // size-sorted
    if (std::none_of(heavy.begin(), heavy.end(), [&](const ItemClass& h) { return h.members == c.members; })) {
      if (chain.members.empty()) chain.item = c.item;
      chain.members.insert(chain.members.end(), c.members.begin(), c.members.end());
    }
  }
  heavy.push_back(std::move(chain));
  return heavy;
}

/// Beam states per depth when SearchOptions::beam_width is 0: as many as keep
/// one run near kBeamWork candidate states, within [4, 64].
constexpr std::int64_t kBeamWork = 20000;

std::size_t beamWidth(const LayoutProblem& problem, std::size_t classes, std::int64_t requested) {
  if (requested > 0) return static_cast<std::size_t>(requested);
  const auto per_state = static_cast<std::int64_t>(problem.items.size() * std::max<std::size_t>(classes, 1));
  return static_cast<std::size_t>(std::clamp<std::int64_t>(kBeamWork / per_state, 4, 64));
}

/// What the portfolio made of one shard size.
struct Attempt {
  std::optional<std::vector<std::int64_t>> offsets;
  Strategy strategy = Strategy::kGivenOrder;
  bool refuted = false;   ///< an exact order search proved that no order fits
  bool searched = false;  ///< the order search ran (or an exhaustive search)
  /// Every strategy the sizes near the result get ran here too (or a
  /// lighter one of the same kind): a failure says as much as one there.
  bool thorough = false;
};

/// How far Portfolio::at goes at one size.
enum class Reach : std::uint8_t {
  kScan,    ///< the fixed orders, the order search, the exhaustive search where it is cheap
  kProbe,   ///< and the beam, then the light interleaved search: sizes far from the result (the probe)
  kSettle,  ///< and the settling interleaved search too (exact ones before the beam): sizes near it
};

/// The strategies of SearchOptions::strategies, tried at one size at a time.
class Portfolio {
 public:
  /// Runs per unit of each interleaved search (the settling one costs up to
  /// interleave_work a run, about 1 ms; the light one a quarter of that):
  /// they keep a unit's plan within a few ms.
  static constexpr int kInterleavedRuns = 12;

  Portfolio(const LayoutProblem& problem, const SearchOptions& options)
      : problem_(problem),
        options_(options),
        classes_(classify(problem)),
        order_search_(problem, classes_),
        beam_(problem, classes_, beamWidth(problem, classes_.size(), options.beam_width)) {
    strategies_ = options.strategies;
    if (strategies_.empty()) {
      strategies_ = {Strategy::kGivenOrder,       Strategy::kSizeDescending, Strategy::kGranularityDescending,
                     Strategy::kOrderSearch,      Strategy::kBeamSearch,     Strategy::kExhaustiveSearch,
                     Strategy::kInterleavedSearch};
    }
    for (const Strategy strategy : strategies_) {
      switch (strategy) {
        case Strategy::kOrderSearch:
          has_order_search_ = true;
          break;
        case Strategy::kBeamSearch:
          has_beam_ = true;
          break;
        case Strategy::kExhaustiveSearch:
          exhaustive_.emplace(problem, classes_);
          if (exhaustive_->cost() > options.exhaustive_work) exhaustive_.reset();
          break;
        case Strategy::kInterleavedSearch:
          build(settling_, options.interleave_work);
          build(probing_, options.interleave_work / 4);
          break;
        default:
          fixed_.emplace_back(strategy, fixedOrder(problem, strategy));
      }
    }
    if (exhaustive_) {  // it runs at every size already
      settling_.search.reset();
      probing_.search.reset();
    }
    if (fixed_.empty() && !canScan() && !canProbe()) {
      // Only an exhaustive search too large for this unit: the given order stands in.
      fixed_.emplace_back(Strategy::kGivenOrder, fixedOrder(problem, Strategy::kGivenOrder));
    }
  }

  /// A strategy that runs at the scan's sizes (cheap ones).
  [[nodiscard]] bool canScan() const noexcept { return !fixed_.empty() || has_order_search_ || exhaustive_; }

  /// A strategy that settles a size on its own (the beam, or the exhaustive
  /// search where the unit is small enough for it): the size search may jump.
  [[nodiscard]] bool canProbe() const noexcept {
    return has_beam_ || exhaustive_.has_value() || settling_.search.has_value();
  }
  [[nodiscard]] const std::vector<ItemClass>& classes() const noexcept { return classes_; }

  /// Work spent so far: items placed by the fixed orders, order-search nodes
  /// times classes, beam candidates.
  [[nodiscard]] std::int64_t work() const noexcept { return work_ + beam_.work(); }

  /// The fixed orders, then the exhaustive search where it is cheap enough
  /// (it decides the size), else the order search (unless it has run out of
  /// nodes before and `insist` is false), then as far as `reach` says the
  /// beam and the interleaved searches.
  Attempt at(std::int64_t shard, Reach reach, bool insist = false) {
    Attempt attempt;
    if (auto found = fixedOrdersAt(shard)) return *found;
    if (exhaustive_) {
      work_ += exhaustive_->cost();
      attempt.offsets = exhaustive_->run(shard);
      attempt.strategy = Strategy::kExhaustiveSearch;
      attempt.refuted = !attempt.offsets;
      attempt.searched = true;
      return attempt;
    }
    if (has_order_search_ && (order_search_useful_ || insist)) {
      bool exact = false;
      attempt.offsets = order_search_.run(shard, options_.node_budget, &exact);
      work_ += order_search_.nodesUsed() * static_cast<std::int64_t>(classes_.size());
      attempt.strategy = Strategy::kOrderSearch;
      attempt.searched = true;
      attempt.refuted = exact && !attempt.offsets;
      // Once it runs out of nodes the state space is too large for it to
      // prove anything; the beam is the better heuristic from then on.
      order_search_useful_ = order_search_useful_ && (exact || attempt.offsets || !has_beam_);
      if (attempt.offsets) return attempt;
    }
    // Without the beam the settling search does the beam's part too, as
    // often as it takes. With it, the probe has a lighter search of its own,
    // which the sizes near the result try before the settling one.
    if (!has_beam_) return reach != Reach::kScan && settling_.search ? cappedAt(settling_, shard) : attempt;
    if (reach == Reach::kScan) return attempt;
    const auto runs = [](const CappedSearch& c) { return c.search && c.runs < kInterleavedRuns; };
    // Exact, they go first (a failure settles the size); else after the
    // beam, which is cheaper and often enough.
    if (runs(probing_) && probing_.exact) return cappedAt(probing_, shard);
    if (reach == Reach::kSettle && runs(settling_) && settling_.exact) return cappedAt(settling_, shard);
    attempt.offsets = beam_.run(shard);
    attempt.strategy = Strategy::kBeamSearch;
    if (attempt.offsets) return attempt;
    attempt.thorough = !settling_.search;
    if (runs(probing_)) {
      attempt = cappedAt(probing_, shard);
      attempt.thorough = true;
      if (attempt.offsets || reach == Reach::kProbe) return attempt;
    }
    if (reach == Reach::kSettle && runs(settling_)) return cappedAt(settling_, shard);
    return attempt;
  }

  /// The order search alone within `work` (nodes times classes), which is
  /// charged what it used.
  Attempt exactlyAt(std::int64_t shard, std::int64_t& work) {
    Attempt attempt;
    bool exact = false;
    const auto classes = static_cast<std::int64_t>(std::max<std::size_t>(classes_.size(), 1));
    attempt.offsets = order_search_.run(shard, std::max<std::int64_t>(work / classes, 1), &exact);
    work -= order_search_.nodesUsed() * classes;
    work_ += order_search_.nodesUsed() * classes;
    attempt.strategy = Strategy::kOrderSearch;
    attempt.searched = true;
    attempt.refuted = exact && !attempt.offsets;
    return attempt;
  }

  /// The fixed orders alone (cheap: O(items) each).
  std::optional<Attempt> fixedOrdersAt(std::int64_t shard) {
    for (const auto& [strategy, order] : fixed_) {
      work_ += static_cast<std::int64_t>(order.size());
      if (auto offsets = placeInOrder(problem_, order, shard)) return Attempt{std::move(offsets), strategy, false};
    }
    return std::nullopt;
  }

 private:
  /// The exhaustive search where one run costs at most `work` (exact: it
  /// refutes sizes), else the interleaved search within that cost, if any.
  struct CappedSearch {
    std::optional<ExhaustiveSearch> search;
    bool exact = false;
    int runs = 0;
  };
  void build(CappedSearch& capped, std::int64_t work) const {
    capped.search.emplace(problem_, classes_);
    capped.exact = capped.search->cost() <= work;
    if (capped.exact) return;
    capped.search.reset();
    if (auto columns = interleavedColumns(classes_, work); !columns.empty()) {
      capped.search.emplace(problem_, std::move(columns));
    }
  }

  Attempt cappedAt(CappedSearch& capped, std::int64_t shard) {
    Attempt attempt;
    ++capped.runs;
    work_ += capped.search->cost();
    attempt.offsets = capped.search->run(shard);
    attempt.strategy = capped.exact ? Strategy::kExhaustiveSearch : Strategy::kInterleavedSearch;
    attempt.searched = capped.exact;
    attempt.refuted = capped.exact && !attempt.offsets;
    return attempt;
  }

  const LayoutProblem& problem_;
  const SearchOptions& options_;
  std::vector<Strategy> strategies_;
  std::vector<ItemClass> classes_;
  std::vector<std::pair<Strategy, std::vector<std::uint32_t>>> fixed_;
  OrderSearch order_search_;
  BeamSearch beam_;
  std::optional<ExhaustiveSearch> exhaustive_;
  // Where exhaustive_ costs too much: within interleave_work at the sizes
  // near the result, within a quarter of it at the probe's.
  CappedSearch settling_;
  CappedSearch probing_;
  bool has_order_search_ = false;
  bool has_beam_ = false;
  bool order_search_useful_ = true;
  std::int64_t work_ = 0;
};

/// Sizes that are multiples of some tensors' block length (with alignment),
/// each period applying below a size limit.
class PeriodicSizes {
 public:
  explicit PeriodicSizes(const LayoutProblem& problem) : problem_(problem) {}

  void add(std::int64_t period, std::int64_t below) {
    for (auto& [known, limit] : periods_) {
      if (known == period) {
        limit = std::max(limit, below);
        return;
      }
    }
    periods_.emplace_back(period, below);
  }

  [[nodiscard]] bool contains(std::int64_t shard) const {
    return std::any_of(periods_.begin(), periods_.end(),
                       [&](const auto& p) { return shard % p.first == 0 && shard < p.second; });
  }

  /// Smallest placeable member in [from, to), or `to`.
  [[nodiscard]] std::int64_t next(std::int64_t from, std::int64_t to) const {
    while (from < to) {
      std::int64_t candidate = to;
      for (const auto& [period, below] : periods_) {
        const std::int64_t multiple = roundUp(from, period);
        if (multiple < below) candidate = std::min(candidate, multiple);
      }
      if (candidate >= to) return to;
      if (nextPlaceableShard(problem_, candidate) == candidate) return candidate;
      from = candidate + problem_.align_elems;
    }
    return to;
  }

 private:
  const LayoutProblem& problem_;
  std::vector<std::pair<std::int64_t, std::int64_t>> periods_;  // (period, sizes below which it applies)
};

/// Sizes at which feasibility may jump down: feasibility over all orders is
/// monotone in S (a layout at S, shard by shard, is one at any larger S:
/// each shard's content still fits, every cut stays on a block edge) except
/// where a tensor may span a whole shard, which needs S to be a multiple of
/// its block. Blocks dividing the alignment allow that at every S (and a
/// layout using it still carries over: such a tensor can be cut anywhere), so
/// only coarser blocks make exceptional sizes: multiples of lcm(a, g) shorter
/// than the tensor.
/// (`items`: the problem's, or a relaxation's; the sizes stay those placeable
/// in `problem`.)
PeriodicSizes exceptionalSizes(const LayoutProblem& problem, const std::vector<LayoutItem>& items) {
  PeriodicSizes sizes(problem);
  for (const LayoutItem& item : items) {
    const std::int64_t period = lcm64(problem.align_elems, item.granularity);
    if (period > problem.align_elems) sizes.add(period, item.numel);
  }
  return sizes;
}

/// Sizes where the classes carrying most of the bytes straddle every
/// boundary on a block edge without a gap (multiples of their blocks): where
/// the searches find layouts that bisection, landing between them, misses.
/// One set per class, heaviest first.
std::vector<PeriodicSizes> heavySizes(const LayoutProblem& problem, const std::vector<ItemClass>& classes,
                                      std::size_t count) {
  std::vector<std::pair<std::int64_t, std::int64_t>> mass_period;
  for (const ItemClass& item_class : classes) {
    for (const Divisor& block : item_class.blocks) {
      const std::int64_t period = lcm64(problem.align_elems, block.value());
      if (period <= problem.align_elems) continue;
      mass_period.emplace_back(item_class.item.numel * static_cast<std::int64_t>(item_class.members.size()), period);
    }
  }
  std::sort(mass_period.rbegin(), mass_period.rend());
  std::vector<PeriodicSizes> sets;
  for (std::size_t i = 0; i < mass_period.size() && sets.size() < count; ++i) {
    if (i > 0 && mass_period[i].second == mass_period[i - 1].second) continue;
    sets.emplace_back(problem).add(mass_period[i].second, std::numeric_limits<std::int64_t>::max());
  }
  return sets;
}

/// What the exact searches refuted, and the proven bound that follows.
class Refutations {
 public:
  Refutations(const LayoutProblem& problem, const PeriodicSizes& exceptional) : problem_(problem) {
    rules_.push_back({0, exceptional});
  }

  /// No layout at `shard`: nor at any ordinary size below it, if it is ordinary.
  void add(std::int64_t shard) {
    refuted_.insert(shard);
    Rule& ordinary = rules_.front();
    if (!ordinary.exceptions.contains(shard)) ordinary.up_to = std::max(ordinary.up_to, shard);
  }

  /// No layout at any size up to `up_to` but `exceptions` (what a relaxation
  /// of the problem, monotone outside its own exceptional sizes, refuted).
  void ruleOut(std::int64_t up_to, const PeriodicSizes& exceptions) {
    if (up_to > 0) rules_.push_back({up_to, exceptions});
  }

  /// Smallest size >= `bound` that nothing rules out.
  [[nodiscard]] std::int64_t provenBound(std::int64_t bound) const {
    std::int64_t shard = bound;
    for (;;) {
      if (refuted_.count(shard) != 0) {
        shard = nextPlaceableShard(problem_, shard + problem_.align_elems);
        continue;
      }
      const auto covering = std::find_if(rules_.begin(), rules_.end(), [&](const Rule& rule) {
        return shard <= rule.up_to && !rule.exceptions.contains(shard);
      });
      if (covering == rules_.end()) return shard;
      const std::int64_t past = nextPlaceableShard(problem_, covering->up_to + problem_.align_elems);
      shard = covering->exceptions.next(shard, past);
    }
  }

 private:
  struct Rule {
    std::int64_t up_to;
    PeriodicSizes exceptions;
  };

  const LayoutProblem& problem_;
  std::set<std::int64_t> refuted_;
  std::vector<Rule> rules_;  // the first: the problem's own ordinary sizes
};

/// The search over sizes (see search.hpp). One per solveLayout call.
class SizeSearch {
 public:
  SizeSearch(const LayoutProblem& problem, const SearchOptions& options)
      : problem_(problem),
        options_(options),
        portfolio_(problem, options),
        exceptional_(exceptionalSizes(problem, problem.items)),
        heavy_(heavySizes(problem, portfolio_.classes(), 3)),
        refutations_(problem, exceptional_),
        bound_(computeLowerBound(problem).shard_elems) {}

  SearchResult run() {
    if (!scanUpward(options_.scan_work)) probe();
    // Without the beam scanUpward went on, coarser, until something fitted.
    if (portfolio_.canProbe() && searched_to_ < best_->layout.shard_elems) {
      // The order search has not seen every size below the result. Where the
      // heaviest classes straddle every boundary without a gap (a MoE
      // layer's experts) bisection lands between the sizes that allow it:
      // they go first, while the searches near the result have runs left.
      tryPeriodicSizes(heavy_);
      bisect();
      bisectOnLattice();
      tryPeriodicSizes({exceptional_});
    }
    scanFixedOrdersBelowBest();
    std::int64_t proof_work = options_.proof_work;
    proveExhaustively(proof_work);
    closeTheProof(proof_work);
    return finish();
  }

 private:
  /// Every placeable size upwards from the bound with the fixed orders and
  /// the order search, until one fits or `work` runs out. Without the beam
  /// to jump with, it goes on past the budget with a doubling step (sizes
  /// get skipped: the scan is no longer complete).
  bool scanUpward(std::int64_t work) {
    std::int64_t step = problem_.align_elems;
    if (!portfolio_.canScan()) {  // the beam or the interleaved search alone
      scanned_to_ = searched_to_ = bound_;
      return false;
    }
    for (scanned_to_ = bound_;; scanned_to_ = nextPlaceableShard(problem_, scanned_to_ + step)) {
      if (attempt(scanned_to_, Reach::kScan)) {
        scanned_to_ += problem_.align_elems;
        searched_to_ = std::min(searched_to_, scanned_to_);
        return true;
      }
      if (!last_searched_) searched_to_ = std::min(searched_to_, scanned_to_);
      if (portfolio_.work() <= work) continue;
      if (portfolio_.canProbe()) {
        scanned_to_ = nextPlaceableShard(problem_, scanned_to_ + problem_.align_elems);
        searched_to_ = std::min(searched_to_, scanned_to_);
        return false;
      }
      complete_ = false;
      step *= 2;
    }
  }

  /// Sizes growing geometrically from the end of the scan until one fits.
  void probe() {
    std::int64_t step = std::max(problem_.align_elems, roundUp(bound_ >> 12, problem_.align_elems));
    for (std::int64_t shard = scanned_to_;; shard = nextPlaceableShard(problem_, shard + step), step *= 2) {
      if (attempt(shard, Reach::kProbe)) return;
      // Where the probe's searches are weaker than the bisection's, its
      // failures prove little: the bisection starts lower.
      if (last_thorough_) probed_below_ = shard;
    }
  }

  /// Halves the interval between the last size that failed and the best, at
  /// ordinary sizes (where feasibility is monotone).
  void bisect() {
    // The last halvings gain ever less: a twentieth of a percent where an
    // attempt is dear (a run of an interleaved or exhaustive search over a
    // MoE layer, about 1 ms), a hundredth where it is a heuristic (its
    // failures prove nothing); only cheap exact searches go on to the last
    // element. (Proofs, when asked for, go on from the bound it leaves.)
    const auto precision = [&](std::int64_t last_cost) -> std::int64_t {
      if (last_cost > options_.interleave_work / 4) return 2000;
      return last_searched_ ? 0 : 10000;
    };
    std::int64_t low = probed_below_ > 0 ? probed_below_ : searched_to_ - problem_.align_elems;
    for (std::int64_t last_cost = 0;;) {
      const std::int64_t above = low + problem_.align_elems;
      const std::int64_t best = best_->layout.shard_elems;
      if (const std::int64_t parts = precision(last_cost); parts > 0 && best - low <= best / parts) return;
      const std::int64_t middle = ordinaryAtOrAbove(std::max(above, low + (best - low) / 2), best);
      const std::int64_t next = middle < best ? middle : ordinaryAtOrAbove(above, best);
      if (next >= best_->layout.shard_elems) return;
      const std::int64_t before = portfolio_.work();
      if (ruledOut(next) || !attempt(next, Reach::kSettle)) low = next;
      last_cost = portfolio_.work() - before;
    }
  }

  /// Bisection on the multiples of P, the lcm of the block periods of every
  /// tensor long enough to span a whole shard in the range (none: ordinary
  /// bisection covers it). Along them feasibility is monotone again: a layout
  /// at S carries over to S + kP shard by shard, a spanning tensor's middle
  /// growing by whole blocks. Where a tensor is longer than two shards every
  /// placeable size is such a multiple and ordinary bisection has none.
  void bisectOnLattice() {
    const std::int64_t best = best_->layout.shard_elems;
    const std::int64_t from = refutations_.provenBound(bound_);
    std::int64_t period = problem_.align_elems;
    for (const LayoutItem& item : problem_.items) {
      if (item.numel < from) continue;  // shorter than every size in the range
      const std::int64_t own = lcm64(problem_.align_elems, item.granularity);
      if (own >= best || period >= best / own) return;  // no multiple below the best (and no overflow)
      period = lcm64(period, own);
    }
    if (period == problem_.align_elems) return;
    std::int64_t low = roundUp(from, period) - period;  // below the bound: ruled out
    for (;;) {
      const std::int64_t steps = (best_->layout.shard_elems - 1 - low) / period;  // multiples in (low, best)
      if (steps < 1) return;
      const std::int64_t middle = low + (steps + 1) / 2 * period;
      if (nextPlaceableShard(problem_, middle) != middle || ruledOut(middle) || !attempt(middle, Reach::kSettle)) {
        low = middle;
      }
    }
  }

  /// The sizes of `sets` below the best, upwards, set by set (each success
  /// narrows the range for the next): the heavy ones, where the heaviest
  /// classes pack without gaps, or the exceptional ones, where feasibility
  /// may jump down. The order search runs at each, whatever it did elsewhere.
  void tryPeriodicSizes(const std::vector<PeriodicSizes>& sets) {
    const std::int64_t limit = portfolio_.work() + options_.scan_work;
    std::int64_t skipped = 0;  // sizes ruled out: a unit of work each, so that the walk ends
    for (const PeriodicSizes& sizes : sets) {
      for (std::int64_t shard = sizes.next(searched_to_, best_->layout.shard_elems); shard < best_->layout.shard_elems;
           shard = sizes.next(shard + problem_.align_elems, best_->layout.shard_elems)) {
        if (portfolio_.work() + skipped > limit) {
          complete_ = false;
          return;
        }
        if (ruledOut(shard)) {
          ++skipped;
        } else if (attempt(shard, Reach::kSettle, true)) {
          break;
        }
      }
    }
  }

  /// Every size left below the best with the fixed orders (their feasibility
  /// is not monotone), as far as the budget goes: when it gets there the
  /// result is never above any of their optima.
  void scanFixedOrdersBelowBest() {
    const std::int64_t limit = portfolio_.work() + options_.scan_work;
    for (std::int64_t shard = scanned_to_; shard < best_->layout.shard_elems;
         shard = nextPlaceableShard(problem_, shard + problem_.align_elems)) {
      if (portfolio_.work() > limit) {
        complete_ = false;
        return;
      }
      if (auto found = portfolio_.fixedOrdersAt(shard)) {
        record(shard, std::move(*found));
        return;
      }
    }
  }

  /// A relaxation of the problem (every layout of the problem is one of it,
  /// so what it refutes is refuted) for the exhaustive search between `from`
  /// and `to`: the tensors that make more than kExceptionalChecks exceptional
  /// sizes there get 1-element blocks (their exceptional sizes go), and while
  /// the unit has too many multisets for the search its classes are shrunk as
  /// `Shrinking` says. `relaxes`: it differs from the problem; `cost`: of one
  /// exhaustive run on it.
  struct Relaxation {
    LayoutProblem problem;
    std::int64_t max_states;                ///< what its classes are shrunk to
    std::set<std::int64_t> pooled_lengths;  ///< classify's: pooled whatever their counts
    bool relaxes = false;
    std::int64_t cost = 0;

    [[nodiscard]] std::vector<ItemClass> classes() const { return classify(problem, pooled_lengths); }
  };
  enum class Shrinking : std::uint8_t {
    kLeaveOut,             ///< the lightest classes left out, up to 1% of the elements
    kMergeLeaveOutLittle,  ///< classes of one length merged, then fewer left out (see relaxationBetween)
    kPoolLeaveOutLittle,   ///< lengths pooled, then fewer left out
  };

  /// With SearchOptions::proof_work: bisection with the exhaustive search
  /// between the proven bound and the result, on a relaxation of the problem
  /// whose exceptional sizes there are few (so bisection covers the range) and
  /// whose class multisets are few enough for the search, then the sizes left
  /// open one by one. A relaxation refuting a size refutes it for the
  /// problem; where there is none, a layout found is the new result. Where
  /// the classes must shrink, up to three relaxations in turn: none is the
  /// tighter on every unit (tensors left out are room the relaxation gains;
  /// pooled lengths, the blocks of a few tensors that every tensor of their
  /// length gets).
  void proveExhaustively(std::int64_t& work) {
    const std::int64_t open = refutations_.provenBound(bound_);
    if (work <= 0 || open >= best_->layout.shard_elems) return;
    constexpr std::array kShrinkings{Shrinking::kLeaveOut, Shrinking::kMergeLeaveOutLittle,
                                     Shrinking::kPoolLeaveOutLittle};
    // A few runs for each relaxation: the first, just below the result,
    // refutes the whole range where the result is optimal; a tighter
    // relaxation too dear to run at all proves nothing.
    constexpr std::int64_t kRunsEach = 4;
    const auto columns = static_cast<std::int64_t>(portfolio_.classes().size());
    const std::int64_t max_states =
        std::clamp<std::int64_t>(work / static_cast<std::int64_t>(kShrinkings.size()) / (kRunsEach * columns),
                                 std::int64_t{1} << 16, ExhaustiveSearch::kExhaustiveStates);
    std::vector<Relaxation> relaxations;
    for (const Shrinking shrinking : kShrinkings) {
      Relaxation relaxation = relaxationBetween(open, best_->layout.shard_elems, shrinking, max_states);
      const bool seen = std::any_of(relaxations.begin(), relaxations.end(), [&](const Relaxation& known) {
        return known.pooled_lengths == relaxation.pooled_lengths && sameItems(known.problem, relaxation.problem);
      });
      if (!seen && relaxation.cost > 0) relaxations.push_back(std::move(relaxation));
    }
    // The cheaper first, so that the dearer ones get what it leaves.
    std::sort(relaxations.begin(), relaxations.end(),
              [](const Relaxation& x, const Relaxation& y) { return x.cost < y.cost; });
    // Each an equal share of the work (the last what the others left): a
    // cheap but loose one could spend it all on sizes that fit it.
    for (std::size_t i = 0; i < relaxations.size(); ++i) {
      const std::int64_t from = refutations_.provenBound(bound_);
      if (work <= 0 || from >= best_->layout.shard_elems) return;
      std::int64_t share = work / static_cast<std::int64_t>(relaxations.size() - i);
      work -= share;
      proveOn(relaxations[i], from, share);
      work += share;  // what it left
    }
  }

  static bool sameItems(const LayoutProblem& x, const LayoutProblem& y) {
    return std::equal(
        x.items.begin(), x.items.end(), y.items.begin(), y.items.end(),
        [](const LayoutItem& a, const LayoutItem& b) { return a.numel == b.numel && a.granularity == b.granularity; });
  }

  void proveOn(const Relaxation& relaxation, std::int64_t open, std::int64_t& work) {
    // Named members, not a structured binding: C++17 lambdas cannot capture one (clang rejects it).
    const LayoutProblem& relaxed = relaxation.problem;
    const bool relaxes = relaxation.relaxes;
    ExhaustiveSearch search(relaxed, relaxation.classes());
    if (search.states() > relaxation.max_states) return;
    const PeriodicSizes exceptions = exceptionalSizes(problem_, relaxed.items);
    // A size at which `search` runs: false once the work runs out.
    const auto decide = [&](std::int64_t shard, bool& fits) {
      if (work < search.cost()) return false;
      work -= search.cost();
      ++sizes_tried_;
      fits = search.fits(shard);
      if (!fits) refutations_.add(shard);
      if (fits && !relaxes) {
        if (auto offsets = search.layout()) {
          record(shard, Attempt{std::move(offsets), Strategy::kExhaustiveSearch, false, false});
        }
      }
      return true;
    };
    std::int64_t refuted = 0;  // every size up to it but `exceptions` is ruled out
    std::int64_t low = open - problem_.align_elems;
    std::int64_t high = best_->layout.shard_elems;
    // The first try is just below the result: where the search found the
    // optimum (the common case), one refutation covers the whole range.
    for (bool fits = false, first = true;; first = false) {
      const std::int64_t middle =
          first ? ordinaryBelow(high, low, exceptions)
                : ordinaryAtOrAbove(std::max(low + problem_.align_elems, low + (high - low) / 2), exceptions, high);
      if (middle >= high || !decide(middle, fits)) break;
      (fits ? high : low) = middle;
      if (!fits) refuted = middle;
    }
    refutations_.ruleOut(refuted, exceptions);
    // Then the smallest size nothing rules out, again and again, until one
    // fits: the exceptional sizes bisection cannot cover, below the sizes it
    // refuted and above them (where every size in range is exceptional, it
    // had nothing to halve).
    bool fits = false;
    for (std::int64_t shard = refutations_.provenBound(bound_); shard < high && decide(shard, fits) && !fits;
         shard = refutations_.provenBound(bound_)) {
    }
  }

  /// (`cost` 0: still too many multisets for the search.)
  Relaxation relaxationBetween(std::int64_t from, std::int64_t to, Shrinking shrinking, std::int64_t max_states) const {
    constexpr std::int64_t kExceptionalChecks = 8;
    Relaxation relaxation{problem_, max_states, {}, false, 0};
    for (LayoutItem& item : relaxation.problem.items) {
      const std::int64_t period = lcm64(problem_.align_elems, item.granularity);
      const std::int64_t below = std::min(to, item.numel);
      if (period <= problem_.align_elems || below <= from) continue;
      if ((below - 1) / period - (from - 1) / period > kExceptionalChecks) {
        item.granularity = 1;
        relaxation.relaxes = true;
      }
    }
    // Tensors left out are room the relaxation gains at every size: where
    // lengths are pooled as well, at most a quarter of what the range
    // [from, to) adds on all ranks, or it fits at every size there.
    const std::int64_t one_percent = totalNumel(problem_) / 100;
    const std::int64_t little = std::min(one_percent, (to - from) * problem_.devices / 4);
    switch (shrinking) {
      case Shrinking::kLeaveOut:
        leaveOutLightClasses(relaxation, one_percent);
        break;
      case Shrinking::kMergeLeaveOutLittle:
        mergeClassesOfOneLength(relaxation);
        leaveOutLightClasses(relaxation, little);
        break;
      case Shrinking::kPoolLeaveOutLittle:
        poolLengths(relaxation);
        leaveOutLightClasses(relaxation, little);
        break;
    }
    const ExhaustiveSearch search(relaxation.problem, relaxation.classes());
    if (search.states() <= max_states) relaxation.cost = search.cost();
    return relaxation;
  }

  /// While the unit has too many multisets for the exhaustive search, two
  /// classes of one length become one whose block is the gcd of theirs
  /// (every cut either allowed is allowed): first the pair where the fewest
  /// tensors gain cuts, then the pair whose blocks shrink least. So a few
  /// shared experts' fine blocks are lent to a few other tensors before the
  /// routed experts' ones are to hundreds.
  static void mergeClassesOfOneLength(Relaxation& relaxation) {
    for (;;) {
      const std::vector<ItemClass> classes = relaxation.classes();
      if (multisets(classes) <= static_cast<double>(relaxation.max_states)) return;
      const auto finest = [](const ItemClass& c) {
        std::int64_t block = c.blocks.front().value();
        for (const Divisor& b : c.blocks) block = std::min(block, b.value());
        return block;
      };
      const ItemClass* first = nullptr;
      const ItemClass* second = nullptr;
      std::int64_t merged = 0;
      std::pair<std::size_t, double> least{std::numeric_limits<std::size_t>::max(), 0};  // (gaining, kept)
      for (std::size_t i = 0; i < classes.size(); ++i) {
        for (std::size_t j = i + 1; j < classes.size() && classes[j].item.numel == classes[i].item.numel; ++j) {
          const std::int64_t block = std::gcd(finest(classes[i]), finest(classes[j]));
          std::size_t gaining = 0;  // tensors whose cuts the merge adds to
          for (const ItemClass* c : {&classes[i], &classes[j]}) gaining += finest(*c) != block ? c->members.size() : 0;
          const double kept =
              static_cast<double>(block) / static_cast<double>(std::max(finest(classes[i]), finest(classes[j])));
          if (gaining < least.first || (gaining == least.first && kept > least.second)) {
            least = {gaining, kept};
            first = &classes[i];
            second = &classes[j];
            merged = block;
          }
        }
      }
      if (first == nullptr) return;
      for (const ItemClass* c : {first, second}) {
        for (const std::uint32_t member : c->members) relaxation.problem.items[member].granularity = merged;
      }
      relaxation.relaxes = true;
    }
  }

  /// While the unit has too many multisets for the exhaustive search, the
  /// items of one length are pooled whatever their counts (classify): the
  /// blocks of a few of them, finer than the rest of their length's, are lent
  /// to all of them. The length whose pooling leaves the fewest multisets
  /// first.
  static void poolLengths(Relaxation& relaxation) {
    std::set<std::int64_t> lengths;
    for (const LayoutItem& item : relaxation.problem.items) lengths.insert(item.numel);
    for (double states = multisets(relaxation.classes()); states > static_cast<double>(relaxation.max_states);) {
      std::optional<std::int64_t> fewest;
      for (const std::int64_t length : lengths) {
        if (!relaxation.pooled_lengths.insert(length).second) continue;
        const double pooled = multisets(relaxation.classes());
        relaxation.pooled_lengths.erase(length);
        if (pooled < states) {
          states = pooled;
          fewest = length;
        }
      }
      if (!fewest) return;
      relaxation.pooled_lengths.insert(*fewest);
      relaxation.relaxes = true;
    }
  }

  static void leaveOutLightClasses(Relaxation& relaxation, std::int64_t allowed) {
    std::vector<ItemClass> classes = relaxation.classes();
    if (multisets(classes) <= static_cast<double>(relaxation.max_states)) return;
    const auto mass = [](const ItemClass& c) { return c.item.numel * static_cast<std::int64_t>(c.members.size()); };
    std::sort(classes.begin(), classes.end(),
              [&](const ItemClass& x, const ItemClass& y) { return mass(x) < mass(y); });
    std::vector<char> left_out(relaxation.problem.items.size(), 0);
    double states = multisets(classes);
    for (const ItemClass& c : classes) {
      if (states <= static_cast<double>(relaxation.max_states) || mass(c) > allowed) break;
      allowed -= mass(c);
      states /= static_cast<double>(c.members.size() + 1);
      for (const std::uint32_t member : c.members) left_out[member] = 1;
    }
    std::vector<LayoutItem> kept;
    for (std::size_t i = 0; i < left_out.size(); ++i) {
      if (!left_out[i]) kept.push_back(relaxation.problem.items[i]);
    }
    relaxation.relaxes = relaxation.relaxes || kept.size() < left_out.size();
    relaxation.problem.items = std::move(kept);
  }

  /// With SearchOptions::proof_work, the order search on the smallest size
  /// nothing rules out yet, again and again, until the proven bound meets
  /// the result (or the work runs out). A layout it finds there is the new,
  /// optimal, result.
  void closeTheProof(std::int64_t& work) {
    while (work > 0) {
      const std::int64_t shard = refutations_.provenBound(bound_);
      if (shard >= best_->layout.shard_elems) return;
      ++sizes_tried_;
      Attempt found = portfolio_.exactlyAt(shard, work);
      if (found.offsets) {
        record(shard, std::move(found));
        return;
      }
      if (!found.refuted) return;
      refutations_.add(shard);
    }
  }

  /// Largest placeable size in (low, high) not in `exceptional`, looked for
  /// among the 64 sizes below `high` (placeability only jumps upwards); else
  /// the midpoint's ordinary size.
  std::int64_t ordinaryBelow(std::int64_t high, std::int64_t low, const PeriodicSizes& exceptional) const {
    constexpr int kSizesLooked = 64;
    std::int64_t shard = high - problem_.align_elems;
    for (int step = 0; step < kSizesLooked && shard > low; ++step, shard -= problem_.align_elems) {
      if (!exceptional.contains(shard) && nextPlaceableShard(problem_, shard) == shard) return shard;
    }
    return ordinaryAtOrAbove(std::max(low + problem_.align_elems, low + (high - low) / 2), exceptional, high);
  }

  /// Smallest placeable size >= `shard` not in `exceptional` (default: the
  /// problem's), looked for among the next 1,024 placeable sizes below
  /// `limit`; else `limit`. (Where a tensor is longer than two shards every
  /// placeable size below half its length is exceptional: an exhaustive walk
  /// could take billions of steps.)
  std::int64_t ordinaryAtOrAbove(std::int64_t shard, std::int64_t limit) const {
    return ordinaryAtOrAbove(shard, exceptional_, limit);
  }
  std::int64_t ordinaryAtOrAbove(std::int64_t shard, const PeriodicSizes& exceptional, std::int64_t limit) const {
    constexpr int kSizesLooked = 1024;
    shard = nextPlaceableShard(problem_, roundUp(shard, problem_.align_elems));
    for (int step = 0; step < kSizesLooked && shard < limit; ++step) {
      if (!exceptional.contains(shard)) return shard;
      shard = nextPlaceableShard(problem_, shard + problem_.align_elems);
    }
    return limit;
  }

  /// A size the refutations so far rule out (no need to try it).
  bool ruledOut(std::int64_t shard) const { return refutations_.provenBound(shard) != shard; }

  bool attempt(std::int64_t shard, Reach reach, bool insist = false) {
    ++sizes_tried_;
    Attempt found = portfolio_.at(shard, reach, insist);
    last_searched_ = found.searched;
    last_thorough_ = found.thorough || found.refuted;
    if (found.refuted) refutations_.add(shard);
    if (!found.offsets) return false;
    record(shard, std::move(found));
    return true;
  }

  void record(std::int64_t shard, Attempt found) {
    if (best_ && best_->layout.shard_elems <= shard) return;
    best_ = SearchResult{};
    best_->layout = Layout{shard, std::move(*found.offsets)};
    best_->strategy = found.strategy;
  }

  SearchResult finish() {
    SearchResult result = std::move(*best_);
    result.shard_sizes_tried = sizes_tried_;
    result.scan_complete = complete_;
    result.proven_bound_elems = std::min(refutations_.provenBound(bound_), result.layout.shard_elems);
    result.proven_optimal = result.proven_bound_elems == result.layout.shard_elems;
    return result;
  }

  const LayoutProblem& problem_;
  const SearchOptions& options_;
  Portfolio portfolio_;
  PeriodicSizes exceptional_;
  std::vector<PeriodicSizes> heavy_;
  Refutations refutations_;
  std::int64_t bound_;
  std::optional<SearchResult> best_;
  std::int64_t scanned_to_ = 0;  // every size below was tried by the fixed orders
  std::int64_t searched_to_ = std::numeric_limits<std::int64_t>::max();  // ... and by the order search
  bool last_searched_ = false;
  bool last_thorough_ = false;
  std::int64_t probed_below_ = 0;
  std::int64_t sizes_tried_ = 0;
  bool complete_ = true;
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
    case Strategy::kBeamSearch:
      return "beam-search";
    case Strategy::kExhaustiveSearch:
      return "exhaustive-search";
    case Strategy::kInterleavedSearch:
      return "interleaved-search";
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
  const std::vector<ItemClass> classes = classify(problem);
  return OrderSearch(problem, classes).run(shard_elems, node_budget, exact);
}

std::optional<std::vector<std::int64_t>> placeByBeam(const LayoutProblem& problem, std::int64_t shard_elems,
                                                     std::int64_t width) {
  const std::vector<ItemClass> classes = classify(problem);
  return BeamSearch(problem, classes, beamWidth(problem, classes.size(), width)).run(shard_elems);
}

ExhaustiveOutcome placeExhaustively(const LayoutProblem& problem, std::int64_t shard_elems) {
  const std::vector<ItemClass> classes = classify(problem);
  ExhaustiveSearch search(problem, classes);
  if (search.states() > ExhaustiveSearch::kExhaustiveStates) return {};
  return {true, search.run(shard_elems)};
}

std::optional<std::vector<std::int64_t>> placeInterleaved(const LayoutProblem& problem, std::int64_t shard_elems,
                                                          std::int64_t work) {
  std::vector<ItemClass> columns = interleavedColumns(classify(problem), work);
  if (columns.empty()) return std::nullopt;
  return ExhaustiveSearch(problem, std::move(columns)).run(shard_elems);
}

SearchResult solveLayout(const LayoutProblem& problem, const SearchOptions& options) {
  return SizeSearch(problem, options).run();
}

}  // namespace dbuf::planner
