#include "dbuf/planner/model_parallel.hpp"

#include <algorithm>
#include <array>
#include <charconv>
#include <set>

#include "dbuf/planner/baselines.hpp"

namespace dbuf::planner {
namespace {

constexpr std::array<std::string_view, 11> kColumnParallel = {
    "q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj", "w1", "w3", "lm_head",
    "gate_up_proj"};
constexpr std::array<std::string_view, 3> kRowParallel = {"o_proj", "down_proj", "w2"};
constexpr std::array<std::string_view, 3> kEmbeddings = {"embed_tokens", "tok_embeddings", "wte"};

template <std::size_t N>
bool oneOf(std::string_view word, const std::array<std::string_view, N>& words) {
  return std::find(words.begin(), words.end(), word) != words.end();
}

/// The module a parameter belongs to and whether it is a bias: `a.q_proj.weight` -> (q_proj, weight);
/// GPT-OSS's fused experts name the parameter alone: `experts.gate_up_proj_bias` -> (gate_up_proj, bias).
struct ParameterName {
  std::string_view module;
  bool bias = false;
};

ParameterName parseName(std::string_view name) {
  const auto last_dot = name.rfind('.');
  const std::string_view last = last_dot == std::string_view::npos ? name : name.substr(last_dot + 1);
  if (last == "weight" || last == "bias") {
    const std::string_view rest = name.substr(0, last_dot == std::string_view::npos ? 0 : last_dot);
    const auto dot = rest.rfind('.');
    return {dot == std::string_view::npos ? rest : rest.substr(dot + 1), last == "bias"};
  }
  constexpr std::string_view kBiasSuffix = "_bias";
  if (last.size() > kBiasSuffix.size() && last.ends_with(kBiasSuffix)) {
    return {last.substr(0, last.size() - kBiasSuffix.size()), true};
  }
  return {last, false};
}

/// The expert index of a per-expert tensor (`.experts.<i>.`), or nullopt (fused, or not an expert).
std::optional<std::int64_t> expertIndex(std::string_view name) {
  constexpr std::string_view kMarker = ".experts.";
  const auto at = name.find(kMarker);
  if (at == std::string_view::npos) return std::nullopt;
  const char* begin = name.data() + at + kMarker.size();
  const char* end = name.data() + name.size();
  std::int64_t index = 0;
  const auto [ptr, ec] = std::from_chars(begin, end, index);
  if (ec != std::errc() || ptr == begin || ptr == end || *ptr != '.') return std::nullopt;
  return index;
}

/// The routed experts of a unit: how many, and whether they are listed per expert (else fused `[E, ...]`).
struct Experts {
  std::int64_t count = 0;
  bool per_expert = false;
  std::vector<std::int64_t> indices;  ///< per expert: the indices in the names, ascending

  /// The place of a per-expert tensor's expert among the unit's (its indices need not start at 0).
  [[nodiscard]] std::int64_t position(std::int64_t index) const {
    return std::lower_bound(indices.begin(), indices.end(), index) - indices.begin();
  }
};

Result<Experts> expertsOf(const UnitSpec& unit) {
  std::set<std::int64_t> indices;
  std::int64_t fused = 0;
  for (const TensorSpec& tensor : unit.tensors) {
    if (!isExpertParameter(tensor.name)) continue;
    if (const auto index = expertIndex(tensor.name)) {
      indices.insert(*index);
    } else if (fused == 0) {
      fused = tensor.shape.front();
    } else if (tensor.shape.front() != fused) {
      return makeError(ErrorCode::kInvalidArgument, "unit '" + unit.name + "': fused expert tensor '" +
                                                        tensor.name + "' has " + std::to_string(tensor.shape.front()) +
                                                        " experts, another one " + std::to_string(fused));
    }
  }
  if (!indices.empty() && fused != 0) {
    return makeError(ErrorCode::kInvalidArgument,
                     "unit '" + unit.name + "' lists some experts one tensor each and others fused");
  }
  if (!indices.empty()) {
    return Experts{static_cast<std::int64_t>(indices.size()), true, {indices.begin(), indices.end()}};
  }
  return Experts{fused, false, {}};
}

/// `tensor` as tp rank `tp_rank` holds it (its shape cut along the Megatron plan's dimension); nullopt when
/// the chunk is empty.
std::optional<TensorSpec> tensorParallelChunk(const TensorSpec& tensor, std::int64_t tp, std::int64_t tp_rank) {
  TensorSpec chunk = tensor;
  if (tp > 1) {
    if (const auto dim = megatronShardDim(tensor.name, tensor.shape.size())) {
      auto& size = chunk.shape[static_cast<std::size_t>(*dim)];
      size = chunkLength(size, tp, tp_rank);
      if (size == 0) return std::nullopt;
    }
  }
  return chunk;
}

std::string shapeText(const std::vector<std::int64_t>& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

/// Where a tp rank's chunk of `size` is not whole groups of `group` (rows or columns) of `rule`: why, or "".
std::string unevenChunk(const GranularityRule& rule, std::int64_t group, std::string_view kept, std::string_view what,
                        const std::string& cut, std::int64_t size, std::int64_t tp) {
  for (std::int64_t r = 0; r < tp; ++r) {
    const std::int64_t held = chunkLength(size, tp, r);
    if (held % group != 0) {
      return "'" + rule.toString() + "' keeps " + std::string(kept) + " " + std::to_string(group) + " " +
             std::string(what) + ", but " + cut + ": tp rank " + std::to_string(r) + " holds " +
             std::to_string(held) + " " + std::string(what);
    }
  }
  return "";
}

/// Why tensor parallelism keeps `tensor`'s blocks under `rule` from being whole, or "" where it does not.
std::string blockProblem(const TensorSpec& tensor, const GranularityRule& rule, std::int64_t tp, int dim) {
  const std::size_t rank = tensor.shape.size();
  if (rank < 2 || static_cast<std::size_t>(dim) + 2 < rank) return "";  // a leading dim: whole matrices stay whole
  const bool cuts_rows = static_cast<std::size_t>(dim) + 2 == rank;
  const std::int64_t size = tensor.shape[static_cast<std::size_t>(dim)];
  const std::string cut = "tensor parallelism cuts dim " + std::to_string(dim) + " (" + std::to_string(size) +
                          ") over " + std::to_string(tp) + " ranks";
  switch (rule.kind) {
    case GranularityRule::Kind::kMatrix:
      return "'matrix' keeps whole matrices, but " + cut + ": no rank holds a whole one (Muon's update needs them "
             "gathered over tp)";
    case GranularityRule::Kind::kRows:
    case GranularityRule::Kind::kBlock:
      if (cuts_rows) return unevenChunk(rule, rule.rows, "bands of", "rows", cut, size, tp);
      if (rule.kind == GranularityRule::Kind::kBlock) {
        return unevenChunk(rule, rule.cols, "tiles of", "columns", cut, size, tp);
      }
      return "'" + rule.toString() + "' keeps whole rows, but " + cut + ": each rank holds part of every row (its "
             "chunk's bands stay whole)";
    case GranularityRule::Kind::kElement:
    case GranularityRule::Kind::kCount:
      return "";
  }
  return "";
}

}  // namespace

std::optional<int> megatronShardDim(std::string_view name, std::size_t rank) {
  if (rank == 0) return std::nullopt;
  const ParameterName parsed = parseName(name);
  const int last = static_cast<int>(rank) - 1;
  if (oneOf(parsed.module, kEmbeddings)) return parsed.bias ? std::nullopt : std::optional<int>(0);
  if (oneOf(parsed.module, kColumnParallel)) {
    // The output dimension: 0 of an [out, in] weight and of its bias; the last of GPT-OSS's fused
    // [E, in, out] experts and of their [E, out] bias.
    const bool fused = parsed.module == "gate_up_proj" && (rank == 3 || (parsed.bias && rank == 2));
    return fused ? last : 0;
  }
  if (oneOf(parsed.module, kRowParallel) && !parsed.bias && rank >= 2) return 1;  // [out, in] and [E, in, out]
  return std::nullopt;
}

std::int64_t chunkLength(std::int64_t size, std::int64_t parts, std::int64_t rank) noexcept {
  const std::int64_t chunk = (size + parts - 1) / parts;
  return std::max<std::int64_t>(0, std::min(chunk, size - rank * chunk));
}

Result<LocalUnits> localUnits(const UnitSpec& unit, const ModelParallelism& parallelism, std::int64_t tp_rank,
                              std::int64_t ep_rank) {
  const std::int64_t tp = parallelism.tp;
  const std::int64_t ep = parallelism.ep;
  if (tp < 1 || ep < 1 || tp_rank < 0 || tp_rank >= tp || ep_rank < 0 || ep_rank >= ep) {
    return makeError(ErrorCode::kInvalidArgument, "tp rank " + std::to_string(tp_rank) + " of " +
                                                      std::to_string(tp) + ", ep rank " + std::to_string(ep_rank) +
                                                      " of " + std::to_string(ep));
  }
  auto experts = expertsOf(unit);
  if (!experts) return std::move(experts).error();
  if (ep > 1 && experts->count % ep != 0) {
    return makeError(ErrorCode::kInvalidArgument, "unit '" + unit.name + "': ep " + std::to_string(ep) +
                                                      " does not divide its " + std::to_string(experts->count) +
                                                      " experts");
  }
  const std::int64_t per_rank = ep > 1 ? experts->count / ep : 0;
  LocalUnits local{.dense = {.name = unit.name, .tensors = {}}, .experts = std::nullopt};
  UnitSpec expert_unit{.name = unit.name + ".experts", .tensors = {}};
  for (const TensorSpec& tensor : unit.tensors) {
    if (ep == 1 || !isExpertParameter(tensor.name)) {
      if (auto chunk = tensorParallelChunk(tensor, tp, tp_rank)) local.dense.tensors.push_back(std::move(*chunk));
      continue;
    }
    // Expert parallelism: this ep rank's experts, whole (expert tensor parallelism 1, torchtitan's default).
    if (experts->per_expert) {
      if (experts->position(*expertIndex(tensor.name)) / per_rank == ep_rank) expert_unit.tensors.push_back(tensor);
    } else {
      TensorSpec mine = tensor;
      mine.shape.front() = per_rank;
      expert_unit.tensors.push_back(std::move(mine));
    }
  }
  if (!expert_unit.tensors.empty()) local.experts = std::move(expert_unit);
  return local;
}

std::vector<std::string> tensorParallelDiagnoses(const UnitSpec& unit, const ModelParallelism& parallelism,
                                                 const GranularityRule& default_rule) {
  std::vector<std::string> diagnoses;
  if (parallelism.tp <= 1) return diagnoses;
  for (const TensorSpec& tensor : unit.tensors) {
    if (parallelism.ep > 1 && isExpertParameter(tensor.name)) continue;  // experts stay whole on their ep rank
    const auto dim = megatronShardDim(tensor.name, tensor.shape.size());
    if (!dim) continue;
    const GranularityRule rule = tensor.granularity ? *tensor.granularity
                                 : tensor.shape.size() >= 2 ? default_rule
                                                            : GranularityRule{};
    const std::string problem = blockProblem(tensor, rule, parallelism.tp, *dim);
    if (!problem.empty()) {
      diagnoses.push_back("unit '" + unit.name + "', " + tensor.name + " " + shapeText(tensor.shape) + ": " + problem);
    }
  }
  return diagnoses;
}

}  // namespace dbuf::planner
