// Fuzzes model files (plan_io/include/dbuf/plan_io/model_file.hpp):
// parseModelJson over the input as JSON, and, when the model is small, the
// planner (planner/include/dbuf/planner/unit_plan.hpp) on it for two device
// counts and default granularity rules.
//
// Properties: bad input is an error value, never a crash; every granularity
// rule of a parsed model prints (toString) as text that parses to the same
// rule; planModel returns a plan or an error, and a plan places every tensor
// once, inside the V*S buffer, without overlaps or split blocks.
//
// Seeds: shrunk copies of models/*.json and a few small models.

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dbuf/plan_io/model_file.hpp"
#include "dbuf/planner/granularity.hpp"
#include "dbuf/planner/unit_plan.hpp"
#include "fuzz_util.hpp"

namespace {

using namespace dbuf::planner;  // NOLINT(google-build-using-namespace)
using dbuf::fuzz::check;

// What is planned: bounded so that one input plans in milliseconds.
constexpr std::size_t kMaxPlannedUnits = 8;
constexpr std::size_t kMaxPlannedTensors = 32;
constexpr std::int64_t kMaxPlannedElements = std::int64_t{1} << 32;

bool smallEnough(const std::vector<UnitSpec>& units) {
  if (units.size() > kMaxPlannedUnits) return false;
  std::size_t tensors = 0;
  std::int64_t elements = 0;
  for (const UnitSpec& unit : units) {
    tensors += unit.tensors.size();
    for (const TensorSpec& tensor : unit.tensors) {
      const std::int64_t numel = tensor.numel();  // validateUnit checked that it fits
      if (numel > kMaxPlannedElements - elements) return false;
      elements += numel;
    }
  }
  return tensors <= kMaxPlannedTensors;
}

void checkPlan(const std::vector<UnitSpec>& units, const ModelPlan& plan, std::int64_t devices) {
  check(plan.units.size() == units.size(), "a plan has one unit plan per unit");
  for (std::size_t u = 0; u < units.size(); ++u) {
    const UnitPlan& unit = plan.units[u];
    check(unit.devices == devices, "a unit plan is for the devices asked for");
    check(unit.tensors.size() == units[u].tensors.size(), "a unit plan places every tensor");
    check(unit.split_blocks == 0, "a plan splits no block");
    check(unit.shard_elems > 0 && unit.shard_elems >= unit.lower_bound_elems, "S >= the proven lower bound > 0");
    const std::int64_t buffer = unit.devices * unit.shard_elems;
    std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
    std::int64_t numel = 0;
    for (const PlannedTensor& tensor : unit.tensors) {
      check(tensor.offset >= 0 && tensor.numel > 0 && tensor.offset <= buffer - tensor.numel,
            "a tensor lies inside the V*S buffer");
      ranges.emplace_back(tensor.offset, tensor.offset + tensor.numel);
      numel += tensor.numel;
    }
    std::sort(ranges.begin(), ranges.end());
    for (std::size_t i = 1; i < ranges.size(); ++i) check(ranges[i - 1].second <= ranges[i].first, "tensors overlap");
    check(numel == unit.numel && unit.padding_elems == buffer - numel, "N and the padding add up");
  }
}

void plan(const std::vector<UnitSpec>& units, std::int64_t devices, std::string_view rule) {
  PlanOptions options;
  options.devices = devices;
  options.default_rule = GranularityRule::parse(rule).value();
  options.search.node_budget = 200;
  options.search.scan_work = 20000;
  auto planned = planModel(units, options);
  if (planned) {
    checkPlan(units, *planned, devices);
  } else {
    check(!planned.error().message.empty(), "a planning error has a message");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);  // NOLINT
  auto model = dbuf::plan_io::parseModelJson(text, "fuzz.json");
  if (!model) {
    check(model.error().message.starts_with("fuzz.json"), "a model error names the file");
    return 0;
  }
  check(!model->units.empty(), "a parsed model has units");
  for (const UnitSpec& unit : model->units) {
    check(validateUnit(unit).ok(), "a parsed unit is valid");
    for (const TensorSpec& tensor : unit.tensors) {
      if (!tensor.granularity) continue;
      auto again = GranularityRule::parse(tensor.granularity->toString());
      check(again.ok() && *again == *tensor.granularity, "a granularity rule prints as text that parses to it");
    }
  }
  if (!smallEnough(model->units)) return 0;
  plan(model->units, 3, "element");
  plan(model->units, 8, "rows:32");
  return 0;
}
