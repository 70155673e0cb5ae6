#pragma once
// Realistic model families for the planner, generated from fixed seeds
// (issue 16: the planner on models it was not tuned on). Each model is its
// FSDP units, one per decoder layer plus the embedding and the head, with the
// shapes public models use:
//   - dense decoders with grouped-query attention (q, k, v, o; gated MLP);
//   - MoE layers with 8 to 512 routed experts, 0 to 2 shared experts, a
//     router, expert matrices as one 2D tensor per expert and projection or
//     as 3D tensors of all experts (fused gate+up), and optionally the first
//     layers dense;
//   - tied or untied embeddings, vocabularies of 32k to 201k;
//   - per-tensor rules: norms, biases and routers `element`; experts, in
//     some models, `block:128x128` whatever the run's default;
//   - in some models tensor parallelism of 2, 4 or 8: column-parallel
//     matrices cut in rows, row-parallel ones (o, down) in columns, marked
//     with tp_dim = 1.
// Identical layers are one unit shape (planModel plans each shape once), so
// the layer count only scales the volume, as in a real model.

#include <cstdint>
#include <string>
#include <vector>

#include "dbuf/planner/tensor_spec.hpp"

namespace dbuf::bench {

struct GeneratedModel {
  std::string name;  ///< e.g. "moe-017 (d 4096, 64 experts x 1408, 2 shared, tp 2)"
  bool moe = false;
  std::vector<planner::UnitSpec> units;
  std::size_t max_unit_tensors = 0;  ///< tensors in its largest unit
};

/// Model `index` of the family drawn from `seed` (the same pair always gives
/// the same model).
[[nodiscard]] GeneratedModel generateModel(std::uint64_t seed, std::size_t index);

/// Models 0 .. count - 1 of `seed`.
[[nodiscard]] std::vector<GeneratedModel> generateModels(std::uint64_t seed, std::size_t count);

}  // namespace dbuf::bench
