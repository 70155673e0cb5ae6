#pragma once
// Checks another implementation of the fused ops (the CUDA kernels, or their
// per-thread bodies run by a host emulation) against the CPU ops, bit for
// bit: a list of op calls covering every op and dtype pair on random bit
// patterns (NaN, inf and subnormals included) with odd sizes, unaligned
// offsets, gaps, multi-tile segments and partial fp8 blocks; the harness runs
// the CPU op and the twin on identical copies of the buffers and compares
// every byte of the destination (gaps included) and of the scales.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dbuf/kernels/ops.hpp"
#include "dbuf/kernels/runner.hpp"

namespace dbuf::kernels::twin {

enum class OpKind { kCopy, kCast, kScale, kZero, kAccumulate, kReduce, kQuantize, kDequantize };

struct OpCall {
  OpKind kind = OpKind::kCopy;
  DType src_type = DType::kF32;
  DType dst_type = DType::kF32;  ///< also the dtype of scale / zero's one buffer
  float value = 1.0F;            ///< scale's factor, accumulate's alpha
  ReduceOptions reduction;
  int sources = 1;           ///< reduce
  bool congruent = true;     ///< reduce: sources at the same address mod 16
  std::int64_t tile = 1000;  ///< tile / chunk elements, small so segments span tiles
  std::vector<Segment> segments;
  std::string name;  ///< for failure messages
};

/// Host buffers of one call; srcs has `sources` entries (1 unless reduce).
/// Scales: fp32, used by quantize (output) and dequantize (input).
struct Buffers {
  std::vector<std::vector<unsigned char>> srcs;  ///< 16 bytes of slack each for src_shift
  std::vector<std::size_t> src_shift;            ///< bytes from a source's allocation to its base
  std::vector<unsigned char> dst;
  std::vector<unsigned char> scales;
  std::int64_t src_elements = 0;
  std::int64_t dst_elements = 0;
  std::int64_t scale_count = 0;
};

/// Every call the twins are checked on (several hundred).
std::vector<OpCall> allCalls();

/// Random bit patterns sized for the call (seeded, reproducible).
Buffers makeBuffers(const OpCall& call, unsigned seed);

/// Views of the buffers at the given base pointers (host or device copies).
struct Views {
  std::vector<ConstBuffer> srcs;
  MutBuffer dst;
  MutBuffer scales;
};
Views viewsOf(const OpCall& call, const Buffers& sizes, const std::vector<void*>& src_bases, void* dst_base,
              void* scales_base);

/// Runs `twin` on a copy of fresh buffers and runCpu on another; returns ""
/// when every byte matches, otherwise a description of the first
/// difference (or of an error).
using Twin = std::function<Result<void>(const OpCall&, Buffers&)>;
std::string compareWithCpu(const OpCall& call, const Twin& twin, unsigned seed);

/// Runs the call on views through `runner`.
Result<void> dispatch(const OpCall& call, const Views& views, Runner& runner);

/// Runs the call on host buffers through `runner` (the CPU, or a host
/// emulation of the GPU kernels).
Result<void> runOnHost(const OpCall& call, Buffers& buffers, Runner& runner);

}  // namespace dbuf::kernels::twin
