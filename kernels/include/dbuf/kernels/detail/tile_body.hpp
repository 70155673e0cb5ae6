#pragma once
/// \file
/// What one GPU thread does in the CUDA twins of the fused ops, written as
/// __host__ __device__ templates. The CUDA kernels (src/cuda_ops.cu) are thin
/// wrappers that pick a tile per thread block and a lane per thread; the
/// host can call the same bodies for every lane of an emulated block, which
/// is how the unit tests check the indexing, the alignment split and the
/// 16-byte vector paths on a machine without a GPU.
///
/// Work split of one tile (see tiles.hpp) across `lanes` lanes: a scalar head
/// until the output is 16-byte aligned, then units of kUnit elements loaded
/// and stored as 16-byte words (when the input is aligned at the same
/// element, otherwise the whole range stays scalar), then a scalar tail.
/// Lane l handles head / tail elements l, l + lanes, ... and units l,
/// l + lanes, ... Every element is computed by the same scalar function on
/// either path, so the bits do not depend on the split, the lane count or
/// the backend.

#include <cstdint>
#include <cstring>

#include "dbuf/kernels/convert.hpp"
#include "dbuf/kernels/detail/tiles.hpp"

namespace dbuf::kernels::detail {

inline constexpr int kVectorBytes = 16;

/// Copies `bytes` (a multiple of 16) between 16-byte aligned addresses in
/// 16-byte words (one LDG.128 / STG.128 each on the GPU).
DBUF_HD inline void copyWords(void* dst, const void* src, int bytes) noexcept {
#if defined(__CUDA_ARCH__)
  for (int i = 0; i < bytes / kVectorBytes; ++i) static_cast<uint4*>(dst)[i] = static_cast<const uint4*>(src)[i];
#else
  std::memcpy(dst, src, static_cast<std::size_t>(bytes));
#endif
}

DBUF_HD inline bool isAligned(const void* p, std::uintptr_t alignment) noexcept {
  return reinterpret_cast<std::uintptr_t>(p) % alignment == 0;  // NOLINT(performance-no-int-to-ptr)
}

/// The head / unit split of a range of n elements read from `in` and
/// written to `out`. kUnit elements of the narrower type make 16 bytes.
template <typename In, typename Out>
struct VectorSplit {
  static constexpr std::size_t kUnit = kVectorBytes / (sizeof(In) < sizeof(Out) ? sizeof(In) : sizeof(Out));
  static constexpr auto kStep = static_cast<std::int64_t>(kUnit);  ///< kUnit, for index arithmetic
  std::int64_t head = 0;                                           ///< scalar elements before the first unit
  std::int64_t units = 0;                                          ///< whole units after the head

  /// in_aligned_too: the other inputs (reduce's sources) are congruent to
  /// `in` modulo 16 bytes.
  DBUF_HD VectorSplit(const In* in, const Out* out, std::int64_t n, bool others_congruent = true) noexcept {
    const auto out_addr = reinterpret_cast<std::uintptr_t>(out);  // NOLINT(performance-no-int-to-ptr)
    head = static_cast<std::int64_t>((kVectorBytes - out_addr % kVectorBytes) % kVectorBytes / sizeof(Out));
    const bool vector =
        others_congruent && isAligned(out, sizeof(Out)) && head < n && isAligned(in + head, kVectorBytes);
    if (!vector) head = n;
    units = (n - head) / kStep;
  }
  DBUF_HD std::int64_t tailBegin() const noexcept { return head + units * kStep; }
};

// ---- element-wise ops -------------------------------------------------------------------

/// Each op maps (input element, current output element) to the new output
/// element; kReadsIn / kReadsOut say which of the two it needs, kInPlace that
/// the input is the output (scale, zero).
template <typename T>
struct CopyOp {
  using In = T;
  using Out = T;
  static constexpr bool kReadsIn = true, kReadsOut = false, kInPlace = false;
  DBUF_HD T operator()(T x, T /*old*/) const noexcept { return x; }
};

template <typename T>
struct ZeroOp {
  using In = T;
  using Out = T;
  static constexpr bool kReadsIn = false, kReadsOut = false, kInPlace = true;
  DBUF_HD T operator()(T /*x*/, T /*old*/) const noexcept { return T{}; }
};

template <typename S, typename D>
struct CastOp {
  using In = typename S::T;
  using Out = typename D::T;
  static constexpr bool kReadsIn = true, kReadsOut = false, kInPlace = false;
  DBUF_HD Out operator()(In x, Out /*old*/) const noexcept { return D::store(S::load(x)); }
};

template <typename E>
struct ScaleOp {
  using In = typename E::T;
  using Out = typename E::T;
  static constexpr bool kReadsIn = true, kReadsOut = false, kInPlace = true;
  typename E::Acc factor = 1.0F;
  DBUF_HD Out operator()(In x, Out /*old*/) const noexcept { return E::store(mulRn(E::load(x), factor)); }
};

template <typename S>
struct AccumulateOp {
  using In = typename S::T;
  using Out = typename S::Acc;  ///< fp32, or fp64 for fp64 sources
  static constexpr bool kReadsIn = true, kReadsOut = true, kInPlace = false;
  Out alpha = 1.0F;
  DBUF_HD Out operator()(In x, Out old) const noexcept { return addProduct(old, mulRn(S::load(x), alpha)); }
};

template <typename S>
struct QuantizeOp {
  using In = typename S::T;
  using Out = std::uint8_t;
  static constexpr bool kReadsIn = true, kReadsOut = false, kInPlace = false;
  float scale = 1.0F;
  DBUF_HD Out operator()(In x, Out /*old*/) const noexcept { return floatToE4m3(divRn(S::load(x), scale)); }
};

template <typename D>
struct DequantizeOp {
  using In = std::uint8_t;
  using Out = typename D::T;
  static constexpr bool kReadsIn = true, kReadsOut = false, kInPlace = false;
  float scale = 1.0F;
  DBUF_HD Out operator()(In q, Out /*old*/) const noexcept { return D::store(mulRn(e4m3ToFloat(q), scale)); }
};

template <typename Op>
DBUF_HD inline typename Op::Out applyAt(const Op& op, const typename Op::In* in, typename Op::Out* out,
                                        std::int64_t i) noexcept {
  using In = typename Op::In;
  using Out = typename Op::Out;
  In x{};
  Out old{};
  if constexpr (Op::kReadsIn) x = in[i];
  if constexpr (Op::kReadsOut) old = out[i];
  return op(x, old);
}

/// Lane `lane` of `lanes`: its share of out[0, n) = op(in[0, n), out[0, n)).
template <typename Op>
DBUF_HD void runElementwise(const Op& op, const typename Op::In* in, typename Op::Out* out, std::int64_t n, int lane,
                            int lanes) noexcept {
  using In = typename Op::In;
  using Out = typename Op::Out;
  using Split = VectorSplit<In, Out>;
  constexpr std::size_t kUnit = Split::kUnit;
  constexpr std::int64_t kStep = Split::kStep;
  const Split split(in, out, n);
  for (std::int64_t i = lane; i < split.head; i += lanes) out[i] = applyAt(op, in, out, i);
  const In* unit_in = in + split.head;
  Out* unit_out = out + split.head;
  for (std::int64_t u = lane; u < split.units; u += lanes) {
    alignas(kVectorBytes) In x[kUnit] = {};
    alignas(kVectorBytes) Out y[kUnit] = {};
    if constexpr (Op::kReadsIn) copyWords(x, unit_in + u * kStep, static_cast<int>(sizeof x));
    if constexpr (Op::kReadsOut) copyWords(y, unit_out + u * kStep, static_cast<int>(sizeof y));
    for (std::size_t k = 0; k < kUnit; ++k) y[k] = op(x[k], y[k]);
    copyWords(unit_out + u * kStep, y, static_cast<int>(sizeof y));
  }
  for (std::int64_t i = split.tailBegin() + lane; i < n; i += lanes) out[i] = applyAt(op, in, out, i);
}

/// One tile of an element-wise op: segment s's elements [tile.begin, tile.end).
template <typename Op>
DBUF_HD void elementwiseTile(const Op& op, const Segment& s, const Tile& tile, const void* src, void* dst, int lane,
                             int lanes) noexcept {
  using In = typename Op::In;
  auto* out = static_cast<typename Op::Out*>(dst) + s.dst_offset + tile.begin;
  const In* in = nullptr;
  if constexpr (Op::kInPlace) {
    in = reinterpret_cast<const In*>(out);
  } else {
    in = static_cast<const In*>(src) + s.src_offset + tile.begin;
  }
  runElementwise(op, in, out, tile.end - tile.begin, lane, lanes);
}

// ---- reduce -------------------------------------------------------------------------

struct ReduceSources {
  const void* const* data = nullptr;  ///< `count` source base pointers
  int count = 0;
  float pre = 1.0F;
  double factor = 1.0;  ///< ReduceOptions::factor, converted to the sum's type where used
  bool congruent = true;  ///< every source's address is congruent to source 0's modulo 16 bytes
};

/// Whether every source sits at the same address modulo 16 bytes as the
/// first (then one alignment check covers them all). Host code.
inline bool sourcesCongruent(std::span<const ConstBuffer> srcs) noexcept {
  const auto mod16 = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % kVectorBytes; };
  for (const ConstBuffer& s : srcs) {
    if (mod16(s.data) != mod16(srcs[0].data)) return false;
  }
  return true;
}

template <typename S, typename D, ReduceOut kOut>
struct ReduceStep {
  using Acc = typename S::Acc;  ///< fp32, or fp64 for fp64 sources
  /// The running sum after source r's element x (r = 0 starts it from +0.0,
  /// as the unfused composition adds into a zeroed scratch).
  DBUF_HD static Acc add(Acc acc, typename S::T x, int r, Acc pre) noexcept {
    const Acc p = mulRn(S::load(x), pre);
    return r == 0 ? addRn(Acc{0}, p) : addProduct(acc, p);
  }
  DBUF_HD static typename D::T finish(Acc acc, typename D::T old, Acc factor) noexcept {
    if constexpr (kOut == ReduceOut::kAccumulate) {
      return addProduct(old, mulRn(acc, factor));
    } else if constexpr (kOut == ReduceOut::kScaleStore) {
      return D::store(mulRn(acc, factor));
    } else {
      return D::store(acc);
    }
  }
};

/// One tile of reduce: dst[s.dst_offset + i] from every source's
/// [s.src_offset + i], i in [tile.begin, tile.end), sources in order.
template <typename S, typename D, ReduceOut kOut>
DBUF_HD void reduceTile(const ReduceSources& a, const Segment& s, const Tile& tile, void* dst, int lane,
                        int lanes) noexcept {
  using In = typename S::T;
  using Out = typename D::T;
  using Step = ReduceStep<S, D, kOut>;
  using Split = VectorSplit<In, Out>;
  constexpr std::size_t kUnit = Split::kUnit;
  constexpr bool kReadsOut = kOut == ReduceOut::kAccumulate;
  const std::int64_t first = s.src_offset + tile.begin;
  const std::int64_t n = tile.end - tile.begin;
  Out* out = static_cast<Out*>(dst) + s.dst_offset + tile.begin;
  const Split split(static_cast<const In*>(a.data[0]) + first, out, n, a.congruent);
  using Acc = typename Step::Acc;
  auto element = [&](std::int64_t i) {
    Acc acc = 0.0F;
    for (int r = 0; r < a.count; ++r) acc = Step::add(acc, static_cast<const In*>(a.data[r])[first + i], r, a.pre);
    out[i] = Step::finish(acc, kReadsOut ? out[i] : Out{}, static_cast<Acc>(a.factor));
  };
  for (std::int64_t i = lane; i < split.head; i += lanes) element(i);
  for (std::int64_t u = lane; u < split.units; u += lanes) {
    const std::int64_t i0 = split.head + u * Split::kStep;
    Acc acc[kUnit] = {};
    for (int r = 0; r < a.count; ++r) {
      alignas(kVectorBytes) In x[kUnit];
      copyWords(x, static_cast<const In*>(a.data[r]) + first + i0, static_cast<int>(sizeof x));
      for (std::size_t k = 0; k < kUnit; ++k) acc[k] = Step::add(acc[k], x[k], r, a.pre);
    }
    alignas(kVectorBytes) Out y[kUnit] = {};
    if constexpr (kReadsOut) copyWords(y, out + i0, static_cast<int>(sizeof y));
    for (std::size_t k = 0; k < kUnit; ++k) y[k] = Step::finish(acc[k], y[k], static_cast<Acc>(a.factor));
    copyWords(out + i0, y, static_cast<int>(sizeof y));
  }
  for (std::int64_t i = split.tailBegin() + lane; i < n; i += lanes) element(i);
}

// ---- fp8 block ops -----------------------------------------------------------------------

/// Lane `lane` of `lanes`: the largest finite-magnitude bits among its
/// elements l, l + lanes, ... of in[0, n) (0 if none). The max over all lanes
/// is the block's amax.
template <typename S>
DBUF_HD std::uint32_t partialAmaxBits(const typename S::T* in, std::int64_t n, int lane, int lanes) noexcept {
  std::uint32_t amax = 0;
  for (std::int64_t i = lane; i < n; i += lanes) {
    const std::uint32_t bits = finiteMagnitudeBits(S::load(in[i]));
    amax = amax > bits ? amax : bits;
  }
  return amax;
}

/// The quantization blocks of a tile: block b starts at element `begin(b)`
/// of the segment and has `size(b)` elements.
struct TileBlocks {
  const Segment& s;
  const Tile& tile;
  DBUF_HD std::int64_t count() const noexcept {
    const std::int64_t n = tile.end - tile.begin;
    return n == 0 ? 0 : (n - 1) / s.block + 1;  // ceil without n + block overflowing
  }
  DBUF_HD std::int64_t begin(std::int64_t b) const noexcept { return tile.begin + b * s.block; }
  DBUF_HD std::int64_t size(std::int64_t b) const noexcept {
    const std::int64_t left = tile.end - begin(b);
    return left < s.block ? left : s.block;
  }
  /// Index of block b's scale in the scales buffer (tiles start on block boundaries).
  DBUF_HD std::int64_t scaleIndex(std::int64_t b) const noexcept { return s.scale_offset + begin(b) / s.block; }
};

inline constexpr int kWarpLanes = 32;

/// Lanes that share one quantization block: enough for one 16-byte unit of
/// fp8 each, a power of two, at most a warp. A warp then works on 32 / lanes
/// blocks at once and small blocks leave no lane idle (128 elements: 8 lanes,
/// 4 blocks per warp; 1 element: 32 blocks per warp, no shuffles).
DBUF_HD constexpr int lanesPerBlock(std::int64_t block) noexcept {
  int lanes = 1;
  while (lanes < kWarpLanes && static_cast<std::int64_t>(lanes) * kVectorBytes < block) lanes *= 2;
  return lanes;
}

/// Where a lane of a warp stands in the block ops: its group (`size`
/// consecutive lanes sharing a block) and its place in that group.
struct LaneGroup {
  int lane = 0;   ///< within the group
  int size = 1;   ///< lanes per group (lanesPerBlock)
  int index = 0;  ///< the group within the warp
  int count = 1;  ///< groups per warp
  DBUF_HD static LaneGroup of(int warp_lane, int lanes) noexcept {
    return {warp_lane % lanes, lanes, warp_lane / lanes, kWarpLanes / lanes};
  }
};

/// Calls fn(b) for the blocks of the tile this lane's group handles: warp w's
/// groups take blocks w * groups + g, then one round (warps * groups) later,
/// and so on. Every lane of a warp goes through the same rounds (the bound
/// depends on the warp only); in a round without a block for its group,
/// fn(-1), so that a group without work still joins the warp's shuffles.
template <typename Fn>
DBUF_HD void forEachBlockRound(const TileBlocks& blocks, int warp, int warps, const LaneGroup& group, Fn&& fn) {
  const std::int64_t count = blocks.count();
  const std::int64_t round = static_cast<std::int64_t>(warps) * group.count;
  for (std::int64_t first = static_cast<std::int64_t>(warp) * group.count; first < count; first += round) {
    const std::int64_t b = first + group.index;
    fn(b < count ? b : -1);
  }
}

/// Quantizes the tile's blocks with warp `warp` of `warps`. groupMax(v)
/// reduces v to its max over the lanes of this lane's group (shuffles on
/// the GPU; a barrier among threads in the host emulation); every lane calls
/// it the same number of times.
template <typename S, typename GroupMax>
DBUF_HD void quantizeTile(const TileBlocks& blocks, int warp, int warps, const LaneGroup& group, const void* src,
                          void* dst, float* scales, GroupMax&& groupMax) noexcept {
  forEachBlockRound(blocks, warp, warps, group, [&](std::int64_t b) {
    const typename S::T* in = nullptr;
    std::int64_t n = 0;
    std::uint32_t amax = 0;
    if (b >= 0) {
      in = static_cast<const typename S::T*>(src) + blocks.s.src_offset + blocks.begin(b);
      n = blocks.size(b);
      amax = partialAmaxBits<S>(in, n, group.lane, group.size);
    }
    amax = groupMax(amax);
    if (b < 0) return;
    const float scale = blockScaleFromAmaxBits(amax);
    if (group.lane == 0) scales[blocks.scaleIndex(b)] = scale;
    auto* out = static_cast<std::uint8_t*>(dst) + blocks.s.dst_offset + blocks.begin(b);
    runElementwise(QuantizeOp<S>{scale}, in, out, n, group.lane, group.size);
  });
}

/// Dequantizes the tile's blocks with warp `warp` of `warps` (no exchange
/// between lanes: each group works alone).
template <typename D>
DBUF_HD void dequantizeTile(const TileBlocks& blocks, int warp, int warps, const LaneGroup& group, const void* src,
                            const float* scales, void* dst) noexcept {
  forEachBlockRound(blocks, warp, warps, group, [&](std::int64_t b) {
    if (b < 0) return;
    const auto* in = static_cast<const std::uint8_t*>(src) + blocks.s.src_offset + blocks.begin(b);
    auto* out = static_cast<typename D::T*>(dst) + blocks.s.dst_offset + blocks.begin(b);
    runElementwise(DequantizeOp<D>{scales[blocks.scaleIndex(b)]}, in, out, blocks.size(b), group.lane, group.size);
  });
}

}  // namespace dbuf::kernels::detail
