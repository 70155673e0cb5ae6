#pragma once
/// \file
/// What a trainer (or a model file) says about the tensors of an FSDP unit.
/// Plain value types.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dbuf/common/dtype.hpp"
#include "dbuf/common/result.hpp"
#include "dbuf/planner/granularity.hpp"

namespace dbuf::planner {

struct TensorSpec {
  std::string name;
  std::vector<std::int64_t> shape;
  DType dtype = DType::kBF16;
  /// Per-tensor rule; when absent the planner's default rule applies (to 2D+
  /// tensors; 1D tensors default to `element`).
  std::optional<GranularityRule> granularity;
  /// Dimension already sharded by tensor parallelism (d > 0), if any.
  std::optional<int> tp_dim;

  [[nodiscard]] std::int64_t numel() const noexcept;
};

/// One FSDP unit (a group): tensors gathered and reduced together, in order.
struct UnitSpec {
  std::string name;
  std::vector<TensorSpec> tensors;
};

/// Checks shapes (non-empty, every dim > 0, numel fits in int64), that the
/// unit is not empty and that its tensors share one dtype. Messages name the
/// unit and the tensor.
[[nodiscard]] Result<void> validateUnit(const UnitSpec& unit);

/// Effective block length of `tensor`, applying `default_rule` to 2D+ tensors
/// without a rule of their own.
[[nodiscard]] Result<std::int64_t> tensorGranularity(const TensorSpec& tensor, const GranularityRule& default_rule);

}  // namespace dbuf::planner
