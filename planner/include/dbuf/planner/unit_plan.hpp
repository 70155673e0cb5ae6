#pragma once
/// \file
/// The planner's front door: plan one FSDP unit (or a whole model) from tensor
/// specs, with the quality report every plan carries.
///
/// Thread safety: pure functions over value types; `ModelPlanner` caches plans
/// of identical units and is not thread-safe (one per thread).

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "dbuf/common/result.hpp"
#include "dbuf/planner/baselines.hpp"
#include "dbuf/planner/granularity.hpp"
#include "dbuf/planner/layout.hpp"
#include "dbuf/planner/search.hpp"
#include "dbuf/planner/tensor_spec.hpp"

namespace dbuf::planner {

struct PlanOptions {
  std::int64_t devices = 1;
  GranularityRule default_rule;   ///< applied to 2D+ tensors without their own rule
  std::int64_t align_bytes = 16;  ///< 1..4096, a multiple of the element size
  SearchOptions search;
};

/// One rank's part of one tensor.
struct RankSlice {
  std::int64_t rank = 0;
  std::int64_t begin = 0;        ///< first local element, relative to the tensor
  std::int64_t end = 0;          ///< one past the last
  std::int64_t local_units = 0;  ///< RaggedShard blocks held by this rank
};

struct PlannedTensor {
  std::string name;
  std::vector<std::int64_t> shape;
  std::int64_t offset = 0;  ///< in the global buffer of V*S elements
  std::int64_t numel = 0;
  std::int64_t granularity = 1;
};

/// Why the lower bound is far above ceil(N/V), and what would bring it down.
struct BoundDiagnosis {
  std::vector<std::string> forcing_tensors;  ///< tensors whose blocks force S up
  /// Smallest number of consecutive units (this one and the next ones) whose
  /// merged lower bound is within 5% of their ceil(N/V); nullopt if even the
  /// whole remaining model is not enough.
  std::optional<std::int64_t> merge_units;
  /// Coarsest `rows:R'` (R' halving from the forcing tensors' rows) that,
  /// applied to every tensor with coarser row bands, brings this unit's bound
  /// within 5%, if any.
  std::optional<std::string> finer_rule;
  /// Largest shard-group size (a proper divisor of V) that would be within
  /// 5%: the HSDP configuration that fixes it, if any.
  std::optional<std::int64_t> hsdp_devices;
};

struct UnitPlan {
  std::string name;
  std::int64_t devices = 1;
  std::int64_t align_elems = 1;
  DType dtype = DType::kBF16;
  std::int64_t numel = 0;        ///< N
  std::int64_t shard_elems = 0;  ///< S
  /// Proven bound: no layout has a smaller S. The placement bound, raised past
  /// the sizes the exact order search refuted (SearchResult::proven_bound_elems).
  std::int64_t lower_bound_elems = 0;
  std::int64_t placement_bound_elems = 0;    ///< what each tensor's placeability alone proves (bounds.hpp)
  std::int64_t brief_lower_bound_elems = 0;  ///< the design brief's formula, <= the placement bound
  std::int64_t ideal_elems = 0;              ///< ceil(N / V)
  std::int64_t padding_elems = 0;            ///< V*S - N
  std::int64_t split_blocks = 0;             ///< always 0 for a valid plan
  Strategy strategy = Strategy::kGivenOrder;
  bool scan_complete = true;           ///< see SearchResult
  bool proven_optimal = false;         ///< see SearchResult
  double plan_us = 0;                  ///< layout planning (problem, bound, search); not baselines or diagnosis
  std::vector<PlannedTensor> tensors;  ///< in declaration order
  Baselines baselines;
  std::optional<BoundDiagnosis> diagnosis;  ///< set when the placement bound > 1.05 * ceil(N/V)

  [[nodiscard]] double inflation() const noexcept {
    return static_cast<double>(devices * shard_elems) / static_cast<double>(numel);
  }
  [[nodiscard]] double gapToLowerBound() const noexcept {
    return static_cast<double>(shard_elems) / static_cast<double>(lower_bound_elems) - 1.0;
  }
};

/// Builds the numeric problem of a unit (granularities resolved, alignment in
/// elements). Errors name the unit and the tensor.
[[nodiscard]] Result<LayoutProblem> buildProblem(const UnitSpec& unit, const PlanOptions& options);

/// Units whose tensors agree in everything a plan and its baselines depend on
/// besides the options (dtypes, shapes, granularity rules, tensor-parallel
/// dimensions, expert flags) have the same plan, names aside. This finds
/// them without building their problems: a look-up is one pass over the
/// unit's tensors (a model of 64 MoE layers has 99,000). The units must
/// outlive it.
class DistinctUnits {
 public:
  /// The index (in the order added) of a unit added before with the same
  /// plan, or nullopt, and then `unit` is added with index `size()`.
  std::optional<std::size_t> findOrAdd(const UnitSpec& unit);
  [[nodiscard]] std::size_t size() const noexcept { return units_.size(); }

 private:
  std::unordered_multimap<std::uint64_t, std::size_t> by_hash_;
  std::vector<const UnitSpec*> units_;
};

/// Plans one unit: layout, lower bound, baselines. `diagnosis` is not filled
/// here (it needs the neighbouring units; see `planModel`).
[[nodiscard]] Result<UnitPlan> planUnit(const UnitSpec& unit, const PlanOptions& options);

/// `rank`'s part of `tensor` in a plan with shard size `shard_elems`, or
/// nullopt when the rank holds none of it.
[[nodiscard]] std::optional<RankSlice> sliceOnRank(const PlannedTensor& tensor, std::int64_t shard_elems,
                                                   std::int64_t rank);

/// Granularity blocks of a set of planned tensors, numbered in buffer order
/// (by offset): the index of block b of tensor i is first[i] + b. Because
/// no block straddles two ranks, the blocks a rank holds form one contiguous
/// range of these indices (block-scale arrays for fp8 rely on it).
struct BlockNumbering {
  std::vector<std::int64_t> first;  ///< per tensor, in the order given
  std::int64_t total = 0;
};
[[nodiscard]] BlockNumbering numberBlocks(const std::vector<PlannedTensor>& tensors);

/// Every rank's slice of tensor `index` of `plan` (ranks holding nothing are
/// left out).
[[nodiscard]] std::vector<RankSlice> rankSlices(const UnitPlan& plan, std::size_t index);

struct ModelPlan {
  std::vector<UnitPlan> units;
  double plan_ms = 0;  ///< wall time of planning every unit (layouts only, cache included)
};

/// Plans every unit of a model. Units with the same tensor shapes and
/// granularities are planned once (a 61-layer model has 3-4 distinct units);
/// diagnoses are added where the bound is more than 5% above ceil(N/V).
[[nodiscard]] Result<ModelPlan> planModel(const std::vector<UnitSpec>& units, const PlanOptions& options);

}  // namespace dbuf::planner
