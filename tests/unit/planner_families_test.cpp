// The planner on a sample of the generated model families of
// bench/model_families.hpp (issue 16): every plan valid, the reported bounds
// consistent, and the whole-model gap at few ranks kept where it stands
// (bench_planner_families measures all 200 models; this is its property test).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dbuf/planner/layout.hpp"
#include "dbuf/planner/unit_plan.hpp"
#include "model_families.hpp"

namespace dbuf::planner {
namespace {

Layout layoutOf(const UnitPlan& plan) {
  Layout layout{plan.shard_elems, {}};
  for (const PlannedTensor& tensor : plan.tensors) layout.offsets.push_back(tensor.offset);
  return layout;
}

LayoutProblem problemOf(const UnitPlan& plan) {
  LayoutProblem problem{{}, plan.devices, plan.align_elems};
  for (const PlannedTensor& tensor : plan.tensors) problem.items.push_back({tensor.numel, tensor.granularity});
  return problem;
}

TEST(PlannerFamilies, PlansAreValidAndBoundsConsistent) {
  const std::vector<bench::GeneratedModel> models = bench::generateModels(16, 200);
  int units_checked = 0;
  for (std::size_t m = 0; m < models.size(); m += 10) {  // 20 of them, MoE and dense
    for (const std::int64_t devices : {8, 256}) {
      for (const char* rule : {"element", "block:128x128"}) {
        PlanOptions options;
        options.devices = devices;
        options.default_rule = *GranularityRule::parse(rule);
        const auto planned = planModel(models[m].units, options);
        ASSERT_TRUE(planned) << models[m].name;
        double volume = 0;
        double bound = 0;
        for (const UnitPlan& plan : planned->units) {
          const std::string where = models[m].name + " V=" + std::to_string(devices) + " " + rule + " " + plan.name;
          ASSERT_EQ(describeViolation(problemOf(plan), layoutOf(plan)), "") << where;
          ASSERT_EQ(plan.split_blocks, 0) << where;
          ASSERT_LE(plan.brief_lower_bound_elems, plan.placement_bound_elems) << where;
          ASSERT_LE(plan.placement_bound_elems, plan.lower_bound_elems) << where;
          ASSERT_LE(plan.lower_bound_elems, plan.shard_elems) << where;
          ASSERT_EQ(plan.proven_optimal, plan.lower_bound_elems == plan.shard_elems) << where;
          volume += static_cast<double>(plan.shard_elems);
          bound += static_cast<double>(plan.lower_bound_elems);
          ++units_checked;
        }
        // Measured on this sample: at most 0.03% at V = 8 (0.31% over all
        // 200 models); a regression guard with room, not a target.
        if (devices == 8) {
          EXPECT_LT(volume / bound - 1, 0.005) << models[m].name << " " << rule;
        }
      }
    }
  }
  EXPECT_GT(units_checked, 300);
}

}  // namespace
}  // namespace dbuf::planner
