#pragma once
/// \file
/// `dbuf-plan --tp / --ep`: the model's units as one rank holds them under
/// tensor and expert parallelism (planner/model_parallel.hpp), planned over
/// their own ranks, and the report's model-parallel section.

#include <cstdint>
#include <vector>

#include "dbuf/common/result.hpp"
#include "dbuf/plan_io/report.hpp"
#include "dbuf/planner/granularity.hpp"
#include "dbuf/planner/model_parallel.hpp"
#include "dbuf/planner/unit_plan.hpp"

namespace dbuf::plan_cli {

/// A unit as one rank holds it under --tp / --ep, and whether it is a unit of routed experts.
struct ComposedUnit {
  planner::UnitSpec unit;
  bool experts = false;
};

/// Every unit as one rank holds it, in model order: its dense part, then its experts'. tp ranks whose
/// chunks differ (torch.chunk's uneven splits) get a unit each, named "<unit>@tp<ranks>"; ep ranks hold
/// experts of one shape (ep divides the expert count), so ep rank 0 stands for all.
[[nodiscard]] Result<std::vector<ComposedUnit>> composedUnits(const std::vector<planner::UnitSpec>& units,
                                                              const planner::ModelParallelism& parallelism);

/// Plans the composed units: dense ones over `options.devices` ranks, experts over devices / ep, back in
/// their order.
[[nodiscard]] Result<planner::ModelPlan> planComposed(const std::vector<ComposedUnit>& composed,
                                                      planner::PlanOptions options, std::int64_t ep);

/// The granularities TP makes impossible, one line per tensor of every layer alike (the first layer's,
/// with how many more units say the same).
[[nodiscard]] plan_io::ModelParallelReport modelParallelReport(const std::vector<planner::UnitSpec>& units,
                                                               const planner::ModelParallelism& parallelism,
                                                               const planner::GranularityRule& rule);

}  // namespace dbuf::plan_cli
