#pragma once
/// \file
/// Merging consecutive FSDP units under a budget for unsharded memory.
///
/// Where one unit's blocks are too coarse for its ranks (DeepSeek-V3 at 1024
/// ranks with `block:128x128`: no layout of one layer gets below 1.42x of
/// N/V), several consecutive units in one DBuffer have more blocks to spread
/// and the merged unit balances; the price is a larger unsharded buffer. Given
/// a budget for the largest unit's unsharded buffer, `planMerges` chooses
/// which consecutive units to merge:
///
/// - if some partition of the units into runs of consecutive units, every run
///   of two or more units within the budget, brings the whole model's
///   all-gather volume (sum over runs of V*S) within 5% of N, it takes the one
///   with the smallest peak unsharded buffer among those, then the fewest
///   merges, then the smallest volume;
/// - otherwise the smallest volume within the budget, then the smallest peak,
///   then the fewest merges.
///
/// A unit alone is always allowed, even above the budget (`MergedRun::
/// over_budget` says so); units of different dtypes never share a run (one
/// DBuffer, one dtype). Pure functions over value types, thread-safe.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dbuf/common/result.hpp"
#include "dbuf/planner/tensor_spec.hpp"
#include "dbuf/planner/unit_plan.hpp"

namespace dbuf::planner {

/// All-gather volume within this factor of N is the merge's target.
inline constexpr double kMergeTarget = 1.05;

struct MergeOptions {
  /// Bytes per rank of the largest merged unit's unsharded buffer: V*S times
  /// the element size of the unit's dtype. Must be > 0.
  std::int64_t unsharded_budget_bytes = 0;
  /// Most units one run may hold (0: no limit besides the budget).
  std::int64_t max_run_units = 0;
};

/// One run of consecutive units, planned as one unit.
struct MergedRun {
  std::size_t first = 0;             ///< index of its first unit in the model
  std::size_t count = 1;             ///< units in the run
  std::int64_t numel = 0;            ///< N of the run
  std::int64_t shard_elems = 0;      ///< S of the merged plan
  std::int64_t allgather_elems = 0;  ///< V*S
  std::int64_t unsharded_bytes = 0;  ///< V*S * element size
  /// A single unit whose unsharded buffer alone exceeds the budget (kept, as
  /// nothing smaller exists for it).
  bool over_budget = false;
  /// The merged unit's plan: named `mergedName`, its tensors those of its
  /// units in order, under their own names.
  UnitPlan plan;
};

struct MergePlan {
  std::int64_t devices = 1;
  std::int64_t budget_bytes = 0;
  std::vector<MergedRun> runs;                     ///< in model order; they cover every unit once
  std::int64_t units = 0;                          ///< units of the model
  std::int64_t numel = 0;                          ///< N of the whole model
  std::int64_t allgather_elems = 0;                ///< sum over runs of V*S
  std::int64_t peak_unsharded_bytes = 0;           ///< largest run's unsharded buffer
  bool within_target = false;                      ///< allgather_elems <= 1.05 N
  std::int64_t unmerged_allgather_elems = 0;       ///< the same without merging (every unit alone)
  std::int64_t unmerged_peak_unsharded_bytes = 0;  ///< the largest unit's, without merging
  std::size_t over_budget_units = 0;               ///< runs with `over_budget` set
  // How the choice was made (for reports and benchmarks).
  std::int64_t runs_planned = 0;     ///< distinct runs (by their units' shapes) planned in full
  std::int64_t bounds_computed = 0;  ///< distinct runs whose lower bound was computed
  double merge_ms = 0;               ///< wall time of planMerges, planning included

  /// Units merged away: units - runs.
  [[nodiscard]] std::int64_t merges() const noexcept { return units - static_cast<std::int64_t>(runs.size()); }
  [[nodiscard]] double inflation() const noexcept {
    return static_cast<double>(allgather_elems) / static_cast<double>(numel > 0 ? numel : 1);
  }
  [[nodiscard]] double unmergedInflation() const noexcept {
    return static_cast<double>(unmerged_allgather_elems) / static_cast<double>(numel > 0 ? numel : 1);
  }
};

/// Chooses the runs (see the file comment). Errors: an empty model, a budget
/// <= 0, a negative `max_run_units`, and every error of `buildProblem` (they
/// name the unit and tensor).
[[nodiscard]] Result<MergePlan> planMerges(const std::vector<UnitSpec>& units, const PlanOptions& options,
                                           const MergeOptions& merge);

/// Name of the run of `count` units from `first`: the unit's own name alone,
/// "A+B" for two, "A..B" (first and last) for three or more.
[[nodiscard]] std::string mergedName(const std::vector<UnitSpec>& units, std::size_t first, std::size_t count);

/// The model as `plan` merges it: one unit per run, its units' tensors
/// concatenated in order, named `mergedName`. Planning these (`planModel`)
/// gives the runs' plans again, with diagnoses.
[[nodiscard]] std::vector<UnitSpec> mergedUnits(const std::vector<UnitSpec>& units, const MergePlan& plan);

}  // namespace dbuf::planner
