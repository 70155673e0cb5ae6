#include "dbuf/plan_io/report.hpp"

#include <algorithm>

namespace dbuf::plan_io {
namespace {

BaselineReport toReport(const planner::BaselineResult& baseline) {
  return {baseline.shard_elems, baseline.split_blocks};
}

UnitReport toReport(const planner::UnitPlan& plan, bool ranks) {
  UnitReport unit;
  unit.name = plan.name;
  unit.numel = plan.numel;
  unit.shard_elems = plan.shard_elems;
  unit.lower_bound_elems = plan.lower_bound_elems;
  unit.padding_elems = plan.padding_elems;
  unit.split_blocks = plan.split_blocks;
  unit.plan_us = plan.plan_us;
  unit.devices = plan.devices;
  unit.tensors.reserve(plan.tensors.size());
  for (std::size_t i = 0; i < plan.tensors.size(); ++i) {
    const planner::PlannedTensor& tensor = plan.tensors[i];
    TensorReport out{tensor.name, tensor.shape, tensor.offset, tensor.numel, tensor.granularity, std::nullopt};
    if (ranks) {
      std::vector<RankSliceReport> slices;
      for (const planner::RankSlice& slice : planner::rankSlices(plan, i)) {
        slices.push_back({slice.rank, slice.begin, slice.end, slice.local_units});
      }
      out.ranks = std::move(slices);
    }
    unit.tensors.push_back(std::move(out));
  }
  unit.fsdp2 = toReport(plan.baselines.fsdp2);
  unit.fsdp1 = toReport(plan.baselines.fsdp1);
  unit.zero3 = toReport(plan.baselines.zero3);
  unit.megatron = toReport(plan.baselines.megatron);
  unit.dtype = std::string(toString(plan.dtype));
  unit.align_elems = plan.align_elems;
  unit.ideal_elems = plan.ideal_elems;
  unit.brief_lower_bound_elems = plan.brief_lower_bound_elems;
  unit.strategy = std::string(planner::toString(plan.strategy));
  unit.scan_complete = plan.scan_complete;
  unit.proven_optimal = plan.proven_optimal;
  unit.inflation = plan.inflation();
  if (plan.diagnosis) {
    unit.diagnosis = DiagnosisReport{plan.diagnosis->forcing_tensors, plan.diagnosis->merge_units,
                                     plan.diagnosis->finer_rule, plan.diagnosis->hsdp_devices};
  }
  return unit;
}

}  // namespace

Result<PlanReport> makeReport(const planner::ModelPlan& plan, const ReportOptions& options) {
  PlanReport report;
  report.model = options.model;
  report.granularity = options.granularity.empty() ? "element" : options.granularity;
  report.align_bytes = options.align_bytes;
  for (const planner::UnitPlan& unit : plan.units) {
    if (!options.only_unit.empty() && unit.name != options.only_unit) continue;
    report.units.push_back(toReport(unit, options.ranks));
  }
  if (report.units.empty() && !options.only_unit.empty()) {
    return makeError(ErrorCode::kNotFound, "no unit named '" + options.only_unit + "'");
  }
  if (!plan.units.empty()) {
    report.devices = plan.units.front().devices;
    report.align_elems = plan.units.front().align_elems;
  }
  report.total.plan_ms = plan.plan_ms;
  recomputeTotals(report);
  return report;
}

MergeReport makeMergeReport(const planner::MergePlan& plan) {
  MergeReport report;
  report.budget_bytes = plan.budget_bytes;
  report.units = plan.units;
  report.numel = plan.numel;
  report.allgather_elems = plan.allgather_elems;
  report.inflation = plan.inflation();
  report.peak_unsharded_bytes = plan.peak_unsharded_bytes;
  report.within_target = plan.within_target;
  report.unmerged_allgather_elems = plan.unmerged_allgather_elems;
  report.unmerged_inflation = plan.unmergedInflation();
  report.unmerged_peak_unsharded_bytes = plan.unmerged_peak_unsharded_bytes;
  report.merge_ms = plan.merge_ms;
  report.runs.reserve(plan.runs.size());
  for (const planner::MergedRun& run : plan.runs) {
    report.runs.push_back({run.plan.name, static_cast<std::int64_t>(run.first), static_cast<std::int64_t>(run.count),
                           run.allgather_elems, run.unsharded_bytes, run.over_budget});
  }
  return report;
}

void recomputeTotals(PlanReport& report) {
  TotalReport& total = report.total;
  total.numel = 0;
  total.allgather_elems = 0;
  std::int64_t bound_elems = 0;
  for (const UnitReport& unit : report.units) {
    total.numel += unit.numel;
    const std::int64_t devices = unitDevices(report, unit);
    total.allgather_elems += devices * unit.shard_elems;
    bound_elems += devices * unit.lower_bound_elems;
  }
  const auto numel = static_cast<double>(std::max<std::int64_t>(total.numel, 1));
  total.inflation = static_cast<double>(total.allgather_elems) / numel;
  total.lower_bound_inflation = static_cast<double>(bound_elems) / numel;
}

}  // namespace dbuf::plan_io
