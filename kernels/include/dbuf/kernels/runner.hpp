#pragma once
/// \file
/// The fused ops behind one interface, so that an algorithm built from them
/// (the daemon's collectives among ranks whose memory it addresses) runs
/// unchanged on the CPU over shared memory or on a GPU over device memory
/// (virtual ranks), and so that tests can hold one implementation against
/// another. Implementations: CpuRunner (here), cuda::CudaRunner
/// (cuda_runner.hpp). Thread safety: one thread at a time per runner.

#include <span>

#include "dbuf/kernels/ops.hpp"

namespace dbuf::kernels {

class Runner {
 public:
  virtual ~Runner() = default;
  Runner() = default;
  Runner(const Runner&) = delete;
  Runner& operator=(const Runner&) = delete;

  [[nodiscard]] virtual Result<void> copy(ConstBuffer src, MutBuffer dst, std::span<const Segment> segments) = 0;
  [[nodiscard]] virtual Result<void> cast(ConstBuffer src, MutBuffer dst, std::span<const Segment> segments) = 0;
  [[nodiscard]] virtual Result<void> scale(MutBuffer data, float factor, std::span<const Segment> segments) = 0;
  [[nodiscard]] virtual Result<void> zero(MutBuffer data, std::span<const Segment> segments) = 0;
  [[nodiscard]] virtual Result<void> accumulate(ConstBuffer src, MutBuffer dst, float alpha,
                                                std::span<const Segment> segments) = 0;
  [[nodiscard]] virtual Result<void> reduce(std::span<const ConstBuffer> srcs, MutBuffer dst,
                                            const ReduceOptions& reduction, std::span<const Segment> segments) = 0;
  [[nodiscard]] virtual Result<void> quantizeE4m3(ConstBuffer src, MutBuffer dst, MutBuffer scales,
                                                  std::span<const Segment> segments) = 0;
  [[nodiscard]] virtual Result<void> dequantizeE4m3(ConstBuffer src, ConstBuffer scales, MutBuffer dst,
                                                    std::span<const Segment> segments) = 0;
};

/// The CPU ops with fixed Options; each call returns when its work is done.
class CpuRunner final : public Runner {
 public:
  explicit CpuRunner(const Options& options = {}) : options_(options) {}

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
  Options options_;
};

}  // namespace dbuf::kernels
