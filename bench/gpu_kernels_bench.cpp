// The CUDA twins of the fused multi-tensor ops over a group of 1000 tensors,
// as bandwidth (bytes read + written per second) next to one cudaMemcpyAsync
// moving the same bytes and next to the FSDP2-style loop of one call per
// tensor, all measured in one run with CUDA events.
//
//   bench_gpu_kernels [MODEL_JSON] [--elements N] [--reps R] [--batch K] [--tile T] [--json PATH]
//
// Group: the model's tensors (default models/llama3-8b.json) repeated in order
// until there are 1000, each scaled by one common factor so the group holds
// about N elements (default 256 Mi: 512 MiB of bf16). Sources are packed
// contiguously in one allocation, destinations in another (a flat buffer, as
// FSDP's copy-in). fp8 quantization uses a fixed block of 128 elements for
// every tensor (not each tensor's row length), so all rows cut the same way.
//
// Timing: one untimed batch first (it uploads every segment table, so no
// timed call uploads one), then R repetitions of K calls queued back to back
// between two events; a row's time is the best repetition divided by K. K > 1
// lets the host prepare call k + 1 while the GPU runs call k, as in a training
// step with work queued ahead; --batch 1 times a single call from an idle
// stream, host preparation included. "host us" is the host's time to queue one
// call (for a per-tensor row: all 1000 of them).
//
// Without a usable GPU it prints "bench_gpu_kernels: skipped: no usable CUDA device: <reason>" and
// exits 0; any CUDA error ends it with the error's name and exit status 1.
#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dbuf/cli/command_line.hpp"
#include "dbuf/common/cuda_status.hpp"
#include "dbuf/common/dtype.hpp"
#include "dbuf/kernels/cuda_ops.hpp"
#include "dbuf/kernels/ops.hpp"
#include "dbuf/plan_io/model_file.hpp"

namespace {

using dbuf::DType;
using dbuf::kernels::ConstBuffer;
using dbuf::kernels::MutBuffer;
using dbuf::kernels::Segment;
namespace gpu = dbuf::kernels::cuda;

constexpr const char* kProgram = "bench_gpu_kernels";
constexpr std::size_t kGroupTensors = 1000;
constexpr std::int64_t kQuantBlock = 128;
constexpr double kTarget = 0.85;  // fused rows against cudaMemcpyAsync

// ---- errors ------------------------------------------------------------------------------------

[[noreturn]] void fail(const std::string& message) {
  std::fprintf(stderr, "%s: %s\n", kProgram, message.c_str());
  std::exit(1);
}

void must(const dbuf::Result<void>& result) {
  if (!result) fail(result.error().message);
}

void mustCuda(cudaError_t status, const char* what) {
  must(dbuf::cudaStatus(status, what));
}

// ---- command line ------------------------------------------------------------------------------

struct Args {
  std::string model = "models/llama3-8b.json";
  std::int64_t elements = std::int64_t{256} << 20;
  int reps = 20;
  int batch = 10;
  std::int64_t tile_elements = gpu::Launch{}.tile_elements;
  std::string json;
};

void describeArgs(CLI::App& app, Args& args) {
  constexpr std::int64_t kMostElements = std::int64_t{1} << 40;
  constexpr int kMostCount = 1000000;
  app.add_option("MODEL_JSON", args.model, "The model file whose 1000 largest tensors make the group")
      ->capture_default_str();
  app.add_option("--elements", args.elements, "Elements of the group")->type_name("N")
      ->check(CLI::Range(std::int64_t{1}, kMostElements))->capture_default_str();
  app.add_option("--reps", args.reps, "Timed repetitions")->type_name("R")->check(CLI::Range(1, kMostCount))
      ->capture_default_str();
  app.add_option("--batch", args.batch, "Launches per timed repetition")->type_name("K")
      ->check(CLI::Range(1, kMostCount))->capture_default_str();
  app.add_option("--tile", args.tile_elements, "Elements per tile of the fused kernels")->type_name("T")
      ->check(CLI::Range(std::int64_t{1}, kMostElements))->capture_default_str();
  app.add_option("--json", args.json, "Also write the results here")->type_name("PATH");
}

// ---- the group ---------------------------------------------------------------------------------

/// 1000 tensors packed contiguously: element i of the group is at index i of
/// both the source and the destination buffers.
struct Group {
  std::string model;
  double factor = 0;                    // model tensor size -> group tensor size
  std::vector<Segment> segments;        // copy and cast
  std::vector<Segment> quant_segments;  // the same runs in blocks, with their scales
  std::int64_t elements = 0;
  std::int64_t scales = 0;
};

Group makeGroup(const Args& args) {
  auto file = dbuf::plan_io::loadModelFile(args.model);
  if (!file) fail(file.error().message);
  std::vector<std::int64_t> numels;
  for (const auto& unit : file->units) {
    for (const auto& tensor : unit.tensors) numels.push_back(tensor.numel());
  }
  if (numels.empty()) fail(args.model + ": no trainable tensors");
  double model_elements = 0;
  for (std::size_t i = 0; i < kGroupTensors; ++i) model_elements += static_cast<double>(numels[i % numels.size()]);

  Group group;
  group.model = file->model;
  group.factor = static_cast<double>(args.elements) / model_elements;
  for (std::size_t i = 0; i < kGroupTensors; ++i) {
    const double scaled = static_cast<double>(numels[i % numels.size()]) * group.factor;
    const std::int64_t count = std::max<std::int64_t>(1, static_cast<std::int64_t>(scaled));
    group.segments.push_back({group.elements, group.elements, count, 0, 0});
    group.quant_segments.push_back({group.elements, group.elements, count, kQuantBlock, group.scales});
    group.elements += count;
    group.scales += (count + kQuantBlock - 1) / kQuantBlock;
  }
  return group;
}

// ---- device resources --------------------------------------------------------------------------

struct CudaFree {
  void operator()(void* memory) const noexcept { static_cast<void>(cudaFree(memory)); }
};
struct StreamDestroy {
  void operator()(cudaStream_t stream) const noexcept { static_cast<void>(cudaStreamDestroy(stream)); }
};
struct EventDestroy {
  void operator()(cudaEvent_t event) const noexcept { static_cast<void>(cudaEventDestroy(event)); }
};
using Stream = std::unique_ptr<CUstream_st, StreamDestroy>;
using Event = std::unique_ptr<CUevent_st, EventDestroy>;

Stream makeStream() {
  cudaStream_t stream = nullptr;
  mustCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  return Stream(stream);
}

Event makeEvent() {
  cudaEvent_t event = nullptr;
  mustCuda(cudaEventCreate(&event), "cudaEventCreate");
  return Event(event);
}

/// One typed array in device memory.
class DeviceArray {
 public:
  DeviceArray(DType dtype, std::int64_t elements, const char* what) : dtype_(dtype), elements_(elements) {
    void* memory = nullptr;
    mustCuda(cudaMalloc(&memory, bytes(elements)), what);
    memory_.reset(memory);
  }

  [[nodiscard]] ConstBuffer in() const { return {memory_.get(), dtype_, elements_}; }
  [[nodiscard]] MutBuffer out() const { return {memory_.get(), dtype_, elements_}; }
  /// The address of element `index`, for the per-tensor cudaMemcpyAsync.
  [[nodiscard]] std::byte* at(std::int64_t index) const {
    return static_cast<std::byte*>(memory_.get()) + index * dbuf::sizeBytes(dtype_);
  }
  [[nodiscard]] std::size_t bytes(std::int64_t elements) const {
    return static_cast<std::size_t>(elements * dbuf::sizeBytes(dtype_));
  }
  [[nodiscard]] std::size_t bytes() const { return bytes(elements_); }

 private:
  std::unique_ptr<void, CudaFree> memory_;
  DType dtype_;
  std::int64_t elements_;
};

struct Buffers {
  DeviceArray f32_src;
  DeviceArray bf16_src;
  DeviceArray f32_dst;
  DeviceArray bf16_dst;
  DeviceArray fp8_dst;
  DeviceArray scales;
};

Buffers allocateBuffers(const Group& group) {
  const std::int64_t n = group.elements;
  return {{DType::kF32, n, "cudaMalloc (fp32 sources)"},       {DType::kBF16, n, "cudaMalloc (bf16 sources)"},
          {DType::kF32, n, "cudaMalloc (fp32 destination)"},   {DType::kBF16, n, "cudaMalloc (bf16 destination)"},
          {DType::kF8E4M3, n, "cudaMalloc (fp8 destination)"}, {DType::kF32, group.scales, "cudaMalloc (fp8 scales)"}};
}

/// Normal(0, 1) values, so that the casts and the fp8 scales see ordinary
/// data: a pattern made on the host and repeated over the fp32 sources (making
/// all of it on the host would take longer than the whole benchmark), and the
/// bf16 sources cast from them on the device.
void fillSources(const Buffers& buffers, const Group& group, cudaStream_t stream) {
  constexpr std::int64_t kPattern = std::int64_t{1} << 20;
  std::vector<float> pattern(static_cast<std::size_t>(kPattern));
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  for (float& x : pattern) x = normal(rng);
  for (std::int64_t at = 0; at < group.elements; at += kPattern) {
    const std::int64_t count = std::min(kPattern, group.elements - at);
    mustCuda(cudaMemcpyAsync(buffers.f32_src.at(at), pattern.data(), buffers.f32_src.bytes(count),
                             cudaMemcpyHostToDevice, stream),
             "cudaMemcpyAsync (filling the sources)");
  }
  const Segment whole{0, 0, group.elements, 0, 0};
  const gpu::Launch launch{stream, nullptr, gpu::Launch{}.tile_elements};
  must(gpu::cast(buffers.f32_src.in(), buffers.bf16_src.out(), std::span<const Segment>(&whole, 1), launch));
  mustCuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize (filling the sources)");
}

std::string deviceName() {
  int device = 0;
  mustCuda(cudaGetDevice(&device), "cudaGetDevice");
  cudaDeviceProp prop{};
  mustCuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  return std::string(prop.name) + " (sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ", " +
         std::to_string(prop.multiProcessorCount) + " SMs)";
}

// ---- measuring ---------------------------------------------------------------------------------

/// Per call, best repetition.
struct Timing {
  double gpu_seconds = std::numeric_limits<double>::infinity();
  double host_seconds = std::numeric_limits<double>::infinity();
};

struct Row {
  std::string name;
  std::string kind;  // "baseline", "fused" or "per-tensor"
  double bytes = 0;  // read + written per call
  Timing time;
  std::optional<double> speedup;  // fused rows: the per-tensor loop's time over theirs

  [[nodiscard]] double gbps() const { return bytes / time.gpu_seconds / 1e9; }
};

/// What every measurement shares: the stream, the timing events, the settings.
class Bench {
 public:
  Bench(cudaStream_t stream, const Args& args)
      : stream_(stream),
        start_(makeEvent()),
        stop_(makeEvent()),
        reps_(args.reps),
        batch_(args.batch),
        tile_elements_(args.tile_elements) {}

  [[nodiscard]] cudaStream_t stream() const { return stream_; }
  [[nodiscard]] gpu::Launch launch(gpu::DeviceTable& table) const { return {stream_, &table, tile_elements_}; }

  [[nodiscard]] Row measure(std::string name, std::string kind, double bytes, const std::function<void()>& call) const {
    runBatch(call);  // warm-up: table uploads, clocks
    mustCuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (warm-up)");
    Row row{std::move(name), std::move(kind), bytes, {}, std::nullopt};
    for (int r = 0; r < reps_; ++r) {
      mustCuda(cudaEventRecord(start_.get(), stream_), "cudaEventRecord");
      const double host = runBatch(call);
      mustCuda(cudaEventRecord(stop_.get(), stream_), "cudaEventRecord");
      // A fault inside a kernel or copy shows up here.
      mustCuda(cudaEventSynchronize(stop_.get()), "cudaEventSynchronize (after the timed calls)");
      float ms = 0;
      mustCuda(cudaEventElapsedTime(&ms, start_.get(), stop_.get()), "cudaEventElapsedTime");
      row.time.gpu_seconds = std::min(row.time.gpu_seconds, static_cast<double>(ms) * 1e-3 / batch_);
      row.time.host_seconds = std::min(row.time.host_seconds, host / batch_);
    }
    return row;
  }

 private:
  /// Queues `batch` calls; returns the host time that took.
  double runBatch(const std::function<void()>& call) const {
    const auto t0 = std::chrono::steady_clock::now();
    for (int b = 0; b < batch_; ++b) call();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  cudaStream_t stream_;
  Event start_;
  Event stop_;
  int reps_;
  int batch_;
  std::int64_t tile_elements_;
};

/// A fused op applied to `segments` with one launch (the buffers are bound in).
using KernelOp = std::function<dbuf::Result<void>(std::span<const Segment>, const gpu::Launch&)>;

/// `op` as one call over the whole table, then as the FSDP2-style loop of one
/// call per tensor (a one-segment table each, kept in its own DeviceTable so
/// the warm-up uploads it and no timed call does). Returns both rows.
std::vector<Row> measureKernel(const Bench& bench, const std::string& name, double bytes,
                               std::span<const Segment> segments, const KernelOp& op) {
  gpu::DeviceTable fused_table;
  std::vector<std::unique_ptr<gpu::DeviceTable>> tables;
  for (std::size_t i = 0; i < segments.size(); ++i) tables.push_back(std::make_unique<gpu::DeviceTable>());

  Row fused = bench.measure(name, "fused", bytes, [&] { must(op(segments, bench.launch(fused_table))); });
  const Row loop = bench.measure(std::to_string(segments.size()) + " calls, one per tensor", "per-tensor", bytes, [&] {
    for (std::size_t i = 0; i < segments.size(); ++i) must(op(segments.subspan(i, 1), bench.launch(*tables[i])));
  });
  fused.speedup = loop.time.gpu_seconds / fused.time.gpu_seconds;
  return {fused, loop};
}

/// The bf16 copy: the fused kernel against one cudaMemcpyAsync per tensor.
std::vector<Row> measureCopy(const Bench& bench, const Buffers& buffers, const Group& group) {
  const ConstBuffer src = buffers.bf16_src.in();
  const MutBuffer dst = buffers.bf16_dst.out();
  const double bytes = 4.0 * static_cast<double>(group.elements);
  gpu::DeviceTable table;
  Row fused = bench.measure("copy bf16", "fused", bytes,
                            [&] { must(gpu::copy(src, dst, group.segments, bench.launch(table))); });
  const Row loop = bench.measure(
      std::to_string(group.segments.size()) + " cudaMemcpyAsync, one per tensor", "per-tensor", bytes, [&] {
        for (const Segment& s : group.segments) {
          mustCuda(cudaMemcpyAsync(buffers.bf16_dst.at(s.dst_offset), buffers.bf16_src.at(s.src_offset),
                                   buffers.bf16_src.bytes(s.count), cudaMemcpyDeviceToDevice, bench.stream()),
                   "cudaMemcpyAsync (per tensor)");
        }
      });
  fused.speedup = loop.time.gpu_seconds / fused.time.gpu_seconds;
  return {fused, loop};
}

/// Every row: the cudaMemcpyAsync baseline (the bf16 group, so its bytes are
/// the copy rows' bytes), then each op fused and per tensor. Bytes = source
/// bytes read + destination bytes written (+ the fp8 scales), for every row.
std::vector<Row> measureAll(const Bench& bench, const Buffers& buffers, const Group& group) {
  const auto elements = static_cast<double>(group.elements);
  std::vector<Row> rows;
  rows.push_back(bench.measure("cudaMemcpyAsync bf16, whole group", "baseline", 4.0 * elements, [&] {
    mustCuda(cudaMemcpyAsync(buffers.bf16_dst.at(0), buffers.bf16_src.at(0), buffers.bf16_src.bytes(),
                             cudaMemcpyDeviceToDevice, bench.stream()),
             "cudaMemcpyAsync (whole group)");
  }));
  const auto append = [&rows](std::vector<Row> more) { rows.insert(rows.end(), more.begin(), more.end()); };
  append(measureCopy(bench, buffers, group));
  append(measureKernel(bench, "cast fp32->bf16", 6.0 * elements, group.segments,
                       [&](std::span<const Segment> part, const gpu::Launch& launch) {
                         return gpu::cast(buffers.f32_src.in(), buffers.bf16_dst.out(), part, launch);
                       }));
  append(measureKernel(bench, "cast bf16->fp32", 6.0 * elements, group.segments,
                       [&](std::span<const Segment> part, const gpu::Launch& launch) {
                         return gpu::cast(buffers.bf16_src.in(), buffers.f32_dst.out(), part, launch);
                       }));
  const double quant_bytes = 3.0 * elements + 4.0 * static_cast<double>(group.scales);
  append(measureKernel(bench, "quantize bf16->e4m3 /" + std::to_string(kQuantBlock), quant_bytes, group.quant_segments,
                       [&](std::span<const Segment> part, const gpu::Launch& launch) {
                         return gpu::quantizeE4m3(buffers.bf16_src.in(), buffers.fp8_dst.out(), buffers.scales.out(),
                                                  part, launch);
                       }));
  return rows;
}

// ---- reporting ---------------------------------------------------------------------------------

double vsMemcpy(const Row& row, const std::vector<Row>& rows) {
  return row.gbps() / rows.front().gbps();
}

/// The fused row furthest below cudaMemcpyAsync.
const Row& slowestFused(const std::vector<Row>& rows) {
  const Row* slowest = nullptr;
  for (const Row& row : rows) {
    if (row.kind == "fused" && (slowest == nullptr || row.gbps() < slowest->gbps())) slowest = &row;
  }
  return *slowest;
}

void printRows(const std::vector<Row>& rows) {
  std::printf("%-42s %9s %10s %10s %14s\n", "op", "GB/s", "vs memcpy", "host us", "vs per-tensor");
  for (const Row& row : rows) {
    const std::string label = row.kind == "fused"        ? row.name + ", 1 fused call"
                              : row.kind == "per-tensor" ? "  " + row.name
                                                         : row.name;
    std::printf("%-42s %9.1f %10.2f %10.1f", label.c_str(), row.gbps(), vsMemcpy(row, rows),
                row.time.host_seconds * 1e6);
    if (row.speedup) std::printf(" %13.2fx", *row.speedup);
    std::printf("\n");
  }
  const Row& slowest = slowestFused(rows);
  const double ratio = vsMemcpy(slowest, rows);
  std::printf("target: fused copy/cast/quantize >= %.2f of cudaMemcpyAsync\n", kTarget);
  std::printf("slowest fused row: %s at %.2f: %s\n", slowest.name.c_str(), ratio, ratio >= kTarget ? "met" : "NOT met");
}

std::string jsonString(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string jsonNumber(double value) {
  if (!std::isfinite(value)) return "null";
  char text[32];
  std::snprintf(text, sizeof text, "%.6g", value);
  return text;
}

std::string jsonRow(const Row& row, const std::vector<Row>& rows) {
  return "{\"name\": " + jsonString(row.name) + ", \"kind\": " + jsonString(row.kind) +
         ", \"bytes_per_call\": " + jsonNumber(row.bytes) +
         ", \"seconds_per_call\": " + jsonNumber(row.time.gpu_seconds) + ", \"gb_per_s\": " + jsonNumber(row.gbps()) +
         ", \"vs_memcpy\": " + jsonNumber(vsMemcpy(row, rows)) +
         ", \"host_us_per_call\": " + jsonNumber(row.time.host_seconds * 1e6) +
         ", \"speedup_vs_per_tensor\": " + (row.speedup ? jsonNumber(*row.speedup) : "null") + "}";
}

void writeJson(const Args& args, const Group& group, const std::string& device, const std::vector<Row>& rows) {
  std::string text =
      "{\n  \"bench\": " + jsonString(kProgram) + ",\n  \"device\": " + jsonString(device) +
      ",\n  \"model\": " + jsonString(group.model) + ",\n  \"tensors\": " + std::to_string(group.segments.size()) +
      ",\n  \"elements\": " + std::to_string(group.elements) + ",\n  \"fp8_block\": " + std::to_string(kQuantBlock) +
      ",\n  \"tile_elements\": " + std::to_string(args.tile_elements) + ",\n  \"reps\": " + std::to_string(args.reps) +
      ",\n  \"batch\": " + std::to_string(args.batch) + ",\n  \"target_vs_memcpy\": " + jsonNumber(kTarget) +
      ",\n  \"target_met\": " + (vsMemcpy(slowestFused(rows), rows) >= kTarget ? "true" : "false") + ",\n  \"rows\": [";
  for (std::size_t i = 0; i < rows.size(); ++i) text += (i == 0 ? "\n    " : ",\n    ") + jsonRow(rows[i], rows);
  text += "\n  ]\n}\n";
  std::FILE* file = std::fopen(args.json.c_str(), "w");
  if (file == nullptr) fail("cannot write " + args.json + ": " + std::strerror(errno));
  const bool written = std::fwrite(text.data(), 1, text.size(), file) == text.size();
  if (std::fclose(file) != 0 || !written) fail("cannot write " + args.json);
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  CLI::App app{"bench_gpu_kernels: the CUDA twins of the fused ops over a 1000-tensor group, against one "
               "cudaMemcpyAsync of the same bytes and a per-tensor loop",
               kProgram};
  dbuf::cli::useConventions(app);
  describeArgs(app, args);
  if (const auto done = dbuf::cli::parse(app, argc, argv)) return *done;
  if (const gpu::DeviceCheck check = gpu::checkDevice(); !check.usable) {
    std::printf("%s: skipped: no usable CUDA device: %s\n", kProgram, check.reason.c_str());
    return 0;
  }
  const Group group = makeGroup(args);
  const std::string device = deviceName();
  std::printf("device: %s\n", device.c_str());
  std::printf(
      "group: %zu tensors from %s (sizes x %.3g), %lld elements; fp8 block %lld; tile %lld elements; "
      "best of %d x %d calls after a warm-up\n",
      group.segments.size(), group.model.c_str(), group.factor, static_cast<long long>(group.elements),
      static_cast<long long>(kQuantBlock), static_cast<long long>(args.tile_elements), args.reps, args.batch);

  const Stream stream = makeStream();
  const Buffers buffers = allocateBuffers(group);
  fillSources(buffers, group, stream.get());
  const Bench bench(stream.get(), args);
  const std::vector<Row> rows = measureAll(bench, buffers, group);
  printRows(rows);
  if (!args.json.empty()) writeJson(args, group, device, rows);
  return 0;
}
