#pragma once
/// \file
/// FSDP composed with tensor and expert parallelism, as the planner sees it.
///
/// Under tensor parallelism (TP) each tp rank holds a chunk of a sharded
/// tensor, and FSDP shards that chunk over the dp ranks (FSDP2's order, and
/// dbuf.torch's: the parameter's DTensor is (RaggedShard, Shard(d)) on the
/// (dp, tp) mesh). Under expert parallelism (EP) each ep rank holds its own
/// experts whole, and FSDP shards them over the dp ranks that hold the same
/// experts: dp / ep of them (torchtitan's, which carves ep out of dp), in a
/// unit of their own. So a unit's plan under TP / EP is the plan of what one
/// rank holds: this file turns a model file's whole tensors into that.
///
/// Which tensors TP shards, and along which dimension, is the Megatron plan
/// torchtitan applies to Llama, Mixtral, DeepSeek-V3 and GPT-OSS, read from
/// the tensor's name (`megatronShardDim`).

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dbuf/common/result.hpp"
#include "dbuf/planner/granularity.hpp"
#include "dbuf/planner/tensor_spec.hpp"

namespace dbuf::planner {

struct ModelParallelism {
  std::int64_t tp = 1;  ///< tensor parallel degree
  std::int64_t ep = 1;  ///< expert parallel degree (divides the dp degree and each unit's expert count)
};

/// The dimension the Megatron plan shards `name` along (a tensor of `rank`
/// dimensions), or nullopt where it replicates the tensor:
/// - column parallel (the output dimension, 0 of an `[out, in]` weight, and
///   its bias): q/k/v, q_b / kv_b (DeepSeek's MLA), gate / up / w1 / w3
///   (dense, shared or routed experts), lm_head; GPT-OSS's fused expert
///   `gate_up_proj` `[E, in, out]` along 2 (its bias along 1);
/// - row parallel (the input dimension, 1 of `[out, in]`; the bias is
///   replicated): o_proj, down_proj, w2; GPT-OSS's fused `down_proj`
///   `[E, in, out]` along 1;
/// - the token embedding along the vocabulary (0, torchtitan's RowwiseParallel);
/// - everything else (norms, routers, MLA's low-rank A projections, sinks) replicated.
[[nodiscard]] std::optional<int> megatronShardDim(std::string_view name, std::size_t rank);

/// Rows of `size` along a dimension that `tp_rank` of `parts` holds: torch.chunk's
/// split (ceil(size / parts) each, the last ones shorter, possibly none).
[[nodiscard]] std::int64_t chunkLength(std::int64_t size, std::int64_t parts, std::int64_t rank) noexcept;

/// What one rank holds of a unit: its dense tensors (sharded over the dp
/// ranks) and, with ep > 1, its routed experts' (over dp / ep of them).
struct LocalUnits {
  UnitSpec dense;                  ///< empty `tensors` when the unit has only experts
  std::optional<UnitSpec> experts; ///< "<unit>.experts"; set with ep > 1 where the unit has routed experts
};

/// The unit as rank (`tp_rank`, `ep_rank`) holds it: every tensor the
/// Megatron plan shards cut to that tp rank's chunk (a tensor whose chunk is
/// empty is left out), and with ep > 1 the routed experts (isExpertParameter)
/// moved to a unit of their own holding that ep rank's experts only, whole
/// (expert tensor parallelism 1, torchtitan's default): of per-expert tensors
/// (`.experts.<i>.`), experts [ep_rank * E / ep, (ep_rank + 1) * E / ep); of
/// fused `[E, ...]` tensors, those rows. With ep = 1 the experts are dense
/// tensors to the Megatron plan. Errors: ep not dividing the expert count,
/// fused expert tensors of different expert counts.
[[nodiscard]] Result<LocalUnits> localUnits(const UnitSpec& unit, const ModelParallelism& parallelism,
                                            std::int64_t tp_rank, std::int64_t ep_rank);

/// Granularities that tensor parallelism makes impossible in `unit` (its
/// whole tensors; `default_rule` applies to 2D+ tensors without their own):
/// one sentence per tensor whose blocks its TP chunk cannot keep whole, as
/// RaggedShard would (a `matrix` of a tensor TP cuts; `rows:R` / `block:RxC`
/// whose rows or columns the chunk does not hold whole). The planner still
/// plans the chunk with its rule; a trainer relying on the blocks (Muon's
/// whole matrices, block-wise quantisation) is told here.
[[nodiscard]] std::vector<std::string> tensorParallelDiagnoses(const UnitSpec& unit,
                                                               const ModelParallelism& parallelism,
                                                               const GranularityRule& default_rule);

}  // namespace dbuf::planner
