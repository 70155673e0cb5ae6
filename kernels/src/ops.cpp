// CPU implementation of the fused multi-tensor ops. Inner loops are plain
// element loops over typed pointers so GCC vectorises them at -O3; the
// fp32 arithmetic is compiled with -ffp-contract=off so it matches the CUDA
// twins (which use __fmul_rn / __fadd_rn / __fdiv_rn) bit for bit.
#include "dbuf/kernels/ops.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "dbuf/kernels/convert.hpp"
#include "dbuf/kernels/detail/checks.hpp"
#include "dbuf/kernels/detail/dispatch.hpp"
#include "dbuf/kernels/detail/tiles.hpp"

namespace dbuf::kernels {
namespace {

using detail::ReduceOut;
using detail::withFloatType;
using detail::withReducedType;

template <typename T>
const T* at(const void* base, std::int64_t offset) {
  return static_cast<const T*>(base) + offset;
}
template <typename T>
T* at(void* base, std::int64_t offset) {
  return static_cast<T*>(base) + offset;
}

// Dequantization looks codes up in a table: measured faster than the
// vectorised bit decoder on AVX2 (a gather per element beats the selects).
constexpr std::array<float, 256> makeE4m3Table() {
  std::array<float, 256> table{};
  for (std::size_t i = 0; i < table.size(); ++i) table[i] = e4m3ToFloat(static_cast<std::uint8_t>(i));
  return table;
}
constexpr std::array<float, 256> kE4m3Table = makeE4m3Table();

// ---- work splitting ---------------------------------------------------------------

/// Runs fn(segment, begin, end) over every element of every segment, cut in
/// tiles of whole blocks (blocked) or elements and shared by up to
/// options.threads threads. Each element (and each block) is handled by
/// exactly one fn call whose result does not depend on the cut, so the output
/// is the same for any thread count.
template <typename Fn>
void forEachChunk(std::span<const Segment> segments, const Options& options, bool blocked, Fn&& fn) {
  const int threads = options.threads > 0 ? options.threads : defaultThreads();
  const std::int64_t chunk = std::max<std::int64_t>(options.chunk_elements, 1);
  if (threads <= 1 || detail::totalElements(segments) < 2 * chunk) {
    for (const Segment& s : segments) {
      if (s.count > 0) fn(s, std::int64_t{0}, s.count);
    }
    return;
  }
  const std::vector<detail::Tile> items = detail::planTiles(segments, chunk, blocked);
  std::atomic<std::size_t> next{0};
  auto drain = [&] {
    for (std::size_t i = next.fetch_add(1, std::memory_order_relaxed); i < items.size();
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      const detail::Tile& t = items[i];
      fn(segments[static_cast<std::size_t>(t.segment)], t.begin, t.end);
    }
  };
  const std::size_t workers = std::min(static_cast<std::size_t>(threads), items.size()) - 1;
  std::vector<std::jthread> pool;
  pool.reserve(workers);
  for (std::size_t w = 0; w < workers; ++w) {
    try {
      pool.emplace_back(drain);
    } catch (const std::system_error&) {
      break;  // fewer threads; the caller drains whatever is left
    }
  }
  drain();
}  // pool joins here

// ---- typed loops --------------------------------------------------------------------

// The loops are compiled twice, for baseline x86-64 (SSE2) and x86-64-v3
// (AVX2), and picked at load time (GCC function multiversioning): the
// conversions need the wider integer ops of AVX2 to keep up with memory.
// Both clones compute the same IEEE operations, so the results are the same.
// Not under ThreadSanitizer: the clones are picked by IFUNC resolvers, which
// the dynamic loader runs during relocation, before TSan's runtime is set up,
// and the instrumented resolver then crashes the process at load.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
#define DBUF_KERNEL_CLONES __attribute__((target_clones("default", "arch=x86-64-v3")))
#else
#define DBUF_KERNEL_CLONES
#endif

template <typename S, typename D>
DBUF_KERNEL_CLONES void castLoop(const typename S::T* __restrict src, typename D::T* __restrict dst, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = D::store(S::load(src[i]));
}

template <typename E>
DBUF_KERNEL_CLONES void scaleLoop(typename E::T* __restrict data, typename E::Acc factor, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) data[i] = E::store(mulRn(E::load(data[i]), factor));
}

template <typename S>
DBUF_KERNEL_CLONES void accumulateLoop(const typename S::T* __restrict src, typename S::Acc* __restrict dst,
                                       typename S::Acc alpha, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = addProduct(dst[i], mulRn(S::load(src[i]), alpha));
}

template <typename S>
DBUF_KERNEL_CLONES float blockScale(const typename S::T* __restrict src, std::int64_t n) {
  // amax as an integer max of magnitude bits: it vectorises (a float max
  // needs -ffast-math). (Signed ints: GCC 12 does not vectorise the unsigned
  // select + max form; the bits are below 2^31 either way.)
  std::int32_t amax = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const auto bits = static_cast<std::int32_t>(finiteMagnitudeBits(S::load(src[i])));
    amax = amax > bits ? amax : bits;
  }
  return blockScaleFromAmaxBits(static_cast<std::uint32_t>(amax));
}

template <typename S>
DBUF_KERNEL_CLONES void quantizeLoop(const typename S::T* __restrict src, std::uint8_t* __restrict dst, float scale,
                                     std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = floatToE4m3(divRn(S::load(src[i]), scale));
}

template <typename D>
DBUF_KERNEL_CLONES void dequantizeLoop(const std::uint8_t* __restrict src, typename D::T* __restrict dst, float scale,
                                       std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = D::store(mulRn(kE4m3Table[src[i]], scale));
}

// ---- reduce ---------------------------------------------------------------------------

/// Elements summed at a time. Each source is read in runs of this many
/// elements, all W of them within a few KiB of each other, and the fp32
/// partial sums (1 KiB; fp64: 2 KiB) stay in L1. Short runs keep many sources' cache line
/// misses in flight at once: on the 2-core AVX2 VM, 8 bf16 sources -> fp32
/// ran at 10-11 GB/s on one core with 128-256, 8 GB/s with 1024, 7 with 2048.
constexpr std::int64_t kReduceBlock = 256;

/// dst[0, n) from srcs[r].data + src_offset, r = 0..w-1 (see reduce()). Each
/// element gets the operations of the unfused composition (zero, W
/// accumulates, then scale + cast or an accumulate), in its order, whatever
/// the block or chunk cut, so the bits match it and do not depend on the
/// thread count.
template <typename S, typename D, ReduceOut kOut>
DBUF_KERNEL_CLONES void reduceChunk(const ConstBuffer* srcs, std::size_t w, std::int64_t src_offset, typename D::T* dst,
                                    typename S::Acc pre, typename S::Acc factor, std::int64_t n) {
  using ST = typename S::T;
  using Acc = typename S::Acc;
  alignas(64) Acc acc[kReduceBlock];
  for (std::int64_t b = 0; b < n; b += kReduceBlock) {
    const std::int64_t m = std::min(kReduceBlock, n - b);
    // Up to two sources per pass over acc: per element the same operations
    // in the same order as one source at a time, with half the passes.
    // (Built with -fno-loop-unroll-and-jam, see kernels/CMakeLists.txt: GCC
    // jammed the passes into one loop that ran 4x slower.)
    // 0 + x is not x for x = -0 (the composition adds to a zeroed
    // scratch): kept, not folded.
    const ST* s0 = at<ST>(srcs[0].data, src_offset + b);
    std::size_t r = 1;
    if (w >= 2) {
      const ST* s1 = at<ST>(srcs[1].data, src_offset + b);
      for (std::int64_t i = 0; i < m; ++i) {
        acc[i] = addProduct(addRn(Acc{0}, mulRn(S::load(s0[i]), pre)), mulRn(S::load(s1[i]), pre));
      }
      r = 2;
    } else {
      for (std::int64_t i = 0; i < m; ++i) acc[i] = addRn(Acc{0}, mulRn(S::load(s0[i]), pre));
    }
    for (; r + 1 < w; r += 2) {
      const ST* sa = at<ST>(srcs[r].data, src_offset + b);
      const ST* sb = at<ST>(srcs[r + 1].data, src_offset + b);
      for (std::int64_t i = 0; i < m; ++i) {
        acc[i] = addProduct(addProduct(acc[i], mulRn(S::load(sa[i]), pre)), mulRn(S::load(sb[i]), pre));
      }
    }
    if (r < w) {
      const ST* sa = at<ST>(srcs[r].data, src_offset + b);
      for (std::int64_t i = 0; i < m; ++i) acc[i] = addProduct(acc[i], mulRn(S::load(sa[i]), pre));
    }
    typename D::T* out = dst + b;
    if constexpr (kOut == ReduceOut::kAccumulate) {
      for (std::int64_t i = 0; i < m; ++i) out[i] = addProduct(out[i], mulRn(acc[i], factor));
    } else if constexpr (kOut == ReduceOut::kScaleStore) {
      for (std::int64_t i = 0; i < m; ++i) out[i] = D::store(mulRn(acc[i], factor));
    } else {
      for (std::int64_t i = 0; i < m; ++i) out[i] = D::store(acc[i]);
    }
  }
}

}  // namespace

int defaultThreads() noexcept {
  const unsigned hw = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp(hw, 1U, 8U));
}

Result<void> copy(ConstBuffer src, MutBuffer dst, std::span<const Segment> segments, const Options& options) {
  if (auto r = detail::checkCopy(src, dst, segments); !r) return r;
  const auto size = static_cast<std::size_t>(sizeBytes(src.dtype));
  forEachChunk(segments, options, false, [&](const Segment& s, std::int64_t b, std::int64_t e) {
    std::memcpy(at<unsigned char>(dst.data, (s.dst_offset + b) * sizeBytes(dst.dtype)),
                at<unsigned char>(src.data, (s.src_offset + b) * sizeBytes(src.dtype)),
                static_cast<std::size_t>(e - b) * size);
  });
  return {};
}

Result<void> cast(ConstBuffer src, MutBuffer dst, std::span<const Segment> segments, const Options& options) {
  if (auto r = detail::checkCast(src, dst, segments); !r) return r;
  if (src.dtype == dst.dtype) return copy(src, dst, segments, options);
  withFloatType(src.dtype, [&](auto s_tag) {
    using S = decltype(s_tag);
    withFloatType(dst.dtype, [&](auto d_tag) {
      using D = decltype(d_tag);
      forEachChunk(segments, options, false, [&](const Segment& s, std::int64_t b, std::int64_t e) {
        castLoop<S, D>(at<typename S::T>(src.data, s.src_offset + b), at<typename D::T>(dst.data, s.dst_offset + b),
                       e - b);
      });
    });
  });
  return {};
}

Result<void> scale(MutBuffer data, float factor, std::span<const Segment> segments, const Options& options) {
  if (auto r = detail::checkScale(data, segments); !r) return r;
  withReducedType(data.dtype, [&](auto tag) {
    using E = decltype(tag);
    forEachChunk(segments, options, false, [&](const Segment& s, std::int64_t b, std::int64_t e) {
      scaleLoop<E>(at<typename E::T>(data.data, s.dst_offset + b), factor, e - b);
    });
  });
  return {};
}

Result<void> zero(MutBuffer data, std::span<const Segment> segments, const Options& options) {
  if (auto r = detail::checkZero(data, segments); !r) return r;
  const std::int64_t size = sizeBytes(data.dtype);
  forEachChunk(segments, options, false, [&](const Segment& s, std::int64_t b, std::int64_t e) {
    std::memset(at<unsigned char>(data.data, (s.dst_offset + b) * size), 0, static_cast<std::size_t>((e - b) * size));
  });
  return {};
}

Result<void> accumulate(ConstBuffer src, MutBuffer dst, float alpha, std::span<const Segment> segments,
                        const Options& options) {
  if (auto r = detail::checkAccumulate(src, dst, segments); !r) return r;
  withReducedType(src.dtype, [&](auto tag) {
    using S = decltype(tag);
    forEachChunk(segments, options, false, [&](const Segment& s, std::int64_t b, std::int64_t e) {
      accumulateLoop<S>(at<typename S::T>(src.data, s.src_offset + b),
                        at<typename S::Acc>(dst.data, s.dst_offset + b), alpha, e - b);
    });
  });
  return {};
}

Result<void> reduce(std::span<const ConstBuffer> srcs, MutBuffer dst, const ReduceOptions& reduction,
                    std::span<const Segment> segments, const Options& options) {
  if (auto r = detail::checkReduce(srcs, dst, reduction, segments); !r) return r;
  const ConstBuffer* in = srcs.data();
  const std::size_t w = srcs.size();
  detail::withReduceTypes(srcs[0].dtype, dst.dtype, reduction, [&](auto s_tag, auto d_tag, auto out) {
    using S = decltype(s_tag);
    using D = decltype(d_tag);
    forEachChunk(segments, options, false, [&](const Segment& s, std::int64_t b, std::int64_t e) {
      reduceChunk<S, D, decltype(out)::value>(in, w, s.src_offset + b, at<typename D::T>(dst.data, s.dst_offset + b),
                                              reduction.pre, static_cast<typename S::Acc>(reduction.factor), e - b);
    });
  });
  return {};
}

Result<void> quantizeE4m3(ConstBuffer src, MutBuffer dst, MutBuffer scales, std::span<const Segment> segments,
                          const Options& options) {
  if (auto r = detail::checkQuantize(src, dst, scales, segments); !r) return r;
  withFloatType(src.dtype, [&](auto tag) {
    using S = decltype(tag);
    forEachChunk(segments, options, true, [&](const Segment& s, std::int64_t b, std::int64_t e) {
      for (std::int64_t b0 = b; b0 < e; b0 += s.block) {
        const std::int64_t n = std::min(s.block, e - b0);
        const auto* in = at<typename S::T>(src.data, s.src_offset + b0);
        const float sc = blockScale<S>(in, n);
        *at<float>(scales.data, s.scale_offset + b0 / s.block) = sc;
        quantizeLoop<S>(in, at<std::uint8_t>(dst.data, s.dst_offset + b0), sc, n);
      }
    });
  });
  return {};
}

Result<void> dequantizeE4m3(ConstBuffer src, ConstBuffer scales, MutBuffer dst, std::span<const Segment> segments,
                            const Options& options) {
  if (auto r = detail::checkDequantize(src, scales, dst, segments); !r) return r;
  withFloatType(dst.dtype, [&](auto tag) {
    using D = decltype(tag);
    forEachChunk(segments, options, true, [&](const Segment& s, std::int64_t b, std::int64_t e) {
      for (std::int64_t b0 = b; b0 < e; b0 += s.block) {
        const std::int64_t n = std::min(s.block, e - b0);
        const float sc = *at<float>(scales.data, s.scale_offset + b0 / s.block);
        dequantizeLoop<D>(at<std::uint8_t>(src.data, s.src_offset + b0), at<typename D::T>(dst.data, s.dst_offset + b0),
                          sc, n);
      }
    });
  });
  return {};
}

}  // namespace dbuf::kernels
