#include "dbuf/planner/baselines.hpp"

#include <limits>
#include <numeric>

#include "dbuf/common/int_math.hpp"

namespace dbuf::planner {
namespace {

constexpr std::int64_t kSaturated = std::numeric_limits<std::int64_t>::max();

/// a * b of non-negative operands, kSaturated when it does not fit.
std::int64_t saturatingMul(std::int64_t a, std::int64_t b) noexcept {
  std::int64_t product = 0;
  return __builtin_mul_overflow(a, b, &product) ? kSaturated : product;
}

/// a + b of non-negative operands, kSaturated when it does not fit.
std::int64_t saturatingAdd(std::int64_t a, std::int64_t b) noexcept {
  std::int64_t sum = 0;
  return __builtin_add_overflow(a, b, &sum) ? kSaturated : sum;
}

/// lcm(a, b) of positive operands, kSaturated when it does not fit.
std::int64_t saturatingLcm(std::int64_t a, std::int64_t b) noexcept {
  if (a == kSaturated || b == kSaturated) return kSaturated;
  return saturatingMul(a / std::gcd(a, b), b);
}

/// Items laid end to end from `offsets`, cut every S elements: count split blocks.
std::int64_t flatSplitBlocks(std::span<const LayoutItem> items, std::span<const std::int64_t> offsets,
                             std::int64_t shard) {
  std::int64_t split = 0;
  for (std::size_t i = 0; i < items.size(); ++i) split += splitBlocks(items[i], offsets[i], shard);
  return split;
}

/// Offsets of items packed back to back, each start rounded up to `align`.
std::vector<std::int64_t> packedOffsets(std::span<const LayoutItem> items, std::int64_t align, std::int64_t& total) {
  std::vector<std::int64_t> offsets;
  offsets.reserve(items.size());
  std::int64_t position = 0;
  for (const LayoutItem& item : items) {
    position = roundUp(position, align);
    offsets.push_back(position);
    position += item.numel;
  }
  total = position;
  return offsets;
}

std::int64_t rowSize(const std::vector<std::int64_t>& shape) {
  return std::accumulate(shape.begin() + 1, shape.end(), std::int64_t{1}, std::multiplies<>());
}

BaselineResult fsdp2(std::span<const std::vector<std::int64_t>> shapes, std::span<const LayoutItem> items,
                     std::int64_t devices) {
  BaselineResult result;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const std::int64_t chunk_rows = ceilDiv(shapes[i].front(), devices);
    const std::int64_t chunk = chunk_rows * rowSize(shapes[i]);
    result.shard_elems += chunk;
    result.split_blocks += countSplitBlocks(items[i], chunk, chunk);
  }
  return result;
}

BaselineResult zero3(std::span<const LayoutItem> items, std::int64_t devices) {
  BaselineResult result;
  for (const LayoutItem& item : items) {
    const std::int64_t chunk = ceilDiv(item.numel, devices);
    result.shard_elems += chunk;
    result.split_blocks += countSplitBlocks(item, chunk, chunk);
  }
  return result;
}

BaselineResult fsdp1(std::span<const LayoutItem> items, std::int64_t devices, std::int64_t align) {
  std::int64_t end = 0;
  const auto offsets = packedOffsets(items, align, end);
  // Every parameter, the last included, is padded to the alignment; the flat
  // parameter is then padded to a multiple of V.
  const std::int64_t flat = roundUp(roundUp(end, align), devices);
  const std::int64_t shard = flat / devices;
  return {shard, flatSplitBlocks(items, offsets, shard)};
}

/// One bucket: its parameters back to back, padded to a multiple of V x lcm
/// of their row sizes, cut every S_bucket. Adds its S and split blocks.
void addMegatronBucket(std::span<const std::vector<std::int64_t>> shapes, std::span<const LayoutItem> items,
                       const std::vector<std::size_t>& members, std::int64_t devices, BaselineResult& result) {
  if (members.empty()) return;
  std::int64_t row_lcm = 1;
  std::vector<LayoutItem> bucket;
  for (const std::size_t i : members) {
    row_lcm = saturatingLcm(row_lcm, rowSize(shapes[i]));
    bucket.push_back(items[i]);
  }
  std::int64_t end = 0;
  const auto offsets = packedOffsets(bucket, 1, end);
  // S = roundUp(end, V x lcm) / V = ceil(end / (V x lcm)) x lcm. Row sizes
  // without common factors take the lcm, and V x lcm, past int64 (a
  // registered group or a model file can have them): such a period is longer
  // than the bucket, so S = lcm; an lcm past int64 saturates (kSaturated).
  const std::int64_t period = saturatingMul(devices, row_lcm);
  const std::int64_t periods = period == kSaturated ? 1 : end / period + (end % period != 0 ? 1 : 0);
  const std::int64_t shard = saturatingMul(periods, row_lcm);
  result.shard_elems = saturatingAdd(result.shard_elems, shard);
  // A shard at least as long as the bucket cuts none of its blocks.
  if (shard < end) result.split_blocks += flatSplitBlocks(bucket, offsets, shard);
}

BaselineResult megatron(std::span<const std::vector<std::int64_t>> shapes, std::span<const LayoutItem> items,
                        std::int64_t devices, std::span<const std::string> names) {
  std::vector<std::size_t> dense;
  std::vector<std::size_t> experts;
  for (std::size_t i = 0; i < items.size(); ++i) {
    (i < names.size() && isExpertParameter(names[i]) ? experts : dense).push_back(i);
  }
  BaselineResult result;
  addMegatronBucket(shapes, items, dense, devices, result);
  addMegatronBucket(shapes, items, experts, devices, result);
  return result;
}

}  // namespace

bool isExpertParameter(std::string_view name) noexcept {
  return name.find(".experts.") != std::string_view::npos;
}

Baselines computeBaselines(std::span<const std::vector<std::int64_t>> shapes, std::span<const LayoutItem> items,
                           std::int64_t devices, std::int64_t align_elems, std::span<const std::string> names) {
  return Baselines{
      .fsdp2 = fsdp2(shapes, items, devices),
      .fsdp1 = fsdp1(items, devices, align_elems),
      .zero3 = zero3(items, devices),
      .megatron = megatron(shapes, items, devices, names),
  };
}

}  // namespace dbuf::planner
