#pragma once
/// \file
/// Plan reports: what `dbuf-plan` prints about a planned model, as a plain
/// struct (`PlanReport`) and its three renderings: JSON (documented in
/// docs/plan-json.md, read back by `readPlanJson`), an aligned text table, and
/// an SVG picture of one unit's layout.
///
/// All sizes are in elements of the unit's dtype, never bytes. Every function
/// here is a pure function over value types (thread-safe); errors are
/// `Result` values, no exception escapes.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dbuf/common/result.hpp"
#include "dbuf/planner/merge.hpp"
#include "dbuf/planner/unit_plan.hpp"

namespace dbuf::plan_io {

struct BaselineReport {
  std::int64_t shard_elems = 0;
  std::int64_t split_blocks = 0;
  friend bool operator==(const BaselineReport&, const BaselineReport&) = default;
};

struct RankSliceReport {
  std::int64_t rank = 0;
  std::int64_t begin = 0;  ///< first local element, relative to the tensor
  std::int64_t end = 0;    ///< one past the last
  std::int64_t local_units = 0;
  friend bool operator==(const RankSliceReport&, const RankSliceReport&) = default;
};

struct TensorReport {
  std::string name;
  std::vector<std::int64_t> shape;
  std::int64_t offset = 0;  ///< in the unit's global buffer of devices * shard_elems elements
  std::int64_t numel = 0;
  std::int64_t granularity_elems = 1;
  /// Per-rank slices; present only when asked for (`ReportOptions::ranks`).
  std::optional<std::vector<RankSliceReport>> ranks;
  friend bool operator==(const TensorReport&, const TensorReport&) = default;
};

struct DiagnosisReport {
  std::vector<std::string> forcing_tensors;
  std::optional<std::int64_t> merge_units;
  std::optional<std::string> finer_rule;
  std::optional<std::int64_t> hsdp_devices;
  friend bool operator==(const DiagnosisReport&, const DiagnosisReport&) = default;
};

struct UnitReport {
  // Required keys of the JSON format, in their order.
  std::string name;
  std::int64_t numel = 0;
  std::int64_t shard_elems = 0;
  std::int64_t lower_bound_elems = 0;
  std::int64_t padding_elems = 0;
  std::int64_t split_blocks = 0;
  double plan_us = 0;
  std::vector<TensorReport> tensors;
  BaselineReport fsdp2;
  BaselineReport fsdp1;
  BaselineReport zero3;
  BaselineReport megatron;
  // Extra keys.
  std::string dtype = "bf16";
  std::int64_t align_elems = 1;
  std::int64_t ideal_elems = 0;  ///< ceil(numel / devices)
  std::int64_t brief_lower_bound_elems = 0;
  std::string strategy;
  bool scan_complete = true;    ///< every smaller size was tried with the fixed orders
  bool proven_optimal = false;  ///< S is optimal over all orders (see planner SearchResult)
  double inflation = 0;         ///< devices * shard_elems / numel
  std::optional<DiagnosisReport> diagnosis;
  /// Ranks sharing this unit: the report's `devices`, except a unit of routed
  /// experts under expert parallelism (devices / ep). JSON: written only where
  /// it differs from the report's.
  std::int64_t devices = 0;
  friend bool operator==(const UnitReport&, const UnitReport&) = default;
};

struct TotalReport {
  std::int64_t numel = 0;
  std::int64_t allgather_elems = 0;  ///< sum of devices * shard_elems
  double inflation = 0;              ///< allgather_elems / numel
  double lower_bound_inflation = 0;  ///< sum of devices * lower_bound_elems / numel
  double plan_ms = 0;
  friend bool operator==(const TotalReport&, const TotalReport&) = default;
};

/// One run of consecutive model units planned as one unit (`--merge auto`).
struct MergeRunReport {
  std::string name;                  ///< the unit's name in `units` (planner::mergedName)
  std::int64_t first = 0;            ///< index of its first unit in the model file
  std::int64_t count = 1;            ///< model units it holds
  std::int64_t allgather_elems = 0;  ///< devices * shard_elems
  std::int64_t unsharded_bytes = 0;  ///< allgather_elems * element size
  bool over_budget = false;          ///< a single unit above the budget, kept
  friend bool operator==(const MergeRunReport&, const MergeRunReport&) = default;
};

/// What `--merge auto --unsharded-budget BYTES` chose (planner::MergePlan),
/// for the whole model, against the same model without merging.
struct MergeReport {
  std::int64_t budget_bytes = 0;
  std::int64_t units = 0;  ///< units of the model file
  std::int64_t numel = 0;
  std::int64_t allgather_elems = 0;
  double inflation = 0;  ///< allgather_elems / numel
  std::int64_t peak_unsharded_bytes = 0;
  bool within_target = false;  ///< allgather_elems <= 1.05 numel
  std::int64_t unmerged_allgather_elems = 0;
  double unmerged_inflation = 0;
  std::int64_t unmerged_peak_unsharded_bytes = 0;
  double merge_ms = 0;
  std::vector<MergeRunReport> runs;  ///< every run, in model order
  friend bool operator==(const MergeReport&, const MergeReport&) = default;
};

[[nodiscard]] MergeReport makeMergeReport(const planner::MergePlan& plan);

/// `dbuf-plan --tp / --ep`: the units are what one rank holds (planner/model_parallel.hpp).
struct ModelParallelReport {
  std::int64_t tp = 1;
  std::int64_t ep = 1;
  /// Granularities tensor parallelism makes impossible (planner::tensorParallelDiagnoses).
  std::vector<std::string> diagnoses;
  friend bool operator==(const ModelParallelReport&, const ModelParallelReport&) = default;
};

struct PlanReport {
  std::int64_t devices = 1;
  std::string granularity = "element";  ///< the default rule, as written
  std::int64_t align_elems = 1;         ///< of the first unit (all units share a dtype in practice)
  std::vector<UnitReport> units;
  TotalReport total;
  // Extra keys.
  std::string model;
  std::int64_t align_bytes = 16;
  /// Set with `--merge auto`: `units` are then the merged units.
  std::optional<MergeReport> merge;
  std::optional<ModelParallelReport> model_parallel;
  friend bool operator==(const PlanReport&, const PlanReport&) = default;
};

/// Ranks sharing `unit` of `report`: its own `devices` where set, else the report's.
[[nodiscard]] inline std::int64_t unitDevices(const PlanReport& report, const UnitReport& unit) noexcept {
  return unit.devices > 0 ? unit.devices : report.devices;
}

struct ReportOptions {
  std::string model;        ///< the model's name
  std::string granularity;  ///< the default rule, as given
  std::int64_t align_bytes = 16;
  bool ranks = false;  ///< fill `TensorReport::ranks`
  /// Report only this unit (empty: all). The totals cover the reported units.
  std::string only_unit;
};

/// Builds the report of a planned model. Fails only when `only_unit` names no
/// unit of the plan.
[[nodiscard]] Result<PlanReport> makeReport(const planner::ModelPlan& plan, const ReportOptions& options);

/// Recomputes `total` from `units` (plan_ms is kept).
void recomputeTotals(PlanReport& report);

/// JSON text (2-space indent, keys in the documented order, trailing newline).
[[nodiscard]] std::string writePlanJson(const PlanReport& report);

/// Parses the output of `writePlanJson`. Every required key must be present
/// with the right type; extra keys are optional (unknown keys are ignored).
/// Errors name the offending key path, e.g. `units[3].tensors[0].offset`.
[[nodiscard]] Result<PlanReport> readPlanJson(std::string_view text);

struct TableOptions {
  /// Collapse runs of consecutive units with identical plans into one row.
  bool summary = false;
};

/// Plain-text table: one row per unit and a TOTAL row (ours, lower bound, each
/// baseline, plan time), followed by the diagnoses.
[[nodiscard]] std::string writePlanTable(const PlanReport& report, const TableOptions& options = {});

struct SvgOptions {
  /// Unit to draw (empty: the largest by numel, the first of equals).
  std::string unit;
  /// At most this many rows; above it consecutive ranks are drawn as bands.
  std::int64_t max_rows = 64;
};

/// SVG picture of one unit's layout: one row per rank (or per band of ranks),
/// tensors as coloured spans, padding hatched. Fails when `options.unit` names
/// no unit of the report.
[[nodiscard]] Result<std::string> writePlanSvg(const PlanReport& report, const SvgOptions& options = {});

/// The unit `writePlanSvg` draws by default: the largest by numel.
[[nodiscard]] std::size_t largestUnit(const PlanReport& report) noexcept;

}  // namespace dbuf::plan_io
