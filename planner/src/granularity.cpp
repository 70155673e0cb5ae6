#include "dbuf/planner/granularity.hpp"

#include <charconv>
#include <functional>
#include <limits>
#include <numeric>

namespace dbuf::planner {
namespace {

std::optional<std::int64_t> parsePositive(std::string_view text) {
  std::int64_t value = 0;
  const auto* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc() || ptr != end || value <= 0) return std::nullopt;
  return value;
}

Error badRule(std::string_view text, std::string_view why) {
  return makeError(ErrorCode::kInvalidArgument,
                   "bad granularity rule '" + std::string(text) + "': " + std::string(why) +
                       " (expected element, rows:R, block:RxC, matrix or a positive element count)");
}

std::int64_t product(std::span<const std::int64_t> dims) {
  return std::accumulate(dims.begin(), dims.end(), std::int64_t{1}, std::multiplies<>());
}

}  // namespace

Result<GranularityRule> GranularityRule::parse(std::string_view text) {
  GranularityRule rule;
  if (text == "element") return rule;
  if (text == "matrix") {
    rule.kind = Kind::kMatrix;
    return rule;
  }
  if (text.starts_with("rows:")) {
    const auto rows = parsePositive(text.substr(5));
    if (!rows) return badRule(text, "R must be a positive integer");
    rule.kind = Kind::kRows;
    rule.rows = *rows;
    return rule;
  }
  if (text.starts_with("block:")) {
    const std::string_view dims = text.substr(6);
    const auto x = dims.find('x');
    if (x == std::string_view::npos) return badRule(text, "block needs RxC");
    const auto rows = parsePositive(dims.substr(0, x));
    const auto cols = parsePositive(dims.substr(x + 1));
    if (!rows || !cols) return badRule(text, "R and C must be positive integers");
    rule.kind = Kind::kBlock;
    rule.rows = *rows;
    rule.cols = *cols;
    return rule;
  }
  if (const auto count = parsePositive(text)) {
    rule.kind = Kind::kCount;
    rule.count = *count;
    return rule;
  }
  return badRule(text, "unknown rule");
}

std::string GranularityRule::toString() const {
  switch (kind) {
    case Kind::kElement:
      return "element";
    case Kind::kRows:
      return "rows:" + std::to_string(rows);
    case Kind::kBlock:
      return "block:" + std::to_string(rows) + "x" + std::to_string(cols);
    case Kind::kMatrix:
      return "matrix";
    case Kind::kCount:
      return std::to_string(count);
  }
  return "element";
}

Result<std::int64_t> resolveGranularity(std::span<const std::int64_t> shape, const GranularityRule& rule,
                                        std::optional<int> tp_dim) {
  if (shape.empty()) return makeError(ErrorCode::kInvalidArgument, "tensor has no dimensions");
  for (const std::int64_t dim : shape) {
    if (dim <= 0) return makeError(ErrorCode::kInvalidArgument, "tensor has a zero or negative dimension");
  }
  const std::int64_t numel = product(shape);
  const bool is_vector = shape.size() == 1;
  const std::int64_t row_len = is_vector ? 1 : shape.back();
  const std::int64_t matrix_rows = is_vector ? shape[0] : shape[shape.size() - 2];
  const std::int64_t matrix_count = numel / (row_len * matrix_rows);

  std::int64_t granularity = 1;
  switch (rule.kind) {
    case GranularityRule::Kind::kElement:
      granularity = 1;
      break;
    case GranularityRule::Kind::kMatrix:
      granularity = row_len * matrix_rows;
      break;
    case GranularityRule::Kind::kRows:
    case GranularityRule::Kind::kBlock:
      // Whole matrices when one band covers a matrix (R*K could also overflow)
      // or when bands would straddle the matrices of a 3D+ tensor.
      if (rule.rows < matrix_rows && (matrix_rows % rule.rows == 0 || matrix_count == 1)) {
        granularity = rule.rows * row_len;
      } else {
        granularity = row_len * matrix_rows;
      }
      break;
    case GranularityRule::Kind::kCount:
      if (numel % rule.count != 0) {
        return makeError(ErrorCode::kInvalidArgument, "granularity " + std::to_string(rule.count) +
                                                          " does not divide numel " + std::to_string(numel));
      }
      granularity = rule.count;
      break;
  }
  if (tp_dim) {
    const int dim = *tp_dim;
    if (dim <= 0 || static_cast<std::size_t>(dim) >= shape.size()) {
      return makeError(ErrorCode::kInvalidArgument, "tp_dim " + std::to_string(dim) +
                                                        " is not a dimension > 0 of a rank-" +
                                                        std::to_string(shape.size()) + " tensor");
    }
    const std::int64_t slice = product(shape.subspan(static_cast<std::size_t>(dim)));
    // lcm(g, slice) = g / gcd * slice; past numel it means "never split".
    const std::int64_t factor = granularity / std::gcd(granularity, slice);
    granularity = factor > numel / slice ? numel : factor * slice;
  }
  return std::min(granularity, numel);
}

}  // namespace dbuf::planner
