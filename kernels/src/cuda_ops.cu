// CUDA twins of the fused ops. Each op is one launch over the whole segment
// table: one thread block per tile (detail/tiles.hpp), 256 threads, the
// per-thread work in detail/tile_body.hpp (shared with the host emulation the
// unit tests run). The table (segments, tiles, reduce's source pointers)
// lives in device memory, cached in a DeviceTable between calls.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "dbuf/common/cuda_status.hpp"
#include "dbuf/kernels/cuda_ops.hpp"
#include "dbuf/kernels/detail/checks.hpp"
#include "dbuf/kernels/detail/dispatch.hpp"
#include "dbuf/kernels/detail/table_image.hpp"
#include "dbuf/kernels/detail/tile_body.hpp"
#include "dbuf/kernels/detail/tiles.hpp"

namespace dbuf::kernels::cuda {

using detail::ReduceOut;
using detail::TableImage;
using detail::TableKey;
using detail::TableLayout;
using detail::Tile;

namespace {

constexpr int kThreads = 256;
constexpr int kWarpSize = detail::kWarpLanes;

/// The table as the kernels see it: three arrays in one device allocation.
struct TableView {
  const Segment* segments = nullptr;
  const Tile* tiles = nullptr;
  const void* const* sources = nullptr;
};

TableView viewAt(const void* device, const TableLayout& layout) {
  const auto* base = static_cast<const std::byte*>(device);
  return {reinterpret_cast<const Segment*>(base), reinterpret_cast<const Tile*>(base + layout.tiles_at),
          reinterpret_cast<const void* const*>(base + layout.sources_at)};
}

// ---- kernels ---------------------------------------------------------------------------

template <typename Op>
__global__ void __launch_bounds__(kThreads) elementwiseKernel(TableView table, Op op, const void* src, void* dst) {
  const Tile tile = table.tiles[blockIdx.x];
  const Segment s = table.segments[tile.segment];
  detail::elementwiseTile(op, s, tile, src, dst, static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x));
}

template <typename S, typename D, ReduceOut kOut>
__global__ void __launch_bounds__(kThreads) reduceKernel(TableView table, detail::ReduceSources sources, void* dst) {
  const Tile tile = table.tiles[blockIdx.x];
  const Segment s = table.segments[tile.segment];
  sources.data = table.sources;
  detail::reduceTile<S, D, kOut>(sources, s, tile, dst, static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x));
}

/// The max of a value over this lane's group of `lanes` (a power of two <=
/// 32, groups aligned in the warp): butterfly shuffles that stay inside the
/// group. Every lane of the warp calls it together (see forEachBlockRound).
struct GroupMax {
  int lanes = kWarpSize;
  __device__ std::uint32_t operator()(std::uint32_t v) const {
    for (int offset = lanes / 2; offset > 0; offset /= 2) {
      const std::uint32_t other = __shfl_xor_sync(0xffffffffU, v, offset);
      v = v > other ? v : other;
    }
    return v;
  }
};

/// The tile's quantization blocks over the block's warps, lanesPerBlock
/// lanes per block (see quantizeTile).
template <typename S>
__global__ void __launch_bounds__(kThreads) quantizeKernel(TableView table, const void* src, void* dst, float* scales) {
  const Tile tile = table.tiles[blockIdx.x];
  const Segment s = table.segments[tile.segment];
  const detail::TileBlocks blocks{s, tile};
  const int lanes = detail::lanesPerBlock(s.block);
  const auto group = detail::LaneGroup::of(static_cast<int>(threadIdx.x) % kWarpSize, lanes);
  detail::quantizeTile<S>(blocks, static_cast<int>(threadIdx.x) / kWarpSize, static_cast<int>(blockDim.x) / kWarpSize,
                          group, src, dst, scales, GroupMax{lanes});
}

template <typename D>
__global__ void __launch_bounds__(kThreads)
    dequantizeKernel(TableView table, const void* src, const float* scales, void* dst) {
  const Tile tile = table.tiles[blockIdx.x];
  const Segment s = table.segments[tile.segment];
  const detail::TileBlocks blocks{s, tile};
  const auto group = detail::LaneGroup::of(static_cast<int>(threadIdx.x) % kWarpSize, detail::lanesPerBlock(s.block));
  detail::dequantizeTile<D>(blocks, static_cast<int>(threadIdx.x) / kWarpSize, static_cast<int>(blockDim.x) / kWarpSize,
                            group, src, scales, dst);
}

// ---- table upload and launch -------------------------------------------------------------------

Result<void> check(cudaError_t status, const char* what) {
  return cudaStatus(status, std::string("kernels::cuda: ") + what);
}

/// Runs `launch_kernel(view, grid)` with the table on the device, through
/// `launch.table` or a temporary stream-ordered copy.
template <typename LaunchKernel>
Result<void> withTable(const TableKey& key, const Launch& launch, LaunchKernel&& launch_kernel);

}  // namespace

// ---- DeviceTable -------------------------------------------------------------------------------

/// One device copy of a table with its pinned staging; `uploaded` fires when
/// the copy has landed (staging reusable), `used` after the last kernel that
/// read it.
struct TableCopy {
  detail::TableKeyCopy key;  // what the device copy holds, if anything
  TableLayout layout;
  void* device = nullptr;
  void* staging = nullptr;  // pinned, the same capacity
  std::size_t capacity = 0;
  cudaEvent_t uploaded = nullptr;
  cudaEvent_t used = nullptr;

  TableCopy() = default;
  TableCopy(const TableCopy&) = delete;
  TableCopy& operator=(const TableCopy&) = delete;
  ~TableCopy() {
    if (used != nullptr) static_cast<void>(cudaEventSynchronize(used));
    if (uploaded != nullptr) static_cast<void>(cudaEventSynchronize(uploaded));
    static_cast<void>(cudaFree(device));
    static_cast<void>(cudaFreeHost(staging));
    if (used != nullptr) static_cast<void>(cudaEventDestroy(used));
    if (uploaded != nullptr) static_cast<void>(cudaEventDestroy(uploaded));
  }

  Result<void> makeEvents() {
    if (auto r = check(cudaEventCreateWithFlags(&uploaded, cudaEventDisableTiming), "cudaEventCreate"); !r) return r;
    return check(cudaEventCreateWithFlags(&used, cudaEventDisableTiming), "cudaEventCreate");
  }

  /// Neither an upload nor a kernel of this copy is pending: reusable now.
  [[nodiscard]] bool idle() const {
    return cudaEventQuery(uploaded) == cudaSuccess && cudaEventQuery(used) == cudaSuccess;
  }

  /// Room for `size` bytes (the copy is idle or its pending work is waited for).
  Result<void> reserve(std::size_t size) {
    if (size <= capacity) return {};
    if (auto r = check(cudaEventSynchronize(used), "cudaEventSynchronize"); !r) return r;
    if (auto r = check(cudaEventSynchronize(uploaded), "cudaEventSynchronize"); !r) return r;
    const std::size_t want = std::max<std::size_t>(size, 2 * capacity);
    static_cast<void>(cudaFree(device));
    static_cast<void>(cudaFreeHost(staging));
    device = staging = nullptr;
    capacity = 0;
    key.clear();
    if (auto r = check(cudaMalloc(&device, want), "cudaMalloc (segment table)"); !r) return r;
    if (auto r = check(cudaMallocHost(&staging, want), "cudaMallocHost (segment table staging)"); !r) return r;
    capacity = want;
    return {};
  }
};

/// A few copies in rotation: a new table goes into an idle copy, so the host
/// never waits for kernels still reading an older one (a stream held back by
/// a stream-memory wait must not block the thread that would release it).
/// Only when every copy is busy and kMaxCopies exist does the host wait, for
/// the least recently used.
struct DeviceTable::Impl {
  static constexpr std::size_t kMaxCopies = 16;
  std::vector<std::unique_ptr<TableCopy>> copies;
  TableCopy* last = nullptr;    // the copy the last prepare() returned
  std::size_t next_victim = 0;  // round robin when all are busy

  Result<TableCopy*> freeCopy() {
    for (auto& c : copies) {
      if (c->idle()) return c.get();
    }
    if (copies.size() < kMaxCopies) {
      auto fresh = std::make_unique<TableCopy>();
      if (auto r = fresh->makeEvents(); !r) return r.error();
      copies.push_back(std::move(fresh));
      return copies.back().get();
    }
    TableCopy* victim = copies[next_victim++ % copies.size()].get();
    if (auto r = check(cudaEventSynchronize(victim->used), "cudaEventSynchronize"); !r) return r.error();
    if (auto r = check(cudaEventSynchronize(victim->uploaded), "cudaEventSynchronize"); !r) return r.error();
    return victim;
  }

  /// The device copy of `key`'s table, valid for work queued on `stream`
  /// next: one held already (found by key, nothing planned), or a new upload.
  Result<const TableCopy*> prepare(const TableKey& key, cudaStream_t stream) {
    for (auto& c : copies) {
      if (c->key.matches(key)) {
        // Uploaded before, perhaps on another stream: wait for that copy.
        if (auto r = check(cudaStreamWaitEvent(stream, c->uploaded, 0), "cudaStreamWaitEvent"); !r) return r.error();
        last = c.get();
        return last;
      }
    }
    auto copy = freeCopy();
    if (!copy) return copy.error();
    TableCopy& c = **copy;
    const TableImage table = detail::makeTableImage(key);
    if (auto r = c.reserve(table.bytes.size()); !r) return r.error();
    c.key.clear();  // until the upload below is queued, the copy holds no table
    std::memcpy(c.staging, table.bytes.data(), table.bytes.size());
    if (auto r = check(cudaMemcpyAsync(c.device, c.staging, table.bytes.size(), cudaMemcpyHostToDevice, stream),
                       "cudaMemcpyAsync (segment table)");
        !r) {
      return r.error();
    }
    if (auto r = check(cudaEventRecord(c.uploaded, stream), "cudaEventRecord"); !r) return r.error();
    c.key.assign(key);
    c.layout = table.layout;
    last = &c;
    return last;
  }

  Result<void> markUsed(cudaStream_t stream) { return check(cudaEventRecord(last->used, stream), "cudaEventRecord"); }
};

DeviceTable::DeviceTable() : impl_(std::make_unique<Impl>()) {}
DeviceTable::~DeviceTable() = default;

namespace {

/// The grid for `tiles` tiles, one block each.
Result<unsigned> gridFor(std::size_t tiles) {
  if (tiles > static_cast<std::size_t>(std::numeric_limits<int>::max())) {
    return makeError(ErrorCode::kInvalidArgument, "kernels::cuda: " + std::to_string(tiles) +
                                                      " tiles do not fit one grid; raise Launch::tile_elements");
  }
  return static_cast<unsigned>(tiles);
}

template <typename LaunchKernel>
Result<void> withTable(const TableKey& key, const Launch& launch, LaunchKernel&& launch_kernel) {
  if (detail::totalElements(key.segments) == 0) return {};  // no tiles: nothing to launch
  cudaStream_t stream = launch.stream;
  // A launch reports its error through cudaGetLastError: clear what an
  // earlier call left there, so that an old error is not blamed on it.
  static_cast<void>(cudaGetLastError());
  if (launch.table != nullptr) {
    DeviceTable::Impl& cache = launch.table->impl();
    auto copy = cache.prepare(key, stream);
    if (!copy) return copy.error();
    auto grid = gridFor((*copy)->layout.tile_count);
    if (!grid) return grid.error();
    launch_kernel(viewAt((*copy)->device, (*copy)->layout), *grid, stream);
    if (auto r = check(cudaGetLastError(), "kernel launch"); !r) return r;
    return cache.markUsed(stream);
  }
  const TableImage table = detail::makeTableImage(key);
  auto grid = gridFor(table.layout.tile_count);
  if (!grid) return grid.error();
  void* device = nullptr;
  if (auto r = check(cudaMallocAsync(&device, table.bytes.size(), stream), "cudaMallocAsync (segment table)"); !r) {
    return r;
  }
  const auto upload_and_launch = [&]() -> Result<void> {
    if (auto r = check(cudaMemcpyAsync(device, table.bytes.data(), table.bytes.size(), cudaMemcpyHostToDevice, stream),
                       "cudaMemcpyAsync (segment table)");
        !r) {
      return r;
    }
    launch_kernel(viewAt(device, table.layout), *grid, stream);
    return check(cudaGetLastError(), "kernel launch");
  };
  Result<void> result = upload_and_launch();
  static_cast<void>(cudaFreeAsync(device, stream));
  return result;
}

template <typename Op>
Result<void> runElementwise(const Op& op, const void* src, void* dst, std::span<const Segment> segments,
                            const Launch& launch) {
  return withTable({segments, launch.tile_elements, false, {}}, launch,
                   [&](TableView view, unsigned grid, cudaStream_t stream) {
                     elementwiseKernel<Op><<<grid, kThreads, 0, stream>>>(view, op, src, dst);
                   });
}

}  // namespace

DeviceCheck checkDevice() {
  int count = 0;
  if (auto r = cudaStatus(cudaGetDeviceCount(&count), "cudaGetDeviceCount"); !r) return {false, r.error().message};
  if (count == 0) return {false, "no CUDA device"};
  return {true, {}};
}

Result<void> copy(ConstBuffer src, MutBuffer dst, std::span<const Segment> segments, const Launch& launch) {
  if (auto r = detail::checkCopy(src, dst, segments); !r) return r;
  return detail::withElementBits(src.dtype, [&](auto raw) {
    using T = typename decltype(raw)::Type;
    return runElementwise(detail::CopyOp<T>{}, src.data, dst.data, segments, launch);
  });
}

Result<void> cast(ConstBuffer src, MutBuffer dst, std::span<const Segment> segments, const Launch& launch) {
  if (auto r = detail::checkCast(src, dst, segments); !r) return r;
  if (src.dtype == dst.dtype) return copy(src, dst, segments, launch);
  return detail::withFloatType(src.dtype, [&](auto s_tag) {
    return detail::withFloatType(dst.dtype, [&](auto d_tag) {
      using Op = detail::CastOp<decltype(s_tag), decltype(d_tag)>;
      return runElementwise(Op{}, src.data, dst.data, segments, launch);
    });
  });
}

Result<void> scale(MutBuffer data, float factor, std::span<const Segment> segments, const Launch& launch) {
  if (auto r = detail::checkScale(data, segments); !r) return r;
  return detail::withReducedType(data.dtype, [&](auto tag) {
    return runElementwise(detail::ScaleOp<decltype(tag)>{factor}, data.data, data.data, segments, launch);
  });
}

Result<void> zero(MutBuffer data, std::span<const Segment> segments, const Launch& launch) {
  if (auto r = detail::checkZero(data, segments); !r) return r;
  return detail::withElementBits(data.dtype, [&](auto raw) {
    using T = typename decltype(raw)::Type;
    return runElementwise(detail::ZeroOp<T>{}, data.data, data.data, segments, launch);
  });
}

Result<void> accumulate(ConstBuffer src, MutBuffer dst, float alpha, std::span<const Segment> segments,
                        const Launch& launch) {
  if (auto r = detail::checkAccumulate(src, dst, segments); !r) return r;
  return detail::withReducedType(src.dtype, [&](auto tag) {
    return runElementwise(detail::AccumulateOp<decltype(tag)>{alpha}, src.data, dst.data, segments, launch);
  });
}

Result<void> reduce(std::span<const ConstBuffer> srcs, MutBuffer dst, const ReduceOptions& reduction,
                    std::span<const Segment> segments, const Launch& launch) {
  if (auto r = detail::checkReduce(srcs, dst, reduction, segments); !r) return r;
  std::vector<const void*> pointers;
  pointers.reserve(srcs.size());
  for (const ConstBuffer& src : srcs) pointers.push_back(src.data);
  const TableKey key{segments, launch.tile_elements, false, pointers};
  const detail::ReduceSources sources{nullptr, static_cast<int>(srcs.size()), reduction.pre, reduction.factor,
                                      detail::sourcesCongruent(srcs)};
  return detail::withReduceTypes(srcs[0].dtype, dst.dtype, reduction, [&](auto s_tag, auto d_tag, auto out) {
    return withTable(key, launch, [&](TableView view, unsigned grid, cudaStream_t stream) {
      reduceKernel<decltype(s_tag), decltype(d_tag), decltype(out)::value>
          <<<grid, kThreads, 0, stream>>>(view, sources, dst.data);
    });
  });
}

Result<void> quantizeE4m3(ConstBuffer src, MutBuffer dst, MutBuffer scales, std::span<const Segment> segments,
                          const Launch& launch) {
  if (auto r = detail::checkQuantize(src, dst, scales, segments); !r) return r;
  return detail::withFloatType(src.dtype, [&](auto tag) {
    return withTable({segments, launch.tile_elements, true, {}}, launch,
                     [&](TableView view, unsigned grid, cudaStream_t stream) {
                       quantizeKernel<decltype(tag)>
                           <<<grid, kThreads, 0, stream>>>(view, src.data, dst.data, static_cast<float*>(scales.data));
                     });
  });
}

Result<void> dequantizeE4m3(ConstBuffer src, ConstBuffer scales, MutBuffer dst, std::span<const Segment> segments,
                            const Launch& launch) {
  if (auto r = detail::checkDequantize(src, scales, dst, segments); !r) return r;
  return detail::withFloatType(dst.dtype, [&](auto tag) {
    return withTable(
        {segments, launch.tile_elements, true, {}}, launch, [&](TableView view, unsigned grid, cudaStream_t stream) {
          dequantizeKernel<decltype(tag)>
              <<<grid, kThreads, 0, stream>>>(view, src.data, static_cast<const float*>(scales.data), dst.data);
        });
  });
}

}  // namespace dbuf::kernels::cuda
