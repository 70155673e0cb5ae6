// Argument checks shared by the CPU ops and the CUDA twins (see
// detail/checks.hpp). Ranges are checked with subtraction so that a huge
// offset or count cannot overflow into a passing check.
#include "dbuf/kernels/detail/checks.hpp"

#include <string>

namespace dbuf::kernels::detail {
namespace {

struct Checks {
  const char* op = "";
  bool has_src = false;
  const void* src = nullptr;
  std::int64_t src_len = 0;
  const void* dst = nullptr;
  std::int64_t dst_len = 0;
  bool blocked = false;  // quantize / dequantize: block > 0, scales in range
  const void* scales = nullptr;
  std::int64_t scales_len = 0;
};

Error bad(const Checks& c, std::size_t index, const std::string& what) {
  return makeError(ErrorCode::kInvalidArgument,
                   std::string("kernels::") + c.op + ": segment " + std::to_string(index) + ": " + what);
}

std::string range(std::int64_t offset, std::int64_t count) {
  return "[" + std::to_string(offset) + ", +" + std::to_string(count) + ")";
}

Result<void> validate(const Checks& c, std::span<const Segment> segments) {
  if (c.src_len < 0 || c.dst_len < 0 || c.scales_len < 0) {
    return makeError(ErrorCode::kInvalidArgument, std::string("kernels::") + c.op + ": negative buffer length");
  }
  bool any = false;
  for (std::size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    if (s.count < 0) return bad(c, i, "negative count " + std::to_string(s.count));
    if (s.dst_offset < 0 || s.dst_offset > c.dst_len - s.count) {
      return bad(c, i,
                 "destination " + range(s.dst_offset, s.count) + " outside the buffer of " + std::to_string(c.dst_len) +
                     " elements");
    }
    if (c.has_src && (s.src_offset < 0 || s.src_offset > c.src_len - s.count)) {
      return bad(c, i,
                 "source " + range(s.src_offset, s.count) + " outside the buffer of " + std::to_string(c.src_len) +
                     " elements");
    }
    if (c.blocked) {
      if (s.block <= 0) return bad(c, i, "block must be > 0, got " + std::to_string(s.block));
      const std::int64_t blocks = s.count / s.block + (s.count % s.block != 0 ? 1 : 0);
      if (s.scale_offset < 0 || s.scale_offset > c.scales_len - blocks) {
        return bad(c, i,
                   "scales " + range(s.scale_offset, blocks) + " outside the buffer of " +
                       std::to_string(c.scales_len) + " scales");
      }
    }
    any = any || s.count > 0;
  }
  if (any && (c.dst == nullptr || (c.has_src && c.src == nullptr) || (c.blocked && c.scales == nullptr))) {
    return makeError(ErrorCode::kInvalidArgument, std::string("kernels::") + c.op + ": null buffer");
  }
  return {};
}

Error badType(const char* op, const std::string& what) {
  return makeError(ErrorCode::kInvalidArgument, std::string("kernels::") + op + ": " + what);
}

}  // namespace

Result<void> checkCopy(ConstBuffer src, MutBuffer dst, std::span<const Segment> segments) {
  if (src.dtype != dst.dtype) return badType("copy", "source and destination dtypes differ (use cast)");
  return validate({"copy", true, src.data, src.elements, dst.data, dst.elements}, segments);
}

Result<void> checkCast(ConstBuffer src, MutBuffer dst, std::span<const Segment> segments) {
  // One dtype on both sides is a copy, whatever the dtype: a gather-only group's all-gather casts that way.
  if (src.dtype != dst.dtype && (!isComputeDType(src.dtype) || !isComputeDType(dst.dtype))) {
    return badType("cast", std::string("unsupported ") + std::string(toString(src.dtype)) + " -> " +
                               std::string(toString(dst.dtype)) + " (fp32, bf16, fp16 only)");
  }
  return validate({src.dtype == dst.dtype ? "copy" : "cast", true, src.data, src.elements, dst.data, dst.elements},
                  segments);
}

Result<void> checkScale(MutBuffer data, std::span<const Segment> segments) {
  if (!isReducedDType(data.dtype)) return badType("scale", "dtype must be fp32, bf16, fp16 or fp64");
  return validate({"scale", false, nullptr, 0, data.data, data.elements}, segments);
}

Result<void> checkZero(MutBuffer data, std::span<const Segment> segments) {
  return validate({"zero", false, nullptr, 0, data.data, data.elements}, segments);
}

Result<void> checkAccumulate(ConstBuffer src, MutBuffer dst, std::span<const Segment> segments) {
  if (!isReducedDType(src.dtype) || dst.dtype != accumulationDType(src.dtype)) {
    return badType("accumulate", "source must be fp32, bf16 or fp16 and destination fp32, or both fp64");
  }
  return validate({"accumulate", true, src.data, src.elements, dst.data, dst.elements}, segments);
}

Result<void> checkReduce(std::span<const ConstBuffer> srcs, MutBuffer dst, const ReduceOptions& reduction,
                         std::span<const Segment> segments) {
  if (srcs.empty() || srcs.size() > kMaxReduceSources) {
    return badType("reduce",
                   "needs 1 to " + std::to_string(kMaxReduceSources) + " sources, got " + std::to_string(srcs.size()));
  }
  const DType src_type = srcs[0].dtype;
  for (std::size_t r = 0; r < srcs.size(); ++r) {
    if (srcs[r].dtype != src_type) return badType("reduce", "source " + std::to_string(r) + " has another dtype");
    if (srcs[r].elements < 0) return badType("reduce", "source " + std::to_string(r) + ": negative buffer length");
  }
  const bool fp64 = src_type == DType::kF64 || dst.dtype == DType::kF64;
  if (fp64 ? src_type != dst.dtype : !isComputeDType(src_type) || !isComputeDType(dst.dtype)) {
    return badType("reduce", "sources and destination must be fp32, bf16 or fp16, or all fp64");
  }
  if (reduction.accumulate && dst.dtype != accumulationDType(src_type)) {
    return badType("reduce", "accumulate needs an fp32 destination (fp64 for fp64 sources)");
  }
  // The destination, then the sources against the shortest one (which
  // covers them all); nulls last, as only non-empty tables need buffers.
  if (auto r = validate({"reduce", false, nullptr, 0, dst.data, dst.elements}, segments); !r) return r;
  std::size_t shortest = 0;
  for (std::size_t r = 1; r < srcs.size(); ++r) {
    if (srcs[r].elements < srcs[shortest].elements) shortest = r;
  }
  const std::int64_t src_len = srcs[shortest].elements;
  bool any = false;
  for (std::size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    if (s.src_offset < 0 || s.src_offset > src_len - s.count) {
      return makeError(ErrorCode::kInvalidArgument, "kernels::reduce: segment " + std::to_string(i) + ": source " +
                                                        std::to_string(shortest) + " " + range(s.src_offset, s.count) +
                                                        " outside the buffer of " + std::to_string(src_len) +
                                                        " elements");
    }
    any = any || s.count > 0;
  }
  if (any) {
    for (std::size_t r = 0; r < srcs.size(); ++r) {
      if (srcs[r].data == nullptr) return badType("reduce", "source " + std::to_string(r) + ": null buffer");
    }
  }
  return {};
}

Result<void> checkQuantize(ConstBuffer src, MutBuffer dst, MutBuffer scales, std::span<const Segment> segments) {
  if (!isComputeDType(src.dtype) || dst.dtype != DType::kF8E4M3 || scales.dtype != DType::kF32) {
    return badType("quantizeE4m3", "source must be fp32, bf16 or fp16, destination fp8_e4m3, scales fp32");
  }
  return validate(
      {"quantizeE4m3", true, src.data, src.elements, dst.data, dst.elements, true, scales.data, scales.elements},
      segments);
}

Result<void> checkDequantize(ConstBuffer src, ConstBuffer scales, MutBuffer dst, std::span<const Segment> segments) {
  if (src.dtype != DType::kF8E4M3 || scales.dtype != DType::kF32 || !isComputeDType(dst.dtype)) {
    return badType("dequantizeE4m3", "source must be fp8_e4m3, scales fp32, destination fp32, bf16 or fp16");
  }
  return validate(
      {"dequantizeE4m3", true, src.data, src.elements, dst.data, dst.elements, true, scales.data, scales.elements},
      segments);
}

}  // namespace dbuf::kernels::detail
