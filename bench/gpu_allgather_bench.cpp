// What going through dbufd costs an all-gather, against the same NCCL call
// made in the trainer process (issue 5's overhead goal: within 3%), 64 MiB to
// 1 GiB of bf16 parameters. One process, one GPU, one rank: dbufd without
// virtual ranks runs a one-rank job through its NCCL path, which is what a
// machine with one GPU can compare. Per size, interleaved rep by rep so that
// noise hits every row alike, median of the reps:
//   direct        the trainer's own copy-in of its shard into its part of the
//                 buffer (cudaMemcpyAsync D2D, what FSDP2 does per unit), the
//                 in-place ncclAllGather, cudaStreamSynchronize
//   dbufd         submitAllGather + wait (host-ordered)
//   dbufd stream  submitAllGather ordered on the trainer's stream, then
//                 cudaStreamSynchronize and wait
// and the ratio of each dbufd row to direct (1.03 is the goal).
//
//   bench_gpu_allgather [--reps R] [--max-mib M] [--json PATH]
//
// Without a usable GPU: "bench_gpu_allgather: skipped: ..." and exit 0.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "dbuf/client.hpp"
#include "dbuf/gpu/nccl.hpp"
#include "dbufd_process.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  int reps = 20;
  std::int64_t max_mib = 1024;
  std::string json;
};

Args parseArgs(int argc, char** argv) {
  Args args;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const char* value = argv[i + 1];
    if (flag == "--reps") {
      args.reps = std::max(3, std::atoi(value));
    } else if (flag == "--max-mib") {
      args.max_mib = std::max<std::int64_t>(64, std::atoll(value));
    } else if (flag == "--json") {
      args.json = value;
    } else {
      std::fprintf(stderr, "usage: bench_gpu_allgather [--reps R] [--max-mib M] [--json PATH]\n");
      std::exit(2);
    }
  }
  if (argc % 2 == 0) {
    std::fprintf(stderr, "usage: bench_gpu_allgather [--reps R] [--max-mib M] [--json PATH]\n");
    std::exit(2);
  }
  return args;
}

double seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "bench_gpu_allgather: %s\n", what.c_str());
  std::exit(1);
}

void cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) fail(std::string(what) + ": " + cudaGetErrorString(status));
}

/// The baseline: the same bytes and NCCL call, made in this process.
class DirectAllGather {
 public:
  DirectAllGather(std::size_t bytes, cudaStream_t stream) : bytes_(bytes), stream_(stream) {
    cuda(cudaMalloc(&shard_, bytes), "cudaMalloc shard");
    cuda(cudaMalloc(&buffer_, bytes), "cudaMalloc buffer");
    cuda(cudaMemset(shard_, 1, bytes), "cudaMemset");
    const int device = 0;
    auto comms = dbuf::gpu::LocalComms::create({&device, 1});
    if (!comms) fail("NCCL: " + comms.error().message);
    comms_.emplace(std::move(*comms));
  }
  ~DirectAllGather() {
    static_cast<void>(cudaFree(shard_));
    static_cast<void>(cudaFree(buffer_));
  }
  DirectAllGather(const DirectAllGather&) = delete;
  DirectAllGather& operator=(const DirectAllGather&) = delete;

  void run() {
    cuda(cudaMemcpyAsync(buffer_, shard_, bytes_, cudaMemcpyDeviceToDevice, stream_), "copy-in");
    void* const buffers[] = {buffer_};
    const cudaStream_t streams[] = {stream_};
    if (auto r = comms_->allGather(buffers, bytes_ / 2, dbuf::DType::kBF16, streams); !r) fail(r.error().message);
    cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

 private:
  std::size_t bytes_;
  cudaStream_t stream_;
  void* shard_ = nullptr;
  void* buffer_ = nullptr;
  std::optional<dbuf::gpu::LocalComms> comms_;
};

struct Row {
  std::int64_t mib = 0;
  double direct_s = 0, dbufd_s = 0, stream_s = 0;
};

Row measure(dbuf::Client& client, std::int64_t mib, int reps, cudaStream_t stream) {
  const std::size_t bytes = static_cast<std::size_t>(mib) << 20;
  dbuf::GroupSpec spec;
  spec.name = "params-" + std::to_string(mib);
  spec.tensors = {{"w", {static_cast<std::int64_t>(bytes / 2)}, "element", -1}};
  spec.sharded_dtype = dbuf::DType::kBF16;
  spec.unsharded_dtype = dbuf::DType::kBF16;
  auto group = client.registerGroup(spec);
  if (!group) fail("registerGroup: " + group.error().message);
  if (auto r = group->acquireSlot(); !r) fail("acquireSlot: " + r.error().message);
  DirectAllGather direct(bytes, stream);
  dbuf::SubmitOptions on_stream;
  on_stream.stream = static_cast<void*>(stream);
  const std::function<void()> through_dbufd = [&] {
    if (auto r = group->allGather(); !r) fail("allGather: " + r.error().message);
  };
  const std::function<void()> through_dbufd_on_stream = [&] {
    auto handle = group->submitAllGather(on_stream);
    if (!handle) fail("submitAllGather: " + handle.error().message);
    cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    if (auto r = client.wait(*handle); !r) fail("wait: " + r.error().message);
  };
  std::vector<double> times[3];
  for (int rep = -2; rep < reps; ++rep) {  // two warm-up rounds
    const std::function<void()> runs[] = {[&] { direct.run(); }, through_dbufd, through_dbufd_on_stream};
    for (int which = 0; which < 3; ++which) {
      const auto start = Clock::now();
      runs[which]();
      if (rep >= 0) times[which].push_back(seconds(Clock::now() - start));
    }
  }
  if (auto r = group->reshard(); !r) fail("reshard: " + r.error().message);
  return {mib, median(times[0]), median(times[1]), median(times[2])};
}

void writeJson(const std::string& path, const std::vector<Row>& rows) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return;
  std::fprintf(f, "{\"bench\": \"gpu_allgather\", \"rows\": [");
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::fprintf(f,
                 "%s\n  {\"mib\": %lld, \"direct_s\": %.6f, \"dbufd_s\": %.6f, \"dbufd_stream_s\": %.6f, "
                 "\"dbufd_ratio\": %.4f, \"dbufd_stream_ratio\": %.4f}",
                 i == 0 ? "" : ",", static_cast<long long>(r.mib), r.direct_s, r.dbufd_s, r.stream_s,
                 r.dbufd_s / r.direct_s, r.stream_s / r.direct_s);
  }
  std::fprintf(f, "\n]}\n");
  std::fclose(f);
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parseArgs(argc, argv);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("bench_gpu_allgather: skipped: no usable CUDA device\n");
    return 0;
  }
  dbuf::bench::DaemonSettings settings;
  settings.extra_args = {"--backend", "cuda"};  // no virtual ranks: the one-rank job goes through NCCL
  dbuf::bench::DaemonProcess daemon(dbuf::bench::dbufdExecutable(), settings);
  if (!daemon.ok()) fail("dbufd: " + daemon.error() + "\n" + daemon.logTail());
  cuda(cudaSetDevice(0), "cudaSetDevice");
  cudaStream_t stream = nullptr;
  cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  auto client = dbuf::Client::connect({daemon.socket()});
  if (!client) fail("connect: " + client.error().message);
  if (auto r = client->attach({"allgather-bench", 0, 1, 0, 0}); !r) fail("attach: " + r.error().message);

  std::vector<Row> rows;
  for (std::int64_t mib = 64; mib <= args.max_mib; mib *= 2) rows.push_back(measure(*client, mib, args.reps, stream));
  std::printf("AllGather of bf16 parameters, 1 rank (NCCL), median of %d reps, wall time per op\n", args.reps);
  std::printf("%8s %12s %12s %12s %12s %12s\n", "MiB", "direct ms", "dbufd ms", "stream ms", "dbufd/dir", "stream/dir");
  for (const Row& r : rows) {
    std::printf("%8lld %12.3f %12.3f %12.3f %12.3f %12.3f\n", static_cast<long long>(r.mib), r.direct_s * 1e3,
                r.dbufd_s * 1e3, r.stream_s * 1e3, r.dbufd_s / r.direct_s, r.stream_s / r.direct_s);
  }
  std::printf("goal: dbufd/direct <= 1.03\n");
  if (!args.json.empty()) writeJson(args.json, rows);
  if (auto r = client->detach(); !r) fail("detach: " + r.error().message);
  static_cast<void>(cudaStreamDestroy(stream));
  return daemon.stop() ? 0 : 1;
}
