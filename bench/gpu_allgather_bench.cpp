// What going through dbufd costs an all-gather, against the same NCCL call
// made in the trainer processes (issue 5's overhead goal: within 3%), 64 MiB
// to 1 GiB of bf16 parameters (the whole unsharded buffer). One trainer
// process per GPU (--ranks, default: every GPU), as in a deployment; dbufd
// without virtual ranks runs the job through its NCCL path. Per size,
// interleaved rep by rep so that noise hits every row alike:
//   direct        each trainer's copy-in of its shard into its part of the
//                 buffer (cudaMemcpyAsync D2D, what FSDP2 does per unit), the
//                 in-place ncclAllGather on a communicator of the trainers
//                 (ncclCommInitRank), cudaStreamSynchronize
//   dbufd         allGather() (submit + wait, host-ordered)
//   dbufd stream  submitAllGather ordered on the trainer's stream, then
//                 cudaStreamSynchronize and wait
// Each rank takes the median of its reps; the slowest rank's median is the
// row's time; ratios to direct are printed (1.03 is the goal).
//
//   bench_gpu_allgather [--ranks N] [--reps R] [--max-mib M] [--json PATH]
//
// The trainers are forked before anything touches CUDA. Without a usable
// GPU: "bench_gpu_allgather: skipped: ..." and exit 0.
#include <cuda_runtime.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "dbuf/cli/command_line.hpp"
#include "dbuf/client.hpp"
#include "dbuf/gpu/nccl.hpp"
#include "dbufd_process.hpp"

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::int64_t kFirstMib = 64;
constexpr int kNoGpu = 77;
constexpr std::size_t kVariants = 3;  // direct, dbufd, dbufd stream

struct Args {
  int ranks = 0;  ///< 0: every GPU
  int reps = 20;
  std::int64_t max_mib = 1024;
  std::string json;
};

void describeArgs(CLI::App& app, Args& args) {
  app.add_option("--ranks", args.ranks, "Ranks, a GPU each (default: every GPU)")->type_name("N")
      ->check(CLI::Range(1, 1 << 10));
  app.add_option("--reps", args.reps, "Timed repetitions per size")->type_name("R")->check(CLI::Range(3, 1 << 20))
      ->capture_default_str();
  app.add_option("--max-mib", args.max_mib, "Largest size in MiB per rank (from 64, doubling)")->type_name("M")
      ->check(CLI::Range(kFirstMib, std::int64_t{1} << 30))->capture_default_str();
  app.add_option("--json", args.json, "Also write the results here")->type_name("PATH");
}

std::vector<std::int64_t> sizesMib(const Args& args) {
  std::vector<std::int64_t> sizes;
  for (std::int64_t mib = kFirstMib; mib <= args.max_mib; mib *= 2) sizes.push_back(mib);
  return sizes;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// ---- a trainer process (one rank) ---------------------------------------------------------

[[noreturn]] void fail(int rank, const std::string& what) {
  std::fprintf(stderr, "bench_gpu_allgather rank %d: %s\n", rank, what.c_str());
  std::_Exit(1);
}

/// The baseline: the rank's shard copied into its part of the buffer, then
/// the in-place all-gather on the trainers' own communicator.
class DirectAllGather {
 public:
  DirectAllGather(int rank, int ranks, std::size_t bytes, ncclComm_t comm, cudaStream_t stream)
      : rank_(rank), part_(bytes / static_cast<std::size_t>(ranks) / 2 * 2), comm_(comm), stream_(stream) {
    if (cudaMalloc(&shard_, part_) != cudaSuccess || cudaMalloc(&buffer_, bytes) != cudaSuccess ||
        cudaMemset(shard_, 1, part_) != cudaSuccess) {
      fail(rank, "cudaMalloc / cudaMemset");
    }
  }
  ~DirectAllGather() {
    static_cast<void>(cudaFree(shard_));
    static_cast<void>(cudaFree(buffer_));
  }
  DirectAllGather(const DirectAllGather&) = delete;
  DirectAllGather& operator=(const DirectAllGather&) = delete;

  void run() {
    auto* own = static_cast<unsigned char*>(buffer_) + static_cast<std::size_t>(rank_) * part_;
    if (cudaMemcpyAsync(own, shard_, part_, cudaMemcpyDeviceToDevice, stream_) != cudaSuccess) fail(rank_, "copy-in");
    const dbuf::gpu::Nccl& nccl = **dbuf::gpu::nccl();
    if (nccl.allGather(own, buffer_, part_ / 2, ncclBfloat16, comm_, stream_) != ncclSuccess) {
      fail(rank_, "ncclAllGather");
    }
    if (cudaStreamSynchronize(stream_) != cudaSuccess) fail(rank_, "cudaStreamSynchronize");
  }

 private:
  int rank_;
  std::size_t part_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  void* shard_ = nullptr;
  void* buffer_ = nullptr;
};

/// The rank's median seconds per variant for one size.
std::array<double, kVariants> measure(int rank, int ranks, dbuf::Client& client, std::int64_t mib, int reps,
                                      ncclComm_t comm, cudaStream_t stream) {
  const std::size_t bytes = static_cast<std::size_t>(mib) << 20;
  dbuf::GroupSpec spec;
  spec.name = "params-" + std::to_string(mib);
  spec.tensors = {{"w", {static_cast<std::int64_t>(bytes / 2)}, "element", -1}};
  spec.sharded_dtype = dbuf::DType::kBF16;
  spec.unsharded_dtype = dbuf::DType::kBF16;
  auto group = client.registerGroup(spec);
  if (!group) fail(rank, "registerGroup: " + group.error().message);
  if (auto r = group->acquireSlot(); !r) fail(rank, "acquireSlot: " + r.error().message);
  DirectAllGather direct(rank, ranks, bytes, comm, stream);
  dbuf::SubmitOptions on_stream;
  on_stream.stream = static_cast<void*>(stream);
  const std::function<void()> variants[kVariants] = {[&] { direct.run(); },
                                                     [&] {
                                                       if (auto r = group->allGather(); !r)
                                                         fail(rank, "allGather: " + r.error().message);
                                                     },
                                                     [&] {
                                                       auto handle = group->submitAllGather(on_stream);
                                                       if (!handle)
                                                         fail(rank, "submitAllGather: " + handle.error().message);
                                                       if (cudaStreamSynchronize(stream) != cudaSuccess)
                                                         fail(rank, "cudaStreamSynchronize");
                                                       if (auto r = client.wait(*handle); !r)
                                                         fail(rank, "wait: " + r.error().message);
                                                     }};
  std::array<std::vector<double>, kVariants> seconds;
  for (int rep = -2; rep < reps; ++rep) {  // two warm-up rounds
    for (std::size_t v = 0; v < kVariants; ++v) {
      const auto start = Clock::now();
      variants[v]();
      if (rep >= 0) seconds[v].push_back(std::chrono::duration<double>(Clock::now() - start).count());
    }
  }
  if (auto r = group->reshard(); !r) fail(rank, "reshard: " + r.error().message);
  return {median(seconds[0]), median(seconds[1]), median(seconds[2])};
}

/// One trainer: reads the NCCL id from `id_in` (rank 0 makes it and writes it
/// to the others' pipes), writes its medians to `out`.
[[noreturn]] void trainer(int rank, int ranks, const Args& args, const std::string& socket, int id_in,
                          const std::vector<int>& id_outs, int out) {
  if (cudaSetDevice(rank) != cudaSuccess) std::_Exit(kNoGpu);
  auto nccl = dbuf::gpu::nccl();
  if (!nccl) fail(rank, nccl.error().message);
  ncclUniqueId id{};
  if (rank == 0) {
    if ((*nccl)->getUniqueId(&id) != ncclSuccess) fail(rank, "ncclGetUniqueId");
    for (const int fd : id_outs) {
      if (write(fd, &id, sizeof(id)) != static_cast<ssize_t>(sizeof(id))) fail(rank, "sending the NCCL id");
    }
  } else if (read(id_in, &id, sizeof(id)) != static_cast<ssize_t>(sizeof(id))) {
    fail(rank, "receiving the NCCL id");
  }
  ncclComm_t comm = nullptr;
  if ((*nccl)->commInitRank(&comm, ranks, id, rank) != ncclSuccess) fail(rank, "ncclCommInitRank");
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) fail(rank, "cudaStreamCreate");
  auto client = dbuf::Client::connect({socket});
  if (!client) fail(rank, "connect: " + client.error().message);
  const auto r = static_cast<std::uint32_t>(rank);
  if (auto a = client->attach({"allgather-bench", r, static_cast<std::uint32_t>(ranks), r, rank}); !a) {
    fail(rank, "attach: " + a.error().message);
  }
  for (const std::int64_t mib : sizesMib(args)) {
    const auto medians = measure(rank, ranks, *client, mib, args.reps, comm, stream);
    if (write(out, medians.data(), sizeof(medians)) != static_cast<ssize_t>(sizeof(medians))) fail(rank, "report");
  }
  if (auto d = client->detach(); !d) fail(rank, "detach: " + d.error().message);
  static_cast<void>((*nccl)->commDestroy(comm));
  std::_Exit(0);
}

// ---- the driver ----------------------------------------------------------------------------

struct Row {
  std::int64_t mib = 0;
  std::array<double, kVariants> seconds{};  ///< the slowest rank's median
};

void writeJson(const std::string& path, int ranks, const std::vector<Row>& rows) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return;
  std::fprintf(f, "{\"bench\": \"gpu_allgather\", \"ranks\": %d, \"rows\": [", ranks);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const auto& s = rows[i].seconds;
    std::fprintf(f,
                 "%s\n  {\"mib\": %lld, \"direct_s\": %.6f, \"dbufd_s\": %.6f, \"dbufd_stream_s\": %.6f, "
                 "\"dbufd_ratio\": %.4f, \"dbufd_stream_ratio\": %.4f}",
                 i == 0 ? "" : ",", static_cast<long long>(rows[i].mib), s[0], s[1], s[2], s[1] / s[0], s[2] / s[0]);
  }
  std::fprintf(f, "\n]}\n");
  std::fclose(f);
}

/// The number of GPUs, counted in a child (this process must not touch CUDA
/// before forking the trainers).
int countGpus() {
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) return 0;
  const pid_t child = fork();
  if (child == 0) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
    std::_Exit(write(pipe_fds[1], &count, sizeof(count)) == sizeof(count) ? 0 : 1);
  }
  close(pipe_fds[1]);
  int count = 0;
  if (read(pipe_fds[0], &count, sizeof(count)) != sizeof(count)) count = 0;
  close(pipe_fds[0]);
  waitpid(child, nullptr, 0);
  return count;
}

using Pipes = std::vector<std::array<int, 2>>;

/// Closes, in trainer `rank` (or in the parent: nullopt), the pipe ends
/// someone else uses, so that a reader sees end-of-file once the writers'
/// processes are gone instead of waiting forever. Rank 0 writes the NCCL id
/// into every other rank's id pipe; rank r writes its report pipe, which the
/// parent reads.
void closeOthersEnds(Pipes& id_pipes, Pipes& report_pipes, std::optional<int> rank) {
  for (std::size_t r = 0; r < id_pipes.size(); ++r) {
    const bool mine = rank && static_cast<std::size_t>(*rank) == r;
    if (!mine) close(id_pipes[r][0]);
    if (!(rank == 0 && r > 0)) close(id_pipes[r][1]);
    if (rank) close(report_pipes[r][0]);
    if (!mine) close(report_pipes[r][1]);
  }
}

/// Every rank's medians, row by row, into `rows` (the slowest rank's per
/// variant). Reads every report pipe as data comes, so a trainer that dies
/// ends the wait (end-of-file) even while the others block in NCCL.
bool collectReports(const std::vector<int>& reports, std::vector<Row>& rows) {
  std::vector<std::size_t> received(reports.size(), 0);
  std::size_t pending = rows.empty() ? 0 : reports.size();
  while (pending > 0) {
    std::vector<pollfd> fds;
    for (std::size_t r = 0; r < reports.size(); ++r) {
      if (received[r] < rows.size()) fds.push_back({reports[r], POLLIN, 0});
    }
    if (poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    for (std::size_t r = 0; r < reports.size(); ++r) {
      if (received[r] == rows.size()) continue;
      const auto it = std::find_if(fds.begin(), fds.end(), [&](const pollfd& p) { return p.fd == reports[r]; });
      if (it->revents == 0) continue;
      std::array<double, kVariants> medians{};
      // One report is one write of a few bytes: pipes deliver it whole.
      if (read(reports[r], medians.data(), sizeof(medians)) != static_cast<ssize_t>(sizeof(medians))) return false;
      Row& row = rows[received[r]++];
      for (std::size_t v = 0; v < kVariants; ++v) row.seconds[v] = std::max(row.seconds[v], medians[v]);
      if (received[r] == rows.size()) --pending;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  CLI::App app{"bench_gpu_allgather: all-gather over NCCL directly, through dbufd, and through dbufd on the "
               "trainer's stream",
               "bench_gpu_allgather"};
  dbuf::cli::useConventions(app);
  describeArgs(app, args);
  if (const auto done = dbuf::cli::parse(app, argc, argv)) return *done;
  const int gpus = countGpus();
  if (gpus == 0) {
    std::printf("bench_gpu_allgather: skipped: no usable CUDA device\n");
    return 0;
  }
  const int ranks = args.ranks == 0 ? gpus : std::min(args.ranks, gpus);
  dbuf::bench::DaemonSettings settings;
  settings.extra_args = {"--backend", "cuda"};  // no virtual ranks: a GPU per rank, NCCL
  dbuf::bench::DaemonProcess daemon(dbuf::bench::dbufdExecutable(), settings);
  if (!daemon.ok()) {
    std::fprintf(stderr, "bench_gpu_allgather: dbufd: %s\n%s\n", daemon.error().c_str(), daemon.logTail().c_str());
    return 1;
  }
  // Pipes: the NCCL id from rank 0 to each other rank; each rank's medians back.
  Pipes id_pipes(static_cast<std::size_t>(ranks));
  Pipes report_pipes(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    if (pipe(id_pipes[static_cast<std::size_t>(r)].data()) != 0 ||
        pipe(report_pipes[static_cast<std::size_t>(r)].data()) != 0) {
      std::perror("pipe");
      return 1;
    }
  }
  std::vector<int> id_outs;
  for (int r = 1; r < ranks; ++r) id_outs.push_back(id_pipes[static_cast<std::size_t>(r)][1]);
  std::vector<pid_t> children;
  bool ok = true;
  for (int r = 0; r < ranks; ++r) {
    const pid_t child = fork();
    if (child < 0) {
      std::perror("fork");
      ok = false;  // the trainers forked so far would wait for the others: ended below
      break;
    }
    if (child == 0) {
      closeOthersEnds(id_pipes, report_pipes, r);
      trainer(r, ranks, args, daemon.socket(), id_pipes[static_cast<std::size_t>(r)][0], id_outs,
              report_pipes[static_cast<std::size_t>(r)][1]);
    }
    children.push_back(child);
  }
  closeOthersEnds(id_pipes, report_pipes, std::nullopt);
  std::vector<Row> rows;
  for (const std::int64_t mib : sizesMib(args)) rows.push_back({mib, {}});
  std::vector<int> reports;
  for (const auto& ends : report_pipes) reports.push_back(ends[0]);
  ok = ok && collectReports(reports, rows);
  for (const pid_t child : children) {
    // A trainer that failed may leave the others blocked in NCCL for good.
    if (!ok) kill(child, SIGKILL);
    int status = 0;
    waitpid(child, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  if (!ok) {
    std::fprintf(stderr, "bench_gpu_allgather: a trainer failed\n%s\n", daemon.logTail().c_str());
    return 1;
  }
  std::printf(
      "AllGather of bf16 parameters, %d rank(s), one GPU each (dbufd: NCCL path), slowest rank's median of "
      "%d reps\n",
      ranks, args.reps);
  std::printf("%8s %12s %12s %12s %12s %12s\n", "MiB", "direct ms", "dbufd ms", "stream ms", "dbufd/dir", "stream/dir");
  for (const Row& row : rows) {
    const auto& s = row.seconds;
    std::printf("%8lld %12.3f %12.3f %12.3f %12.3f %12.3f\n", static_cast<long long>(row.mib), s[0] * 1e3, s[1] * 1e3,
                s[2] * 1e3, s[1] / s[0], s[2] / s[0]);
  }
  std::printf("goal: dbufd/direct <= 1.03\n");
  if (!args.json.empty()) writeJson(args.json, ranks, rows);
  return daemon.stop() ? 0 : 1;
}
