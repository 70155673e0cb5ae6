#pragma once
/// \file
/// The CUDA ops behind kernels::Runner: each call queues one launch on the
/// runner's stream and returns; the caller orders or waits on that stream.
/// Its DeviceTable caches the last segment table (or, with cache_table
/// false, every call uploads a temporary one). Thread safety: one thread at
/// a time.

#include "dbuf/kernels/cuda_ops.hpp"
#include "dbuf/kernels/runner.hpp"

namespace dbuf::kernels::cuda {

class CudaRunner final : public Runner {
 public:
  explicit CudaRunner(Stream stream = nullptr, std::int64_t tile_elements = Launch{}.tile_elements,
                      bool cache_table = true)
      : launch_{stream, cache_table ? &table_ : nullptr, tile_elements} {}

  [[nodiscard]] Stream stream() const noexcept { return launch_.stream; }

  Result<void> copy(ConstBuffer src, MutBuffer dst, std::span<const Segment> segments) override;
  Result<void> cast(ConstBuffer src, MutBuffer dst, std::span<const Segment> segments) override;
  Result<void> scale(MutBuffer data, float factor, std::span<const Segment> segments) override;
  Result<void> zero(MutBuffer data, std::span<const Segment> segments) override;
  Result<void> accumulate(ConstBuffer src, MutBuffer dst, float alpha, std::span<const Segment> segments) override;
  Result<void> reduce(std::span<const ConstBuffer> srcs, MutBuffer dst, const ReduceOptions& reduction,
                      std::span<const Segment> segments) override;
  Result<void> quantizeE4m3(ConstBuffer src, MutBuffer dst, MutBuffer scales,
                            std::span<const Segment> segments) override;
  Result<void> dequantizeE4m3(ConstBuffer src, ConstBuffer scales, MutBuffer dst,
                              std::span<const Segment> segments) override;

 private:
  DeviceTable table_;
  Launch launch_;
};

}  // namespace dbuf::kernels::cuda
