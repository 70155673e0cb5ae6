// Does the daemon's GPU work overlap a trainer's compute on the same GPU?
// Two real processes, as in a deployment (dbufd and a trainer are separate
// processes with separate CUDA contexts): a "trainer" running a compute-bound
// kernel loop, and a "daemon" running either the fused kernels the daemon
// uses for virtual ranks (a 256 Mi-element fp32 -> bf16 cast per unit, on the
// SMs) or cudaMemcpyAsync device-to-device copies of the same bytes (copy
// engines). Each is timed alone, then both start together; reported:
//   overlap = (alone_trainer + alone_daemon - together_makespan) / min(alone)
// (1: fully hidden, 0: serialised, as time-slicing between contexts does
// without MPS) and the trainer's slowdown. Run it with and without MPS
// (the GPU bundle's `run` starts nvidia-cuda-mps-control when it can and
// labels the rows); docs/gpu.md records what it found.
//
//   bench_gpu_overlap [--seconds S] [--label NAME] [--json PATH]
//
// Both processes are forked before anything touches CUDA (a context does not
// survive fork). Without a usable GPU: "bench_gpu_overlap: skipped: ..." and
// exit 0.
#include <cuda_runtime.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "dbuf/cli/command_line.hpp"
#include "dbuf/kernels/cuda_ops.hpp"
#include "gpu_compute_load.hpp"

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kNoGpu = 77;
constexpr std::int64_t kCastElements = std::int64_t{1} << 28;  // 1 GiB of fp32 read, 512 MiB of bf16 written
constexpr int kComputeIterations = 1 << 16;

enum class Role { kTrainer, kDaemonKernels, kDaemonCopies };

const char* roleName(Role role) {
  switch (role) {
    case Role::kTrainer:
      return "trainer compute";
    case Role::kDaemonKernels:
      return "daemon fused kernels (SMs)";
    case Role::kDaemonCopies:
      return "daemon cudaMemcpyAsync D2D (copy engines)";
  }
  return "?";
}

// ---- the child processes ----------------------------------------------------------------

/// One unit of a role's work, queued on `stream`.
struct Work {
  Role role = Role::kTrainer;
  cudaStream_t stream = nullptr;
  float* compute_out = nullptr;
  int compute_blocks = 0;
  void* src = nullptr;
  void* dst = nullptr;
  dbuf::kernels::cuda::DeviceTable table;

  bool queueOne() {
    if (role == Role::kTrainer) {
      return dbuf::bench::launchComputeLoad(stream, compute_out, compute_blocks, kComputeIterations) == cudaSuccess;
    }
    if (role == Role::kDaemonCopies) {
      return cudaMemcpyAsync(dst, src, static_cast<std::size_t>(kCastElements) * 4, cudaMemcpyDeviceToDevice, stream) ==
             cudaSuccess;
    }
    const dbuf::kernels::Segment all{0, 0, kCastElements, 0, 0};
    return dbuf::kernels::cuda::cast({src, dbuf::DType::kF32, kCastElements}, {dst, dbuf::DType::kBF16, kCastElements},
                                     {&all, 1}, {stream, &table})
        .ok();
  }
};

bool gpuPresent() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

bool setUp(Work& work) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return false;
  work.compute_blocks = prop.multiProcessorCount * 8;
  bool ok = cudaStreamCreateWithFlags(&work.stream, cudaStreamNonBlocking) == cudaSuccess;
  if (work.role == Role::kTrainer) {
    const auto threads = static_cast<std::size_t>(work.compute_blocks) * dbuf::bench::kComputeThreads;
    ok = ok && cudaMalloc(&work.compute_out, threads * sizeof(float)) == cudaSuccess;
  } else {
    const auto bytes = static_cast<std::size_t>(kCastElements) * 4;
    ok = ok && cudaMalloc(&work.src, bytes) == cudaSuccess && cudaMalloc(&work.dst, bytes) == cudaSuccess &&
         cudaMemset(work.src, 0x3c, bytes) == cudaSuccess;
  }
  // One unit untimed: module load, table upload, clocks up.
  return ok && work.queueOne() && cudaStreamSynchronize(work.stream) == cudaSuccess;
}

double runUnits(Work& work, long units) {
  const auto t0 = Clock::now();
  for (long i = 0; i < units; ++i) {
    if (!work.queueOne()) return -1;
  }
  if (cudaStreamSynchronize(work.stream) != cudaSuccess) return -1;
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

/// The child: set up, calibrate if units == 0 (to about `seconds`), say
/// "ready", wait for the go byte, run, report "units seconds".
[[noreturn]] void child(Role role, long units, double seconds, int report_fd, int go_fd) {
  Work work;
  work.role = role;
  if (!gpuPresent()) _exit(kNoGpu);
  if (!setUp(work)) _exit(1);  // a real failure (memory, launch), not a skip
  if (units == 0) {
    const double one = runUnits(work, 1);
    if (one <= 0) _exit(2);
    units = std::max(1L, static_cast<long>(seconds / one));
  }
  if (write(report_fd, "r", 1) != 1) _exit(3);
  char go = 0;
  if (read(go_fd, &go, 1) != 1) _exit(4);
  const double took = runUnits(work, units);
  if (took < 0) _exit(5);
  char line[64];
  const int n = std::snprintf(line, sizeof line, "%ld %.6f\n", units, took);
  _exit(write(report_fd, line, static_cast<std::size_t>(n)) == n ? 0 : 6);
}

// ---- the parent -------------------------------------------------------------------------------

struct Outcome {
  long units = 0;
  double seconds = 0;
};

struct Running {
  pid_t pid = -1;
  int report = -1;  // read end
  int go = -1;      // write end
};

Running start(Role role, long units, double seconds) {
  int report[2];
  int go[2];
  if (pipe(report) != 0 || pipe(go) != 0) std::exit(1);
  const pid_t pid = fork();
  if (pid == 0) {
    close(report[0]);
    close(go[1]);
    child(role, units, seconds, report[1], go[0]);
  }
  close(report[1]);
  close(go[0]);
  return {pid, report[0], go[1]};
}

bool readAll(int fd, std::string& out) {
  char buffer[128];
  for (ssize_t n; (n = read(fd, buffer, sizeof buffer)) > 0;) out.append(buffer, static_cast<std::size_t>(n));
  return true;
}

/// Runs the roles at once (each calibrated to `units` or, if 0, to
/// `seconds`), started by one go byte after all are ready. nullopt-like
/// empty vector: no GPU.
std::vector<Outcome> runTogether(const std::vector<Role>& roles, const std::vector<long>& units, double seconds,
                                 int& exit_code) {
  std::vector<Running> running;
  for (std::size_t i = 0; i < roles.size(); ++i) running.push_back(start(roles[i], units[i], seconds));
  bool ready = true;
  for (const Running& r : running) {
    char c = 0;
    ready = ready && read(r.report, &c, 1) == 1 && c == 'r';
  }
  for (const Running& r : running) {
    if (ready && write(r.go, "g", 1) != 1) ready = false;
    close(r.go);
  }
  std::vector<Outcome> outcomes;
  exit_code = 0;
  for (const Running& r : running) {
    std::string text;
    readAll(r.report, text);
    close(r.report);
    int status = 0;
    waitpid(r.pid, &status, 0);
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
    if (code != 0 && exit_code == 0) exit_code = code;
    Outcome o;
    if (std::sscanf(text.c_str(), "%ld %lf", &o.units, &o.seconds) != 2) o = {};
    outcomes.push_back(o);
  }
  return outcomes;
}

struct Row {
  std::string daemon_role;
  double trainer_alone = 0, daemon_alone = 0, trainer_together = 0, daemon_together = 0;
  [[nodiscard]] double makespan() const { return std::max(trainer_together, daemon_together); }
  [[nodiscard]] double overlap() const {
    return (trainer_alone + daemon_alone - makespan()) / std::min(trainer_alone, daemon_alone);
  }
  [[nodiscard]] double trainerSlowdown() const { return trainer_together / trainer_alone; }
};

struct Args {
  double seconds = 2.0;
  std::string label = "default";
  std::string json;
};

void describeArgs(CLI::App& app, Args& args) {
  app.add_option("--seconds", args.seconds, "Seconds of each measurement")->type_name("S")
      ->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--label", args.label, "The run's name in the JSON (e.g. mps)")->type_name("NAME")
      ->capture_default_str();
  app.add_option("--json", args.json, "Also write the results here")->type_name("PATH");
}

void writeJson(const Args& args, const std::vector<Row>& rows) {
  FILE* f = std::fopen(args.json.c_str(), "w");
  if (f == nullptr) return;
  std::fprintf(f, "{\"bench\": \"gpu_overlap\", \"label\": \"%s\", \"rows\": [", args.label.c_str());
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::fprintf(f,
                 "%s\n  {\"daemon\": \"%s\", \"trainer_alone_s\": %.4f, \"daemon_alone_s\": %.4f, "
                 "\"trainer_together_s\": %.4f, \"daemon_together_s\": %.4f, \"overlap\": %.3f, "
                 "\"trainer_slowdown\": %.3f}",
                 i == 0 ? "" : ",", r.daemon_role.c_str(), r.trainer_alone, r.daemon_alone, r.trainer_together,
                 r.daemon_together, r.overlap(), r.trainerSlowdown());
  }
  std::fprintf(f, "\n]}\n");
  std::fclose(f);
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  CLI::App app{"bench_gpu_overlap: a trainer's compute-bound kernels beside the daemon's fused kernels or copies "
               "on the same GPU, alone and together",
               "bench_gpu_overlap"};
  dbuf::cli::useConventions(app);
  describeArgs(app, args);
  if (const auto done = dbuf::cli::parse(app, argc, argv)) return *done;
  int code = 0;
  const auto trainer = runTogether({Role::kTrainer}, {0}, args.seconds, code);
  if (code == kNoGpu) {
    std::printf("bench_gpu_overlap: skipped: no usable CUDA device\n");
    return 0;
  }
  if (code != 0) {
    std::fprintf(stderr, "bench_gpu_overlap: the trainer process failed (exit %d)\n", code);
    return 1;
  }
  std::vector<Row> rows;
  for (const Role daemon : {Role::kDaemonKernels, Role::kDaemonCopies}) {
    const auto alone = runTogether({daemon}, {0}, args.seconds, code);
    if (code != 0) return std::fprintf(stderr, "bench_gpu_overlap: %s failed alone\n", roleName(daemon)), 1;
    const auto both = runTogether({Role::kTrainer, daemon}, {trainer[0].units, alone[0].units}, args.seconds, code);
    if (code != 0) return std::fprintf(stderr, "bench_gpu_overlap: %s failed together\n", roleName(daemon)), 1;
    rows.push_back({roleName(daemon), trainer[0].seconds, alone[0].seconds, both[0].seconds, both[1].seconds});
  }
  std::printf("GPU overlap (%s): trainer %ld compute launches; daemon units of %lld fp32 elements\n",
              args.label.c_str(), trainer[0].units, static_cast<long long>(kCastElements));
  std::printf("%-44s %9s %9s %9s %9s %8s %9s\n", "daemon work", "train s", "daemon s", "train+", "daemon+", "overlap",
              "slowdown");
  for (const Row& r : rows) {
    std::printf("%-44s %9.3f %9.3f %9.3f %9.3f %8.2f %9.2fx\n", r.daemon_role.c_str(), r.trainer_alone, r.daemon_alone,
                r.trainer_together, r.daemon_together, r.overlap(), r.trainerSlowdown());
  }
  std::printf("overlap: 1 = the daemon's work is hidden under the trainer's, 0 = serialised (time-slicing)\n");
  if (!args.json.empty()) writeJson(args, rows);
  return 0;
}
