#include "model_families.hpp"

#include <algorithm>
#include <array>
#include <cstdio>
#include <random>

#include "dbuf/planner/granularity.hpp"

namespace dbuf::bench {
namespace {

using planner::GranularityRule;
using planner::TensorSpec;
using planner::UnitSpec;

/// The sizes public decoders use (hidden, head and MLP dimensions, vocabularies).
constexpr std::array<std::int64_t, 9> kHidden{2048, 2560, 2880, 3072, 4096, 5120, 6144, 7168, 8192};
constexpr std::array<std::int64_t, 2> kHeadDim{64, 128};
constexpr std::array<std::int64_t, 5> kKvHeads{1, 2, 4, 8, 16};
constexpr std::array<std::int64_t, 6> kVocab{32000, 50304, 128256, 151936, 163840, 201088};
constexpr std::array<std::int64_t, 9> kExperts{8, 16, 32, 64, 128, 160, 256, 384, 512};
constexpr std::array<std::int64_t, 3> kTensorParallel{2, 4, 8};

class Draw {
 public:
  explicit Draw(std::uint64_t seed) : rng_(seed) {}
  template <typename T, std::size_t N>
  T from(const std::array<T, N>& values) {
    return values[std::uniform_int_distribution<std::size_t>(0, N - 1)(rng_)];
  }
  std::int64_t between(std::int64_t low, std::int64_t high) {
    return std::uniform_int_distribution<std::int64_t>(low, high)(rng_);
  }
  bool chance(double p) { return std::bernoulli_distribution(p)(rng_); }

 private:
  std::mt19937_64 rng_;
};

/// One model's dimensions, drawn once.
struct Shape {
  std::int64_t hidden = 0;
  std::int64_t heads = 0;
  std::int64_t kv_heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t mlp = 0;  ///< dense layers' MLP width
  std::int64_t vocab = 0;
  std::int64_t tp = 1;
  bool tied = false;
  bool attention_bias = false;
  // MoE
  std::int64_t experts = 0;
  std::int64_t expert_mlp = 0;
  std::int64_t shared_experts = 0;
  std::int64_t dense_layers = 0;  ///< the first layers, before the MoE ones
  bool experts_3d = false;
  bool experts_blocked = false;  ///< experts carry block:128x128 of their own
};

TensorSpec tensor(std::string name, std::vector<std::int64_t> shape) {
  TensorSpec spec;
  spec.name = std::move(name);
  spec.shape = std::move(shape);
  return spec;
}

TensorSpec elementwise(std::string name, std::vector<std::int64_t> shape) {
  TensorSpec spec = tensor(std::move(name), std::move(shape));
  spec.granularity = GranularityRule{};  // element
  return spec;
}

/// A column-parallel matrix (output rows cut by tensor parallelism).
TensorSpec columnParallel(std::string name, std::int64_t out, std::int64_t in, const Shape& s) {
  return tensor(std::move(name), {out / s.tp, in});
}

/// A row-parallel matrix (input columns cut by tensor parallelism).
TensorSpec rowParallel(std::string name, std::int64_t out, std::int64_t in, const Shape& s) {
  TensorSpec spec = tensor(std::move(name), {out, in / s.tp});
  if (s.tp > 1) spec.tp_dim = 1;
  return spec;
}

void addAttention(UnitSpec& unit, const Shape& s) {
  const std::int64_t q = s.heads * s.head_dim;
  const std::int64_t kv = s.kv_heads * s.head_dim;
  unit.tensors.push_back(elementwise("input_layernorm.weight", {s.hidden}));
  unit.tensors.push_back(columnParallel("self_attn.q_proj.weight", q, s.hidden, s));
  unit.tensors.push_back(columnParallel("self_attn.k_proj.weight", kv, s.hidden, s));
  unit.tensors.push_back(columnParallel("self_attn.v_proj.weight", kv, s.hidden, s));
  if (s.attention_bias) {
    unit.tensors.push_back(elementwise("self_attn.q_proj.bias", {q / s.tp}));
    unit.tensors.push_back(elementwise("self_attn.k_proj.bias", {kv / s.tp}));
    unit.tensors.push_back(elementwise("self_attn.v_proj.bias", {kv / s.tp}));
  }
  unit.tensors.push_back(rowParallel("self_attn.o_proj.weight", s.hidden, q, s));
  unit.tensors.push_back(elementwise("post_attention_layernorm.weight", {s.hidden}));
}

void addDenseMlp(UnitSpec& unit, const std::string& prefix, std::int64_t width, const Shape& s) {
  unit.tensors.push_back(columnParallel(prefix + "gate_proj.weight", width, s.hidden, s));
  unit.tensors.push_back(columnParallel(prefix + "up_proj.weight", width, s.hidden, s));
  unit.tensors.push_back(rowParallel(prefix + "down_proj.weight", s.hidden, width, s));
}

void addExperts(UnitSpec& unit, const Shape& s) {
  unit.tensors.push_back(elementwise("mlp.router.weight", {s.experts, s.hidden}));
  const auto expert = [&](TensorSpec spec) {
    if (s.experts_blocked) spec.granularity = *GranularityRule::parse("block:128x128");
    unit.tensors.push_back(std::move(spec));
  };
  if (s.experts_3d) {  // all experts in one tensor per projection (gate and up fused)
    expert(tensor("mlp.experts.gate_up_proj", {s.experts, 2 * s.expert_mlp / s.tp, s.hidden}));
    expert(tensor("mlp.experts.down_proj", {s.experts, s.hidden, s.expert_mlp / s.tp}));
  } else {
    for (std::int64_t e = 0; e < s.experts; ++e) {
      const std::string prefix = "mlp.experts." + std::to_string(e) + ".";
      expert(columnParallel(prefix + "gate_proj.weight", s.expert_mlp, s.hidden, s));
      expert(columnParallel(prefix + "up_proj.weight", s.expert_mlp, s.hidden, s));
      expert(rowParallel(prefix + "down_proj.weight", s.hidden, s.expert_mlp, s));
    }
  }
  for (std::int64_t e = 0; e < s.shared_experts; ++e) {
    addDenseMlp(unit, "mlp.shared_experts." + std::to_string(e) + ".", s.expert_mlp, s);
  }
}

Shape drawShape(Draw& draw, bool moe) {
  Shape s;
  s.hidden = draw.from(kHidden);
  s.head_dim = draw.from(kHeadDim);
  s.heads = s.hidden / s.head_dim;
  s.vocab = draw.from(kVocab);
  s.tied = draw.chance(0.3);
  s.attention_bias = draw.chance(0.25);
  s.tp = draw.chance(0.25) ? draw.from(kTensorParallel) : 1;
  if (s.heads % s.tp != 0) s.tp = 1;  // every TP rank holds whole heads
  // Grouped-query attention: kv heads dividing the heads, each TP rank whole ones.
  std::vector<std::int64_t> kv_choices;
  for (const std::int64_t kv : kKvHeads) {
    if (kv <= s.heads && s.heads % kv == 0 && kv % s.tp == 0) kv_choices.push_back(kv);
  }
  kv_choices.push_back(s.heads);  // (multi-head attention)
  s.kv_heads = kv_choices[static_cast<std::size_t>(draw.between(0, static_cast<std::int64_t>(kv_choices.size()) - 1))];
  // Dense MLPs 2.5x .. 4x the hidden size, in multiples of 256 (of the TP degree too).
  s.mlp = s.hidden * draw.between(10, 16) / 4 / 256 * 256;
  if (!moe) return s;
  s.experts = draw.from(kExperts);
  s.expert_mlp = draw.between(2, 32) * 128;  // 256 .. 4096
  s.shared_experts = draw.between(0, 2);
  s.dense_layers = draw.chance(0.4) ? draw.between(1, 3) : 0;
  s.experts_3d = draw.chance(0.4);
  s.experts_blocked = draw.chance(0.5);
  return s;
}

std::string describe(const Shape& s, bool moe, std::size_t index) {
  char id[16];
  std::snprintf(id, sizeof id, "%03zu", index);
  std::string name = std::string(moe ? "moe-" : "dense-") + id + " (d " + std::to_string(s.hidden) + ", " +
                     std::to_string(s.heads) + "/" + std::to_string(s.kv_heads) + " heads";
  if (moe) {
    name += ", " + std::to_string(s.experts) + " experts x " + std::to_string(s.expert_mlp) +
            (s.experts_3d ? " 3D" : " 2D") + ", " + std::to_string(s.shared_experts) + " shared";
  } else {
    name += ", mlp " + std::to_string(s.mlp);
  }
  if (s.tp > 1) name += ", tp " + std::to_string(s.tp);
  return name + ")";
}

}  // namespace

GeneratedModel generateModel(std::uint64_t seed, std::size_t index) {
  Draw draw(seed * 0x9e3779b97f4a7c15ULL + index);
  const bool moe = draw.chance(0.6);
  const Shape s = drawShape(draw, moe);
  GeneratedModel model;
  model.moe = moe;
  model.name = describe(s, moe, index);
  UnitSpec embedding{"embed", {tensor("embed_tokens.weight", {s.vocab, s.hidden})}};
  model.units.push_back(std::move(embedding));
  // Every layer a unit of its own, as FSDP wraps them: planModel plans each
  // distinct shape once, and the totals weigh the layers as the model does.
  const std::int64_t layers = draw.between(16, 80);
  for (std::int64_t layer = 0; layer < layers; ++layer) {
    const bool dense = !moe || layer < s.dense_layers;
    if (layer > (moe ? s.dense_layers : 0)) {  // the same shape as the layer before
      UnitSpec copy = model.units.back();
      copy.name = "layers." + std::to_string(layer);
      model.units.push_back(std::move(copy));
      continue;
    }
    UnitSpec unit{"layers." + std::to_string(layer), {}};
    addAttention(unit, s);
    if (dense) {
      addDenseMlp(unit, "mlp.", s.mlp, s);
    } else {
      addExperts(unit, s);
    }
    model.units.push_back(std::move(unit));
  }
  UnitSpec head{"head", {elementwise("norm.weight", {s.hidden})}};
  if (!s.tied) head.tensors.push_back(tensor("lm_head.weight", {s.vocab, s.hidden}));
  model.units.push_back(std::move(head));
  for (const UnitSpec& unit : model.units)
    model.max_unit_tensors = std::max(model.max_unit_tensors, unit.tensors.size());
  return model;
}

std::vector<GeneratedModel> generateModels(std::uint64_t seed, std::size_t count) {
  std::vector<GeneratedModel> models;
  models.reserve(count);
  for (std::size_t i = 0; i < count; ++i) models.push_back(generateModel(seed, i));
  return models;
}

}  // namespace dbuf::bench
