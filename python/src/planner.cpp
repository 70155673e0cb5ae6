// The planner, for Python: plan a unit (or a model's units) offline, with the
// quality report and the diagnosis every plan carries, and choose units to
// merge under an unsharded budget. dbuf.torch's automatic wrap policy uses it
// to choose its units.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "dbuf/planner/merge.hpp"
#include "dbuf/planner/unit_plan.hpp"

namespace dbuf::python {
namespace {

using namespace nb::literals;
namespace planner = dbuf::planner;

planner::PlanOptions planOptions(std::int64_t devices, const std::string& granularity, std::int64_t align_bytes) {
  if (devices < 1) throw nb::value_error("devices must be >= 1");
  planner::PlanOptions options;
  options.devices = devices;
  options.default_rule = unwrap(planner::GranularityRule::parse(granularity));
  options.align_bytes = align_bytes;
  return options;
}

planner::UnitSpec unitSpec(const std::string& name, const std::vector<TensorSpec>& tensors, const std::string& dtype) {
  const auto element = parseDType(dtype);
  if (!element) throw nb::value_error(("unknown dtype '" + dtype + "'").c_str());
  planner::UnitSpec unit{name, {}};
  for (const TensorSpec& tensor : tensors) {
    planner::TensorSpec spec{tensor.name, tensor.shape, *element, std::nullopt, std::nullopt};
    if (!tensor.granularity.empty()) spec.granularity = unwrap(planner::GranularityRule::parse(tensor.granularity));
    if (tensor.tp_dim >= 0) spec.tp_dim = tensor.tp_dim;
    unit.tensors.push_back(std::move(spec));
  }
  return unit;
}

void exposeResults(nb::module_& m) {
  nb::class_<planner::BoundDiagnosis>(m, "PlanDiagnosis",
                                      "Why a unit's lower bound is far above ceil(N/V), and what would fix it.")
      .def_ro("forcing_tensors", &planner::BoundDiagnosis::forcing_tensors, "tensors whose blocks force S up")
      .def_ro("merge_units", &planner::BoundDiagnosis::merge_units,
              "consecutive units (this one and the next) to merge to get within 5%, if any number does")
      .def_ro("finer_rule", &planner::BoundDiagnosis::finer_rule, "a finer rows:R rule that would, if any")
      .def_ro("hsdp_devices", &planner::BoundDiagnosis::hsdp_devices, "the largest shard group size that would");

  nb::class_<planner::UnitPlan>(m, "UnitPlan", "A unit's plan and its quality report.")
      .def_ro("name", &planner::UnitPlan::name)
      .def_ro("devices", &planner::UnitPlan::devices)
      .def_ro("numel", &planner::UnitPlan::numel, "N")
      .def_ro("shard_elems", &planner::UnitPlan::shard_elems, "S")
      .def_ro("lower_bound_elems", &planner::UnitPlan::lower_bound_elems,
              "the proven lower bound of S (the placement bound, raised past sizes the exact search refuted)")
      .def_ro("placement_bound_elems", &planner::UnitPlan::placement_bound_elems,
              "what each tensor's placeability alone proves")
      .def_ro("ideal_elems", &planner::UnitPlan::ideal_elems, "ceil(N / V)")
      .def_ro("padding_elems", &planner::UnitPlan::padding_elems, "V*S - N")
      .def_ro("split_blocks", &planner::UnitPlan::split_blocks, "always 0")
      .def_prop_ro("strategy", [](const planner::UnitPlan& p) { return std::string(planner::toString(p.strategy)); })
      .def_ro("proven_optimal", &planner::UnitPlan::proven_optimal)
      .def_ro("plan_us", &planner::UnitPlan::plan_us)
      .def_ro("tensors", &planner::UnitPlan::tensors)
      .def_ro("diagnosis", &planner::UnitPlan::diagnosis, "set when the bound is > 5% above ceil(N/V)")
      .def_prop_ro("inflation", &planner::UnitPlan::inflation, "V*S / N: all-gather volume against N")
      .def_prop_ro("gap_to_lower_bound", &planner::UnitPlan::gapToLowerBound)
      .def_prop_ro(
          "baselines",
          [](const planner::UnitPlan& p) {
            return std::vector<std::pair<std::string, std::int64_t>>{{"fsdp2", p.baselines.fsdp2.shard_elems},
                                                                     {"fsdp1", p.baselines.fsdp1.shard_elems},
                                                                     {"zero3", p.baselines.zero3.shard_elems},
                                                                     {"megatron", p.baselines.megatron.shard_elems}};
          },
          "(name, S) of FSDP2, FSDP1, ZeRO-3 and Megatron-FSDP on the same unit");

  nb::class_<planner::MergedRun>(m, "MergedRun", "Consecutive units planned as one unit (plan_merges).")
      .def_ro("first", &planner::MergedRun::first, "index of its first unit")
      .def_ro("count", &planner::MergedRun::count, "units it holds")
      .def_prop_ro(
          "name", [](const planner::MergedRun& r) { return r.plan.name; },
          "the unit's own name alone, 'A+B' for two, 'A..C' (first and last) for three or more")
      .def_ro("numel", &planner::MergedRun::numel, "N of the run")
      .def_ro("shard_elems", &planner::MergedRun::shard_elems, "S of the merged plan")
      .def_ro("allgather_elems", &planner::MergedRun::allgather_elems, "V*S")
      .def_ro("unsharded_bytes", &planner::MergedRun::unsharded_bytes, "V*S times the element size")
      .def_ro("over_budget", &planner::MergedRun::over_budget, "a single unit above the budget on its own, kept")
      .def_ro("plan", &planner::MergedRun::plan, "the merged unit's plan (its tensors those of its units, in order)");

  nb::class_<planner::MergePlan>(m, "MergePlan",
                                 "Which consecutive units to merge under an unsharded budget, and what it costs.")
      .def_ro("runs", &planner::MergePlan::runs, "every run, in model order")
      .def_ro("budget_bytes", &planner::MergePlan::budget_bytes)
      .def_ro("units", &planner::MergePlan::units, "units of the model")
      .def_ro("numel", &planner::MergePlan::numel, "N of the whole model")
      .def_ro("allgather_elems", &planner::MergePlan::allgather_elems, "sum over runs of V*S")
      .def_ro("peak_unsharded_bytes", &planner::MergePlan::peak_unsharded_bytes, "the largest run's unsharded bytes")
      .def_ro("within_target", &planner::MergePlan::within_target, "allgather_elems <= 1.05 N")
      .def_ro("unmerged_allgather_elems", &planner::MergePlan::unmerged_allgather_elems,
              "sum of V*S with every unit alone")
      .def_ro("unmerged_peak_unsharded_bytes", &planner::MergePlan::unmerged_peak_unsharded_bytes,
              "the largest unit's unsharded bytes, without merging")
      .def_ro("over_budget_units", &planner::MergePlan::over_budget_units, "single units above the budget")
      .def_ro("merge_ms", &planner::MergePlan::merge_ms, "wall time of the choice, planning included")
      .def_prop_ro("merges", &planner::MergePlan::merges, "units merged away: units - runs")
      .def_prop_ro("inflation", &planner::MergePlan::inflation, "allgather_elems / N")
      .def_prop_ro("unmerged_inflation", &planner::MergePlan::unmergedInflation, "the same without merging");
}

}  // namespace

void exposePlanner(nb::module_& m) {
  exposeResults(m);
  m.def(
      "plan_unit",
      [](const std::vector<TensorSpec>& tensors, std::int64_t devices, const std::string& granularity,
         std::int64_t align_bytes, const std::string& dtype, const std::string& name) {
        const planner::UnitSpec unit = unitSpec(name, tensors, dtype);
        const planner::PlanOptions options = planOptions(devices, granularity, align_bytes);
        std::optional<Result<planner::UnitPlan>> plan;
        {
          const nb::gil_scoped_release no_gil;  // pure C++
          plan.emplace(planner::planUnit(unit, options));
        }
        return unwrap(std::move(*plan));
      },
      "tensors"_a, "devices"_a, nb::kw_only(), "granularity"_a = "element", "align_bytes"_a = 16, "dtype"_a = "bf16",
      "name"_a = "unit",
      "Plans one unit offline, as dbufd would for a group of these tensors (no diagnosis: see plan_model).");
  m.def(
      "plan_model",
      [](const std::vector<std::pair<std::string, std::vector<TensorSpec>>>& units, std::int64_t devices,
         const std::string& granularity, std::int64_t align_bytes, const std::string& dtype) {
        std::vector<planner::UnitSpec> specs;
        for (const auto& [name, tensors] : units) specs.push_back(unitSpec(name, tensors, dtype));
        const planner::PlanOptions options = planOptions(devices, granularity, align_bytes);
        std::optional<Result<planner::ModelPlan>> plans;
        {
          const nb::gil_scoped_release no_gil;
          plans.emplace(planner::planModel(specs, options));
        }
        return unwrap(std::move(*plans)).units;
      },
      "units"_a, "devices"_a, nb::kw_only(), "granularity"_a = "element", "align_bytes"_a = 16, "dtype"_a = "bf16",
      "Plans consecutive units (name, tensors) with diagnoses where a unit cannot get within 5% of ceil(N/V).");
  m.def(
      "plan_merges",
      [](const std::vector<std::pair<std::string, std::vector<TensorSpec>>>& units, std::int64_t devices,
         std::int64_t unsharded_budget, const std::string& granularity, std::int64_t align_bytes,
         const std::string& dtype, std::int64_t max_run_units) {
        std::vector<planner::UnitSpec> specs;
        for (const auto& [name, tensors] : units) specs.push_back(unitSpec(name, tensors, dtype));
        const planner::PlanOptions options = planOptions(devices, granularity, align_bytes);
        std::optional<Result<planner::MergePlan>> merged;
        {
          const nb::gil_scoped_release no_gil;
          merged.emplace(planner::planMerges(
              specs, options, {.unsharded_budget_bytes = unsharded_budget, .max_run_units = max_run_units}));
        }
        return unwrap(std::move(*merged));
      },
      "units"_a, "devices"_a, nb::kw_only(), "unsharded_budget"_a, "granularity"_a = "element", "align_bytes"_a = 16,
      "dtype"_a = "bf16", "max_run_units"_a = 0,
      "Chooses consecutive units (name, tensors) to merge into one, with unsharded_budget the most bytes per rank "
      "of a merged unit's unsharded buffer (V*S elements of dtype): within 5% of N at the smallest peak where some "
      "partition gets there, else the least volume. A unit alone is always allowed (over_budget says when it "
      "exceeds the budget). max_run_units: most units a run may hold (0: no limit).");
}

}  // namespace dbuf::python
