#pragma once
/// \file
/// Argument checks of the fused ops, shared by the CPU ops and their CUDA
/// twins so both refuse the same calls with the same messages. Each returns
/// an Error (kInvalidArgument) naming the op and, for a bad segment, its
/// index; nothing is touched. Pure functions; thread-safe.

#include <span>

#include "dbuf/kernels/ops.hpp"

namespace dbuf::kernels::detail {

[[nodiscard]] Result<void> checkCopy(ConstBuffer src, MutBuffer dst, std::span<const Segment> segments);
/// Also accepts src.dtype == dst.dtype, any dtype (a cast that is a copy).
[[nodiscard]] Result<void> checkCast(ConstBuffer src, MutBuffer dst, std::span<const Segment> segments);
[[nodiscard]] Result<void> checkScale(MutBuffer data, std::span<const Segment> segments);
[[nodiscard]] Result<void> checkZero(MutBuffer data, std::span<const Segment> segments);
[[nodiscard]] Result<void> checkAccumulate(ConstBuffer src, MutBuffer dst, std::span<const Segment> segments);
[[nodiscard]] Result<void> checkReduce(std::span<const ConstBuffer> srcs, MutBuffer dst, const ReduceOptions& reduction,
                                       std::span<const Segment> segments);
[[nodiscard]] Result<void> checkQuantize(ConstBuffer src, MutBuffer dst, MutBuffer scales,
                                         std::span<const Segment> segments);
[[nodiscard]] Result<void> checkDequantize(ConstBuffer src, ConstBuffer scales, MutBuffer dst,
                                           std::span<const Segment> segments);

}  // namespace dbuf::kernels::detail
