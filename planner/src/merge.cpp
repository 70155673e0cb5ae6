// Merging consecutive units under an unsharded-memory budget (merge.hpp).
//
// The choice is a shortest path over prefixes of the model: a partition is a
// sequence of runs [first, first + count), each a candidate allowed by the
// budget. Three quantities matter per run: its all-gather volume V*S, its
// unsharded bytes (V*S * element size) and its merges (count - 1). The
// objective (smallest peak reaching the target, then fewest merges, then
// least volume) is solved exactly with two dynamic programs:
//   - least volume over partitions whose runs all stay under a cap on bytes;
//   - for each number of merges m in turn, the least volume with exactly m
//     merges (a run of k units adds k - 1), stopping at the first m whose
//     least volume reaches the target;
// and a search over caps (a larger cap never hurts: the runs allowed only
// grow), the peak being the smallest cap at which the target is reached.
//
// S of a run is known exactly only after planning it (the layout search).
// Its proven lower bound (computeLowerBound on the concatenated problem) is
// cheap and never above S, so runs start with the bound as an optimistic
// estimate and are planned lazily: a program is solved with estimates, the
// runs of its answer that are not planned yet are planned, and it is solved
// again until its answer holds planned runs only. That answer is then exact
// (its value is true, and no other partition can beat a lower bound of its
// own). A run whose bound already exceeds the budget is no candidate, and
// since the bound only grows as a run is extended (more elements, more
// constraints), no longer run from the same first unit is one either.
//
// Runs are memoised by the sequence of distinct units they contain (a
// 61-layer model has 3-4 distinct units), so bounds and plans are computed
// once per distinct sequence.
#include "dbuf/planner/merge.hpp"

#include <algorithm>
#include <chrono>
#include <limits>
#include <map>
#include <optional>
#include <unordered_map>
#include <utility>

#include "dbuf/planner/baselines.hpp"
#include "dbuf/planner/bounds.hpp"

namespace dbuf::planner {
namespace {

constexpr std::int64_t kInf = std::numeric_limits<std::int64_t>::max();
constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();
// buildProblem's limit on V*N (positions stay inside int64): a longer run is
// not planned.
constexpr std::int64_t kMaxBufferElems = std::int64_t{1} << 60;

/// Saturating arithmetic on non-negative values.
std::int64_t satAdd(std::int64_t a, std::int64_t b) noexcept {
  return a > kInf - b ? kInf : a + b;
}
std::int64_t satMul(std::int64_t a, std::int64_t b) noexcept {
  return b != 0 && a > kInf / b ? kInf : a * b;
}

double millisSince(std::chrono::steady_clock::time_point started) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count();
}

UnitSpec concatenate(const std::vector<UnitSpec>& units, std::size_t first, std::size_t count) {
  UnitSpec merged{mergedName(units, first, count), {}};
  for (std::size_t u = first; u < first + count; ++u) {
    merged.tensors.insert(merged.tensors.end(), units[u].tensors.begin(), units[u].tensors.end());
  }
  return merged;
}

class Merger {
 public:
  Merger(const std::vector<UnitSpec>& units, const PlanOptions& options, const MergeOptions& merge)
      : units_(units),
        options_(options),
        budget_(merge.unsharded_budget_bytes),
        max_run_(static_cast<std::size_t>(merge.max_run_units)) {}

  Result<MergePlan> run() {
    if (auto distinct = distinctUnits(); !distinct) return std::move(distinct).error();
    enumerate();
    for (const Candidate& candidate : candidates_) {
      if (candidate.count > 1) continue;
      if (auto planned = plan(candidate.value); !planned) return std::move(planned).error();
    }
    const std::int64_t target = satAdd(numel_, numel_ / 20);  // floor(1.05 N): volumes are integers
    std::int64_t goal = target;
    auto peak = smallestPeak(goal);
    if (!peak) return std::move(peak).error();
    if (!peak->has_value()) {  // the target is out of reach: the least volume instead
      auto least = exactMinVolume(kInf);
      if (!least) return std::move(least).error();
      goal = (*least)->volume;  // singles are always allowed: a partition exists
      peak = smallestPeak(goal);
      if (!peak) return std::move(peak).error();
      if (!peak->has_value()) return makeError(ErrorCode::kInternal, "merge: the least volume is out of reach");
    }
    auto chosen = exactFewest(**peak, goal);
    if (!chosen) return std::move(chosen).error();
    if (!chosen->has_value()) return makeError(ErrorCode::kInternal, "merge: no partition at the chosen peak");
    return result(**chosen, target);
  }

 private:
  /// A distinct run: the sequence of distinct units it holds.
  struct Value {
    std::int64_t lower_bound = 0;  ///< proven bound on S
    std::int64_t shard = 0;        ///< S once planned, else 0
    std::int64_t elem_bytes = 1;
    std::size_t plan = kNone;          ///< index into plans_ once planned
    std::size_t first = 0, count = 0;  ///< the first run met with this sequence
  };
  struct Candidate {
    std::size_t first = 0;
    std::size_t count = 1;
    std::size_t value = 0;
  };
  struct Partition {
    std::vector<std::size_t> runs;  ///< indices into candidates_, in model order
    std::int64_t volume = 0;        ///< with the values known when it was found
  };

  Result<void> distinctUnits() {
    DistinctUnits distinct;
    ids_.reserve(units_.size());
    for (const UnitSpec& unit : units_) {
      if (const auto known = distinct.findOrAdd(unit)) {
        numel_ += totalNumel(problems_[*known]);
        ids_.push_back(static_cast<std::uint32_t>(*known));
        continue;
      }
      auto problem = buildProblem(unit, options_);
      if (!problem) return std::move(problem).error();
      numel_ += totalNumel(*problem);
      ids_.push_back(static_cast<std::uint32_t>(problems_.size()));
      problems_.push_back(std::move(*problem));
    }
    return {};
  }

  DType dtypeOf(std::size_t unit) const { return units_[unit].tensors.front().dtype; }

  /// Every run allowed by the bounds: within one dtype, within max_run_ units,
  /// and (for two units or more) a bound within the budget.
  void enumerate() {
    const std::size_t n = units_.size();
    ending_at_.assign(n + 1, {});
    for (std::size_t first = 0; first < n; ++first) {
      std::vector<std::uint32_t> key;
      LayoutProblem merged{{}, options_.devices, problems_[ids_[first]].align_elems};
      std::int64_t numel = 0;
      for (std::size_t last = first; last < n; ++last) {
        const std::size_t count = last - first + 1;
        if (count > 1 && (dtypeOf(last) != dtypeOf(first) || (max_run_ > 0 && count > max_run_))) break;
        const LayoutProblem& unit = problems_[ids_[last]];
        numel += totalNumel(unit);
        if (count > 1 && numel > kMaxBufferElems / options_.devices) break;
        key.push_back(ids_[last]);
        merged.items.insert(merged.items.end(), unit.items.begin(), unit.items.end());
        const auto [hit, inserted] = memo_.try_emplace(key, values_.size());
        if (inserted) {
          Value value;
          value.lower_bound = computeLowerBound(merged).shard_elems;
          value.elem_bytes = sizeBytes(dtypeOf(first));
          value.first = first;
          value.count = count;
          values_.push_back(value);
        }
        if (count > 1 && bytes(values_[hit->second]) > budget_) break;  // and so is every longer run
        ending_at_[first + count].push_back(candidates_.size());
        candidates_.push_back({first, count, hit->second});
      }
    }
  }

  std::int64_t volume(const Value& value) const {
    return satMul(options_.devices, value.plan != kNone ? value.shard : value.lower_bound);
  }
  std::int64_t bytes(const Value& value) const { return satMul(volume(value), value.elem_bytes); }

  bool allowed(const Candidate& candidate, std::int64_t cap) const {
    const std::int64_t size = bytes(values_[candidate.value]);
    return size <= cap && (candidate.count == 1 || size <= budget_);
  }

  Result<void> plan(std::size_t index) {
    Value& value = values_[index];
    if (value.plan != kNone) return {};
    auto planned = planUnit(concatenate(units_, value.first, value.count), options_);
    if (!planned) return std::move(planned).error();
    value.shard = planned->shard_elems;
    value.plan = plans_.size();
    plans_.push_back(std::move(*planned));
    return {};
  }

  /// Plans the runs of `partition` not planned yet; true if there was one.
  Result<bool> planUnplanned(const Partition& partition) {
    bool any = false;
    for (const std::size_t run : partition.runs) {
      const std::size_t index = candidates_[run].value;
      if (values_[index].plan != kNone) continue;
      if (auto planned = plan(index); !planned) return std::move(planned).error();
      any = true;
    }
    return any;
  }

  Partition trace(const std::vector<std::size_t>& parent, std::int64_t volume) const {
    Partition partition;
    partition.volume = volume;
    for (std::size_t end = units_.size(); end > 0; end = candidates_[partition.runs.back()].first) {
      partition.runs.push_back(parent[end]);
    }
    std::reverse(partition.runs.begin(), partition.runs.end());
    return partition;
  }

  /// Least volume (ties: fewest merges) with every run's bytes <= cap, with
  /// the values known now (a lower bound of the true one).
  std::optional<Partition> minVolume(std::int64_t cap) const {
    const std::size_t n = units_.size();
    std::vector<std::int64_t> best{0};  // best[end]: least volume of units [0, end)
    best.resize(n + 1, kInf);
    std::vector<std::size_t> merges(n + 1, 0), parent(n + 1, kNone);  // merges: where best is finite
    for (std::size_t end = 1; end <= n; ++end) {
      for (const std::size_t index : ending_at_[end]) {
        const Candidate& candidate = candidates_[index];
        if (best[candidate.first] == kInf || !allowed(candidate, cap)) continue;
        const std::int64_t total = satAdd(best[candidate.first], volume(values_[candidate.value]));
        const std::size_t merged = merges[candidate.first] + candidate.count - 1;
        if (total == kInf) continue;
        if (total < best[end] || (total == best[end] && merged < merges[end])) {
          best[end] = total;
          merges[end] = merged;
          parent[end] = index;
        }
      }
    }
    if (best[n] == kInf) return std::nullopt;
    return trace(parent, best[n]);
  }

  /// Fewest merges (ties: least volume) reaching `target` with every run's
  /// bytes <= cap, with the values known now; nullopt when no number of
  /// merges reaches it.
  std::optional<Partition> fewestMerges(std::int64_t cap, std::int64_t target) const {
    if (const auto least = minVolume(cap); !least || least->volume > target) return std::nullopt;
    const std::size_t n = units_.size();
    // level[m][end]: least volume of units [0, end) with m merges in all.
    std::vector<std::vector<std::int64_t>> level;
    std::vector<std::vector<std::size_t>> parent;
    for (std::size_t m = 0; m < n; ++m) {
      level.emplace_back(std::vector<std::int64_t>{m == 0 ? 0 : kInf});
      level.back().resize(n + 1, kInf);
      parent.emplace_back(n + 1, kNone);
      for (std::size_t end = 1; end <= n; ++end) {
        for (const std::size_t index : ending_at_[end]) {
          const Candidate& candidate = candidates_[index];
          const std::size_t added = candidate.count - 1;
          if (added > m) continue;
          const std::int64_t before = level[m - added][candidate.first];
          if (before == kInf || !allowed(candidate, cap)) continue;
          const std::int64_t total = satAdd(before, volume(values_[candidate.value]));
          if (total < level[m][end]) {
            level[m][end] = total;
            parent[m][end] = index;
          }
        }
      }
      if (level[m][n] <= target) {
        Partition partition;
        partition.volume = level[m][n];
        std::size_t merges = m;
        for (std::size_t end = n; end > 0;) {
          const std::size_t index = parent[merges][end];
          partition.runs.push_back(index);
          merges -= candidates_[index].count - 1;
          end = candidates_[index].first;
        }
        std::reverse(partition.runs.begin(), partition.runs.end());
        return partition;
      }
    }
    return std::nullopt;
  }

  /// minVolume with true values: solved again until its answer is planned.
  Result<std::optional<Partition>> exactMinVolume(std::int64_t cap) {
    for (;;) {
      std::optional<Partition> found = minVolume(cap);
      if (!found) return found;
      auto planned = planUnplanned(*found);
      if (!planned) return std::move(planned).error();
      if (!*planned) return found;
    }
  }

  /// fewestMerges with true values.
  Result<std::optional<Partition>> exactFewest(std::int64_t cap, std::int64_t target) {
    for (;;) {
      std::optional<Partition> found = fewestMerges(cap, target);
      if (!found) return found;
      auto planned = planUnplanned(*found);
      if (!planned) return std::move(planned).error();
      if (!*planned) return found;
    }
  }

  /// The smallest cap on a run's bytes at which some partition reaches
  /// `goal`, or nullopt when none does even without a cap. The runs' sizes
  /// known at the start are probed from the smallest up, each with an exact
  /// answer, so no probe has a cap above the answer (a larger cap lets longer
  /// runs in, and planning them is what costs). Planning during the probes
  /// may reveal a run smaller than the cap found, so the cap just below it is
  /// probed too, and the probes repeated when that reaches as well.
  Result<std::optional<std::int64_t>> smallestPeak(std::int64_t goal) {
    const auto reaches = [&](std::int64_t cap) -> Result<bool> {
      auto found = exactFewest(cap, goal);
      if (!found) return std::move(found).error();
      return found->has_value();
    };
    for (;;) {
      std::vector<std::int64_t> caps;
      for (const Candidate& candidate : candidates_) {
        if (allowed(candidate, kInf)) caps.push_back(bytes(values_[candidate.value]));
      }
      caps.push_back(kInf);  // sizes may grow as runs are planned: the last probe has no cap
      std::sort(caps.begin(), caps.end());
      caps.erase(std::unique(caps.begin(), caps.end()), caps.end());
      std::optional<std::int64_t> found;
      for (const std::int64_t cap : caps) {
        auto ok = reaches(cap);
        if (!ok) return std::move(ok).error();
        if (*ok) {
          found = cap;
          break;
        }
      }
      if (!found) return found;
      auto below = reaches(*found - 1);
      if (!below) return std::move(below).error();
      if (!*below) return found;
    }
  }

  MergePlan result(const Partition& partition, std::int64_t target) const {
    MergePlan out;
    out.devices = options_.devices;
    out.budget_bytes = budget_;
    out.units = static_cast<std::int64_t>(units_.size());
    out.numel = numel_;
    for (const Candidate& candidate : candidates_) {
      if (candidate.count > 1) continue;
      const Value& value = values_[candidate.value];
      out.unmerged_allgather_elems = satAdd(out.unmerged_allgather_elems, volume(value));
      out.unmerged_peak_unsharded_bytes = std::max(out.unmerged_peak_unsharded_bytes, bytes(value));
    }
    for (const std::size_t index : partition.runs) {
      const Candidate& candidate = candidates_[index];
      const Value& value = values_[candidate.value];
      MergedRun run;
      run.first = candidate.first;
      run.count = candidate.count;
      run.plan = plans_[value.plan];
      // The plan was made for the first run with these units: give it this one's names.
      run.plan.name = mergedName(units_, candidate.first, candidate.count);
      std::size_t tensor = 0;
      for (std::size_t u = candidate.first; u < candidate.first + candidate.count; ++u) {
        for (const TensorSpec& spec : units_[u].tensors) run.plan.tensors[tensor++].name = spec.name;
      }
      run.numel = run.plan.numel;
      run.shard_elems = value.shard;
      run.allgather_elems = volume(value);
      run.unsharded_bytes = bytes(value);
      run.over_budget = run.unsharded_bytes > budget_;  // only ever a single unit
      out.over_budget_units += run.over_budget ? 1 : 0;
      out.allgather_elems = satAdd(out.allgather_elems, run.allgather_elems);
      out.peak_unsharded_bytes = std::max(out.peak_unsharded_bytes, run.unsharded_bytes);
      out.runs.push_back(std::move(run));
    }
    out.within_target = out.allgather_elems <= target;
    out.runs_planned = static_cast<std::int64_t>(plans_.size());
    out.bounds_computed = static_cast<std::int64_t>(values_.size());
    return out;
  }

  const std::vector<UnitSpec>& units_;
  const PlanOptions& options_;
  const std::int64_t budget_;
  const std::size_t max_run_;
  std::int64_t numel_ = 0;
  std::vector<std::uint32_t> ids_;                          // per unit: its distinct unit
  std::vector<LayoutProblem> problems_;                     // per distinct unit
  std::map<std::vector<std::uint32_t>, std::size_t> memo_;  // distinct units of a run -> values_
  std::vector<Value> values_;
  std::vector<UnitPlan> plans_;
  std::vector<Candidate> candidates_;
  std::vector<std::vector<std::size_t>> ending_at_;  // per end index: candidates ending there
};

}  // namespace

std::string mergedName(const std::vector<UnitSpec>& units, std::size_t first, std::size_t count) {
  if (count <= 1) return units[first].name;
  return units[first].name + (count == 2 ? "+" : "..") + units[first + count - 1].name;
}

std::vector<UnitSpec> mergedUnits(const std::vector<UnitSpec>& units, const MergePlan& plan) {
  std::vector<UnitSpec> merged;
  merged.reserve(plan.runs.size());
  for (const MergedRun& run : plan.runs) merged.push_back(concatenate(units, run.first, run.count));
  return merged;
}

Result<MergePlan> planMerges(const std::vector<UnitSpec>& units, const PlanOptions& options,
                             const MergeOptions& merge) {
  const auto started = std::chrono::steady_clock::now();
  if (units.empty()) return makeError(ErrorCode::kInvalidArgument, "merge: the model has no units");
  if (merge.unsharded_budget_bytes <= 0) {
    return makeError(ErrorCode::kInvalidArgument, "merge: the unsharded budget must be > 0 bytes, got " +
                                                      std::to_string(merge.unsharded_budget_bytes));
  }
  if (merge.max_run_units < 0) {
    return makeError(ErrorCode::kInvalidArgument,
                     "merge: max_run_units must be >= 0 (0: no limit), got " + std::to_string(merge.max_run_units));
  }
  auto plan = Merger(units, options, merge).run();
  if (plan) plan->merge_ms = millisSince(started);
  return plan;
}

}  // namespace dbuf::planner
