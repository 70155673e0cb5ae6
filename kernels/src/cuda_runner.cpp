#include "dbuf/kernels/cuda_runner.hpp"

namespace dbuf::kernels::cuda {

Result<void> CudaRunner::copy(ConstBuffer src, MutBuffer dst, std::span<const Segment> segments) {
  return cuda::copy(src, dst, segments, launch_);
}
Result<void> CudaRunner::cast(ConstBuffer src, MutBuffer dst, std::span<const Segment> segments) {
  return cuda::cast(src, dst, segments, launch_);
}
Result<void> CudaRunner::scale(MutBuffer data, float factor, std::span<const Segment> segments) {
  return cuda::scale(data, factor, segments, launch_);
}
Result<void> CudaRunner::zero(MutBuffer data, std::span<const Segment> segments) {
  return cuda::zero(data, segments, launch_);
}
Result<void> CudaRunner::accumulate(ConstBuffer src, MutBuffer dst, float alpha, std::span<const Segment> segments) {
  return cuda::accumulate(src, dst, alpha, segments, launch_);
}
Result<void> CudaRunner::reduce(std::span<const ConstBuffer> srcs, MutBuffer dst, const ReduceOptions& reduction,
                                std::span<const Segment> segments) {
  return cuda::reduce(srcs, dst, reduction, segments, launch_);
}
Result<void> CudaRunner::quantizeE4m3(ConstBuffer src, MutBuffer dst, MutBuffer scales,
                                      std::span<const Segment> segments) {
  return cuda::quantizeE4m3(src, dst, scales, segments, launch_);
}
Result<void> CudaRunner::dequantizeE4m3(ConstBuffer src, ConstBuffer scales, MutBuffer dst,
                                        std::span<const Segment> segments) {
  return cuda::dequantizeE4m3(src, scales, dst, segments, launch_);
}

}  // namespace dbuf::kernels::cuda
