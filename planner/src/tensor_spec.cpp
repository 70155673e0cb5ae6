#include "dbuf/planner/tensor_spec.hpp"

#include <limits>

namespace dbuf::planner {

std::int64_t TensorSpec::numel() const noexcept {
  std::int64_t n = 1;
  for (const std::int64_t dim : shape) n *= dim;
  return n;
}

Result<void> validateUnit(const UnitSpec& unit) {
  const std::string where = "unit '" + unit.name + "'";
  if (unit.tensors.empty()) return makeError(ErrorCode::kInvalidArgument, where + ": unit has no tensors");
  std::int64_t unit_numel = 0;
  for (const TensorSpec& tensor : unit.tensors) {
    // Built only for an error: units of thousands of tensors are validated on every plan.
    const auto what = [&] { return where + ": tensor '" + tensor.name + "'"; };
    if (tensor.shape.empty()) return makeError(ErrorCode::kInvalidArgument, what() + ": empty shape");
    std::int64_t numel = 1;
    for (const std::int64_t dim : tensor.shape) {
      if (dim <= 0) {
        return makeError(ErrorCode::kInvalidArgument,
                         what() + ": dimension " + std::to_string(dim) + " is not positive");
      }
      // Keep every later product (V*S, offsets) comfortably inside int64.
      if (numel > (std::int64_t{1} << 50) / dim) {
        return makeError(ErrorCode::kInvalidArgument, what() + ": too many elements");
      }
      numel *= dim;
    }
    unit_numel += numel;
    if (unit_numel > (std::int64_t{1} << 60)) {
      return makeError(ErrorCode::kInvalidArgument, where + ": too many elements in the unit");
    }
    if (tensor.dtype != unit.tensors.front().dtype) {
      return makeError(ErrorCode::kInvalidArgument, what() + ": dtype " + std::string(toString(tensor.dtype)) +
                                                        " differs from the unit's " +
                                                        std::string(toString(unit.tensors.front().dtype)) +
                                                        " (one DBuffer holds one dtype; split the unit)");
    }
  }
  return {};
}

Result<std::int64_t> tensorGranularity(const TensorSpec& tensor, const GranularityRule& default_rule) {
  GranularityRule rule;  // element
  if (tensor.granularity) {
    rule = *tensor.granularity;
  } else if (tensor.shape.size() >= 2) {
    rule = default_rule;
  }
  return resolveGranularity(tensor.shape, rule, tensor.tp_dim);
}

}  // namespace dbuf::planner
