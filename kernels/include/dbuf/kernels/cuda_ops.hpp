#pragma once
/// \file
/// CUDA twins of the fused multi-tensor ops (ops.hpp): the same buffers,
/// segment tables and checks, and bit-identical results (fp8 and NaNs
/// included), with the buffers in GPU memory. Each call is one kernel launch
/// for the whole table, queued on Launch::stream; it returns once queued.
///
/// Argument errors (the same messages as the CPU ops) come back before
/// anything is queued; a failed launch comes back as kDevice (kUnavailable
/// without a usable GPU). Faults inside a kernel show up, as in any CUDA
/// code, at the stream's next synchronisation.
///
/// Ownership / lifetime: buffers are device pointers (or anything the device
/// can address) borrowed until the queued work has run. Threads: calls on
/// distinct DeviceTables may come from any threads; one DeviceTable is used
/// by one thread at a time.

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "dbuf/kernels/ops.hpp"

struct CUstream_st;

namespace dbuf::kernels::cuda {

using Stream = CUstream_st*;  ///< cudaStream_t / CUstream

/// Whether a CUDA device can run the kernels here; why not, if not.
struct DeviceCheck {
  bool usable = false;
  std::string reason;
};
[[nodiscard]] DeviceCheck checkDevice();

/// Device copies of segment tables (with their tile lists and, for reduce,
/// the source pointers), kept between calls. A call whose table is one of
/// the copies reuses it, found by what the table is made of (segments, tile
/// size, sources) without planning tiles: a group's table is uploaded once
/// and every later step launches at once. A new table goes through pinned staging into an
/// idle copy (up to 16 are kept in rotation), so the host does not wait for
/// kernels still reading older copies; it waits only when all 16 are busy.
/// The copies live on the device current when the table is first used; use
/// a table with streams of that device, one stream at a time (a copy reused
/// on another stream is waited for, but a copy's "used" mark follows the
/// last stream only).
class DeviceTable {
 public:
  DeviceTable();
  ~DeviceTable();  ///< waits for the kernels that use it
  DeviceTable(const DeviceTable&) = delete;
  DeviceTable& operator=(const DeviceTable&) = delete;

  struct Impl;
  Impl& impl() noexcept { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

struct Launch {
  Stream stream = nullptr;  ///< nullptr: the legacy default stream
  /// Where the table's device copy lives. nullptr: a temporary copy per call
  /// (stream-ordered allocation; the upload from pageable memory makes the
  /// host wait for the stream, so repeated calls should pass a table).
  DeviceTable* table = nullptr;
  /// Elements per thread block (rounded up to whole blocks for fp8).
  std::int64_t tile_elements = std::int64_t{1} << 15;
};

[[nodiscard]] Result<void> copy(ConstBuffer src, MutBuffer dst, std::span<const Segment> segments,
                                const Launch& launch = {});
[[nodiscard]] Result<void> cast(ConstBuffer src, MutBuffer dst, std::span<const Segment> segments,
                                const Launch& launch = {});
[[nodiscard]] Result<void> scale(MutBuffer data, float factor, std::span<const Segment> segments,
                                 const Launch& launch = {});
[[nodiscard]] Result<void> zero(MutBuffer data, std::span<const Segment> segments, const Launch& launch = {});
[[nodiscard]] Result<void> accumulate(ConstBuffer src, MutBuffer dst, float alpha, std::span<const Segment> segments,
                                      const Launch& launch = {});
/// The source pointers travel with the table, so every source must be device memory.
[[nodiscard]] Result<void> reduce(std::span<const ConstBuffer> srcs, MutBuffer dst, const ReduceOptions& reduction,
                                  std::span<const Segment> segments, const Launch& launch = {});
[[nodiscard]] Result<void> quantizeE4m3(ConstBuffer src, MutBuffer dst, MutBuffer scales,
                                        std::span<const Segment> segments, const Launch& launch = {});
[[nodiscard]] Result<void> dequantizeE4m3(ConstBuffer src, ConstBuffer scales, MutBuffer dst,
                                          std::span<const Segment> segments, const Launch& launch = {});

}  // namespace dbuf::kernels::cuda
