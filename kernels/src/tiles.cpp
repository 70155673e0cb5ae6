#include "dbuf/kernels/detail/tiles.hpp"

#include <algorithm>

namespace dbuf::kernels::detail {

std::int64_t totalElements(std::span<const Segment> segments) noexcept {
  std::int64_t total = 0;
  for (const Segment& s : segments) total += s.count;
  return total;
}

std::vector<Tile> planTiles(std::span<const Segment> segments, std::int64_t tile_elements, bool blocked) {
  const std::int64_t chunk = std::max<std::int64_t>(tile_elements, 1);
  std::vector<Tile> tiles;
  tiles.reserve(static_cast<std::size_t>(totalElements(segments) / chunk) + segments.size());
  for (std::size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    std::int64_t step = chunk;
    if (blocked) step = std::max<std::int64_t>(1, (chunk + s.block - 1) / s.block) * s.block;
    for (std::int64_t b = 0; b < s.count; b += step) {
      tiles.push_back({b, std::min(s.count, b + step), static_cast<std::int32_t>(i), 0});
    }
  }
  return tiles;
}

}  // namespace dbuf::kernels::detail
