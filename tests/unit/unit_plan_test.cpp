// The planner's front door (unit_plan.hpp): problem building and its errors,
// unit plans, rank slices, model plans with caching and diagnoses.
#include "dbuf/planner/unit_plan.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "dbuf/plan_io/model_file.hpp"
#include "dbuf/planner/bounds.hpp"
#include "support/oracle.hpp"
#include "support/plan_options.hpp"
#include "support/text.hpp"

namespace dbuf::planner {
namespace {

namespace t = dbuf::planner::testing;
using dbuf::planner::testing::optionsFor;

TensorSpec tensor(std::string name, std::vector<std::int64_t> shape, DType dtype = DType::kBF16) {
  TensorSpec spec;
  spec.name = std::move(name);
  spec.shape = std::move(shape);
  spec.dtype = dtype;
  return spec;
}

TensorSpec withRule(TensorSpec spec, const std::string& rule) {
  auto parsed = GranularityRule::parse(rule);
  EXPECT_TRUE(parsed.ok()) << rule;
  if (parsed) spec.granularity = *parsed;
  return spec;
}

UnitSpec toyUnit() { return UnitSpec{"toy", {tensor("A", {5, 4}), tensor("B", {3, 2}), tensor("C", {7})}}; }

using dbuf::testing::contains;

// ---------------------------------------------------------------- buildProblem

TEST(BuildProblem, ResolvesGranularityAndAlignment) {
  UnitSpec unit{"u",
                {tensor("w", {8, 6}), tensor("b", {8}), withRule(tensor("m", {4, 8, 6}), "matrix"),
                 withRule(tensor("c", {10}), "5")}};
  const auto problem = buildProblem(unit, optionsFor(4, "rows:2"));
  ASSERT_TRUE(problem.ok()) << problem.error().message;
  EXPECT_EQ(problem->devices, 4);
  EXPECT_EQ(problem->align_elems, 8);  // 16 bytes of bf16
  ASSERT_EQ(problem->items.size(), 4U);
  EXPECT_EQ(problem->items[0].numel, 48);
  EXPECT_EQ(problem->items[0].granularity, 12);  // default rule rows:2 on a 2D tensor
  EXPECT_EQ(problem->items[1].granularity, 1);   // 1D tensors default to element
  EXPECT_EQ(problem->items[2].granularity, 48);  // own rule wins
  EXPECT_EQ(problem->items[3].granularity, 5);   // own rule applies to 1D too
  // Alignment in elements follows the dtype.
  UnitSpec fp32{"f", {tensor("x", {4}, DType::kF32)}};
  EXPECT_EQ(buildProblem(fp32, optionsFor(2))->align_elems, 4);
  UnitSpec fp8{"f", {tensor("x", {4}, DType::kF8E4M3)}};
  EXPECT_EQ(buildProblem(fp8, optionsFor(2))->align_elems, 16);
  EXPECT_EQ(buildProblem(toyUnit(), optionsFor(2, "element", 2))->align_elems, 1);
}

TEST(BuildProblem, RejectsBadDeviceCounts) {
  for (const std::int64_t devices : {std::int64_t{0}, std::int64_t{-1}, std::int64_t{-1024}, (std::int64_t{1} << 24) + 1,
                                    std::int64_t{1} << 40}) {
    const auto problem = buildProblem(toyUnit(), optionsFor(devices));
    ASSERT_FALSE(problem.ok()) << devices;
    EXPECT_EQ(problem.error().code, ErrorCode::kInvalidArgument);
    EXPECT_TRUE(contains(problem.error().message, "device")) << problem.error().message;
  }
}

TEST(BuildProblem, RejectsBadAlignment) {
  for (const std::int64_t align_bytes : {0, -16, 3, 15}) {  // bf16: must be a positive multiple of 2
    const auto problem = buildProblem(toyUnit(), optionsFor(4, "element", align_bytes));
    ASSERT_FALSE(problem.ok()) << align_bytes;
    EXPECT_EQ(problem.error().code, ErrorCode::kInvalidArgument);
    EXPECT_TRUE(contains(problem.error().message, "alignment")) << problem.error().message;
  }
}

void expectErrorNaming(const UnitSpec& unit, const std::string& tensor_name, const std::string& what,
                       const PlanOptions& options = optionsFor(4)) {
  const auto problem = buildProblem(unit, options);
  ASSERT_FALSE(problem.ok()) << "accepted unit " << unit.name;
  EXPECT_EQ(problem.error().code, ErrorCode::kInvalidArgument);
  const std::string& message = problem.error().message;
  EXPECT_TRUE(contains(message, "unit '" + unit.name + "'")) << message;
  if (!tensor_name.empty()) {
    EXPECT_TRUE(contains(message, "tensor '" + tensor_name + "'")) << message;
  }
  EXPECT_TRUE(contains(message, what)) << message;
  // planUnit and planModel pass the same error on.
  const auto plan = planUnit(unit, options);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.error().message, message);
  const auto model = planModel({toyUnit(), unit}, options);
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.error().message, message);
}

TEST(BuildProblem, ErrorsNameUnitAndTensor) {
  expectErrorNaming(UnitSpec{"mixed", {tensor("a", {4}), tensor("b", {4}, DType::kF32)}}, "b", "dtype");
  expectErrorNaming(UnitSpec{"zero", {tensor("a", {4}), tensor("w", {4, 0})}}, "w", "not positive");
  expectErrorNaming(UnitSpec{"negative", {tensor("w", {-2, 3})}}, "w", "not positive");
  expectErrorNaming(UnitSpec{"noshape", {tensor("s", {})}}, "s", "empty shape");
  expectErrorNaming(UnitSpec{"empty", {}}, "", "no tensors");
  expectErrorNaming(UnitSpec{"count", {withRule(tensor("c", {4, 3}), "5")}}, "c", "does not divide");
  TensorSpec tp = tensor("tp", {4, 3});
  tp.tp_dim = 2;
  expectErrorNaming(UnitSpec{"tpdim", {tp}}, "tp", "tp_dim");
  expectErrorNaming(UnitSpec{"huge", {tensor("h", {1LL << 40, 1LL << 20})}}, "h", "too many");
}

TEST(BuildProblem, RejectsUnitsTooLargeForInt64Arithmetic) {
  // V * N must stay far inside int64: 2^37 elements over 2^24 devices is too much.
  const UnitSpec big{"big", {tensor("w", {std::int64_t{1} << 37})}};
  const auto problem = buildProblem(big, optionsFor(std::int64_t{1} << 24));
  ASSERT_FALSE(problem.ok());
  EXPECT_EQ(problem.error().code, ErrorCode::kInvalidArgument);
  EXPECT_TRUE(contains(problem.error().message, "unit 'big'")) << problem.error().message;
  // The same unit over fewer devices is fine, and so is the largest V with a
  // smaller unit; plans stay valid at those sizes.
  ASSERT_TRUE(buildProblem(big, optionsFor(1024)).ok());
  const UnitSpec wide{"wide", {tensor("w", {std::int64_t{1} << 35}), tensor("b", {3})}};
  const PlanOptions many = optionsFor(std::int64_t{1} << 24);
  const auto plan = planUnit(wide, many);
  ASSERT_TRUE(plan.ok()) << plan.error().message;
  const auto wide_problem = buildProblem(wide, many);
  Layout layout{plan->shard_elems, {plan->tensors[0].offset, plan->tensors[1].offset}};
  EXPECT_EQ(describeViolation(*wide_problem, layout), "");
  EXPECT_EQ(plan->shard_elems, plan->lower_bound_elems);
  // A unit whose tensors together pass 2^60 elements.
  UnitSpec many_tensors{"many", {}};
  for (int i = 0; i < 1025; ++i) many_tensors.tensors.push_back(tensor("t" + std::to_string(i), {std::int64_t{1} << 50}));
  expectErrorNaming(many_tensors, "", "too many elements");
}

// ------------------------------------------------------------------- planUnit

void expectConsistentPlan(const UnitSpec& unit, const PlanOptions& options, const UnitPlan& plan) {
  const auto problem = buildProblem(unit, options);
  ASSERT_TRUE(problem.ok());
  Layout layout{plan.shard_elems, {}};
  for (const PlannedTensor& planned : plan.tensors) layout.offsets.push_back(planned.offset);
  EXPECT_EQ(describeViolation(*problem, layout), "");
  EXPECT_EQ(t::checkLayout(*problem, plan.shard_elems, layout.offsets), "");
  EXPECT_EQ(plan.name, unit.name);
  EXPECT_EQ(plan.devices, options.devices);
  EXPECT_EQ(plan.align_elems, problem->align_elems);
  EXPECT_EQ(plan.numel, totalNumel(*problem));
  EXPECT_EQ(plan.ideal_elems, (plan.numel + options.devices - 1) / options.devices);
  EXPECT_EQ(plan.padding_elems, options.devices * plan.shard_elems - plan.numel);
  EXPECT_EQ(plan.placement_bound_elems, computeLowerBound(*problem).shard_elems);
  EXPECT_GE(plan.lower_bound_elems, plan.placement_bound_elems);
  EXPECT_EQ(plan.proven_optimal, plan.lower_bound_elems == plan.shard_elems);
  EXPECT_EQ(plan.brief_lower_bound_elems, briefLowerBound(*problem));
  EXPECT_GE(plan.shard_elems, plan.lower_bound_elems);
  EXPECT_EQ(plan.split_blocks, 0);
  EXPECT_DOUBLE_EQ(plan.inflation(), static_cast<double>(options.devices * plan.shard_elems) / static_cast<double>(plan.numel));
  EXPECT_DOUBLE_EQ(plan.gapToLowerBound(), static_cast<double>(plan.shard_elems) / static_cast<double>(plan.lower_bound_elems) - 1.0);
  ASSERT_EQ(plan.tensors.size(), unit.tensors.size());
  for (std::size_t i = 0; i < unit.tensors.size(); ++i) {
    EXPECT_EQ(plan.tensors[i].name, unit.tensors[i].name);
    EXPECT_EQ(plan.tensors[i].shape, unit.tensors[i].shape);
    EXPECT_EQ(plan.tensors[i].numel, problem->items[i].numel);
    EXPECT_EQ(plan.tensors[i].granularity, problem->items[i].granularity);
  }
}

TEST(PlanUnit, ToyUnitIsOptimal) {
  for (const std::string rule : {"element", "rows:1", "matrix"}) {
    for (const std::int64_t align_bytes : {2, 16}) {
      const PlanOptions options = optionsFor(4, rule, align_bytes);
      const auto plan = planUnit(toyUnit(), options);
      ASSERT_TRUE(plan.ok()) << plan.error().message;
      expectConsistentPlan(toyUnit(), options, *plan);
      EXPECT_EQ(plan->shard_elems, t::oracleShard(*buildProblem(toyUnit(), options))) << rule << " " << align_bytes;
      EXPECT_FALSE(plan->diagnosis.has_value());  // planUnit never diagnoses
    }
  }
  // Hand-checked: element granularity, no alignment: ceil(33 / 4) = 9.
  const auto packed = planUnit(toyUnit(), optionsFor(4, "element", 2));
  EXPECT_EQ(packed->shard_elems, 9);
  EXPECT_EQ(packed->padding_elems, 3);
  // 16-byte alignment: 24 + 8 + 8 aligned elements -> S >= 10 -> 16.
  const auto aligned = planUnit(toyUnit(), optionsFor(4, "element", 16));
  EXPECT_EQ(aligned->shard_elems, 16);
  EXPECT_EQ(aligned->lower_bound_elems, 16);
}

// ----------------------------------------------------------------- rankSlices

/// Checks the slices of every tensor of `plan` against a direct reading of the
/// layout: they tile [0, numel) in rank order, each within its rank's chunk,
/// with local_units the blocks they touch.
void expectSlicesTile(const UnitPlan& plan) {
  for (std::size_t i = 0; i < plan.tensors.size(); ++i) {
    const PlannedTensor& tensor = plan.tensors[i];
    const std::vector<RankSlice> slices = rankSlices(plan, i);
    ASSERT_FALSE(slices.empty());
    std::int64_t next = 0;
    std::int64_t previous_rank = -1;
    std::int64_t units = 0;
    for (const RankSlice& slice : slices) {
      EXPECT_GT(slice.rank, previous_rank);
      EXPECT_LT(slice.rank, plan.devices);
      EXPECT_EQ(slice.begin, next) << tensor.name;
      EXPECT_LT(slice.begin, slice.end) << "ranks holding nothing must be left out";
      // Within the rank's chunk of the global buffer.
      EXPECT_GE(tensor.offset + slice.begin, slice.rank * plan.shard_elems);
      EXPECT_LE(tensor.offset + slice.end, (slice.rank + 1) * plan.shard_elems);
      // Every element of the tensor in this rank's chunk is in the slice.
      if (slice.end < tensor.numel) {
        EXPECT_EQ(tensor.offset + slice.end, (slice.rank + 1) * plan.shard_elems);
      }
      // local_units: blocks intersecting [begin, end), counted one by one;
      // since no block is split they are whole (the last may be short).
      std::int64_t blocks = 0;
      for (std::int64_t block = 0; block * tensor.granularity < tensor.numel; ++block) {
        const std::int64_t lo = block * tensor.granularity;
        const std::int64_t hi = std::min(lo + tensor.granularity, tensor.numel);
        if (lo < slice.end && slice.begin < hi) {
          ++blocks;
          EXPECT_TRUE(slice.begin <= lo && hi <= slice.end) << "block " << block << " of " << tensor.name << " split";
        }
      }
      EXPECT_EQ(slice.local_units, blocks) << tensor.name << " rank " << slice.rank;
      units += slice.local_units;
      next = slice.end;
      previous_rank = slice.rank;
    }
    EXPECT_EQ(next, tensor.numel) << tensor.name;
    EXPECT_EQ(units, (tensor.numel + tensor.granularity - 1) / tensor.granularity) << tensor.name;
  }
}

TEST(RankSlices, ToyUnitByHand) {
  const auto plan = planUnit(toyUnit(), optionsFor(4, "element", 2));  // S = 9, packed
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->shard_elems, 9);
  expectSlicesTile(*plan);
  // Whatever the order, the 33 elements fill ranks 0-3 but for 3 padding
  // elements; every rank holds something.
  std::vector<std::int64_t> per_rank(4, 0);
  for (std::size_t i = 0; i < plan->tensors.size(); ++i) {
    for (const RankSlice& slice : rankSlices(*plan, i)) per_rank[static_cast<std::size_t>(slice.rank)] += slice.end - slice.begin;
  }
  EXPECT_EQ(per_rank[0] + per_rank[1] + per_rank[2] + per_rank[3], 33);
}

TEST(RankSlices, OmitRanksWithNothing) {
  // One small tensor on many ranks: a single slice on one rank.
  const UnitSpec unit{"small", {tensor("w", {2, 4})}};
  const auto plan = planUnit(unit, optionsFor(64, "matrix", 2));
  ASSERT_TRUE(plan.ok());
  const auto slices = rankSlices(*plan, 0);
  ASSERT_EQ(slices.size(), 1U);
  EXPECT_EQ(slices[0].begin, 0);
  EXPECT_EQ(slices[0].end, 8);
  EXPECT_EQ(slices[0].local_units, 1);
}

TEST(RankSlices, RandomUnitsTileExactly) {
  std::mt19937_64 rng(0x0a170001);
  const std::vector<std::string> rules{"element", "rows:2", "rows:3", "matrix", "block:4x8"};
  for (int trial = 0; trial < 400; ++trial) {
    UnitSpec unit{"r" + std::to_string(trial), {}};
    const auto count = t::uniform(rng, 1, 6);
    for (std::int64_t i = 0; i < count; ++i) {
      std::vector<std::int64_t> shape;
      const auto rank = t::uniform(rng, 1, 3);
      for (std::int64_t d = 0; d < rank; ++d) shape.push_back(t::uniform(rng, 1, rank == 1 ? 40 : 9));
      TensorSpec spec = tensor("t" + std::to_string(i), shape);
      if (t::uniform(rng, 0, 2) == 0) spec = withRule(spec, rules[static_cast<std::size_t>(t::uniform(rng, 0, 4))]);
      unit.tensors.push_back(spec);
    }
    const PlanOptions options = optionsFor(t::uniform(rng, 1, 12), rules[static_cast<std::size_t>(t::uniform(rng, 0, 4))],
                                           t::uniform(rng, 0, 1) ? 2 : 16);
    const auto plan = planUnit(unit, options);
    ASSERT_TRUE(plan.ok()) << plan.error().message;
    expectConsistentPlan(unit, options, *plan);
    expectSlicesTile(*plan);
    if (::testing::Test::HasFailure()) break;
  }
}

// ------------------------------------------------------------------ planModel

/// Every bundled model at 8, 256 and 1024 ranks under each rule: every plan
/// valid with no split block, at or above its bound, and no worse than the
/// three fixed orders (checked on the first units and the last, where the
/// distinct shapes are: embeddings, dense and MoE layers, head).
class BundledModel : public ::testing::TestWithParam<std::string> {};

std::string modelTestName(const ::testing::TestParamInfo<std::string>& model) {
  std::string name = model.param;
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

TEST_P(BundledModel, EveryPlanValidAndNoWorseThanFixedOrders) {
  const auto file = plan_io::loadModelFile(std::string(DBUF_MODELS_DIR) + "/" + GetParam() + ".json");
  ASSERT_TRUE(file.ok()) << file.error().message;
  const std::vector<UnitSpec>& units = file->units;
  for (const std::int64_t devices : {8, 256, 1024}) {
    for (const std::string rule : {"element", "rows:32", "block:128x128"}) {
      SCOPED_TRACE("V=" + std::to_string(devices) + " " + rule);
      const PlanOptions options = optionsFor(devices, rule);
      const auto model = planModel(units, options);
      ASSERT_TRUE(model.ok()) << model.error().message;
      ASSERT_EQ(model->units.size(), units.size());
      for (std::size_t u = 0; u < units.size(); ++u) {
        const UnitPlan& plan = model->units[u];
        const auto problem = buildProblem(units[u], options);
        ASSERT_TRUE(problem.ok());
        Layout layout{plan.shard_elems, {}};
        for (const PlannedTensor& planned : plan.tensors) layout.offsets.push_back(planned.offset);
        ASSERT_EQ(describeViolation(*problem, layout), "") << plan.name;
        ASSERT_EQ(plan.split_blocks, 0);
        ASSERT_GE(plan.shard_elems, plan.lower_bound_elems);
        ASSERT_EQ(plan.placement_bound_elems, computeLowerBound(*problem).shard_elems);
        ASSERT_GE(plan.lower_bound_elems, plan.placement_bound_elems);
        // Slices: contiguous, covering, cut only on block edges.
        for (std::size_t i = 0; i < plan.tensors.size(); ++i) {
          const PlannedTensor& planned = plan.tensors[i];
          std::int64_t next = 0;
          std::int64_t units_held = 0;
          for (const RankSlice& slice : rankSlices(plan, i)) {
            ASSERT_EQ(slice.begin, next);
            ASSERT_LT(slice.begin, slice.end);
            ASSERT_LT(slice.rank, devices);
            if (slice.end < planned.numel) {
              ASSERT_EQ(slice.end % planned.granularity, 0) << planned.name;
            }
            units_held += slice.local_units;
            next = slice.end;
          }
          ASSERT_EQ(next, planned.numel);
          ASSERT_EQ(units_held, (planned.numel + planned.granularity - 1) / planned.granularity);
        }
        if (u > 3 && u + 2 < units.size()) continue;
        for (const Strategy strategy :
             {Strategy::kGivenOrder, Strategy::kSizeDescending, Strategy::kGranularityDescending}) {
          SearchOptions fixed;
          fixed.strategies = {strategy};
          ASSERT_LE(plan.shard_elems, solveLayout(*problem, fixed).layout.shard_elems)
              << plan.name << " vs " << toString(strategy);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, BundledModel,
                         ::testing::Values("deepseek-v3", "gpt-oss-120b", "gpt-oss-20b", "llama3-70b", "llama3-8b",
                                           "mixtral-8x7b"),
                         modelTestName);

void expectSamePlan(const UnitPlan& from_model, const UnitPlan& alone) {
  EXPECT_EQ(from_model.name, alone.name);
  EXPECT_EQ(from_model.shard_elems, alone.shard_elems) << alone.name;
  EXPECT_EQ(from_model.lower_bound_elems, alone.lower_bound_elems) << alone.name;
  EXPECT_EQ(from_model.numel, alone.numel);
  EXPECT_EQ(from_model.align_elems, alone.align_elems);
  EXPECT_EQ(from_model.dtype, alone.dtype);
  ASSERT_EQ(from_model.tensors.size(), alone.tensors.size());
  for (std::size_t i = 0; i < alone.tensors.size(); ++i) {
    EXPECT_EQ(from_model.tensors[i].name, alone.tensors[i].name);
    EXPECT_EQ(from_model.tensors[i].offset, alone.tensors[i].offset) << alone.tensors[i].name;
    EXPECT_EQ(from_model.tensors[i].granularity, alone.tensors[i].granularity) << alone.tensors[i].name;
  }
  EXPECT_EQ(from_model.baselines.fsdp2.shard_elems, alone.baselines.fsdp2.shard_elems) << alone.name;
  EXPECT_EQ(from_model.baselines.fsdp1.shard_elems, alone.baselines.fsdp1.shard_elems) << alone.name;
  EXPECT_EQ(from_model.baselines.zero3.shard_elems, alone.baselines.zero3.shard_elems) << alone.name;
  EXPECT_EQ(from_model.baselines.megatron.shard_elems, alone.baselines.megatron.shard_elems) << alone.name;
}

TEST(PlanModel, EveryUnitAsIfPlannedAlone) {
  // u1 repeats u0's shapes under other names (a cache hit); u2 has the same
  // shapes but its own rule on one tensor; u3 the same shapes in fp32.
  const UnitSpec u0{"u0", {tensor("u0.w", {6, 4}), tensor("u0.b", {6}), tensor("u0.v", {3, 4})}};
  const UnitSpec u1{"u1", {tensor("u1.w", {6, 4}), tensor("u1.b", {6}), tensor("u1.v", {3, 4})}};
  const UnitSpec u2{"u2", {withRule(tensor("u2.w", {6, 4}), "matrix"), tensor("u2.b", {6}), tensor("u2.v", {3, 4})}};
  const UnitSpec u3{"u3",
                    {tensor("u3.w", {6, 4}, DType::kF32), tensor("u3.b", {6}, DType::kF32),
                     tensor("u3.v", {3, 4}, DType::kF32)}};
  const std::vector<UnitSpec> units{u0, u1, u2, u3, u1};
  for (const std::int64_t devices : {2, 3, 8}) {
    const PlanOptions options = optionsFor(devices, "rows:2");
    const auto model = planModel(units, options);
    ASSERT_TRUE(model.ok()) << model.error().message;
    ASSERT_EQ(model->units.size(), units.size());
    for (std::size_t u = 0; u < units.size(); ++u) {
      const auto alone = planUnit(units[u], options);
      ASSERT_TRUE(alone.ok());
      expectSamePlan(model->units[u], *alone);
      expectConsistentPlan(units[u], options, model->units[u]);
    }
    EXPECT_GE(model->plan_ms, 0.0);
  }
}

TEST(PlanModel, ReusesPlansOfIdenticalLayers) {
  const auto file = plan_io::loadModelFile(std::string(DBUF_MODELS_DIR) + "/llama3-8b.json");
  ASSERT_TRUE(file.ok()) << file.error().message;
  const PlanOptions options = optionsFor(64, "rows:32");
  const auto model = planModel(file->units, options);
  ASSERT_TRUE(model.ok()) << model.error().message;
  ASSERT_EQ(model->units.size(), file->units.size());
  const UnitPlan* first_layer = nullptr;
  for (std::size_t u = 0; u < file->units.size(); ++u) {
    const UnitPlan& plan = model->units[u];
    expectConsistentPlan(file->units[u], options, plan);
    if (file->units[u].name.rfind("layers.", 0) != 0) continue;
    if (!first_layer) {
      first_layer = &plan;
      continue;
    }
    // Same layout as the first layer, under this layer's own names.
    EXPECT_EQ(plan.shard_elems, first_layer->shard_elems);
    for (std::size_t i = 0; i < plan.tensors.size(); ++i) {
      EXPECT_EQ(plan.tensors[i].offset, first_layer->tensors[i].offset);
      EXPECT_EQ(plan.tensors[i].name, file->units[u].tensors[i].name);
    }
  }
  ASSERT_NE(first_layer, nullptr);
  // Spot check against planning a layer alone.
  const auto alone = planUnit(file->units[5], options);
  ASSERT_TRUE(alone.ok());
  expectSamePlan(model->units[5], *alone);
}

/// Lower bound of `unit` is within 5% of its ceil(N/V).
bool boundIsNear(const UnitSpec& unit, const PlanOptions& options) {
  const auto problem = buildProblem(unit, options);
  EXPECT_TRUE(problem.ok());
  if (!problem) return false;
  const std::int64_t ideal = (totalNumel(*problem) + options.devices - 1) / options.devices;
  return static_cast<double>(computeLowerBound(*problem).shard_elems) <= 1.05 * static_cast<double>(ideal);
}

UnitSpec mergeWindow(const std::vector<UnitSpec>& units, std::size_t index, std::size_t count) {
  const std::size_t first = std::min(index, units.size() - count);
  UnitSpec merged{"merged", {}};
  for (std::size_t u = first; u < first + count; ++u) {
    merged.tensors.insert(merged.tensors.end(), units[u].tensors.begin(), units[u].tensors.end());
  }
  return merged;
}

UnitSpec withRuleOn(UnitSpec unit, const std::vector<std::string>& names, const std::string& rule) {
  for (TensorSpec& spec : unit.tensors) {
    if (std::find(names.begin(), names.end(), spec.name) != names.end()) spec = withRule(spec, rule);
  }
  return unit;
}

TEST(PlanModel, DiagnosesCoarseBlocksAtManyRanks) {
  // Llama-3-8B at 1024 ranks in bands of 32 rows: a decoder layer's matrices
  // are longer than 2S, so S must be a multiple of lcm(32 x 4096, 32 x 14336)
  // = 917504, over 4x ceil(N/V) = 213000.
  const auto file = plan_io::loadModelFile(std::string(DBUF_MODELS_DIR) + "/llama3-8b.json");
  ASSERT_TRUE(file.ok()) << file.error().message;
  const std::vector<UnitSpec>& units = file->units;
  const PlanOptions options = optionsFor(1024, "rows:32");
  const auto model = planModel(units, options);
  ASSERT_TRUE(model.ok()) << model.error().message;
  std::size_t diagnosed = 0;
  for (std::size_t u = 0; u < units.size(); ++u) {
    const UnitPlan& plan = model->units[u];
    const bool far = static_cast<double>(plan.placement_bound_elems) > 1.05 * static_cast<double>(plan.ideal_elems);
    ASSERT_EQ(plan.diagnosis.has_value(), far) << plan.name;
    if (!far) continue;
    ++diagnosed;
    const BoundDiagnosis& diagnosis = *plan.diagnosis;
    SCOPED_TRACE(plan.name);

    // Forcing tensors: names of this unit's tensors; together they force the
    // whole bound (the other tensors alone would be placeable at capacity).
    ASSERT_FALSE(diagnosis.forcing_tensors.empty());
    for (const std::string& name : diagnosis.forcing_tensors) {
      EXPECT_TRUE(std::any_of(units[u].tensors.begin(), units[u].tensors.end(),
                              [&](const TensorSpec& spec) { return spec.name == name; }))
          << name;
    }

    // merge_units: the merged window's bound is within 5%, one fewer is not.
    if (diagnosis.merge_units) {
      const auto count = static_cast<std::size_t>(*diagnosis.merge_units);
      ASSERT_GE(count, 2U);
      ASSERT_LE(count, units.size());
      EXPECT_TRUE(boundIsNear(mergeWindow(units, u, count), options)) << "merge " << count;
      if (count > 2) {
        EXPECT_FALSE(boundIsNear(mergeWindow(units, u, count - 1), options)) << "merge " << count - 1;
      }
    } else {
      for (std::size_t count = 2; count <= units.size(); ++count) {
        EXPECT_FALSE(boundIsNear(mergeWindow(units, u, count), options)) << "merge " << count << " would do";
      }
    }

    // finer_rule: applied to the forcing tensors it brings the bound within
    // 5%; twice as many rows (when still finer than rows:32) does not.
    if (diagnosis.finer_rule) {
      const auto rule = GranularityRule::parse(*diagnosis.finer_rule);
      ASSERT_TRUE(rule.ok()) << *diagnosis.finer_rule;
      ASSERT_EQ(rule->kind, GranularityRule::Kind::kRows);
      ASSERT_LT(rule->rows, 32);
      EXPECT_TRUE(boundIsNear(withRuleOn(units[u], diagnosis.forcing_tensors, *diagnosis.finer_rule), options));
      if (rule->rows * 2 < 32) {
        EXPECT_FALSE(boundIsNear(
            withRuleOn(units[u], diagnosis.forcing_tensors, "rows:" + std::to_string(rule->rows * 2)), options));
      }
    } else {
      for (std::int64_t rows = 16; rows >= 1; rows /= 2) {
        EXPECT_FALSE(
            boundIsNear(withRuleOn(units[u], diagnosis.forcing_tensors, "rows:" + std::to_string(rows)), options))
            << "rows:" << rows << " would do";
      }
    }

    // hsdp_devices: a power-of-two fraction of V within 5%; twice it is not.
    if (diagnosis.hsdp_devices) {
      const std::int64_t devices = *diagnosis.hsdp_devices;
      ASSERT_GE(devices, 1);
      ASSERT_LT(devices, options.devices);
      EXPECT_EQ(options.devices % devices, 0);
      PlanOptions hsdp = options;
      hsdp.devices = devices;
      EXPECT_TRUE(boundIsNear(units[u], hsdp)) << devices;
      hsdp.devices = devices * 2;
      if (hsdp.devices < options.devices) {
        EXPECT_FALSE(boundIsNear(units[u], hsdp)) << hsdp.devices;
      }
    }
    // Some fix must exist for a decoder layer: HSDP down to one device
    // always has S = N (within 5%).
    if (units[u].name.rfind("layers.", 0) == 0) {
      EXPECT_TRUE(diagnosis.hsdp_devices.has_value());
      EXPECT_GE(plan.lower_bound_elems, 917504);
    }
  }
  EXPECT_GE(diagnosed, 32U);  // every decoder layer
  std::printf("layers.0 diagnosis: forcing %zu tensors, merge %s, finer %s, hsdp %s\n",
              model->units[1].diagnosis ? model->units[1].diagnosis->forcing_tensors.size() : 0,
              model->units[1].diagnosis && model->units[1].diagnosis->merge_units
                  ? std::to_string(*model->units[1].diagnosis->merge_units).c_str()
                  : "-",
              model->units[1].diagnosis && model->units[1].diagnosis->finer_rule
                  ? model->units[1].diagnosis->finer_rule->c_str()
                  : "-",
              model->units[1].diagnosis && model->units[1].diagnosis->hsdp_devices
                  ? std::to_string(*model->units[1].diagnosis->hsdp_devices).c_str()
                  : "-");
}

// Two identical coarse tensors both force the bound; the finer rule must be
// found for the unit as a whole (V=64, rows:8 on two [64, 16] bf16 tensors:
// N = 2048, ceil(N/V) = 32, bound 128; rows:1 brings it to 32).
TEST(PlanModel, FinerRuleCoversEveryForcingTensor) {
  const UnitSpec unit{"twins", {tensor("w0", {64, 16}), tensor("w1", {64, 16})}};
  const PlanOptions options = optionsFor(64, "rows:8", 2);
  ASSERT_TRUE(boundIsNear(withRuleOn(unit, {"w0", "w1"}, "rows:1"), options));
  const auto model = planModel({unit}, options);
  ASSERT_TRUE(model.ok());
  ASSERT_TRUE(model->units[0].diagnosis.has_value());
  const BoundDiagnosis& diagnosis = *model->units[0].diagnosis;
  EXPECT_EQ(diagnosis.forcing_tensors, (std::vector<std::string>{"w0", "w1"}));
  ASSERT_TRUE(diagnosis.finer_rule.has_value());
  EXPECT_TRUE(boundIsNear(withRuleOn(unit, diagnosis.forcing_tensors, *diagnosis.finer_rule), options));
}

// Units with the same shapes share a cached plan; Megatron-FSDP's baseline
// depends on which tensors are experts (by name), so a unit that differs only
// in that must still get its own baseline.
//
// The cache key includes which tensors are experts.
TEST(PlanModel, CachedPlansKeepTheirOwnExpertBaseline) {
  const UnitSpec dense{"dense", {tensor("a.mlp.w", {5, 4}), tensor("a.mlp.v", {2, 3, 2})}};
  const UnitSpec moe{"moe", {tensor("b.mlp.w", {5, 4}), tensor("b.mlp.experts.v", {2, 3, 2})}};
  const PlanOptions options = optionsFor(4);
  const auto model = planModel({dense, moe}, options);
  ASSERT_TRUE(model.ok());
  const auto alone = planUnit(moe, options);
  ASSERT_TRUE(alone.ok());
  EXPECT_EQ(alone->baselines.megatron.shard_elems, 14);  // buckets 32 / 4 + 24 / 4
  EXPECT_EQ(model->units[0].baselines.megatron.shard_elems, 12);
  EXPECT_EQ(model->units[1].baselines.megatron.shard_elems, alone->baselines.megatron.shard_elems);
}

// DistinctUnits: a unit matches an earlier one exactly when every tensor's
// plan inputs agree; names do not matter, expert flags, rules, tensor-parallel
// dims, dtypes and shapes do.
TEST(DistinctUnits, MatchesUnitsWithTheSamePlanInputs) {
  const UnitSpec base{"layers.0", {tensor("layers.0.w", {8, 4}), tensor("layers.0.mlp.experts.3.w", {4, 4})}};
  UnitSpec renamed{"layers.1", {tensor("layers.1.w", {8, 4}), tensor("layers.1.mlp.experts.9.w", {4, 4})}};
  std::vector<UnitSpec> different(6, renamed);
  different[0].tensors[1].name = "layers.1.mlp.dense.w";                // no longer an expert
  different[1].tensors[0] = withRule(different[1].tensors[0], "rows:2");  // a rule of its own
  different[2].tensors[0].tp_dim = 1;
  different[3].tensors[0].dtype = DType::kF32;
  different[4].tensors[0].shape = {4, 8};
  different[5].tensors.pop_back();
  DistinctUnits distinct;
  EXPECT_EQ(distinct.findOrAdd(base), std::nullopt);
  EXPECT_EQ(distinct.findOrAdd(renamed), 0U);
  for (std::size_t i = 0; i < different.size(); ++i) {
    EXPECT_EQ(distinct.findOrAdd(different[i]), std::nullopt) << i;
    EXPECT_EQ(distinct.findOrAdd(different[i]), i + 1) << i;  // now known
  }
  EXPECT_EQ(distinct.size(), different.size() + 1);
}

// An HSDP shard group must divide the world: V / hsdp_devices replicas.
//
// The group size is the largest proper divisor of V that works.
TEST(PlanModel, HsdpGroupSizeDividesTheDeviceCount) {
  const auto file = plan_io::loadModelFile(std::string(DBUF_MODELS_DIR) + "/llama3-8b.json");
  ASSERT_TRUE(file.ok()) << file.error().message;
  for (const std::int64_t devices : {1000, 1200}) {
    const PlanOptions options = optionsFor(devices, "rows:32");
    const auto model = planModel(file->units, options);
    ASSERT_TRUE(model.ok());
    const UnitPlan& layer = model->units[1];
    ASSERT_TRUE(layer.diagnosis.has_value());
    ASSERT_TRUE(layer.diagnosis->hsdp_devices.has_value());
    const std::int64_t group = *layer.diagnosis->hsdp_devices;
    EXPECT_EQ(devices % group, 0) << "V=" << devices << " hsdp_devices=" << group;
    PlanOptions hsdp = options;
    hsdp.devices = group;
    EXPECT_TRUE(boundIsNear(file->units[1], hsdp));
    // No larger proper divisor of V would do.
    for (std::int64_t larger = group + 1; larger < devices; ++larger) {
      if (devices % larger != 0) continue;
      hsdp.devices = larger;
      EXPECT_FALSE(boundIsNear(file->units[1], hsdp)) << "V=" << devices << ": " << larger << " would do";
    }
  }
}

TEST(PlanModel, NoDiagnosisWhenTheBoundIsClose) {
  const PlanOptions options = optionsFor(4);
  const auto model = planModel({toyUnit()}, options);
  ASSERT_TRUE(model.ok());
  // Toy at a = 8: bound 16 vs ceil(33/4) = 9 is far: diagnosed. At a = 1 it is not.
  EXPECT_TRUE(model->units[0].diagnosis.has_value());
  const auto packed = planModel({toyUnit()}, optionsFor(4, "element", 2));
  ASSERT_TRUE(packed.ok());
  EXPECT_FALSE(packed->units[0].diagnosis.has_value());
}

}  // namespace
}  // namespace dbuf::planner
