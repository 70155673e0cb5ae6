// FSDP composed with tensor / expert parallelism: the Megatron plan by name, one rank's chunks and experts,
// and the granularities tensor parallelism makes impossible.
#include "dbuf/planner/model_parallel.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dbuf::planner {
namespace {

using Shape = std::vector<std::int64_t>;

TensorSpec tensor(const std::string& name, Shape shape) {
  return TensorSpec{.name = name, .shape = std::move(shape), .dtype = DType::kBF16, .granularity = std::nullopt,
                    .tp_dim = std::nullopt};
}

GranularityRule rule(const std::string& text) { return *GranularityRule::parse(text); }

TEST(MegatronPlan, ColumnRowEmbeddingAndReplicatedByName) {
  EXPECT_EQ(megatronShardDim("model.layers.0.self_attn.q_proj.weight", 2), 0);
  EXPECT_EQ(megatronShardDim("model.layers.0.self_attn.q_proj.bias", 1), 0);
  EXPECT_EQ(megatronShardDim("model.layers.0.self_attn.o_proj.weight", 2), 1);
  EXPECT_EQ(megatronShardDim("model.layers.0.self_attn.o_proj.bias", 1), std::nullopt);
  EXPECT_EQ(megatronShardDim("model.layers.3.mlp.experts.7.down_proj.weight", 2), 1);
  EXPECT_EQ(megatronShardDim("model.layers.0.block_sparse_moe.experts.1.w3.weight", 2), 0);
  EXPECT_EQ(megatronShardDim("model.embed_tokens.weight", 2), 0);
  EXPECT_EQ(megatronShardDim("lm_head.weight", 2), 0);
  // GPT-OSS's fused experts, [E, in, out]: gate_up along out, down along in; down's bias replicated.
  EXPECT_EQ(megatronShardDim("model.layers.0.mlp.experts.gate_up_proj", 3), 2);
  EXPECT_EQ(megatronShardDim("model.layers.0.mlp.experts.gate_up_proj_bias", 2), 1);
  EXPECT_EQ(megatronShardDim("model.layers.0.mlp.experts.down_proj", 3), 1);
  EXPECT_EQ(megatronShardDim("model.layers.0.mlp.experts.down_proj_bias", 2), std::nullopt);
  for (const char* name : {"model.norm.weight", "model.layers.0.mlp.gate.weight", "model.layers.0.self_attn.sinks",
                           "model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.mlp.router.weight"}) {
    EXPECT_EQ(megatronShardDim(name, 2), std::nullopt) << name;
  }
}

TEST(MegatronPlan, ChunksAreTorchChunks) {
  // torch.chunk(90 rows, 4): 23, 23, 23, 21; (5, 4): 2, 2, 1, 0.
  EXPECT_EQ(chunkLength(90, 4, 0), 23);
  EXPECT_EQ(chunkLength(90, 4, 3), 21);
  EXPECT_EQ(chunkLength(5, 4, 2), 1);
  EXPECT_EQ(chunkLength(5, 4, 3), 0);
}

TEST(LocalUnits, TensorParallelChunksPerRank) {
  const UnitSpec unit{.name = "layers.0",
                      .tensors = {tensor("a.q_proj.weight", {90, 64}), tensor("a.o_proj.weight", {64, 90}),
                                  tensor("a.input_layernorm.weight", {64})}};
  auto first = localUnits(unit, {.tp = 4, .ep = 1}, 0, 0);
  auto last = localUnits(unit, {.tp = 4, .ep = 1}, 3, 0);
  ASSERT_TRUE(first.ok() && last.ok());
  EXPECT_EQ(first->dense.tensors[0].shape, (Shape{23, 64}));
  EXPECT_EQ(last->dense.tensors[0].shape, (Shape{21, 64}));
  EXPECT_EQ(last->dense.tensors[1].shape, (Shape{64, 21}));
  EXPECT_EQ(last->dense.tensors[2].shape, (Shape{64}));
  EXPECT_FALSE(first->experts.has_value());
}

TEST(LocalUnits, ExpertParallelTakesThisRanksExpertsWhole) {
  UnitSpec per_expert{.name = "layers.3", .tensors = {tensor("m.mlp.gate.weight", {8, 16})}};
  for (int e = 0; e < 8; ++e) {
    per_expert.tensors.push_back(tensor("m.mlp.experts." + std::to_string(e) + ".up_proj.weight", {32, 16}));
  }
  auto local = localUnits(per_expert, {.tp = 2, .ep = 4}, 1, 2);
  ASSERT_TRUE(local.ok()) << local.error().message;
  ASSERT_TRUE(local->experts.has_value());
  EXPECT_EQ(local->experts->name, "layers.3.experts");
  ASSERT_EQ(local->experts->tensors.size(), 2u);
  EXPECT_EQ(local->experts->tensors[0].name, "m.mlp.experts.4.up_proj.weight");
  EXPECT_EQ(local->experts->tensors[1].shape, (Shape{32, 16}));  // whole: no tensor parallelism on experts
  ASSERT_EQ(local->dense.tensors.size(), 1u);

  const UnitSpec fused{.name = "layers.0",
                       .tensors = {tensor("m.mlp.experts.gate_up_proj", {32, 64, 128}),
                                   tensor("m.mlp.experts.down_proj_bias", {32, 64})}};
  auto fused_local = localUnits(fused, {.tp = 1, .ep = 8}, 0, 5);
  ASSERT_TRUE(fused_local.ok());
  EXPECT_TRUE(fused_local->dense.tensors.empty());
  EXPECT_EQ(fused_local->experts->tensors[0].shape, (Shape{4, 64, 128}));
  EXPECT_EQ(fused_local->experts->tensors[1].shape, (Shape{4, 64}));

  // Expert indices need not start at 0: ep rank 1 of 2 holds the later half of them.
  const UnitSpec numbered{.name = "layers.9", .tensors = {tensor("m.experts.10.w1.weight", {4, 4}),
                                                          tensor("m.experts.11.w1.weight", {4, 4})}};
  auto second = localUnits(numbered, {.tp = 1, .ep = 2}, 0, 1);
  ASSERT_TRUE(second.ok());
  ASSERT_EQ(second->experts->tensors.size(), 1u);
  EXPECT_EQ(second->experts->tensors[0].name, "m.experts.11.w1.weight");

  auto refused = localUnits(fused, {.tp = 1, .ep = 3}, 0, 0);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message.find("ep 3 does not divide its 32 experts"), std::string::npos);
}

TEST(TensorParallelDiagnoses, NameWhatTheChunkCannotKeepWhole) {
  const UnitSpec unit{.name = "layers.0",
                      .tensors = {tensor("a.q_proj.weight", {96, 64}), tensor("a.o_proj.weight", {64, 96}),
                                  tensor("a.norm.weight", {64})}};
  const auto matrix = tensorParallelDiagnoses(unit, {.tp = 4, .ep = 1}, rule("matrix"));
  ASSERT_EQ(matrix.size(), 2u);
  EXPECT_NE(matrix[0].find("a.q_proj.weight [96, 64]: 'matrix' keeps whole matrices"), std::string::npos);
  // rows:32 of q_proj: 24 rows per tp rank; o_proj's rows are split over the tp ranks.
  const auto rows = tensorParallelDiagnoses(unit, {.tp = 4, .ep = 1}, rule("rows:32"));
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_NE(rows[0].find("tp rank 0 holds 24 rows"), std::string::npos);
  EXPECT_NE(rows[1].find("part of every row"), std::string::npos);
  EXPECT_TRUE(tensorParallelDiagnoses(unit, {.tp = 4, .ep = 1}, rule("rows:8")).size() == 1);  // o_proj only
  EXPECT_TRUE(tensorParallelDiagnoses(unit, {.tp = 4, .ep = 1}, rule("element")).empty());
  EXPECT_TRUE(tensorParallelDiagnoses(unit, {.tp = 1, .ep = 1}, rule("matrix")).empty());
}

}  // namespace
}  // namespace dbuf::planner
