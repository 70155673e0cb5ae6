// coll-rank: a test-only trainer process for tests/collectives. It attaches to
// a real dbufd as one rank of a job, runs a scenario of collectives through
// libdbuf and checks every result element by element against the reference
// (reference.hpp), which it computes in-process for every rank (inputs are a
// pure function of seed, rank, tensor and element).
//
//   coll-rank --socket PATH --job JOB --rank R --world W --scenario NAME
//             [--shape NAME] [--seed N] [--out FILE] [--timeout-ms MS] [--device GPU]
//             [--local-world L --store STORE]
//
// --local-world L: a job across nodes of L ranks each (rank r on node r / L),
// its daemons meeting in STORE; the reference then sums node by node
// (GroupSim::setNodes).
//
// Scenarios:
//   ops    every op (all-gather, reduce-scatter sum/avg with and without
//          pre/post scales and accumulate, all-reduce sum/avg, broadcast from
//          a non-zero root (then the other roots, 0 too), barrier), sync and
//          async, on one group per dtype pair (fp32 -> fp32/bf16/fp16/fp8_e4m3,
//          bf16 -> bf16/fp8_e4m3/fp32, fp16 -> fp16/bf16, fp64 -> fp64, reduced
//          in fp64), tensors of --shape (element, rows, block, mixed, tiny,
//          medium)
//   fp8    all-gather into fp8 e4m3 of block-aligned shards == one
//          kernels::quantizeE4m3 over the full tensors, bitwise (data, scales)
//   train  kTrainWorld ranks, kTrainSteps SGD steps on fp32 master shards
//          gathered as bf16; writes the final master shard to --out
//   large  shards larger than one daemon step (LocalCollective::kStepElements)
//
// Everything goes to stderr. Exit status: 0 all checks passed, 1 a mismatch
// (the first per buffer and tensor is described, with the number of
// mismatching elements), 2 a libdbuf call failed or bad arguments.
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#if defined(DBUF_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

#include "dbuf/client.hpp"
#include "dbuf/kernels/convert.hpp"
#include "dbuf/kernels/ops.hpp"
#include "dbuf/planner/unit_plan.hpp"
#include "reference.hpp"

namespace {

using dbuf::Client;
using dbuf::DType;
using dbuf::Group;
using dbuf::GroupSpec;
using dbuf::OpHandle;
using dbuf::ReduceMode;
using dbuf::ReduceOptions;
using dbuf::TensorView;
using dbuf::coll::GroupSim;
using dbuf::coll::hashKey;
using dbuf::coll::Stream;

struct Args {
  std::string socket;
  std::string job;
  std::uint32_t rank = 0;
  std::uint32_t world = 1;
  std::string scenario;
  std::string shape = "rows";
  std::uint64_t seed = 1;
  std::string out;
  std::chrono::milliseconds timeout{20000};
  std::int32_t device = -1;  ///< the GPU to attach on (a dbufd with the cuda backend); -1: host memory
  std::uint32_t local_world = 0;  ///< ranks per node of a job across nodes; 0: one node
  std::string store;
};

Args g_args;
int g_mismatches = 0;   // checks that found a difference
int g_reported = 0;     // mismatch lines printed (capped)
int g_checks = 0;       // buffers compared
int g_collectives = 0;  // collectives completed
constexpr int kMaxReports = 40;
std::set<std::string> g_seen;  // mismatches described so far
std::string g_first_context;   // where the first one was

void say(const char* format, ...) __attribute__((format(printf, 1, 2)));
void say(const char* format, ...) {
  char text[2048];
  va_list list;
  va_start(list, format);
  std::vsnprintf(text, sizeof text, format, list);
  va_end(list);
  std::fprintf(stderr, "[rank %u/%u %s] %s\n", g_args.rank, g_args.world, g_args.scenario.c_str(), text);
  std::fflush(stderr);
}

[[noreturn]] void fatal(const std::string& what, const dbuf::Error& error) {
  say("FATAL %s: %s: %s", what.c_str(), std::string(dbuf::toString(error.code)).c_str(), error.message.c_str());
  std::exit(2);
}

void must(const dbuf::Result<void>& result, const std::string& what) {
  if (!result) fatal(what, result.error());
}
template <typename T>
T must(dbuf::Result<T> result, const std::string& what) {
  if (!result) fatal(what, result.error());
  return std::move(*result);
}

std::string dtypeName(DType dtype) {
  return std::string(dbuf::toString(dtype));
}

std::string describe(const ReduceOptions& r) {
  char text[160];
  std::snprintf(text, sizeof text, "%s, pre %g, post %g%s", r.mode == ReduceMode::kAvg ? "avg" : "sum",
                static_cast<double>(r.pre_scale), static_cast<double>(r.post_scale),
                r.accumulate ? ", accumulate" : "");
  return text;
}

// ----------------------------------------------------------------- memory

/// Bytes of the group's memory where this process's CPU can touch them. Host
/// memory: the memory itself. GPU memory (--device): a host copy read now,
/// and store() writes it back and waits for the copy to land (ordering with
/// dbufd is host-synchronous: the next op is submitted after store()).
class HostBytes {
 public:
  HostBytes(const std::byte* base, std::int64_t bytes) {
    auto* memory = const_cast<std::byte*>(base);  // NOLINT(cppcoreguidelines-pro-type-const-cast): libdbuf's views
    if (g_args.device < 0) {
      host_ = memory;
      return;
    }
    device_ = memory;
    copy_.resize(static_cast<std::size_t>(bytes));
    cuda(copy_.empty() ? 0 : copyToHost(), "cudaMemcpy from the GPU");
  }
  explicit HostBytes(const TensorView& view) : HostBytes(view.base, view.numel() * dbuf::sizeBytes(view.dtype)) {}
  explicit HostBytes(std::span<const float> values)
      : HostBytes(reinterpret_cast<const std::byte*>(values.data()), static_cast<std::int64_t>(values.size_bytes())) {}

  [[nodiscard]] std::byte* data() noexcept { return device_ != nullptr ? copy_.data() : host_; }
  template <typename T>
  [[nodiscard]] T* as() noexcept {
    return reinterpret_cast<T*>(data());
  }
  void store() {
    if (device_ != nullptr && !copy_.empty()) cuda(copyToDevice(), "cudaMemcpy to the GPU");
  }

 private:
#if defined(DBUF_WITH_CUDA)
  int copyToHost() {
    return cudaMemcpy(copy_.data(), device_, copy_.size(), cudaMemcpyDeviceToHost);
  }
  int copyToDevice() {
    // From pageable memory cudaMemcpy may return before the copy has landed.
    const cudaError_t copied = cudaMemcpy(device_, copy_.data(), copy_.size(), cudaMemcpyHostToDevice);
    return copied != cudaSuccess ? copied : cudaDeviceSynchronize();
  }
  static void cuda(int status, const char* what) {
    if (status == 0) return;
    say("FATAL %s: %s", what, cudaGetErrorString(static_cast<cudaError_t>(status)));
    std::exit(2);
  }
#else
  static int copyToHost() {
    return 1;
  }
  static int copyToDevice() {
    return 1;
  }
  static void cuda(int status, const char* what) {
    if (status == 0) return;
    say("FATAL %s: coll-rank was built without CUDA", what);
    std::exit(2);
  }
#endif

  std::byte* host_ = nullptr;
  std::byte* device_ = nullptr;
  std::vector<std::byte> copy_;
};

// ----------------------------------------------------------------- groups

struct Shape {
  std::string granularity;
  std::vector<dbuf::TensorSpec> tensors;
  std::uint32_t align_bytes = 16;
};

Shape shapeNamed(const std::string& name) {
  if (name == "element") {
    return {"element",
            {{"w1", {13, 37}, "", -1},
             {"b1", {37}, "", -1},
             {"w2", {29, 11}, "", -1},
             {"emb", {7, 5, 3}, "", -1},
             {"b2", {5}, "", -1},
             {"one", {1}, "", -1}}};
  }
  if (name == "rows") {
    // 17 % 3 != 0: a 2-D tensor with a short last band; 3-D with whole bands.
    return {"rows:3",
            {{"w1", {17, 23}, "", -1},
             {"b1", {23}, "", -1},
             {"w2", {12, 9}, "", -1},
             {"w3", {4, 6, 5}, "", -1},
             {"b2", {7}, "", -1}}};
  }
  if (name == "block") {
    return {"block:4x8",
            {{"w1", {22, 40}, "", -1},
             {"w2", {9, 17}, "", -1},
             {"b1", {33}, "", -1},
             {"w3", {3, 8, 5}, "", -1},
             {"b2", {6}, "", -1}}};
  }
  if (name == "mixed") {
    // Per-tensor rules over a group default; 64-byte alignment.
    return {"rows:2",
            {{"w1", {15, 21}, "", -1},
             {"b1", {21}, "", -1},
             {"e", {10, 3}, "6", -1},
             {"m", {5, 7}, "matrix", -1},
             {"w2", {8, 9}, "block:4x3", -1},
             {"bias", {11}, "element", -1},
             {"w3", {13, 5}, "rows:5", -1}},
            64};
  }
  if (name == "medium") {
    // Large enough that the kernels split their calls across threads
    // (more than two 64Ki-element chunks per call).
    return {"rows:7", {{"w", {517, 613}, "", -1}, {"b", {613}, "", -1}, {"w2", {64, 1031}, "block:16x32", -1}}};
  }
  if (name == "tiny") {
    // Fewer elements than ranks times the alignment: most ranks hold nothing.
    return {"element", {{"a", {3}, "", -1}, {"b", {2, 2}, "", -1}}};
  }
  // fp8 scenario: shapes whose blocks differ in size; every shard is
  // block-aligned by construction of RaggedShard.
  if (name == "fp8-rows") {
    return {"rows:4",
            {{"w1", {32, 24}, "", -1}, {"w2", {20, 9}, "", -1}, {"b", {64}, "", -1}, {"w3", {2, 8, 6}, "", -1}}};
  }
  if (name == "fp8-block") {
    return {"block:8x16", {{"w", {40, 33}, "", -1}, {"w2", {17, 48}, "", -1}, {"b", {50}, "", -1}}};
  }
  if (name == "fp8-mixed") {
    return {"rows:3",
            {{"e", {6, 10}, "12", -1},
             {"m", {5, 13}, "matrix", -1},
             {"b", {7}, "element", -1},
             {"w", {14, 11}, "", -1},
             {"w2", {9, 16}, "block:2x4", -1}}};
  }
  say("unknown shape '%s'", name.c_str());
  std::exit(2);
}

struct Pair {
  DType sharded;
  DType unsharded;
};

/// One registered group with its simulator.
struct TestGroup {
  std::uint64_t index = 0;  // in the hash keys
  std::string label;
  Group group;
  GroupSim sim;
};

TestGroup registerGroup(Client& client, std::uint64_t index, const std::string& name, const Shape& shape, Pair pair) {
  GroupSpec spec;
  spec.name = name;
  spec.tensors = shape.tensors;
  spec.granularity = shape.granularity;
  spec.sharded_dtype = pair.sharded;
  spec.unsharded_dtype = pair.unsharded;
  spec.align_bytes = shape.align_bytes;
  Group group = must(client.registerGroup(spec, g_args.timeout), "registerGroup " + name);
  GroupSim sim(group.plan(), pair.sharded, pair.unsharded);
  if (g_args.local_world != 0) {
    std::vector<std::uint32_t> first_ranks;
    for (std::uint32_t r = 0; r < g_args.world; r += g_args.local_world) first_ranks.push_back(r);
    first_ranks.push_back(g_args.world);
    sim.setNodes(std::move(first_ranks));
  }
  const std::string label = name + " (" + dtypeName(pair.sharded) + " -> " + dtypeName(pair.unsharded) + ")";
  return TestGroup{index, label, std::move(group), std::move(sim)};
}

// ----------------------------------------------------------------- writes

TensorView shardView(const TestGroup& g, std::size_t t, bool grad) {
  TensorView view = grad ? g.group.shardGradView(t) : g.group.shardView(t);
  const auto slice = dbuf::planner::sliceOnRank(g.group.plan().tensors[t], g.group.plan().shard_elems, g_args.rank);
  const std::int64_t begin = slice ? slice->begin : 0;
  const std::int64_t end = slice ? slice->end : 0;
  if (view.dtype != g.sim.sharded() || view.begin != begin || view.end != end ||
      (end > begin && view.base == nullptr)) {
    say("FATAL %s: shard%sView(%zu) covers [%" PRId64 ", %" PRId64 ") dtype %s, expected [%" PRId64 ", %" PRId64
        ") dtype %s",
        g.label.c_str(), grad ? "Grad" : "", t, view.begin, view.end, dtypeName(view.dtype).c_str(), begin, end,
        dtypeName(g.sim.sharded()).c_str());
    std::exit(2);
  }
  return view;
}

TensorView slotView(const TestGroup& g, std::size_t t, bool grad) {
  TensorView view = must(grad ? g.group.unshardedGradView(t) : g.group.unshardedView(t),
                         g.label + (grad ? ": unshardedGradView" : ": unshardedView"));
  const DType expected = grad ? g.sim.grad() : g.sim.unsharded();
  const dbuf::PlacedTensor& tensor = g.group.plan().tensors[t];
  if (view.dtype != expected || view.begin != 0 || view.end != tensor.numel || view.base == nullptr) {
    say("FATAL %s: unsharded%sView(%zu) has dtype %s and [%" PRId64 ", %" PRId64 "), expected %s and [0, %" PRId64 ")",
        g.label.c_str(), grad ? "Grad" : "", t, dtypeName(view.dtype).c_str(), view.begin, view.end,
        dtypeName(expected).c_str(), tensor.numel);
    std::exit(2);
  }
  return view;
}

using ValueFn = float (*)(std::uint64_t hash, std::int64_t element, const dbuf::PlacedTensor& tensor);

float paramFn(std::uint64_t hash, std::int64_t /*element*/, const dbuf::PlacedTensor& /*tensor*/) {
  return dbuf::coll::paramValue(hash);
}
float blockFn(std::uint64_t hash, std::int64_t element, const dbuf::PlacedTensor& tensor) {
  return dbuf::coll::blockScaledValue(hash, element / tensor.granularity);
}

/// Hashes of the elements of one tensor in one stream (one splitmix round
/// per element; equal to hashKey with the same fields).
class Keys {
 public:
  Keys(const TestGroup& g, Stream stream, std::uint64_t round, std::uint32_t rank, std::size_t t)
      : prefix_(dbuf::coll::hashPrefix(g_args.seed, stream, round, rank, g.index, t)) {}
  std::uint64_t operator()(std::int64_t e) const noexcept {
    return dbuf::coll::hashElement(prefix_, static_cast<std::uint64_t>(e));
  }

 private:
  std::uint64_t prefix_;
};

/// Master shards: this rank writes its part through shardView; the simulator
/// gets every rank's.
void writeShards(TestGroup& g, std::uint64_t round, ValueFn fn = paramFn) {
  const auto& tensors = g.group.plan().tensors;
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const Keys key(g, Stream::kShard, round, 0, t);
    const TensorView view = shardView(g, t, false);
    HostBytes host(view);
    const auto value = [&](std::int64_t e) {
      const std::uint64_t hash = key(e);
      return dbuf::coll::elementValue(view.dtype, fn(hash, e, tensors[t]), hash);
    };
    for (std::int64_t i = 0; i < view.numel(); ++i) {
      dbuf::coll::storeDouble(view.dtype, host.data(), i, value(view.begin + i));
    }
    host.store();
    for (std::int64_t e = 0; e < tensors[t].numel; ++e) g.sim.setShard(tensors[t].offset + e, value(e));
  }
}

/// Initial sharded gradients (for accumulate).
void writeShardGrads(TestGroup& g, std::uint64_t round) {
  const auto& tensors = g.group.plan().tensors;
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const Keys key(g, Stream::kShardGrad, round, 0, t);
    const TensorView view = shardView(g, t, true);
    HostBytes host(view);
    const auto value = [&](std::int64_t e) {
      const std::uint64_t hash = key(e);
      return dbuf::coll::elementValue(view.dtype, dbuf::coll::moderateValue(hash), hash);
    };
    for (std::int64_t i = 0; i < view.numel(); ++i) {
      dbuf::coll::storeDouble(view.dtype, host.data(), i, value(view.begin + i));
    }
    host.store();
    for (std::int64_t e = 0; e < tensors[t].numel; ++e) g.sim.setShardGrad(tensors[t].offset + e, value(e));
  }
  g.sim.markShardGradKnown();
}

/// Every rank writes its own whole unsharded gradient.
void writeGrads(TestGroup& g, std::uint64_t round) {
  const auto& tensors = g.group.plan().tensors;
  const DType grad = g.sim.grad();
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const TensorView view = slotView(g, t, true);
    const Keys mine(g, Stream::kGrad, round, g_args.rank, t);
    HostBytes host(view);
    const auto value = [grad](const Keys& key, std::int64_t e) {
      const std::uint64_t hash = key(e);
      return dbuf::coll::elementValue(grad, dbuf::coll::gradValue(hash, grad), hash);
    };
    for (std::int64_t e = 0; e < view.numel(); ++e) dbuf::coll::storeDouble(view.dtype, host.data(), e, value(mine, e));
    host.store();
    for (std::uint32_t r = 0; r < g.sim.world(); ++r) {
      const Keys key(g, Stream::kGrad, round, r, t);
      for (std::int64_t e = 0; e < tensors[t].numel; ++e) g.sim.setGrad(r, tensors[t].offset + e, value(key, e));
    }
  }
  for (std::uint32_t r = 0; r < g.sim.world(); ++r) g.sim.markGradsKnown(r);
}

std::uint64_t paramBits(const TestGroup& g, std::uint64_t hash) {
  if (g.sim.quantized()) return hash & 0xffU;
  const DType dtype = g.sim.unsharded();
  std::byte bits[8] = {};
  dbuf::coll::storeDouble(dtype, bits, 0, dbuf::coll::elementValue(dtype, dbuf::coll::paramValue(hash), hash));
  return dbuf::coll::elementBits64(dtype, bits, 0);
}

float scaleFor(const TestGroup& g, std::uint64_t round, std::uint32_t rank, std::int64_t block) {
  return std::fabs(dbuf::coll::moderateValue(
      hashKey(g_args.seed, Stream::kScales, round, rank, g.index, 0, static_cast<std::uint64_t>(block))));
}

/// Every rank writes its own, different unsharded params (and fp8 scales):
/// the source of a broadcast.
void writeParams(TestGroup& g, std::uint64_t round) {
  const auto& tensors = g.group.plan().tensors;
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const TensorView view = slotView(g, t, false);
    const Keys mine(g, Stream::kParams, round, g_args.rank, t);
    HostBytes host(view);
    for (std::int64_t e = 0; e < view.numel(); ++e)
      dbuf::coll::setElementBits(view.dtype, host.data(), e, paramBits(g, mine(e)));
    host.store();
    for (std::uint32_t r = 0; r < g.sim.world(); ++r) {
      const Keys key(g, Stream::kParams, round, r, t);
      for (std::int64_t e = 0; e < tensors[t].numel; ++e)
        g.sim.setParamBits(r, tensors[t].offset + e, paramBits(g, key(e)));
    }
  }
  if (g.sim.quantized()) {
    // libdbuf exposes the scales read-only; a trainer that produced its own
    // fp8 parameters writes them through the same mapping.
    const std::span<const float> scales = g.group.unshardedScales();
    if (static_cast<std::int64_t>(scales.size()) != g.sim.totalBlocks()) {
      say("FATAL %s: unshardedScales() has %zu scales, expected %" PRId64, g.label.c_str(), scales.size(),
          g.sim.totalBlocks());
      std::exit(2);
    }
    HostBytes writable(scales);
    for (std::int64_t b = 0; b < g.sim.totalBlocks(); ++b) {
      writable.as<float>()[b] = scaleFor(g, round, g_args.rank, b);
      for (std::uint32_t r = 0; r < g.sim.world(); ++r) g.sim.setScale(r, b, scaleFor(g, round, r, b));
    }
    writable.store();
  }
  for (std::uint32_t r = 0; r < g.sim.world(); ++r) g.sim.markParamsKnown(r);
}

// ----------------------------------------------------------------- checks

/// Compares n elements bitwise; reports the first difference and the count.
/// Element i is element first_element + i of the tensor, or with `scales`
/// its block first_element + i, whose scale index is scale_base + that.
void compare(const std::string& context, const std::string& buffer, const dbuf::PlacedTensor& tensor, std::size_t t,
             DType dtype, const std::byte* actual, const std::byte* expected, std::int64_t first_element,
             std::int64_t n, std::optional<std::int64_t> scale_base = std::nullopt) {
  ++g_checks;
  if (n <= 0 || std::memcmp(actual, expected, static_cast<std::size_t>(n * dbuf::sizeBytes(dtype))) == 0) return;
  std::int64_t bad = 0;
  std::int64_t first_bad = -1;
  for (std::int64_t i = 0; i < n; ++i) {
    if (dbuf::coll::elementBits64(dtype, actual, i) != dbuf::coll::elementBits64(dtype, expected, i)) {
      if (first_bad < 0) first_bad = i;
      ++bad;
    }
  }
  if (bad == 0) return;
  ++g_mismatches;
  // The same difference seen again by a later check (a buffer the later op
  // did not touch) is counted, not described again.
  const std::int64_t at = first_element + first_bad;
  const std::string signature = buffer + "|" + tensor.name + "|" + std::to_string(at) + "|" + std::to_string(bad) +
                                "|" + std::to_string(dbuf::coll::elementBits64(dtype, actual, first_bad));
  if (!g_seen.insert(signature).second) return;
  if (g_reported++ >= kMaxReports) return;
  if (g_first_context.empty()) g_first_context = context;
  char where[96];
  if (scale_base) {
    std::snprintf(where, sizeof where, "block %" PRId64 " (scale index %" PRId64 ")", at, *scale_base + at);
  } else {
    std::snprintf(where, sizeof where, "element %" PRId64 " (global offset %" PRId64 ")", at, tensor.offset + at);
  }
  say("MISMATCH %s: %s of tensor '%s' (#%zu, %s): %s: expected %s, actual %s; %" PRId64 " of %" PRId64 " %s differ%s",
      context.c_str(), buffer.c_str(), tensor.name.c_str(), t, dtypeName(dtype).c_str(), where,
      dbuf::coll::showBits(dtype, dbuf::coll::elementBits64(dtype, expected, first_bad)).c_str(),
      dbuf::coll::showBits(dtype, dbuf::coll::elementBits64(dtype, actual, first_bad)).c_str(), bad, n,
      scale_base ? "blocks" : "elements",
      context == g_first_context ? "" : (" (may follow from the first mismatch, " + g_first_context + ")").c_str());
}

/// Everything this rank can see of the group against the simulator.
void check(const TestGroup& g, const std::string& after) {
  const std::string context = g.label + " after " + after;
  const std::uint32_t rank = g_args.rank;
  const auto& tensors = g.group.plan().tensors;
  const DType sharded = g.sim.sharded();
  const auto element = [](DType dtype, std::int64_t global) {
    return static_cast<std::size_t>(global * dbuf::sizeBytes(dtype));
  };
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const dbuf::PlacedTensor& tensor = tensors[t];
    const TensorView shard = shardView(g, t, false);
    compare(context, "master shard", tensor, t, sharded, HostBytes(shard).data(),
            g.sim.shard() + element(sharded, tensor.offset + shard.begin), shard.begin, shard.numel());
    if (g.sim.shardGradKnown()) {
      const TensorView grad = shardView(g, t, true);
      compare(context, "sharded gradient", tensor, t, sharded, HostBytes(grad).data(),
              g.sim.shardGrad() + element(sharded, tensor.offset + grad.begin), grad.begin, grad.numel());
    }
    if (!g.group.unsharded()) continue;
    if (g.sim.paramsKnown(rank)) {
      const TensorView params = slotView(g, t, false);
      compare(context, "unsharded params", tensor, t, g.sim.unsharded(), HostBytes(params).data(),
              g.sim.params(rank) + element(g.sim.unsharded(), tensor.offset), 0, tensor.numel);
    }
    if (g.sim.gradsKnown(rank)) {
      const TensorView grads = slotView(g, t, true);
      compare(context, "unsharded grads", tensor, t, g.sim.grad(), HostBytes(grads).data(),
              g.sim.grads(rank) + element(g.sim.grad(), tensor.offset), 0, tensor.numel);
    }
  }
  if (g.sim.quantized() && g.group.unsharded() && g.sim.paramsKnown(rank)) {
    const std::span<const float> scales = g.group.unshardedScales();
    if (static_cast<std::int64_t>(scales.size()) != g.sim.totalBlocks()) {
      ++g_mismatches;
      say("MISMATCH %s: unshardedScales() has %zu scales, expected %" PRId64, context.c_str(), scales.size(),
          g.sim.totalBlocks());
      return;
    }
    HostBytes host_scales(scales);
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      if (g.group.scaleIndex(t) != g.sim.firstBlock(t)) {
        ++g_mismatches;
        say("MISMATCH %s: scaleIndex(%zu) = %" PRId64 ", expected %" PRId64, context.c_str(), t, g.group.scaleIndex(t),
            g.sim.firstBlock(t));
        continue;
      }
      const std::int64_t blocks = (tensors[t].numel + tensors[t].granularity - 1) / tensors[t].granularity;
      const auto* actual = reinterpret_cast<const std::byte*>(host_scales.as<float>() + g.group.scaleIndex(t));
      const auto* expected = reinterpret_cast<const std::byte*>(g.sim.scales(rank).data() + g.sim.firstBlock(t));
      compare(context, "fp8 block scales", tensors[t], t, DType::kF32, actual, expected, 0, blocks,
              g.sim.firstBlock(t));
    }
  }
}

// ----------------------------------------------------------------- ops

/// Group 1 broadcasts from the last rank; the others cycle through every
/// rank (0 included).
std::uint32_t broadcastRoot(std::uint64_t index) {
  const std::uint64_t world = g_args.world;
  return static_cast<std::uint32_t>((index + 2 * world - 2) % world);
}

void waitOk(Client& client, OpHandle handle, const std::string& what, std::uint64_t* sequence = nullptr) {
  const dbuf::OpResult result = must(client.wait(handle, g_args.timeout), "wait " + what);
  if (sequence != nullptr) *sequence = result.sequence;
  ++g_collectives;
}

void reduceScatter(TestGroup& g, const ReduceOptions& reduce) {
  must(g.group.reduceScatter(reduce, g_args.timeout), g.label + ": reduceScatter(" + describe(reduce) + ")");
  ++g_collectives;
  g.sim.reduceScatter(reduce);
  check(g, "reduceScatter(" + describe(reduce) + ")");
}

void allReduce(TestGroup& g, const ReduceOptions& reduce) {
  must(g.group.allReduce(reduce, g_args.timeout), g.label + ": allReduce(" + describe(reduce) + ")");
  ++g_collectives;
  g.sim.allReduce(reduce);
  check(g, "allReduce(" + describe(reduce) + ")");
}

/// The synchronous sequence of every op on one group that holds a slot and
/// has been all-gathered.
void opSequence(Client& client, TestGroup& g) {
  writeGrads(g, 1);
  reduceScatter(g, {ReduceMode::kSum, 1.0F, 1.0F, false});
  reduceScatter(g, {ReduceMode::kAvg, 1.0F, 1.0F, false});
  reduceScatter(g, {ReduceMode::kSum, 0.37F, 1.9F, false});
  reduceScatter(g, {ReduceMode::kAvg, -1.25F, 0.3F, false});
  if (g.sim.sharded() == dbuf::accumulationDType(g.sim.grad())) {
    writeShardGrads(g, 1);
    reduceScatter(g, {ReduceMode::kAvg, 0.5F, 3.0F, true});
    reduceScatter(g, {ReduceMode::kSum, 1.0F, 1.0F, true});
  } else {
    // accumulate needs a sharded gradient of the dtype the reduction sums in
    // (fp32; fp64 for fp64 groups): refused on every rank, nothing written.
    const auto refused = g.group.reduceScatter({ReduceMode::kSum, 1.0F, 1.0F, true}, g_args.timeout);
    if (refused.ok() || refused.error().message.find("accumulate") == std::string::npos) {
      ++g_mismatches;
      say("MISMATCH %s: reduceScatter(accumulate) into a %s sharded gradient: expected an error naming accumulate, "
          "got %s",
          g.label.c_str(), dtypeName(g.sim.sharded()).c_str(),
          refused.ok() ? "success" : refused.error().message.c_str());
    }
    ++g_collectives;
    check(g, "a refused reduceScatter(accumulate)");
  }
  allReduce(g, {ReduceMode::kSum, 1.0F, 1.0F, false});
  writeGrads(g, 2);
  allReduce(g, {ReduceMode::kAvg, 2.0F, 0.75F, false});

  writeParams(g, 3);
  const std::uint32_t root = broadcastRoot(g.index);
  must(g.group.broadcast(root, g_args.timeout), g.label + ": broadcast");
  ++g_collectives;
  g.sim.broadcast(root);
  check(g, "broadcast(root " + std::to_string(root) + ")");
  must(client.barrier(g_args.timeout), "barrier");
  ++g_collectives;

  // Async: four ops in flight, waited for in reverse order; the daemon runs
  // them in submission order (the reduce-scatter reads the gradients before
  // the all-reduce overwrites them).
  writeGrads(g, 4);
  writeShards(g, 2);
  const ReduceOptions rs{ReduceMode::kAvg, 1.0F, 1.5F, false};
  const ReduceOptions ar{ReduceMode::kSum, 0.5F, 1.0F, false};
  const OpHandle h_rs = must(g.group.submitReduceScatter(rs), g.label + ": submitReduceScatter");
  const OpHandle h_ar = must(g.group.submitAllReduce(ar), g.label + ": submitAllReduce");
  const OpHandle h_ag = must(g.group.submitAllGather(), g.label + ": submitAllGather");
  const OpHandle h_bar = must(client.submitBarrier(), "submitBarrier");
  std::uint64_t s_rs = 0;
  std::uint64_t s_ar = 0;
  std::uint64_t s_ag = 0;
  std::uint64_t s_bar = 0;
  waitOk(client, h_bar, "barrier", &s_bar);
  waitOk(client, h_ag, g.label + ": allGather", &s_ag);
  waitOk(client, h_ar, g.label + ": allReduce", &s_ar);
  waitOk(client, h_rs, g.label + ": reduceScatter", &s_rs);
  if (!(s_rs + 1 == s_ar && s_ar + 1 == s_ag && s_ag + 1 == s_bar)) {
    ++g_mismatches;
    say("MISMATCH %s: async ops completed with sequences rs %" PRIu64 ", ar %" PRIu64 ", ag %" PRIu64
        ", barrier %" PRIu64 " (expected consecutive, in submission order)",
        g.label.c_str(), s_rs, s_ar, s_ag, s_bar);
  }
  g.sim.reduceScatter(rs);
  g.sim.allReduce(ar);
  g.sim.allGather();
  check(g, "async reduceScatter + allReduce + allGather + barrier");
}

void forgetSlots(TestGroup& g) {
  for (std::uint32_t r = 0; r < g.sim.world(); ++r) g.sim.forgetSlot(r);
}

const std::vector<Pair>& opPairs() {
  static const std::vector<Pair> pairs = {
      {DType::kF32, DType::kF32},    {DType::kF32, DType::kBF16},  {DType::kF32, DType::kF16},
      {DType::kF32, DType::kF8E4M3}, {DType::kBF16, DType::kBF16}, {DType::kBF16, DType::kF8E4M3},
      {DType::kF16, DType::kF16},    {DType::kF16, DType::kBF16},  {DType::kBF16, DType::kF32},
      {DType::kF64, DType::kF64},
  };
  return pairs;
}

void scenarioOps(Client& client) {
  const Shape shape = shapeNamed(g_args.shape);
  std::vector<TestGroup> groups;
  for (std::size_t i = 0; i < opPairs().size(); ++i) {
    groups.push_back(registerGroup(client, i + 1, "g" + std::to_string(i) + "-" + g_args.shape, shape, opPairs()[i]));
    writeShards(groups.back(), 1);
  }
  // Two groups at a time (prefetch depth 1: two slots per rank).
  for (std::size_t a = 0; a < groups.size(); a += 2) {
    TestGroup& first = groups[a];
    TestGroup* second = a + 1 < groups.size() ? &groups[a + 1] : nullptr;
    must(first.group.acquireSlot(g_args.timeout), first.label + ": acquireSlot");
    forgetSlots(first);
    if (second != nullptr) {
      must(second->group.acquireSlot(g_args.timeout), second->label + ": acquireSlot");
      forgetSlots(*second);
    }
    // Both all-gathers and a barrier in flight at once; waited in reverse.
    const OpHandle h1 = must(first.group.submitAllGather(), first.label + ": submitAllGather");
    std::optional<OpHandle> h2;
    if (second != nullptr) h2 = must(second->group.submitAllGather(), second->label + ": submitAllGather");
    const OpHandle bar = must(client.submitBarrier(), "submitBarrier");
    waitOk(client, bar, "barrier");
    if (h2) waitOk(client, *h2, second->label + ": allGather");
    waitOk(client, h1, first.label + ": allGather");
    first.sim.allGather();
    check(first, "async allGather");
    if (second != nullptr) {
      second->sim.allGather();
      check(*second, "async allGather");
    }
    opSequence(client, first);
    if (second != nullptr) opSequence(client, *second);
    must(first.group.reshard(g_args.timeout), first.label + ": reshard");
    forgetSlots(first);
    if (second != nullptr) {
      must(second->group.reshard(g_args.timeout), second->label + ": reshard");
      forgetSlots(*second);
    }
    check(first, "reshard");
  }
  // unshard() again after a reshard (a fresh slot from the pool).
  for (TestGroup& g : groups) {
    writeShards(g, 5);
    must(g.group.unshard(g_args.timeout), g.label + ": unshard");
    ++g_collectives;
    forgetSlots(g);
    g.sim.allGather();
    check(g, "unshard after reshard");
    must(g.group.reshard(g_args.timeout), g.label + ": reshard");
    forgetSlots(g);
  }
}

// ----------------------------------------------------------------- fp8

/// All-gathered fp8 data and scales == kernels::quantizeE4m3 over the full
/// tensors in this one process, bitwise; and == the scalar reference.
void scenarioFp8(Client& client) {
  const std::vector<std::pair<std::string, Pair>> configs = {
      {"fp8-rows", {DType::kF32, DType::kF8E4M3}},  {"fp8-block", {DType::kF32, DType::kF8E4M3}},
      {"fp8-mixed", {DType::kF32, DType::kF8E4M3}}, {"fp8-rows", {DType::kBF16, DType::kF8E4M3}},
      {"fp8-mixed", {DType::kF16, DType::kF8E4M3}},
  };
  std::uint64_t index = 100;
  for (const auto& [shape_name, pair] : configs) {
    TestGroup g =
        registerGroup(client, index, "q" + std::to_string(index) + "-" + shape_name, shapeNamed(shape_name), pair);
    ++index;
    const auto& plan = g.group.plan();
    // Precondition: every rank's part of every tensor is block-aligned.
    for (std::size_t t = 0; t < plan.tensors.size(); ++t) {
      for (std::uint32_t r = 0; r < plan.devices; ++r) {
        const auto slice = dbuf::planner::sliceOnRank(plan.tensors[t], plan.shard_elems, r);
        if (!slice) continue;
        const std::int64_t gran = plan.tensors[t].granularity;
        if (slice->begin % gran != 0 || (slice->end % gran != 0 && slice->end != plan.tensors[t].numel)) {
          ++g_mismatches;
          say("MISMATCH %s: rank %u holds [%" PRId64 ", %" PRId64 ") of tensor '%s', not whole blocks of %" PRId64,
              g.label.c_str(), r, slice->begin, slice->end, plan.tensors[t].name.c_str(), gran);
        }
      }
    }
    writeShards(g, 1, blockFn);
    must(g.group.unshard(g_args.timeout), g.label + ": unshard");
    ++g_collectives;
    g.sim.allGather();
    check(g, "unshard (scalar reference)");

    const std::span<const float> scales = g.group.unshardedScales();
    if (static_cast<std::int64_t>(scales.size()) != g.sim.totalBlocks()) continue;  // reported by check()
    HostBytes host_scales(scales);
    std::vector<float> full_scales(scales.size(), -1.0F);
    for (std::size_t t = 0; t < plan.tensors.size(); ++t) {
      const dbuf::PlacedTensor& tensor = plan.tensors[t];
      // The full tensor in the sharded dtype, then one quantize over it.
      const std::int64_t bytes = dbuf::sizeBytes(pair.sharded);
      std::vector<std::byte> full(static_cast<std::size_t>(tensor.numel * bytes));
      for (std::int64_t e = 0; e < tensor.numel; ++e) {
        dbuf::coll::storeElement(
            pair.sharded, full.data(), e,
            blockFn(hashKey(g_args.seed, Stream::kShard, 1, 0, g.index, t, static_cast<std::uint64_t>(e)), e, tensor));
      }
      std::vector<std::byte> quantized(static_cast<std::size_t>(tensor.numel));
      const dbuf::kernels::Segment segment{0, 0, tensor.numel, tensor.granularity, g.group.scaleIndex(t)};
      must(dbuf::kernels::quantizeE4m3(
               {full.data(), pair.sharded, tensor.numel}, {quantized.data(), DType::kF8E4M3, tensor.numel},
               {full_scales.data(), DType::kF32, static_cast<std::int64_t>(full_scales.size())}, {&segment, 1}),
           "kernels::quantizeE4m3 over the full tensor");
      const TensorView gathered = slotView(g, t, false);
      const std::string context = g.label + " all-gathered vs quantizeE4m3 of the full tensor";
      compare(context, "fp8 data", tensor, t, DType::kF8E4M3, HostBytes(gathered).data(), quantized.data(), 0,
              tensor.numel);
      const std::int64_t blocks = (tensor.numel + tensor.granularity - 1) / tensor.granularity;
      compare(context, "fp8 block scales", tensor, t, DType::kF32,
              reinterpret_cast<const std::byte*>(host_scales.as<float>() + g.group.scaleIndex(t)),
              reinterpret_cast<const std::byte*>(full_scales.data() + g.group.scaleIndex(t)), 0, blocks,
              g.group.scaleIndex(t));
    }
    must(g.group.reshard(g_args.timeout), g.label + ": reshard");
  }
}

// ----------------------------------------------------------------- train

void scenarioTrain(Client& client) {
  using dbuf::kernels::bf16ToFloat;
  if (g_args.world != dbuf::coll::kTrainWorld) {
    say("the train scenario needs --world %u", dbuf::coll::kTrainWorld);
    std::exit(2);
  }
  const auto specs = dbuf::coll::trainTensors();
  Shape shape{"rows:2", {}};
  for (const auto& tensor : specs) shape.tensors.push_back({tensor.name, tensor.shape, "", -1});
  TestGroup g = registerGroup(client, 7, "train", shape, {DType::kF32, DType::kBF16});
  const auto& tensors = g.group.plan().tensors;
  std::vector<std::vector<std::vector<std::uint16_t>>> expected_gathered;
  (void)dbuf::coll::trainReference(g_args.seed, &expected_gathered);

  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const TensorView w = shardView(g, t, false);
    HostBytes host(w);
    for (std::int64_t i = 0; i < w.numel(); ++i)
      host.as<float>()[i] = dbuf::coll::trainInit(g_args.seed, t, w.begin + i);
    host.store();
  }
  for (int step = 1; step <= dbuf::coll::kTrainSteps; ++step) {
    must(g.group.unshard(g_args.timeout), "step " + std::to_string(step) + ": unshard");
    ++g_collectives;
    // Forward-like read of the gathered bf16 parameters (checked against the
    // reference's bf16(master) of this step), then gradients from them.
    double activation = 0;
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      HostBytes p(slotView(g, t, false));
      const TensorView grad_view = slotView(g, t, true);
      HostBytes grad(grad_view);
      const auto& expected = expected_gathered[static_cast<std::size_t>(step - 1)][t];
      std::vector<std::byte> expected_bytes(expected.size() * 2);
      std::memcpy(expected_bytes.data(), expected.data(), expected_bytes.size());
      compare("train step " + std::to_string(step) + " after unshard", "gathered bf16 params", tensors[t], t,
              DType::kBF16, p.data(), expected_bytes.data(), 0, tensors[t].numel);
      for (std::int64_t e = 0; e < grad_view.numel(); ++e) {
        const float value = bf16ToFloat(p.as<std::uint16_t>()[e]);
        activation += static_cast<double>(value);
        grad.as<std::uint16_t>()[e] = dbuf::coll::trainGrad(value, g_args.rank, t, step);
      }
      grad.store();
    }
    must(g.group.reduceScatter({ReduceMode::kAvg, 1.0F, 1.0F, false}, g_args.timeout),
         "step " + std::to_string(step) + ": reduceScatter");
    ++g_collectives;
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      const TensorView w_view = shardView(g, t, false);
      HostBytes w(w_view);
      HostBytes grad(shardView(g, t, true));
      for (std::int64_t i = 0; i < w_view.numel(); ++i) {
        w.as<float>()[i] = dbuf::coll::sgdUpdate(w.as<float>()[i], grad.as<float>()[i]);
      }
      w.store();
    }
    must(g.group.reshard(g_args.timeout), "step " + std::to_string(step) + ": reshard");
    say("step %d done (sum of gathered params %.6g)", step, activation);
  }
  // The final master shard, for the driver's single-process reference:
  // per tensor: int64 index, begin, end, then (end - begin) floats.
  std::ofstream out(g_args.out, std::ios::binary);
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const TensorView w = shardView(g, t, false);
    const std::int64_t header[3] = {static_cast<std::int64_t>(t), w.begin, w.end};
    out.write(reinterpret_cast<const char*>(header), sizeof header);
    if (w.numel() > 0) {
      out.write(reinterpret_cast<const char*>(HostBytes(w).data()), static_cast<std::streamsize>(w.numel() * 4));
    }
  }
  out.close();
  if (!out) {
    say("FATAL cannot write %s", g_args.out.c_str());
    std::exit(2);
  }
}

// ----------------------------------------------------------------- large

/// Shards larger than one step of the daemon (LocalCollective::kStepElements
/// = 2^22 elements per kernel call): the op cursor crosses step boundaries
/// inside a rank's shard and inside the all-reduce's element range.
/// --shape bf16: one bf16 -> bf16 group only (half the memory, so that two
/// such jobs fit in one tenant's quota at once).
void scenarioLarge(Client& client) {
  const Shape big{"element", {{"big", {2100, 4001}, "", -1}, {"bias", {4001}, "", -1}}};
  const Shape big_rows{"rows:1", big.tensors};
  std::vector<std::pair<Shape, Pair>> configs = {
      {big, {DType::kF32, DType::kBF16}},
      {big_rows, {DType::kF32, DType::kF8E4M3}},
  };
  if (g_args.shape == "bf16") configs = {{big, {DType::kBF16, DType::kBF16}}};
  std::uint64_t index = 200;
  for (const auto& [shape, pair] : configs) {
    TestGroup g = registerGroup(client, index, "large" + std::to_string(index), shape, pair);
    ++index;
    if (g.group.plan().shard_elems <= (std::int64_t{1} << 22)) {
      say("FATAL %s: shard of %" PRId64 " elements is not larger than one daemon step", g.label.c_str(),
          g.group.plan().shard_elems);
      std::exit(2);
    }
    writeShards(g, 1);
    must(g.group.unshard(g_args.timeout), g.label + ": unshard");
    ++g_collectives;
    forgetSlots(g);
    g.sim.allGather();
    check(g, "unshard");
    writeGrads(g, 1);
    reduceScatter(g, {ReduceMode::kAvg, 0.5F, 1.5F, false});
    allReduce(g, {ReduceMode::kSum, 1.0F, 1.0F, false});
    writeParams(g, 2);
    const std::uint32_t root = g_args.world - 1;
    must(g.group.broadcast(root, g_args.timeout), g.label + ": broadcast");
    ++g_collectives;
    g.sim.broadcast(root);
    check(g, "broadcast(root " + std::to_string(root) + ")");
    must(g.group.reshard(g_args.timeout), g.label + ": reshard");
  }
}

// ----------------------------------------------------------------- main

bool parse(int argc, char** argv) {
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i];
    const std::string value = argv[i + 1];
    if (key == "--socket") {
      g_args.socket = value;
    } else if (key == "--job") {
      g_args.job = value;
    } else if (key == "--rank") {
      g_args.rank = static_cast<std::uint32_t>(std::stoul(value));
    } else if (key == "--world") {
      g_args.world = static_cast<std::uint32_t>(std::stoul(value));
    } else if (key == "--scenario") {
      g_args.scenario = value;
    } else if (key == "--shape") {
      g_args.shape = value;
    } else if (key == "--seed") {
      g_args.seed = std::stoull(value);
    } else if (key == "--out") {
      g_args.out = value;
    } else if (key == "--timeout-ms") {
      g_args.timeout = std::chrono::milliseconds(std::stol(value));
    } else if (key == "--device") {
      g_args.device = static_cast<std::int32_t>(std::stol(value));
    } else if (key == "--local-world") {
      g_args.local_world = static_cast<std::uint32_t>(std::stoul(value));
    } else if (key == "--store") {
      g_args.store = value;
    } else {
      return false;
    }
  }
  return argc % 2 == 1 && !g_args.socket.empty() && !g_args.job.empty() && !g_args.scenario.empty() &&
         g_args.rank < g_args.world && (g_args.local_world == 0 || g_args.world % g_args.local_world == 0);
}

}  // namespace

int main(int argc, char** argv) {
  if (!parse(argc, argv)) {
    std::fprintf(
        stderr,
        "usage: coll-rank --socket PATH --job JOB --rank R --world W --scenario ops|fp8|train|large "
        "[--shape element|rows|block|mixed|tiny|medium] [--seed N] [--out FILE] [--timeout-ms MS] [--device GPU]\n");
    return 2;
  }
  const auto started = std::chrono::steady_clock::now();
  Client client = must(Client::connect({g_args.socket, g_args.timeout}), "connect");
  dbuf::AttachOptions attach{g_args.job, g_args.rank, g_args.world, g_args.rank, g_args.device, false, 1};
  if (g_args.local_world != 0) {
    attach.local_rank = g_args.rank % g_args.local_world;
    attach.local_world_size = g_args.local_world;
    attach.store = g_args.store;
  }
  must(client.attach(attach, g_args.timeout), "attach");
  if (g_args.scenario == "ops") {
    scenarioOps(client);
  } else if (g_args.scenario == "fp8") {
    scenarioFp8(client);
  } else if (g_args.scenario == "train") {
    scenarioTrain(client);
  } else if (g_args.scenario == "large") {
    scenarioLarge(client);
  } else {
    say("unknown scenario");
    return 2;
  }
  must(client.barrier(g_args.timeout), "final barrier");
  must(client.detach(g_args.timeout), "detach");
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - started);
  say("%s: %d collectives, %d buffer checks, %d mismatching (%lld ms)", g_mismatches == 0 ? "PASS" : "FAIL",
      g_collectives, g_checks, g_mismatches, static_cast<long long>(ms.count()));
  return g_mismatches == 0 ? 0 : 1;
}
