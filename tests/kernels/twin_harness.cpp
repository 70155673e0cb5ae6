#include "twin_harness.hpp"

#include <array>
#include <cstring>
#include <random>

namespace dbuf::kernels::twin {
namespace {

constexpr std::array<DType, 3> kFloats{DType::kF32, DType::kBF16, DType::kF16};
/// The dtypes reductions take: the three above, summed in fp32, and fp64.
constexpr std::array<DType, 4> kReduced{DType::kF32, DType::kBF16, DType::kF16, DType::kF64};
/// Segment sizes around the 16-byte unit of every dtype, one past, one
/// short, and several tiles long.
constexpr std::array<std::int64_t, 17> kCounts{0,  1,   3,   7,    8,    15,   16,   17,  31,
                                               33, 100, 257, 1000, 1001, 2048, 4099, 9000};
constexpr std::array<std::int64_t, 5> kBlocks{1, 3, 16, 128, 1000};

std::string name(DType t) {
  return std::string(toString(t));
}

/// Segments of every size in kCounts, each at a fresh place in src, dst and
/// scales. ragged: random gaps (0-5 elements), so most starts are unaligned
/// and src / dst are misaligned against each other; otherwise no gaps and
/// sizes rounded up to 16 elements, so both stay 16-element aligned and the
/// vector paths run.
std::vector<Segment> makeSegments(bool ragged, bool blocked, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::int64_t> gap(0, 5);
  std::vector<Segment> segments;
  std::int64_t src = 0;
  std::int64_t dst = 0;
  std::int64_t scale = 0;
  std::size_t i = 0;
  for (std::int64_t count : kCounts) {
    if (!ragged) count = (count + 15) / 16 * 16;
    Segment s;
    s.count = count;
    s.src_offset = src + (ragged ? gap(rng) : 0);
    s.dst_offset = dst + (ragged ? gap(rng) : 0);
    if (blocked) {
      s.block = kBlocks[i++ % kBlocks.size()];
      s.scale_offset = scale + gap(rng);
      scale = s.scale_offset + (count + s.block - 1) / s.block;
    }
    src = s.src_offset + count;
    dst = s.dst_offset + count;
    segments.push_back(s);
  }
  return segments;
}

void addCalls(std::vector<OpCall>& calls, OpCall call, bool blocked) {
  for (const bool ragged : {true, false}) {
    call.segments = makeSegments(ragged, blocked, static_cast<unsigned>(calls.size()));
    call.name += ragged ? " ragged" : " aligned";
    calls.push_back(call);
    call.name.resize(call.name.size() - (ragged ? 7 : 8));
  }
}

std::int64_t end(const std::vector<Segment>& segments, std::int64_t Segment::*offset) {
  std::int64_t e = 0;
  for (const Segment& s : segments) e = std::max(e, s.*offset + s.count);
  return e;
}

void randomBits(std::vector<unsigned char>& bytes, std::mt19937& rng) {
  for (auto& b : bytes) b = static_cast<unsigned char>(rng());
}

}  // namespace

namespace {

OpCall op(OpKind kind, DType src, DType dst, std::string label, float value = 1.0F) {
  OpCall call;
  call.kind = kind;
  call.src_type = src;
  call.dst_type = dst;
  call.value = value;
  call.name = std::move(label);
  return call;
}

}  // namespace

std::vector<OpCall> allCalls() {
  std::vector<OpCall> calls;
  for (const DType t : {DType::kF32, DType::kBF16, DType::kF8E4M3, DType::kF64}) {
    addCalls(calls, op(OpKind::kCopy, t, t, "copy " + name(t)), false);
    addCalls(calls, op(OpKind::kZero, t, t, "zero " + name(t)), false);
  }
  for (const DType s : kFloats) {
    for (const DType d : kFloats) {
      if (s != d) addCalls(calls, op(OpKind::kCast, s, d, "cast " + name(s) + "->" + name(d)), false);
    }
    addCalls(calls, op(OpKind::kQuantize, s, DType::kF8E4M3, "quantize " + name(s)), true);
    addCalls(calls, op(OpKind::kDequantize, DType::kF8E4M3, s, "dequantize to " + name(s)), true);
  }
  for (const DType s : kReduced) {
    // factor 0: inf * 0 makes the default NaN, which the GPU must match.
    for (const float factor : {0.37F, 0.0F}) {
      addCalls(calls, op(OpKind::kScale, s, s, "scale " + name(s) + " by " + std::to_string(factor), factor), false);
    }
    addCalls(calls, op(OpKind::kAccumulate, s, accumulationDType(s), "accumulate " + name(s), -1.5F), false);
  }
  const std::array<ReduceOptions, 3> reductions{ReduceOptions{}, ReduceOptions{0.5F, 0.25F, false},
                                                ReduceOptions{1.0F, 0.125F, true}};
  for (const DType s : kReduced) {
    for (const DType d : kReduced) {
      if ((s == DType::kF64 || d == DType::kF64) && s != d) continue;  // fp64 reduces into fp64 only
      for (const ReduceOptions& r : reductions) {
        if (r.accumulate && d != accumulationDType(s)) continue;
        for (const int sources : {1, 2, 3, 5}) {
          for (const bool congruent : {true, false}) {
            if (!congruent && sources == 1) continue;
            OpCall call = op(OpKind::kReduce, s, d,
                             "reduce " + std::to_string(sources) + " x " + name(s) + "->" + name(d) +
                                 (r.accumulate ? " accumulate" : (r.factor != 1.0F ? " scaled" : "")) +
                                 (congruent ? "" : " unaligned sources"));
            call.reduction = r;
            call.sources = sources;
            call.congruent = congruent;
            addCalls(calls, call, false);
          }
        }
      }
    }
  }
  return calls;
}

Buffers makeBuffers(const OpCall& call, unsigned seed) {
  std::mt19937 rng(seed);
  Buffers b;
  b.src_elements = end(call.segments, &Segment::src_offset);
  b.dst_elements = std::max(end(call.segments, &Segment::dst_offset), std::int64_t{1});
  for (const Segment& s : call.segments) {
    if (s.block > 0) b.scale_count = std::max(b.scale_count, s.scale_offset + (s.count + s.block - 1) / s.block);
  }
  const auto src_size = static_cast<std::size_t>(sizeBytes(call.src_type));
  for (int r = 0; r < call.sources; ++r) {
    std::vector<unsigned char> bytes(static_cast<std::size_t>(b.src_elements) * src_size + 16);
    randomBits(bytes, rng);
    b.srcs.push_back(std::move(bytes));
    b.src_shift.push_back(call.congruent ? 0 : static_cast<std::size_t>(r) * src_size % 16);
  }
  b.dst.resize(static_cast<std::size_t>(b.dst_elements * sizeBytes(call.dst_type)));
  randomBits(b.dst, rng);
  b.scales.resize(static_cast<std::size_t>(std::max<std::int64_t>(b.scale_count, 1)) * sizeof(float));
  // Dequantize reads the scales: random finite positive ones, like quantize's.
  std::uniform_real_distribution<float> scale(1e-6F, 4.0F);
  for (std::size_t i = 0; i < b.scales.size() / sizeof(float); ++i) {
    const float v = call.kind == OpKind::kDequantize ? scale(rng) : -1.0F;
    std::memcpy(&b.scales[i * sizeof(float)], &v, sizeof v);
  }
  return b;
}

Views viewsOf(const OpCall& call, const Buffers& sizes, const std::vector<void*>& src_bases, void* dst_base,
              void* scales_base) {
  Views v;
  for (std::size_t r = 0; r < src_bases.size(); ++r) {
    v.srcs.push_back(
        {static_cast<unsigned char*>(src_bases[r]) + sizes.src_shift[r], call.src_type, sizes.src_elements});
  }
  v.dst = {dst_base, call.dst_type, sizes.dst_elements};
  v.scales = {scales_base, DType::kF32, sizes.scale_count};
  return v;
}

Result<void> dispatch(const OpCall& call, const Views& v, Runner& runner) {
  switch (call.kind) {
    case OpKind::kCopy:
      return runner.copy(v.srcs[0], v.dst, call.segments);
    case OpKind::kCast:
      return runner.cast(v.srcs[0], v.dst, call.segments);
    case OpKind::kScale:
      return runner.scale(v.dst, call.value, call.segments);
    case OpKind::kZero:
      return runner.zero(v.dst, call.segments);
    case OpKind::kAccumulate:
      return runner.accumulate(v.srcs[0], v.dst, call.value, call.segments);
    case OpKind::kReduce:
      return runner.reduce(v.srcs, v.dst, call.reduction, call.segments);
    case OpKind::kQuantize:
      return runner.quantizeE4m3(v.srcs[0], v.dst, v.scales, call.segments);
    case OpKind::kDequantize:
      return runner.dequantizeE4m3(v.srcs[0], ConstBuffer{v.scales.data, DType::kF32, v.scales.elements}, v.dst,
                                   call.segments);
  }
  return makeError(ErrorCode::kInternal, "unknown op kind");
}

Result<void> runOnHost(const OpCall& call, Buffers& b, Runner& runner) {
  std::vector<void*> srcs;
  for (auto& s : b.srcs) srcs.push_back(s.data());
  return dispatch(call, viewsOf(call, b, srcs, b.dst.data(), b.scales.data()), runner);
}

namespace {

std::string firstDifference(const char* what, const std::vector<unsigned char>& want,
                            const std::vector<unsigned char>& got, std::int64_t element_size) {
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (want[i] == got[i]) continue;
    const auto e = static_cast<std::int64_t>(i) / element_size;
    const auto at = static_cast<std::size_t>(e * element_size);
    std::uint64_t w = 0;
    std::uint64_t g = 0;
    std::memcpy(&w, &want[at], static_cast<std::size_t>(element_size));
    std::memcpy(&g, &got[at], static_cast<std::size_t>(element_size));
    char line[160];
    std::snprintf(line, sizeof line, "%s element %lld: CPU 0x%llx, twin 0x%llx", what, static_cast<long long>(e),
                  static_cast<unsigned long long>(w), static_cast<unsigned long long>(g));
    return line;
  }
  return {};
}

}  // namespace

std::string compareWithCpu(const OpCall& call, const Twin& twin, unsigned seed) {
  Buffers cpu = makeBuffers(call, seed);
  Buffers other = cpu;
  CpuRunner runner(Options{2, call.tile});
  if (auto r = runOnHost(call, cpu, runner); !r) return call.name + ": CPU op failed: " + r.error().message;
  if (auto r = twin(call, other); !r) return call.name + ": twin failed: " + r.error().message;
  if (auto d = firstDifference("dst", cpu.dst, other.dst, sizeBytes(call.dst_type)); !d.empty()) {
    return call.name + ": " + d;
  }
  if (auto d = firstDifference("scale", cpu.scales, other.scales, 4); !d.empty()) return call.name + ": " + d;
  return {};
}

}  // namespace dbuf::kernels::twin
