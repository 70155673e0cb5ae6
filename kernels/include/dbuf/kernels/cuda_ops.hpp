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

/// A segment table's copy in device memory (with its tile list and, for
/// reduce, the source pointers), kept between calls. A call whose table is
/// the same as the previous one's reuses the copy: a group's table is
/// uploaded once and every later step launches at once. A changed table is
/// copied through pinned memory, ordered on the streams so that kernels still
/// reading the previous copy finish first; the host waits only when the
/// table grows past its capacity or its pinned staging is still in flight.
/// Meant for one stream at a time (a later stream waits for the upload, but
/// a re-upload waits only for the last stream's kernels).
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
