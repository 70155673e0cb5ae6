#include "composed.hpp"

#include <algorithm>
#include <string>
#include <string_view>
#include <utility>

namespace dbuf::plan_cli {
namespace {

bool sameTensors(const planner::UnitSpec& a, const planner::UnitSpec& b) {
  if (a.tensors.size() != b.tensors.size()) return false;
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    if (a.tensors[i].name != b.tensors[i].name || a.tensors[i].shape != b.tensors[i].shape) return false;
  }
  return true;
}

bool sameLocalUnits(const planner::LocalUnits& a, const planner::LocalUnits& b) {
  return sameTensors(a.dense, b.dense) && a.experts.has_value() == b.experts.has_value() &&
         (!a.experts || sameTensors(*a.experts, *b.experts));
}

/// "0-6,8": ascending ranks as runs.
std::string rankRuns(const std::vector<std::int64_t>& ranks) {
  std::string text;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    text += (text.empty() ? "" : ",") + std::to_string(ranks[i]) + (j > i ? "-" + std::to_string(ranks[j]) : "");
    i = j + 1;
  }
  return text;
}

/// `text` with every run of digits between dots ("layers.12.") read as N: the same tensor of every layer.
std::string layerless(std::string_view text) {
  std::string out;
  for (std::size_t i = 0; i < text.size(); ++i) {
    std::size_t j = i;
    while (j < text.size() && text[j] >= '0' && text[j] <= '9') ++j;
    if (j > i && i > 0 && text[i - 1] == '.' && j < text.size() && text[j] == '.') {
      out += 'N';
      i = j - 1;
    } else {
      out += text[i];
    }
  }
  return out;
}

}  // namespace

Result<std::vector<ComposedUnit>> composedUnits(const std::vector<planner::UnitSpec>& units,
                                                const planner::ModelParallelism& parallelism) {
  std::vector<ComposedUnit> composed;
  for (const planner::UnitSpec& unit : units) {
    std::vector<std::pair<std::vector<std::int64_t>, planner::LocalUnits>> classes;
    for (std::int64_t tp_rank = 0; tp_rank < parallelism.tp; ++tp_rank) {
      auto local = planner::localUnits(unit, parallelism, tp_rank, 0);
      if (!local) return std::move(local).error();
      auto same = std::find_if(classes.begin(), classes.end(),
                               [&](const auto& known) { return sameLocalUnits(known.second, *local); });
      if (same != classes.end()) {
        same->first.push_back(tp_rank);
      } else {
        classes.emplace_back(std::vector<std::int64_t>{tp_rank}, std::move(*local));
      }
    }
    for (auto& [tp_ranks, local] : classes) {
      const std::string suffix = classes.size() > 1 ? "@tp" + rankRuns(tp_ranks) : "";
      if (!local.dense.tensors.empty()) {
        local.dense.name += suffix;
        composed.push_back({std::move(local.dense), false});
      }
      if (local.experts) {
        local.experts->name += suffix;
        composed.push_back({std::move(*local.experts), true});
      }
    }
  }
  return composed;
}

Result<planner::ModelPlan> planComposed(const std::vector<ComposedUnit>& composed, planner::PlanOptions options,
                                        std::int64_t ep) {
  std::vector<planner::UnitSpec> dense, experts;
  for (const ComposedUnit& unit : composed) (unit.experts ? experts : dense).push_back(unit.unit);
  auto dense_plan = planner::planModel(dense, options);
  if (!dense_plan) return std::move(dense_plan).error();
  planner::ModelPlan expert_plan;
  if (!experts.empty()) {
    options.devices /= ep;
    auto planned = planner::planModel(experts, options);
    if (!planned) return std::move(planned).error();
    expert_plan = std::move(*planned);
  }
  planner::ModelPlan plan;
  plan.plan_ms = dense_plan->plan_ms + expert_plan.plan_ms;
  std::size_t next_dense = 0, next_expert = 0;
  for (const ComposedUnit& unit : composed) {
    plan.units.push_back(std::move(unit.experts ? expert_plan.units[next_expert++] : dense_plan->units[next_dense++]));
  }
  return plan;
}

plan_io::ModelParallelReport modelParallelReport(const std::vector<planner::UnitSpec>& units,
                                                 const planner::ModelParallelism& parallelism,
                                                 const planner::GranularityRule& rule) {
  std::vector<std::pair<std::string, std::int64_t>> seen;  // (layerless text, further units)
  plan_io::ModelParallelReport report{.tp = parallelism.tp, .ep = parallelism.ep, .diagnoses = {}};
  for (const planner::UnitSpec& unit : units) {
    for (std::string& diagnosis : planner::tensorParallelDiagnoses(unit, parallelism, rule)) {
      // "unit 'NAME', " leads every line: what follows names the tensor.
      const std::string key = layerless(std::string_view(diagnosis).substr(unit.name.size() + 9));
      auto known = std::find_if(seen.begin(), seen.end(), [&](const auto& entry) { return entry.first == key; });
      if (known != seen.end()) {
        ++known->second;
        continue;
      }
      seen.emplace_back(key, 0);
      report.diagnoses.push_back(std::move(diagnosis));
    }
  }
  for (std::size_t i = 0; i < seen.size(); ++i) {
    if (seen[i].second > 0) report.diagnoses[i] += " (and " + std::to_string(seen[i].second) + " more units alike)";
  }
  return report;
}

}  // namespace dbuf::plan_cli
