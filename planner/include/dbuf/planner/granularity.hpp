#pragma once
/// \file
/// RaggedShard granularity: how many contiguous elements of a tensor must stay
/// on one rank. Rules are written as text in model files and on the command
/// line: `element`, `rows:R`, `block:RxC`, `matrix`, or an explicit count `N`.
/// Pure value types and functions, thread-safe.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "dbuf/common/result.hpp"

namespace dbuf::planner {

struct GranularityRule {
  enum class Kind : std::uint8_t { kElement, kRows, kBlock, kMatrix, kCount };

  Kind kind = Kind::kElement;
  std::int64_t rows = 0;   ///< kRows, kBlock: rows per block
  std::int64_t cols = 0;   ///< kBlock: columns per tile (recorded for quantisation; FSDP keeps whole rows)
  std::int64_t count = 0;  ///< kCount: explicit element count

  [[nodiscard]] static Result<GranularityRule> parse(std::string_view text);
  [[nodiscard]] std::string toString() const;

  friend bool operator==(const GranularityRule&, const GranularityRule&) = default;
};

/// Block length in elements for a tensor of `shape` under `rule`.
///
/// - 1D tensors: `element` -> 1, `matrix` -> the whole tensor, `rows:R` and
///   `block:RxC` -> R (a vector is a column of one-element rows), `N` -> N.
/// - 2D and higher `[..., M, K]` are E = prod(leading dims) matrices of M x K:
///   `rows:R` / `block:RxC` give R*K when M % R == 0. When M % R != 0 a 2D tensor
///   keeps R*K (its last band is short, cuts still fall on band edges) while a
///   3D+ tensor falls back to the whole M*K matrix, because later matrices'
///   bands are not on multiples of R*K. `matrix` -> M*K.
/// - `tp_dim` d > 0: the tensor is already sharded by tensor parallelism on
///   dimension d, so FSDP may cut only between whole slices of dimension d-1:
///   the block length is raised to lcm(g, prod(shape[d:])).
///
/// The result is clamped to the tensor's numel. Errors: non-positive dims, an
/// explicit count that does not divide numel, tp_dim out of range.
[[nodiscard]] Result<std::int64_t> resolveGranularity(std::span<const std::int64_t> shape, const GranularityRule& rule,
                                                      std::optional<int> tp_dim = std::nullopt);

}  // namespace dbuf::planner
