#include "dbuf/kernels/detail/table_image.hpp"

#include <cstring>

#include "dbuf/kernels/detail/tiles.hpp"

namespace dbuf::kernels::detail {
namespace {

template <typename T>
void append(std::vector<std::byte>& bytes, std::span<const T> items) {
  const std::size_t at = bytes.size();
  bytes.resize(at + items.size_bytes());
  if (!items.empty()) std::memcpy(bytes.data() + at, items.data(), items.size_bytes());
}

/// Byte-wise: Segment is five int64s and pointers compare as bits.
template <typename T>
bool sameBytes(const std::vector<T>& held, std::span<const T> wanted) noexcept {
  return held.size() == wanted.size() &&
         (wanted.empty() || std::memcmp(held.data(), wanted.data(), wanted.size_bytes()) == 0);
}

}  // namespace

TableImage makeTableImage(const TableKey& key) {
  TableImage image;
  const std::vector<Tile> tiles = planTiles(key.segments, key.tile_elements, key.blocked);
  append(image.bytes, key.segments);
  image.layout.tiles_at = image.bytes.size();
  append(image.bytes, std::span<const Tile>(tiles));
  image.layout.sources_at = image.bytes.size();
  append(image.bytes, key.sources);
  image.layout.tile_count = tiles.size();
  return image;
}

bool TableKeyCopy::matches(const TableKey& key) const noexcept {
  return held_ && tile_elements_ == key.tile_elements && blocked_ == key.blocked &&
         sameBytes(segments_, key.segments) && sameBytes(sources_, key.sources);
}

void TableKeyCopy::assign(const TableKey& key) {
  segments_.assign(key.segments.begin(), key.segments.end());
  sources_.assign(key.sources.begin(), key.sources.end());
  tile_elements_ = key.tile_elements;
  blocked_ = key.blocked;
  held_ = true;
}

}  // namespace dbuf::kernels::detail
