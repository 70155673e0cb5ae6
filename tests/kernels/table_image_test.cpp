// The host side of the CUDA ops' segment tables (detail/table_image.hpp):
// the image's layout, and that a cached copy is reused only for a key that
// makes the very same table.
#include "dbuf/kernels/detail/table_image.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "dbuf/kernels/detail/tiles.hpp"

namespace dbuf::kernels::detail {
namespace {

std::vector<Segment> someSegments(std::mt19937& rng, int count) {
  std::uniform_int_distribution<std::int64_t> length(0, 5000);
  std::vector<Segment> segments;
  std::int64_t at = 0;
  for (int i = 0; i < count; ++i) {
    const std::int64_t n = length(rng);
    segments.push_back({at, at + 7, n, 32, at / 32});
    at += n;
  }
  return segments;
}

TEST(TableImage, SegmentsThenTilesThenSources) {
  std::mt19937 rng(3);
  const std::vector<Segment> segments = someSegments(rng, 40);
  int a = 0;
  int b = 0;
  const std::vector<const void*> sources{&a, &b};
  const TableImage image = makeTableImage({segments, 1000, true, sources});
  const std::vector<Tile> tiles = planTiles(segments, 1000, true);

  ASSERT_EQ(image.layout.tile_count, tiles.size());
  ASSERT_EQ(image.layout.tiles_at, segments.size() * sizeof(Segment));
  ASSERT_EQ(image.layout.sources_at, image.layout.tiles_at + tiles.size() * sizeof(Tile));
  ASSERT_EQ(image.bytes.size(), image.layout.sources_at + sources.size() * sizeof(void*));
  EXPECT_EQ(std::memcmp(image.bytes.data(), segments.data(), image.layout.tiles_at), 0);
  EXPECT_EQ(std::memcmp(image.bytes.data() + image.layout.tiles_at, tiles.data(), tiles.size() * sizeof(Tile)), 0);
  EXPECT_EQ(std::memcmp(image.bytes.data() + image.layout.sources_at, sources.data(), 2 * sizeof(void*)), 0);
}

TEST(TableKeyCopy, MatchesTheSameKeyFromOtherStorageOnly) {
  std::mt19937 rng(5);
  const std::vector<Segment> segments = someSegments(rng, 30);
  int a = 0;
  int b = 0;
  const std::vector<const void*> sources{&a, &b};
  const TableKey key{segments, 4096, false, sources};

  TableKeyCopy copy;
  EXPECT_FALSE(copy.matches(key)) << "an empty copy held a table";
  EXPECT_FALSE(copy.matches(TableKey{})) << "an empty copy matched the empty key";
  copy.assign(key);
  const std::vector<Segment> same_segments = segments;  // equal, elsewhere in memory
  const std::vector<const void*> same_sources = sources;
  EXPECT_TRUE(copy.matches({same_segments, 4096, false, same_sources}));

  std::vector<Segment> longer = segments;
  longer[17].count += 1;
  EXPECT_FALSE(copy.matches({longer, 4096, false, sources}));
  std::vector<Segment> moved = segments;
  moved[0].dst_offset += 1;
  EXPECT_FALSE(copy.matches({moved, 4096, false, sources}));
  const std::span<const Segment> fewer(segments.data(), segments.size() - 1);
  EXPECT_FALSE(copy.matches({fewer, 4096, false, sources}));
  EXPECT_FALSE(copy.matches({segments, 4097, false, sources}));
  EXPECT_FALSE(copy.matches({segments, 4096, true, sources}));
  const std::vector<const void*> swapped{&b, &a};
  EXPECT_FALSE(copy.matches({segments, 4096, false, swapped}));
  EXPECT_FALSE(copy.matches({segments, 4096, false, {}}));

  copy.clear();
  EXPECT_FALSE(copy.matches(key));
}

/// Soundness: whenever a copy matches a key, that key makes the table the
/// copy's key made (a match never reuses a wrong table).
TEST(TableKeyCopy, AMatchAlwaysMeansTheSameImage) {
  std::mt19937 rng(11);
  for (int round = 0; round < 200; ++round) {
    const std::vector<Segment> base = someSegments(rng, 1 + static_cast<int>(rng() % 20));
    const std::int64_t tile = 1 + static_cast<std::int64_t>(rng() % 3000);
    const bool blocked = rng() % 2 == 0;
    TableKeyCopy copy;
    copy.assign({base, tile, blocked, {}});
    const std::vector<std::byte> made = makeTableImage({base, tile, blocked, {}}).bytes;
    for (int variant = 0; variant < 8; ++variant) {
      std::vector<Segment> other = base;
      std::int64_t other_tile = tile;
      bool other_blocked = blocked;
      switch (rng() % 4) {
        case 0:
          break;
        case 1:
          other[rng() % other.size()].count = static_cast<std::int64_t>(rng() % 5000);
          break;
        case 2:
          other_tile = 1 + static_cast<std::int64_t>(rng() % 3000);
          break;
        default:
          other_blocked = !blocked;
          break;
      }
      const TableKey key{other, other_tile, other_blocked, {}};
      if (copy.matches(key)) {
        EXPECT_EQ(makeTableImage(key).bytes, made) << "round " << round;
      }
    }
    EXPECT_TRUE(copy.matches({base, tile, blocked, {}}));
  }
}

}  // namespace
}  // namespace dbuf::kernels::detail
