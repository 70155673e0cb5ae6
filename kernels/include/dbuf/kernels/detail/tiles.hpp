#pragma once
/// \file
/// How a segment table is cut into units of work ("tiles"): the CPU ops hand
/// tiles to their threads, the CUDA ops give one tile to each thread block.
/// A tile is a run [begin, end) of one segment's elements; for the blocked
/// ops (fp8 quantize / dequantize) it holds whole quantization blocks, so a
/// block's amax is never split. Every element of every segment is in exactly
/// one tile, so results do not depend on the cut. Pure; thread-safe.

#include <cstdint>
#include <span>
#include <vector>

#include "dbuf/kernels/ops.hpp"

namespace dbuf::kernels::detail {

/// Trivially copyable: uploaded as is to the GPU.
struct Tile {
  std::int64_t begin = 0;
  std::int64_t end = 0;
  std::int32_t segment = 0;  ///< index into the segment table
  std::int32_t unused = 0;
};

/// Tiles of about tile_elements elements (rounded up to whole blocks when
/// blocked; segments' block > 0 is checked by the caller), in segment order;
/// empty segments get none. tile_elements < 1 counts as 1.
[[nodiscard]] std::vector<Tile> planTiles(std::span<const Segment> segments, std::int64_t tile_elements, bool blocked);

/// How reduce writes a summed element out (see kernels::reduce).
enum class ReduceOut {
  kStore,       ///< dst = round(acc)
  kScaleStore,  ///< dst = round(acc * factor)
  kAccumulate,  ///< dst(fp32) = dst + (acc * factor)
};

[[nodiscard]] std::int64_t totalElements(std::span<const Segment> segments) noexcept;

}  // namespace dbuf::kernels::detail
