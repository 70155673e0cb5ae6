#pragma once
/// \file
/// The host side of the CUDA ops' segment tables (cuda_ops.cu): what a table
/// is made of (its key), its image as uploaded (segments, then tiles, then
/// reduce's source pointers) and the key a cached device copy remembers, so
/// that a call whose table is cached is recognised by comparing segments,
/// without planning its tiles again. Host code, so it is tested and
/// measured without a GPU. Pure; thread-safe except a TableKeyCopy, which
/// one thread uses at a time.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "dbuf/kernels/ops.hpp"

namespace dbuf::kernels::detail {

/// Equal keys make equal tables.
struct TableKey {
  std::span<const Segment> segments;
  std::int64_t tile_elements = 0;
  bool blocked = false;                  ///< whole quantization blocks per tile (fp8)
  std::span<const void* const> sources;  ///< reduce's source pointers, else empty
};

/// Where the parts of a table lie in its image (byte offsets).
struct TableLayout {
  std::size_t tiles_at = 0;
  std::size_t sources_at = 0;
  std::size_t tile_count = 0;
};

struct TableImage {
  std::vector<std::byte> bytes;
  TableLayout layout;
};

/// The table `key` makes: its tiles planned (planTiles), all parts packed.
[[nodiscard]] TableImage makeTableImage(const TableKey& key);

/// A copy of a key, kept beside the device copy of the table it made.
class TableKeyCopy {
 public:
  [[nodiscard]] bool matches(const TableKey& key) const noexcept;
  void assign(const TableKey& key);
  void clear() noexcept { held_ = false; }

 private:
  bool held_ = false;
  std::vector<Segment> segments_;
  std::vector<const void*> sources_;
  std::int64_t tile_elements_ = 0;
  bool blocked_ = false;
};

}  // namespace dbuf::kernels::detail
