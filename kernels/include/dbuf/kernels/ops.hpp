#pragma once
/// \file
/// Fused multi-tensor ops on the CPU. Each call walks a whole segment table
/// once (one entry per tensor or per tensor shard), so a group of ~1000
/// tensors costs one call, not 1000. The CUDA kernels will take the same
/// arguments and give bit-identical results.
///
/// Buffers: a base pointer, its element type and its length in elements.
/// Segment offsets and counts are in elements relative to those bases; every
/// segment is checked against the lengths before any element is touched, so
/// a bad table is an Error, never an out-of-bounds access.
///
/// Ownership / lifetime: the ops borrow the buffers for the duration of the
/// call only. Threads: a call may split large segments across
/// Options::threads threads (std::jthread, joined before it returns);
/// results are bitwise identical for any thread count. Source and
/// destination ranges of one call must not overlap (except the in-place ops
/// scale and zero, which have one buffer); distinct calls on disjoint memory
/// may run concurrently.

#include <cstddef>
#include <cstdint>
#include <span>

#include "dbuf/common/dtype.hpp"
#include "dbuf/common/result.hpp"
#include "dbuf/kernels/convert.hpp"

namespace dbuf::kernels {

/// One contiguous run of elements. `block` is the quantisation block length
/// (quantizeE4m3 / dequantizeE4m3 only, must be > 0 there; 0 elsewhere);
/// `scale_offset` is the index, in the scales buffer, of the scale of the
/// segment's first block (quantize / dequantize only). Block b of the segment
/// covers elements [b*block, min((b+1)*block, count)) of the segment and its
/// scale is scales[scale_offset + b]; the last block may be partial.
struct Segment {
  std::int64_t src_offset = 0;
  std::int64_t dst_offset = 0;
  std::int64_t count = 0;
  std::int64_t block = 0;
  std::int64_t scale_offset = 0;
};

struct ConstBuffer {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  std::int64_t elements = 0;
};

struct MutBuffer {
  void* data = nullptr;
  DType dtype = DType::kF32;
  std::int64_t elements = 0;
};

/// min(hardware threads, 8), at least 1.
[[nodiscard]] int defaultThreads() noexcept;

struct Options {
  int threads = 0;  ///< 0: defaultThreads(); 1: the calling thread only
  /// Work is cut into chunks of about this many elements (rounded up to whole
  /// blocks for quantize); calls smaller than two chunks run on the caller.
  std::int64_t chunk_elements = std::int64_t{1} << 16;
};

/// dst[dst_offset + i] = src[src_offset + i]; any dtype, src.dtype == dst.dtype.
[[nodiscard]] Result<void> copy(ConstBuffer src, MutBuffer dst, std::span<const Segment> segments,
                                const Options& options = {});

/// dst = convert(src) for src, dst in {fp32, bf16, fp16}; one dtype on both sides (any dtype) = copy.
[[nodiscard]] Result<void> cast(ConstBuffer src, MutBuffer dst, std::span<const Segment> segments,
                                const Options& options = {});

/// In place: x = round(float(x) * factor) at data[dst_offset + i]; fp32, bf16, fp16
/// (fp64: x = x * double(factor)).
[[nodiscard]] Result<void> scale(MutBuffer data, float factor, std::span<const Segment> segments,
                                 const Options& options = {});

/// data[dst_offset + i] = 0 (all-zero bytes); any dtype.
[[nodiscard]] Result<void> zero(MutBuffer data, std::span<const Segment> segments, const Options& options = {});

/// dst(fp32) += float(src) * alpha, computed as two roundings (no FMA):
/// d = addProduct(d, s * alpha) (convert.hpp: when both are NaN, the
/// product's NaN). src in {fp32, bf16, fp16}; or src and dst fp64, computed
/// in fp64 the same way (alpha converted to double, exactly).
[[nodiscard]] Result<void> accumulate(ConstBuffer src, MutBuffer dst, float alpha, std::span<const Segment> segments,
                                      const Options& options = {});

/// Scalars (scale's factor, accumulate's alpha, reduce's pre / factor) are
/// expected to be numbers: with a NaN scalar and a NaN element, which NaN
/// comes out may differ between the CPU and CUDA ops.

/// What reduce() computes besides the sum; the defaults give a plain sum.
struct ReduceOptions {
  float pre = 1.0F;         ///< every source element is multiplied by this first
  /// The sum is multiplied by this, converted to the type it is summed in
  /// (a double, so that an fp64 sum's factor, 1 / world say, keeps fp64
  /// precision; fp32 sums take it as a float).
  double factor = 1.0;
  bool accumulate = false;  ///< dst (fp32) += sum * factor, instead of dst = round(sum * factor)
};

/// The most sources one reduce() call takes.
inline constexpr std::size_t kMaxReduceSources = 4096;

/// Fused sum of W = srcs.size() sources (1 <= W <= kMaxReduceSources, all of
/// one dtype in {fp32, bf16, fp16}, each checked against its own length) at
/// the same src_offset, into dst at dst_offset. Per element, in fp32 with
/// every product and sum rounded (no FMA), sources in span order:
///   acc = 0.0f;  for r in 0..W-1: acc = acc + (float(srcs[r][i]) * pre);
///   accumulate == false (dst fp32, bf16 or fp16):
///     if (factor != 1.0f) acc = acc * factor;   dst[i] = round_to_dst(acc);
///   accumulate == true (dst fp32 only):
///     dst[i] = dst[i] + (acc * factor);          (the multiply is always done)
/// fp64: sources and dst all fp64, every step above in fp64 instead of fp32
/// (pre converted to double, exactly; factor taken whole, while fp32 sums
/// take it as a float); accumulate into fp64.
/// These are bitwise the results of the unfused composition on an fp32
/// scratch: zero(scratch); accumulate(srcs[r] -> scratch, pre) for each r;
/// then either scale(scratch, factor) (only when factor != 1) and
/// cast(scratch -> dst), or accumulate(scratch -> dst, factor). When the
/// running sum and the product being added are both NaN, the result is the
/// product's NaN (what those ops give on x86). One pass over memory instead of
/// W + 2: each chunk is summed a block of elements at a time in an fp32
/// buffer that stays in L1. dst must not overlap any source (not even
/// exactly); sources may overlap each other or be the same buffer.
/// Threads: split like the other ops by dst elements (chunk_elements counts
/// dst elements); bitwise identical for any thread count.
[[nodiscard]] Result<void> reduce(std::span<const ConstBuffer> srcs, MutBuffer dst, const ReduceOptions& reduction,
                                  std::span<const Segment> segments, const Options& options = {});

/// Block quantization to fp8 e4m3. Per block: amax = max |x| over the block's
/// finite elements, clamped below at kAmaxFloor; scale = amax / 448 (fp32
/// division); q = floatToE4m3(x / scale) (fp32 division, saturating; NaN stays
/// NaN, infinities become +-448). src in {fp32, bf16, fp16}, dst fp8_e4m3,
/// scales fp32. Blocks never straddle segments, so quantizing block-aligned
/// parts of a tensor separately gives the same bytes and scales as the whole.
[[nodiscard]] Result<void> quantizeE4m3(ConstBuffer src, MutBuffer dst, MutBuffer scales,
                                        std::span<const Segment> segments, const Options& options = {});

/// x = e4m3ToFloat(q) * scale (then rounded to dst's dtype); src fp8_e4m3,
/// scales fp32, dst in {fp32, bf16, fp16}. Same block / scale_offset rules.
[[nodiscard]] Result<void> dequantizeE4m3(ConstBuffer src, ConstBuffer scales, MutBuffer dst,
                                          std::span<const Segment> segments, const Options& options = {});

}  // namespace dbuf::kernels
