// The planner, for Python: plan a unit (or a model's units) offline, with the
// quality report and the diagnosis every plan carries. dbuf.torch's
// automatic wrap policy uses it to choose its units.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <utility>
#include <vector>

#include "bindings.hpp"
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

void bindResults(nb::module_& m) {
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
      .def_ro("lower_bound_elems", &planner::UnitPlan::lower_bound_elems, "the proven lower bound of S")
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
}

}  // namespace

void bindPlanner(nb::module_& m) {
  bindResults(m);
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
}

}  // namespace dbuf::python
