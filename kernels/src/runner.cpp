#include "dbuf/kernels/runner.hpp"

namespace dbuf::kernels {

Result<void> CpuRunner::copy(ConstBuffer src, MutBuffer dst, std::span<const Segment> segments) {
  return kernels::copy(src, dst, segments, options_);
}
Result<void> CpuRunner::cast(ConstBuffer src, MutBuffer dst, std::span<const Segment> segments) {
  return kernels::cast(src, dst, segments, options_);
}
Result<void> CpuRunner::scale(MutBuffer data, float factor, std::span<const Segment> segments) {
  return kernels::scale(data, factor, segments, options_);
}
Result<void> CpuRunner::zero(MutBuffer data, std::span<const Segment> segments) {
  return kernels::zero(data, segments, options_);
}
Result<void> CpuRunner::accumulate(ConstBuffer src, MutBuffer dst, float alpha, std::span<const Segment> segments) {
  return kernels::accumulate(src, dst, alpha, segments, options_);
}
Result<void> CpuRunner::reduce(std::span<const ConstBuffer> srcs, MutBuffer dst, const ReduceOptions& reduction,
                               std::span<const Segment> segments) {
  return kernels::reduce(srcs, dst, reduction, segments, options_);
}
Result<void> CpuRunner::quantizeE4m3(ConstBuffer src, MutBuffer dst, MutBuffer scales,
                                     std::span<const Segment> segments) {
  return kernels::quantizeE4m3(src, dst, scales, segments, options_);
}
Result<void> CpuRunner::dequantizeE4m3(ConstBuffer src, ConstBuffer scales, MutBuffer dst,
                                       std::span<const Segment> segments) {
  return kernels::dequantizeE4m3(src, scales, dst, segments, options_);
}

}  // namespace dbuf::kernels
