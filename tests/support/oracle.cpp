#include "support/oracle.hpp"

#include <algorithm>
#include <numeric>
#include <set>
#include <sstream>

namespace dbuf::planner::testing {
namespace {

// Deliberately local helpers: nothing from the planner or dbuf/common is used
// for the arithmetic the oracle checks.
std::int64_t roundUpTo(std::int64_t value, std::int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

std::int64_t sumNumel(const LayoutProblem& problem) {
  std::int64_t total = 0;
  for (const LayoutItem& item : problem.items) total += item.numel;
  return total;
}

/// Exhaustive search for one fixed order at one S: can order[k..] be placed
/// with the first of them at an offset >= position? Memoised on (k, position)
/// only to avoid recomputing the same sub-question; every aligned offset is
/// tried.
class FixedOrderSearch {
 public:
  FixedOrderSearch(const LayoutProblem& problem, std::span<const std::uint32_t> order, std::int64_t shard)
      : problem_(problem), order_(order), shard_(shard), capacity_(problem.devices * shard) {
    rest_.assign(order.size() + 1, 0);
    for (std::size_t k = order.size(); k-- > 0;) rest_[k] = rest_[k + 1] + problem.items[order[k]].numel;
    memo_.assign((order.size() + 1) * static_cast<std::size_t>(capacity_ + 1), kUnknown);
  }

  bool feasible(std::size_t k, std::int64_t position) {
    if (k == order_.size()) return true;
    if (position > capacity_) return false;
    std::int8_t& memo = memo_[k * static_cast<std::size_t>(capacity_ + 1) + static_cast<std::size_t>(position)];
    if (memo != kUnknown) return memo == kYes;
    const LayoutItem& item = problem_.items[order_[k]];
    bool found = false;
    for (std::int64_t offset = roundUpTo(position, problem_.align_elems); offset + rest_[k] <= capacity_;
         offset += problem_.align_elems) {
      if (!offsetValid(item, offset, shard_, problem_.align_elems)) continue;
      if (feasible(k + 1, offset + item.numel)) {
        found = true;
        break;
      }
    }
    memo = found ? kYes : kNo;
    return found;
  }

  /// After feasible(0, 0): one placement, rebuilt by taking the first offset
  /// whose remainder is feasible (all memoised already).
  std::vector<std::int64_t> placement() {
    std::vector<std::int64_t> offsets(problem_.items.size(), 0);
    std::int64_t position = 0;
    for (std::size_t k = 0; k < order_.size(); ++k) {
      const LayoutItem& item = problem_.items[order_[k]];
      for (std::int64_t offset = roundUpTo(position, problem_.align_elems); offset + rest_[k] <= capacity_;
           offset += problem_.align_elems) {
        if (offsetValid(item, offset, shard_, problem_.align_elems) && feasible(k + 1, offset + item.numel)) {
          offsets[order_[k]] = offset;
          position = offset + item.numel;
          break;
        }
      }
    }
    return offsets;
  }

 private:
  static constexpr std::int8_t kUnknown = -1;
  static constexpr std::int8_t kNo = 0;
  static constexpr std::int8_t kYes = 1;

  const LayoutProblem& problem_;
  std::span<const std::uint32_t> order_;
  std::int64_t shard_;
  std::int64_t capacity_;
  std::vector<std::int64_t> rest_;
  std::vector<std::int8_t> memo_;
};

/// Depth-first enumeration of every order with earliest placement. Items
/// identical in (numel, granularity) are interchangeable, so only the first
/// unused one of each kind is tried at a depth.
class AllOrders {
 public:
  AllOrders(const LayoutProblem& problem, std::int64_t shard)
      : problem_(problem), shard_(shard), capacity_(problem.devices * shard) {
    used_.assign(problem.items.size(), 0);
    offsets_.assign(problem.items.size(), 0);
  }

  bool search(std::size_t depth, std::int64_t position, std::int64_t remaining) {
    if (depth == problem_.items.size()) return true;
    for (std::size_t i = 0; i < problem_.items.size(); ++i) {
      if (used_[i] || duplicateOfUnusedEarlier(i)) continue;
      const LayoutItem& item = problem_.items[i];
      const auto offset = bruteEarliestOffset(position, item, shard_, problem_.align_elems);
      if (!offset || *offset + remaining > capacity_) continue;
      used_[i] = 1;
      offsets_[i] = *offset;
      if (search(depth + 1, *offset + item.numel, remaining - item.numel)) return true;
      used_[i] = 0;
    }
    return false;
  }

  [[nodiscard]] const std::vector<std::int64_t>& offsets() const { return offsets_; }

 private:
  bool duplicateOfUnusedEarlier(std::size_t i) const {
    for (std::size_t j = 0; j < i; ++j) {
      if (!used_[j] && problem_.items[j].numel == problem_.items[i].numel &&
          problem_.items[j].granularity == problem_.items[i].granularity) {
        return true;
      }
    }
    return false;
  }

  const LayoutProblem& problem_;
  std::int64_t shard_;
  std::int64_t capacity_;
  std::vector<char> used_;  // not vector<bool>: GCC 12 -Wnull-dereference false positive
  std::vector<std::int64_t> offsets_;
};

}  // namespace

bool offsetValid(const LayoutItem& item, std::int64_t offset, std::int64_t shard, std::int64_t align) {
  if (offset < 0 || offset % align != 0) return false;
  for (std::int64_t boundary = (offset / shard + 1) * shard; boundary < offset + item.numel; boundary += shard) {
    if ((boundary - offset) % item.granularity != 0) return false;
  }
  return true;
}

std::int64_t bruteSplitBlocks(const LayoutItem& item, std::int64_t offset, std::int64_t shard) {
  std::set<std::int64_t> split;
  for (std::int64_t boundary = (offset / shard + 1) * shard; boundary < offset + item.numel; boundary += shard) {
    const std::int64_t cut = boundary - offset;
    if (cut % item.granularity != 0) split.insert(cut / item.granularity);
  }
  return static_cast<std::int64_t>(split.size());
}

std::optional<std::int64_t> bruteEarliestOffset(std::int64_t position, const LayoutItem& item, std::int64_t shard,
                                                std::int64_t align) {
  // Validity depends only on offset mod S (every boundary k*S exists), and
  // S is a multiple of a, so one period of aligned offsets covers every case.
  const std::int64_t first = roundUpTo(std::max<std::int64_t>(position, 0), align);
  for (std::int64_t offset = first; offset < first + shard; offset += align) {
    if (offsetValid(item, offset, shard, align)) return offset;
  }
  return std::nullopt;
}

bool brutePlaceable(const LayoutItem& item, std::int64_t shard, std::int64_t align) {
  return bruteEarliestOffset(0, item, shard, align).has_value();
}

std::string checkLayout(const LayoutProblem& problem, std::int64_t shard, std::span<const std::int64_t> offsets) {
  if (shard <= 0) return "S is not positive";
  if (shard % problem.align_elems != 0) return "S is not a multiple of the alignment";
  if (offsets.size() != problem.items.size()) return "wrong number of offsets";
  std::vector<std::size_t> by_offset(offsets.size());
  std::iota(by_offset.begin(), by_offset.end(), std::size_t{0});
  std::sort(by_offset.begin(), by_offset.end(), [&](std::size_t x, std::size_t y) { return offsets[x] < offsets[y]; });
  std::int64_t previous_end = 0;
  for (const std::size_t i : by_offset) {
    const LayoutItem& item = problem.items[i];
    const std::string which = "item " + std::to_string(i) + " at " + std::to_string(offsets[i]);
    if (offsets[i] < 0) return which + ": negative offset";
    if (offsets[i] % problem.align_elems != 0) return which + ": misaligned";
    if (offsets[i] < previous_end) return which + ": overlap";
    if (offsets[i] + item.numel > problem.devices * shard) return which + ": past V*S";
    if (!offsetValid(item, offsets[i], shard, problem.align_elems)) return which + ": split block";
    previous_end = offsets[i] + item.numel;
  }
  return {};
}

bool fixedOrderFeasible(const LayoutProblem& problem, std::span<const std::uint32_t> order, std::int64_t shard,
                        std::vector<std::int64_t>* offsets) {
  FixedOrderSearch search(problem, order, shard);
  if (!search.feasible(0, 0)) return false;
  if (offsets) *offsets = search.placement();
  return true;
}

std::int64_t bruteForceFixedOrder(const LayoutProblem& problem, std::span<const std::uint32_t> order) {
  // Terminates: at S = sum of aligned lengths everything fits in shard 0.
  for (std::int64_t shard = problem.align_elems;; shard += problem.align_elems) {
    if (fixedOrderFeasible(problem, order, shard)) return shard;
  }
}

bool earliestPlacementFits(const LayoutProblem& problem, std::span<const std::uint32_t> order, std::int64_t shard,
                           std::vector<std::int64_t>* offsets) {
  std::vector<std::int64_t> placed(problem.items.size(), 0);
  std::int64_t position = 0;
  for (const std::uint32_t index : order) {
    const LayoutItem& item = problem.items[index];
    const auto offset = bruteEarliestOffset(position, item, shard, problem.align_elems);
    if (!offset || *offset + item.numel > problem.devices * shard) return false;
    placed[index] = *offset;
    position = *offset + item.numel;
  }
  if (offsets) *offsets = std::move(placed);
  return true;
}

bool anyOrderFits(const LayoutProblem& problem, std::int64_t shard, std::vector<std::int64_t>* offsets) {
  AllOrders search(problem, shard);
  if (!search.search(0, 0, sumNumel(problem))) return false;
  if (offsets) *offsets = search.offsets();
  return true;
}

OracleResult oracleSolve(const LayoutProblem& problem) {
  // No layout of N elements fits in V*S < N, so the scan may start at
  // ceil(N/V) rounded up to a.
  const std::int64_t total = sumNumel(problem);
  OracleResult result;
  for (std::int64_t shard = roundUpTo((total + problem.devices - 1) / problem.devices, problem.align_elems);;
       shard += problem.align_elems) {
    if (anyOrderFits(problem, shard, &result.offsets)) {
      result.shard_elems = shard;
      return result;
    }
  }
}

std::int64_t oracleShard(const LayoutProblem& problem) { return oracleSolve(problem).shard_elems; }

std::int64_t uniform(std::mt19937_64& rng, std::int64_t lo, std::int64_t hi) {
  return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
}

namespace {

std::int64_t randomGranularity(std::mt19937_64& rng, std::int64_t numel) {
  std::int64_t granularity = 1;
  switch (uniform(rng, 0, 5)) {
    case 0: granularity = 1; break;
    case 1: granularity = numel; break;
    case 2: {  // a divisor of numel
      std::vector<std::int64_t> divisors;
      for (std::int64_t d = 1; d <= numel; ++d) {
        if (numel % d == 0) divisors.push_back(d);
      }
      granularity = divisors[static_cast<std::size_t>(uniform(rng, 0, static_cast<std::int64_t>(divisors.size()) - 1))];
      break;
    }
    case 3: granularity = uniform(rng, 2, std::max<std::int64_t>(2, numel)); break;  // often not a divisor
    default: granularity = uniform(rng, 2, 5); break;                               // small blocks
  }
  return std::clamp<std::int64_t>(granularity, 1, numel);
}

}  // namespace

LayoutItem randomItem(std::mt19937_64& rng, std::int64_t max_numel) {
  const std::int64_t numel = uniform(rng, 1, max_numel);
  return {numel, randomGranularity(rng, numel)};
}

LayoutProblem randomProblem(std::mt19937_64& rng, const GeneratorOptions& options) {
  LayoutProblem problem;
  const auto count = uniform(rng, options.min_items, options.max_items);
  std::int64_t budget = options.max_total;
  for (std::int64_t i = 0; i < count; ++i) {
    const std::int64_t left_after = count - i - 1;
    const std::int64_t cap = std::max<std::int64_t>(1, std::min(budget - left_after, 2 * options.max_total / count));
    LayoutItem item = randomItem(rng, cap);
    if (uniform(rng, 0, 99) < options.whole_percent) item.granularity = item.numel;
    // Now and then repeat an earlier item: identical tensors are common in
    // real units and exercise the search's class handling.
    if (!problem.items.empty() && uniform(rng, 0, 5) == 0) {
      const LayoutItem& copy =
          problem.items[static_cast<std::size_t>(uniform(rng, 0, static_cast<std::int64_t>(problem.items.size()) - 1))];
      if (copy.numel <= cap) item = copy;
    }
    problem.items.push_back(item);
    budget -= item.numel;
  }
  problem.devices = uniform(rng, 1, options.max_devices);
  problem.align_elems =
      options.aligns[static_cast<std::size_t>(uniform(rng, 0, static_cast<std::int64_t>(options.aligns.size()) - 1))];
  return problem;
}

std::string describe(const LayoutProblem& problem) {
  std::ostringstream out;
  out << "V=" << problem.devices << " a=" << problem.align_elems << " items=[";
  for (std::size_t i = 0; i < problem.items.size(); ++i) {
    out << (i ? ", " : "") << "(n=" << problem.items[i].numel << ",g=" << problem.items[i].granularity << ")";
  }
  out << "]";
  return out.str();
}

std::string describe(std::span<const std::int64_t> values) {
  std::ostringstream out;
  out << "[";
  for (std::size_t i = 0; i < values.size(); ++i) out << (i ? ", " : "") << values[i];
  out << "]";
  return out.str();
}

}  // namespace dbuf::planner::testing
