// Fused multi-tensor CPU kernels: each op over a group of ~1000 tensors in one
// call, as bandwidth (bytes read + written per second) relative to memcpy of
// the same bytes on the same cores, measured side by side in one run.
// Figures go to docs/kernels.md. Last: reduce of 4 and 8 bf16 sources next
// to the unfused composition it replaces.
//
//   bench_kernels [MODEL_JSON] [--elements N] [--threads T]
//
// Tensor sizes: the model's tensors (default models/llama3-8b.json) repeated
// in order until there are 1000, each scaled by one common factor so the
// group holds about N elements (default 32 Mi: 128 MiB of fp32), as one
// rank's shards of the model at a large world size.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dbuf/cli/command_line.hpp"
#include "dbuf/kernels/convert.hpp"
#include "dbuf/kernels/cuda_ops.hpp"
#include "dbuf/kernels/detail/table_image.hpp"
#include "dbuf/kernels/ops.hpp"
#include "dbuf/plan_io/model_file.hpp"

namespace {

using dbuf::DType;
using namespace dbuf::kernels;  // NOLINT(google-build-using-namespace)

double seconds(const std::function<void()>& fn, int reps) {
  fn();  // warm up: page faults, caches
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  return best;
}

/// One memcpy of `bytes` split across `threads` threads (one spawn per call,
/// like the kernels).
void parallelMemcpy(unsigned char* dst, const unsigned char* src, std::size_t bytes, int threads) {
  const std::size_t per = (bytes + static_cast<std::size_t>(threads) - 1) / static_cast<std::size_t>(threads);
  std::vector<std::jthread> pool;
  for (int t = 1; t < threads; ++t) {
    const std::size_t b = std::min(bytes, per * static_cast<std::size_t>(t));
    const std::size_t e = std::min(bytes, b + per);
    pool.emplace_back([=] { std::memcpy(dst + b, src + b, e - b); });
  }
  std::memcpy(dst, src, std::min(bytes, per));
}

void must(const dbuf::Result<void>& r) {
  if (!r.ok()) {
    std::fprintf(stderr, "bench_kernels: %s\n", r.error().message.c_str());
    std::exit(1);
  }
}

/// The CUDA twins' host work per call over this group (host code, so it is
/// measured here): building the segment table's image, which a call whose
/// table is not cached does (the tiles planned, then uploaded), against
/// recognising a cached copy by its key, which every later call does.
void printTableLookup(const std::vector<Segment>& segments) {
  constexpr int kReps = 200;
  const detail::TableKey key{segments, cuda::Launch{}.tile_elements, false, {}};  // the CUDA ops' default tile
  const detail::TableImage image = detail::makeTableImage(key);
  detail::TableKeyCopy cached;
  cached.assign(key);
  const std::vector<Segment> same = segments;  // the caller's table, elsewhere in memory
  std::size_t found = 0;
  const double build_s = seconds([&] { found += detail::makeTableImage(key).layout.tile_count; }, kReps);
  const double match_s = seconds(
      [&] {
        found += cached.matches({same, key.tile_elements, false, {}}) ? 1U : 0U;
      },
      kReps);
  std::printf("\nCUDA ops' segment table on the host (%zu segments, %zu tiles, %zu bytes; best of %d)\n",
              segments.size(), image.layout.tile_count, image.bytes.size(), kReps);
  std::printf("%-40s %10.2f us\n", "not cached: plan the tiles, build it", build_s * 1e6);
  std::printf("%-40s %10.2f us   x%.0f less host work per call\n", "cached: found by its key", match_s * 1e6,
              build_s / match_s);
  if (found == 0) std::printf("(unreachable)\n");  // keeps the timed work observable
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "models/llama3-8b.json";
  std::int64_t target = std::int64_t{32} << 20;
  int threads = defaultThreads();
  CLI::App app{"bench_kernels: the fused multi-tensor ops (copy, cast, reduce, fp8) over a 1000-tensor group "
               "against memcpy and per-tensor loops",
               "bench_kernels"};
  dbuf::cli::useConventions(app);
  app.add_option("MODEL_JSON", model, "The model file whose tensor sizes make the group")->capture_default_str();
  app.add_option("--elements", target, "Elements of the group")->type_name("N")
      ->check(CLI::Range(std::int64_t{1000}, std::int64_t{1} << 40))->capture_default_str();
  app.add_option("--threads", threads, "Threads of the ops")->type_name("T")->check(CLI::Range(1, 1024))
      ->capture_default_str();
  if (const auto done = dbuf::cli::parse(app, argc, argv)) return *done;
  auto file = dbuf::plan_io::loadModelFile(model);
  if (!file.ok()) {
    std::fprintf(stderr, "bench_kernels: %s\n", file.error().message.c_str());
    return 1;
  }
  std::vector<std::int64_t> numels;
  for (const auto& u : file->units) {
    for (const auto& t : u.tensors) numels.push_back(t.numel());
  }
  if (numels.empty()) return 1;
  std::vector<std::int64_t> sizes;
  double model_total = 0;
  for (std::size_t i = 0; sizes.size() < 1000; ++i) {
    sizes.push_back(numels[i % numels.size()]);
    model_total += static_cast<double>(sizes.back());
  }
  const double factor = static_cast<double>(target) / model_total;
  std::vector<Segment> segs;
  std::vector<Segment> quant_segs;
  std::int64_t total = 0;
  std::int64_t scales_total = 0;
  const std::int64_t block = 128;
  for (const auto n : sizes) {
    const auto count = std::max<std::int64_t>(1, static_cast<std::int64_t>(static_cast<double>(n) * factor));
    segs.push_back({total, total, count, 0, 0});
    quant_segs.push_back({total, total, count, block, scales_total});
    total += count;
    scales_total += (count + block - 1) / block;
  }
  std::printf("group: %zu tensors from %s (sizes x %.3g), %lld elements, block %lld for fp8\n", segs.size(),
              file->model.c_str(), factor, static_cast<long long>(total), static_cast<long long>(block));

  const auto n = static_cast<std::size_t>(total);
  std::vector<float> f32_a(n);
  std::vector<float> f32_b(n);
  std::vector<std::uint16_t> b16(n);
  std::vector<std::uint8_t> q(n);
  std::vector<float> scales(static_cast<std::size_t>(scales_total));
  std::mt19937 rng(1);
  std::normal_distribution<float> dist(0.0F, 1.0F);
  for (auto& x : f32_a) x = dist(rng);
  for (std::size_t i = 0; i < n; ++i) b16[i] = floatToBf16(f32_a[i]);
  std::memset(f32_b.data(), 0, n * 4);
  std::memset(q.data(), 0, n);

  const DType f32 = DType::kF32;
  const ConstBuffer in32{f32_a.data(), f32, total};
  const MutBuffer out32{f32_b.data(), f32, total};
  const ConstBuffer in16{b16.data(), DType::kBF16, total};
  const MutBuffer out16{b16.data(), DType::kBF16, total};
  const MutBuffer outq{q.data(), DType::kF8E4M3, total};
  const ConstBuffer inq{q.data(), DType::kF8E4M3, total};
  const MutBuffer outs{scales.data(), f32, scales_total};
  const ConstBuffer ins{scales.data(), f32, scales_total};

  struct Op {
    const char* name;
    double bytes_per_element;  // read + written
    std::function<void(const Options&)> run;
  };
  const std::vector<Op> ops{
      {"copy fp32", 8, [&](const Options& o) { must(copy(in32, out32, segs, o)); }},
      {"copy fp32, one call per tensor", 8,
       [&](const Options& o) {
         for (const Segment& s : segs) must(copy(in32, out32, std::span<const Segment>(&s, 1), o));
       }},
      {"cast fp32->bf16", 6, [&](const Options& o) { must(cast(in32, out16, segs, o)); }},
      {"cast bf16->fp32", 6, [&](const Options& o) { must(cast(in16, out32, segs, o)); }},
      {"scale fp32 (in place)", 8, [&](const Options& o) { must(scale(out32, 0.5F, segs, o)); }},
      {"zero fp32", 4, [&](const Options& o) { must(zero(out32, segs, o)); }},
      {"accumulate fp32 += bf16*a", 10, [&](const Options& o) { must(accumulate(in16, out32, 0.25F, segs, o)); }},
      {"quantize fp32->e4m3 /128", 5 + 4.0 / 128,
       [&](const Options& o) { must(quantizeE4m3(in32, outq, outs, quant_segs, o)); }},
      {"dequantize e4m3->fp32 /128", 5 + 4.0 / 128,
       [&](const Options& o) { must(dequantizeE4m3(inq, ins, out32, quant_segs, o)); }},
      {"dequantize e4m3->bf16 /128", 3 + 4.0 / 128,
       [&](const Options& o) { must(dequantizeE4m3(inq, ins, out16, quant_segs, o)); }},
  };

  std::vector<int> thread_counts{1};
  if (threads > 1) thread_counts.push_back(threads);
  const int reps = 5;
  std::vector<double> memcpy_bw;
  std::printf("%-32s", "op");
  for (const int t : thread_counts) std::printf("  %2d thr: GB/s  vs memcpy", t);
  std::printf("\n%-32s", "memcpy (same bytes, same cores)");
  for (const int t : thread_counts) {
    const double s = seconds(
        [&] {
          parallelMemcpy(reinterpret_cast<unsigned char*>(f32_b.data()),
                         reinterpret_cast<const unsigned char*>(f32_a.data()), n * 4, t);
        },
        reps);
    memcpy_bw.push_back(8.0 * static_cast<double>(total) / s / 1e9);
    std::printf("  %12.2f  %9.2f", memcpy_bw.back(), 1.0);
  }
  std::printf("\n");
  for (const Op& op : ops) {
    std::printf("%-32s", op.name);
    for (std::size_t k = 0; k < thread_counts.size(); ++k) {
      const Options o{thread_counts[k]};
      const double s = seconds([&] { op.run(o); }, reps);
      const double bw = op.bytes_per_element * static_cast<double>(total) / s / 1e9;
      std::printf("  %12.2f  %9.2f", bw, bw / memcpy_bw[k]);
    }
    std::printf("\n");
  }

  // Reduce: W bf16 sources (distinct buffers) summed into fp32 or bf16, as
  // the daemon's reduce-scatter / all-reduce does per step; fused against
  // the composition it replaces (zero an fp32 scratch, W accumulates, cast).
  // Bytes = W source reads + one dst write per element, for both rows.
  std::vector<std::vector<std::uint16_t>> sources(8);
  for (std::size_t r = 0; r < sources.size(); ++r) {
    sources[r].resize(n);
    const std::size_t shift = (r * 7919) % n;
    std::memcpy(sources[r].data(), b16.data() + shift, (n - shift) * 2);
    std::memcpy(sources[r].data() + (n - shift), b16.data(), shift * 2);
  }
  std::vector<float> scratch(n);
  std::vector<std::uint16_t> red16(n);
  const MutBuffer scratch_out{scratch.data(), f32, total};
  const ConstBuffer scratch_in{scratch.data(), f32, total};
  const MutBuffer red_out16{red16.data(), DType::kBF16, total};
  std::printf("\nreduce of W bf16 sources (bytes: W reads + 1 write per element)\n");
  for (const std::size_t w : {std::size_t{4}, std::size_t{8}}) {
    std::vector<ConstBuffer> in;
    for (std::size_t r = 0; r < w; ++r) in.push_back({sources[r].data(), DType::kBF16, total});
    for (const bool to_f32 : {true, false}) {
      const MutBuffer dst = to_f32 ? out32 : red_out16;
      const double bytes = static_cast<double>(w) * 2 + (to_f32 ? 4 : 2);
      const std::string what = std::to_string(w) + " x bf16 -> " + (to_f32 ? "fp32" : "bf16");
      const Op fused{"", bytes, [&](const Options& o) { must(reduce(in, dst, ReduceOptions{}, segs, o)); }};
      const Op composed{"", bytes, [&](const Options& o) {
                          must(zero(scratch_out, segs, o));
                          for (const ConstBuffer& src : in) must(accumulate(src, scratch_out, 1.0F, segs, o));
                          must(cast(scratch_in, dst, segs, o));
                        }};
      const std::vector<std::pair<std::string, const Op*>> rows{
          {"reduce " + what, &fused}, {"  zero+" + std::to_string(w) + "acc+cast", &composed}};
      std::vector<double> fused_s;
      for (const auto& row : rows) {
        const Op* op = row.second;
        const std::string& label = row.first;
        std::printf("%-32s", label.c_str());
        for (std::size_t k = 0; k < thread_counts.size(); ++k) {
          const Options o{thread_counts[k]};
          const double s = seconds([&] { op->run(o); }, reps);
          const double bw = op->bytes_per_element * static_cast<double>(total) / s / 1e9;
          std::printf("  %12.2f  %9.2f", bw, bw / memcpy_bw[k]);
          if (op == &fused) {
            fused_s.push_back(s);
          } else {
            std::printf("  fused x%.2f", s / fused_s[k]);
          }
        }
        std::printf("\n");
      }
    }
  }
  printTableLookup(segs);
  return 0;
}
