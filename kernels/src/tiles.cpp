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
    // Whole blocks per tile when blocked: ceil(chunk / block) of them, or one
    // block larger than a chunk (computed without overflow for any block).
    const std::int64_t step = blocked ? (s.block >= chunk ? s.block : ((chunk - 1) / s.block + 1) * s.block) : chunk;
    for (std::int64_t b = 0; b < s.count;) {
      const std::int64_t end = s.count - b <= step ? s.count : b + step;
      tiles.push_back({b, end, static_cast<std::int32_t>(i), 0});
      b = end;
    }
  }
  return tiles;
}

}  // namespace dbuf::kernels::detail
