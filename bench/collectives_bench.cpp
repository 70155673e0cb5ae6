// Collectives through a real dbufd, side by side with their baselines in one
// run. Figures go to docs/collectives.md ("Performance").
//
//   bench_collectives [--worlds 4,8] [--sizes 1,4,16,64,256,1024] [--repeats N]
//                     [--memory-budget GiB] [--no-cast] [--no-cold] [--no-diagnostics]
//                     [--no-model | --only-model | --only-diagnostics] [--model FILE] [--model-scale K]
//                     [--busy-poll-us N] [--quick]
//
// dbufd is $DBUFD, else the build's; it runs with a temp config ([rings]
// busy_poll_us = --busy-poll-us, default 50, as shipped) on a temp socket.
// --quick: sizes 1,4,16,64, 3 repeats, model scale 4 (what `make bench` runs).
// Exit status 1 if an op failed or gave a wrong result (each rank checks
// samples of its results), or the model's slot memory went over its bound.
//
// Part 1, bandwidth. For each world size W (rank processes forked from this
// one, each a libdbuf Client of one W-rank job on one dbufd) and per-rank
// size P (bytes of one rank's part in the unsharded dtype): one group of one
// [W * P / 2 / 1024, 1024] tensor, granularity "element", so every rank's
// shard is P / 2 elements. Rows:
//   allGather bf16->bf16     every rank's shard -> every rank's unsharded params
//   reduceScatter bf16       every rank's unsharded grads -> sum into each rank's shard grad
//   allGather after reshard  reshard + acquireSlot before each op (what an FSDP
//                            step that reshards each layer does): the released
//                            slot keeps its pages in the rank's pool, so this
//                            should match the allGather row (faults/op 0)
//   fp32->bf16 rows          the same at one size (64 MiB), sharded fp32
// Bytes moved, per op (defined in docs/collectives.md too):
//   allGather:     W * W * P bytes written into the W destination buffers
//                  (each rank's unsharded params, W parts of P bytes; its own
//                  part comes from its shard, W - 1 from the other ranks)
//   reduceScatter: W * W * P bytes read from the W ranks' unsharded grads
//                  (each of the W output shards sums W inputs of P bytes)
// Times: "run" = OpResult::run (the daemon's execution time, from the match
// of the last rank's submission to the completion); "wall" = from the moment
// the last rank submitted (after a barrier) to the moment the last rank's
// wait() returned (CLOCK_MONOTONIC, shared by the processes).
// Baseline, same run, interleaved: before each timed op this process times
// one memcpy of the same W * W copies of P bytes, from W source buffers to W
// destination buffers of W * P bytes (anonymous memory, distinct, touched
// beforehand), on kernels::defaultThreads() threads (min(hardware threads,
// 8), like dbufd's kernel calls), each copying its 1/T of every copy; the
// threads are started once (a pool whose idle workers sleep). The ranks wait
// (sleeping) at a gate in shared memory while it runs, and the next memcpy
// waits for the op: the two never overlap, and each op has its memcpy right
// before it. GB/s = bytes moved / median time; run/cpy and wall/cpy = the
// median over repeats of (that repeat's memcpy time / op time). One warm-up
// op (first touch of the slots) and one warm-up memcpy; then --repeats
// (default 5). Rank 0 also reads dbufd's /proc/<pid>/stat around each op:
// minor faults and CPU time (user + system, all its threads; 10 ms ticks, so
// "cores" = CPU seconds / run seconds is shown only for runs of 250 ms in
// all).
//
// A configuration is skipped, with its reason printed, when the memory it
// needs does not fit: the job's memfds (slots 2 * W * W * P: params + grads
// of W ranks; shards 2 * W * P_sharded) plus the baseline's buffers
// (W * W * P + W * P) must stay under --memory-budget (default 16 GiB) and
// under 80% of MemAvailable.
//
// Part 2, diagnostics (in this process, no daemon): a jthread start + join;
// kernels::copy of daemon-sized steps (LocalCollective::kStepElements = 4 Mi
// bf16 elements = 8 MiB per call) against the pool memcpy of the same bytes;
// one reduce-scatter step of 8 ranks done as HostCollective did it before
// kernels::reduce (zero, 8 x accumulate, cast through an fp32 scratch of
// 16 MiB) against one fused pass with the same arithmetic (checked bitwise
// equal); and a memcpy into a memfd whose pages were just given back
// (fallocate punch hole: what the first all-gather into a new slot file sees,
// e.g. a slot replaced by a larger one) against the same into resident pages.
//
// Part 3, unsharded memory: 2 ranks step a 32-layer model (the decoder layers
// of --model, default models/llama3-8b.json, every dimension >= 256 divided
// by --model-scale, default 2, so the model is ~3.3 GiB in bf16), one group
// per layer, prefetch depth 1: forward (unshard layer 0; then for each layer
// i: acquireSlot + submitAllGather of layer i + 1, "compute" on i, wait,
// reshard i) and backward (the same in reverse, writing each layer's grads
// and reduce-scattering them before its reshard). The resident unsharded
// memory is the sum of st_blocks * 512 of dbufd's slot memfds
// (/proc/<dbufd>/fd/* named "dbuf:<job>:slot:<rank>"), sampled by rank 0 at
// every step and by this process every 2 ms; it is compared with the whole
// model's unsharded size (params + grads of every rank) and with the bound
// ranks * (prefetch depth + 1) * the largest layer's slot.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dbuf/cli/command_line.hpp"
#include "dbuf/client.hpp"
#include "dbuf/common/shared_memory.hpp"
#include "dbuf/kernels/convert.hpp"
#include "dbuf/kernels/ops.hpp"
#include "dbuf/plan_io/model_file.hpp"
#include "dbufd_process.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;
constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;
constexpr std::uint64_t kGiB = std::uint64_t{1} << 30;

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "bench_collectives: %s\n", what.c_str());
  std::exit(1);
}

std::int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

std::string sizeText(std::uint64_t bytes) {
  char text[32];
  if (bytes >= kGiB && bytes % kGiB == 0) {
    std::snprintf(text, sizeof(text), "%llu GiB", static_cast<unsigned long long>(bytes / kGiB));
  } else if (bytes >= kGiB) {
    std::snprintf(text, sizeof(text), "%.2f GiB", static_cast<double>(bytes) / static_cast<double>(kGiB));
  } else {
    std::snprintf(text, sizeof(text), "%llu MiB", static_cast<unsigned long long>(bytes / kMiB));
  }
  return text;
}

std::uint64_t memAvailable() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  std::uint64_t value = 0;
  std::string unit;
  while (in >> key >> value >> unit) {
    if (key == "MemAvailable:") return value * 1024;
  }
  return 0;
}

/// dbufd's counters from /proc/<pid>/stat.
struct ProcStat {
  std::uint64_t minflt = 0;
  std::uint64_t majflt = 0;
  double cpu_s = 0;  ///< utime + stime, every thread
};

ProcStat readStat(pid_t pid) {
  ProcStat stat;
  char buffer[1024];
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return stat;
  const ssize_t n = ::read(fd, buffer, sizeof(buffer) - 1);
  ::close(fd);
  if (n <= 0) return stat;
  const std::string text(buffer, static_cast<std::size_t>(n));
  const auto close = text.rfind(')');
  if (close == std::string::npos) return stat;
  std::istringstream fields(text.substr(close + 2));
  std::vector<std::string> f;
  std::string field;
  while (fields >> field) f.push_back(field);
  // f[0] is field 3 (state): minflt = field 10, majflt = 12, utime = 14, stime = 15.
  if (f.size() < 13) return stat;
  const double tick = static_cast<double>(::sysconf(_SC_CLK_TCK));
  stat.minflt = std::stoull(f[7]);
  stat.majflt = std::stoull(f[9]);
  stat.cpu_s = static_cast<double>(std::stoull(f[11]) + std::stoull(f[12])) / tick;
  return stat;
}

/// Resident bytes of dbufd's memfds of one job: slots and shards.
struct MemfdUsage {
  std::uint64_t slot_resident = 0;
  std::uint64_t slot_file = 0;
  int slot_files = 0;
  std::uint64_t shard_resident = 0;
};

MemfdUsage scanMemfds(pid_t pid, const std::string& job) {
  MemfdUsage usage;
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR* listing = ::opendir(dir.c_str());
  if (listing == nullptr) return usage;
  const std::string prefix = "/memfd:dbuf:" + job + ":";
  // A file can be open twice for a moment (dbufd holds a duplicate of a slot
  // fd while it sends it): count each inode once.
  std::vector<ino_t> seen;
  char target[512];
  while (const dirent* entry = ::readdir(listing)) {
    if (entry->d_name[0] == '.') continue;
    const std::string path = dir + "/" + entry->d_name;
    const ssize_t n = ::readlink(path.c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    target[n] = '\0';
    if (std::strncmp(target, prefix.c_str(), prefix.size()) != 0) continue;
    struct stat info {};
    if (::stat(path.c_str(), &info) != 0) continue;
    if (std::find(seen.begin(), seen.end(), info.st_ino) != seen.end()) continue;
    seen.push_back(info.st_ino);
    const auto resident = static_cast<std::uint64_t>(info.st_blocks) * 512;
    if (std::strstr(target + prefix.size(), "slot:") == target + prefix.size()) {
      usage.slot_resident += resident;
      usage.slot_file += static_cast<std::uint64_t>(info.st_size);
      ++usage.slot_files;
    } else {
      usage.shard_resident += resident;
    }
  }
  ::closedir(listing);
  return usage;
}

// ------------------------------------------------------------------ options

struct Options {
  std::vector<std::uint32_t> worlds{4, 8};
  std::vector<std::uint64_t> sizes_mib{1, 4, 16, 64, 256, 1024};
  int repeats = 5;
  double budget_gib = 16;
  bool cast_rows = true;
  bool cold_rows = true;
  bool diagnostics = true;
  bool bandwidth = true;
  bool model = true;
  std::string model_path = "models/llama3-8b.json";
  int model_scale = 2;
  std::uint32_t busy_poll_us = 50;
};
Options options;

// ------------------------------------------------------- shared with ranks

constexpr int kMaxRepeats = 16;
constexpr int kMaxRanks = 8;
enum OpKind : int { kAllGather = 0, kReduceScatter = 1, kAllGatherCold = 2, kOpKinds = 3 };
constexpr const char* kOpNames[kOpKinds] = {"allGather", "reduceScatter", "allGather after reshard"};

struct Sample {
  std::int64_t submit_ns = 0;
  std::int64_t done_ns = 0;
  std::int64_t run_ns = 0;
  std::uint64_t daemon_faults = 0;  ///< rank 0 only
  double daemon_cpu_s = 0;          ///< rank 0 only
};

struct RankReport {
  int status = -1;  ///< 0: ok
  char message[480] = {};
  std::int64_t shard_elems = 0;
  Sample samples[kOpKinds][kMaxRepeats];
};

/// The parent and the ranks take turns: the parent times one memcpy
/// baseline, then opens the gate for the ranks' next timed op and waits for
/// it to finish, so each op and its baseline run back to back under the same
/// conditions (and never at the same time). Lock-free atomics in MAP_SHARED
/// memory work across processes.
struct Shared {
  std::atomic<int> ready{0};     ///< ranks set up, warmed up and verified
  std::atomic<int> gate{0};      ///< the ranks may start timed op #gate (1-based)
  std::atomic<int> finished{0};  ///< timed ops completed, all ranks together
  std::atomic<int> failed{0};    ///< a rank failed: nobody waits any more
  RankReport ranks[kMaxRanks];
};

void fail(RankReport& report, const std::string& what) {
  report.status = 1;
  std::snprintf(report.message, sizeof(report.message), "%s", what.c_str());
}

pid_t daemon_pid = -1;

struct Case {
  std::uint32_t world = 4;
  std::uint64_t part_bytes = 0;  ///< P: one rank's part in the unsharded dtype (bf16)
  dbuf::DType sharded = dbuf::DType::kBF16;
  std::string job;
  std::string socket;
};

void fillShard(const dbuf::TensorView& view, float value) {
  const auto n = static_cast<std::size_t>(view.numel());
  if (view.dtype == dbuf::DType::kF32) {
    std::fill_n(view.data<float>(), n, value);
  } else {
    std::fill_n(view.data<std::uint16_t>(), n, dbuf::kernels::floatToBf16(value));
  }
}

float readElement(const dbuf::TensorView& view, std::int64_t index) {
  if (view.dtype == dbuf::DType::kF32) return view.data<float>()[index];
  return dbuf::kernels::bf16ToFloat(view.data<std::uint16_t>()[index]);
}

/// One rank of a bandwidth case; writes its report; returns the exit code.
int bandwidthRankBody(const Case& c, std::uint32_t rank, Shared& shared) {
  RankReport& report = shared.ranks[rank];
  const auto timeout = std::chrono::milliseconds(600000);
  auto client = dbuf::Client::connect({.socket_path = c.socket, .timeout = timeout});
  if (!client) return fail(report, "connect: " + client.error().message), 1;
  if (auto attached = client->attach({.job = c.job, .rank = rank, .world_size = c.world}); !attached) {
    return fail(report, "attach: " + attached.error().message), 1;
  }
  const std::int64_t shard_elems = static_cast<std::int64_t>(c.part_bytes / 2);
  const std::int64_t total = shard_elems * c.world;
  dbuf::GroupSpec spec;
  spec.name = "g";
  spec.tensors.push_back({"w", {total / 1024, 1024}, "", -1});
  spec.granularity = "element";
  spec.sharded_dtype = c.sharded;
  spec.unsharded_dtype = dbuf::DType::kBF16;
  auto group = client->registerGroup(spec);
  if (!group) return fail(report, "registerGroup: " + group.error().message), 1;
  report.shard_elems = group->plan().shard_elems;
  if (group->plan().tensors.size() != 1 || group->plan().tensors[0].offset != 0) {
    return fail(report, "unexpected plan (tensor offset != 0)"), 1;
  }
  const std::int64_t s = group->plan().shard_elems;
  fillShard(group->shardView(0), static_cast<float>(rank + 1));
  if (auto acquired = group->acquireSlot(); !acquired)
    return fail(report, "acquireSlot: " + acquired.error().message), 1;
  {
    auto grads = group->unshardedGradView(0);
    if (!grads) return fail(report, "unshardedGradView: " + grads.error().message), 1;
    fillShard(*grads, static_cast<float>(rank + 1));
  }
  auto check = [&](const char* what, bool good) {
    if (!good && report.status != 1) fail(report, std::string("wrong result: ") + what);
    return good;
  };
  auto verify = [&] {
    auto params = group->unshardedView(0);
    if (!params) return check("no unsharded view", false);
    const dbuf::TensorView shard_grad = group->shardGradView(0);
    bool good = true;
    for (std::uint32_t q = 0; q < c.world; ++q) {
      for (const std::int64_t i : {std::int64_t{0}, s / 2, s - 1}) {
        good = good && check("allGather", readElement(*params, q * s + i) == static_cast<float>(q + 1));
      }
    }
    const auto expected = static_cast<float>(c.world * (c.world + 1) / 2);
    const dbuf::TensorView view{shard_grad.name,    c.sharded, shard_grad.shape, shard_grad.base, 0,
                                shard_grad.numel(), 0};
    for (const std::int64_t i : {std::int64_t{0}, s / 2, s - 1}) {
      good = good && check("reduceScatter", readElement(view, i) == expected);
    }
    return good;
  };
  auto run = [&](OpKind kind) -> std::optional<dbuf::OpResult> {
    auto handle = kind == kReduceScatter ? group->submitReduceScatter() : group->submitAllGather();
    if (!handle) return fail(report, std::string(kOpNames[kind]) + ": " + handle.error().message), std::nullopt;
    auto done = client->wait(*handle, timeout);
    if (!done) return fail(report, std::string(kOpNames[kind]) + ": " + done.error().message), std::nullopt;
    return *done;
  };
  // Warm-up: the first touch of the slot's pages (and the shards') by dbufd.
  if (!run(kAllGather) || !run(kReduceScatter)) return 1;
  if (!verify()) return 1;
  shared.ready.fetch_add(1);
  int turn = 0;
  auto timed = [&](OpKind kind, int repeat) -> bool {
    // Wait for the parent's baseline run (sleeping: the parent needs the cores).
    ++turn;
    while (shared.gate.load() < turn) {
      if (shared.failed.load() != 0) return fail(report, "another rank failed"), false;
      ::usleep(1000);
    }
    if (kind == kAllGatherCold) {
      // The slot goes back to the rank's pool with its pages; the next
      // acquire gets the same slot file, so nothing is faulted in again.
      if (auto released = group->reshard(); !released)
        return fail(report, "reshard: " + released.error().message), false;
      if (auto acquired = group->acquireSlot(); !acquired) {
        return fail(report, "acquireSlot: " + acquired.error().message), false;
      }
    }
    if (auto met = client->barrier(timeout); !met) return fail(report, "barrier: " + met.error().message), false;
    Sample& sample = report.samples[kind][repeat];
    const ProcStat before = rank == 0 ? readStat(daemon_pid) : ProcStat{};
    sample.submit_ns = nowNs();
    const auto result = run(kind == kReduceScatter ? kReduceScatter : kAllGather);
    sample.done_ns = nowNs();
    if (!result) return false;
    sample.run_ns = result->run.count();
    if (rank == 0) {
      const ProcStat after = readStat(daemon_pid);
      sample.daemon_faults = after.minflt + after.majflt - before.minflt - before.majflt;
      sample.daemon_cpu_s = after.cpu_s - before.cpu_s;
    }
    shared.finished.fetch_add(1);
    return true;
  };
  for (const OpKind kind : {kAllGather, kReduceScatter}) {
    for (int r = 0; r < options.repeats; ++r) {
      if (!timed(kind, r)) return 1;
    }
  }
  if (options.cold_rows) {
    for (int r = 0; r < options.repeats; ++r) {
      if (!timed(kAllGatherCold, r)) return 1;
    }
  }
  if (!verify()) return 1;
  if (auto detached = client->detach(); !detached) return fail(report, "detach: " + detached.error().message), 1;
  report.status = 0;
  return 0;
}

int bandwidthRank(const Case& c, std::uint32_t rank, Shared& shared) {
  const int code = bandwidthRankBody(c, rank, shared);
  if (code != 0) shared.failed.store(1);
  return code;
}

/// Forks `world` ranks running `body(rank)`; their pids.
std::vector<pid_t> spawnRanks(std::uint32_t world, const std::function<int(std::uint32_t)>& body) {
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  const pid_t parent = ::getpid();
  for (std::uint32_t r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) die(std::string("fork: ") + std::strerror(errno));
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(90);
      int code = 92;
      try {
        code = body(r);
      } catch (...) {
      }
      std::fflush(nullptr);
      ::_exit(code);
    }
    pids.push_back(pid);
  }
  return pids;
}

/// Waits for every rank; false if any failed.
bool joinRanks(const std::vector<pid_t>& pids) {
  bool good = true;
  for (const pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    good = good && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  return good;
}

// ------------------------------------------------------------------ memcpy

/// T threads (the caller is thread 0) started once; run(job) calls job(t)
/// on every thread and returns when all are done. Idle workers sleep (futex),
/// so the pool costs nothing while the ranks and dbufd run.
class Pool {
 public:
  explicit Pool(int threads) : threads_(threads) {
    for (int t = 1; t < threads_; ++t) {
      workers_.emplace_back([this, t] {
        std::uint64_t seen = 0;
        while (true) {
          generation_.wait(seen, std::memory_order_acquire);
          seen = generation_.load(std::memory_order_acquire);
          if (stop_.load()) return;
          (*job_)(t);
          done_.fetch_add(1, std::memory_order_acq_rel);
        }
      });
    }
  }
  ~Pool() {
    stop_.store(true);
    generation_.fetch_add(1);
    generation_.notify_all();
    for (auto& worker : workers_) worker.join();
  }
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  [[nodiscard]] int threads() const noexcept { return threads_; }

  void run(const std::function<void(int)>& job) {
    job_ = &job;
    done_.store(0, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_acq_rel);
    generation_.notify_all();
    job(0);
    while (done_.load(std::memory_order_acquire) != threads_ - 1) {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
  }

 private:
  int threads_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* job_ = nullptr;
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<int> done_{0};
  std::atomic<bool> stop_{false};
};

struct Buffer {
  std::byte* data = nullptr;
  std::size_t bytes = 0;
  explicit Buffer(std::size_t n) : bytes(n) {
    void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) die("mmap " + std::to_string(n) + ": " + std::strerror(errno));
    data = static_cast<std::byte*>(p);
  }
  ~Buffer() {
    if (data != nullptr) ::munmap(data, bytes);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& other) noexcept : data(std::exchange(other.data, nullptr)), bytes(other.bytes) {}
};

/// The memcpy baseline of one case: W sources of P bytes, W destinations of
/// W * P bytes, touched here; run() times one pass of the W * W copies.
class Baseline {
 public:
  Baseline(std::uint32_t world, std::uint64_t part)
      : world_(world), part_(part), pool_(dbuf::kernels::defaultThreads()) {
    for (std::uint32_t r = 0; r < world; ++r) {
      sources_.emplace_back(part);
      destinations_.emplace_back(part * world);
      std::memset(sources_.back().data, static_cast<int>(r + 1), part);
      std::memset(destinations_.back().data, 0, part * world);
    }
    job_ = [this](int t) {
      const auto threads = static_cast<std::uint64_t>(pool_.threads());
      const std::uint64_t slice = (part_ / threads + 63) & ~std::uint64_t{63};
      const std::uint64_t begin = std::min(part_, slice * static_cast<std::uint64_t>(t));
      const std::uint64_t end = std::min(part_, begin + slice);
      if (begin >= end) return;
      for (std::uint32_t to = 0; to < world_; ++to) {
        for (std::uint32_t from = 0; from < world_; ++from) {
          std::memcpy(destinations_[to].data + from * part_ + begin, sources_[from].data + begin, end - begin);
        }
      }
    };
    pool_.run(job_);  // warm-up
  }

  /// Seconds of one pass.
  double run() {
    const auto start = Clock::now();
    pool_.run(job_);
    return std::chrono::duration<double>(Clock::now() - start).count();
  }

 private:
  std::uint32_t world_;
  std::uint64_t part_;
  Pool pool_;
  std::vector<Buffer> sources_;
  std::vector<Buffer> destinations_;
  std::function<void(int)> job_;
};

// --------------------------------------------------------------- bandwidth

struct Row {
  std::string op;
  std::uint32_t world = 0;
  std::uint64_t part = 0;
  std::string dtypes;
  std::uint64_t bytes = 0;
  double run_s = 0;
  double wall_s = 0;
  double memcpy_s = 0;
  double run_ratio = 0;   ///< median over repeats of memcpy time / run time (each pair back to back)
  double wall_ratio = 0;  ///< the same for the wall time
  double faults = 0;
  double cores = -1;  ///< dbufd CPU seconds / run seconds over every repeat; -1: too short to tell
};

std::vector<Row> rows;
int failures = 0;

void printRowsHeader() {
  std::printf("%-23s %5s %9s %-10s %10s %9s %9s %9s %9s %9s %8s %8s %9s %6s\n", "op", "ranks", "per rank", "dtypes",
              "bytes", "run ms", "wall ms", "run GB/s", "wall GB/s", "cpy GB/s", "run/cpy", "wall/cpy", "faults/op",
              "cores");
}

void printRow(const Row& row) {
  const auto gbs = [&](double seconds) { return seconds > 0 ? static_cast<double>(row.bytes) / seconds / 1e9 : 0.0; };
  char cores[16] = "-";
  if (row.cores >= 0) std::snprintf(cores, sizeof(cores), "%.2f", row.cores);
  std::printf("%-23s %5u %9s %-10s %10s %9.2f %9.2f %9.2f %9.2f %9.2f %8.2f %8.2f %9.0f %6s\n", row.op.c_str(),
              row.world, sizeText(row.part).c_str(), row.dtypes.c_str(), sizeText(row.bytes).c_str(), row.run_s * 1e3,
              row.wall_s * 1e3, gbs(row.run_s), gbs(row.wall_s), gbs(row.memcpy_s), row.run_ratio, row.wall_ratio,
              row.faults, cores);
  std::fflush(stdout);
}

void bandwidthCase(const dbuf::bench::DaemonProcess& daemon, std::uint32_t world, std::uint64_t part,
                   dbuf::DType sharded) {
  const std::uint64_t sharded_part = sharded == dbuf::DType::kF32 ? part * 2 : part;
  const std::uint64_t job_bytes = 2 * world * world * part + 2 * world * sharded_part;
  const std::uint64_t baseline_bytes = world * world * part + world * part;
  const auto budget = static_cast<std::uint64_t>(options.budget_gib * static_cast<double>(kGiB));
  const std::uint64_t available = memAvailable() / 10 * 8;
  const std::string dtypes = sharded == dbuf::DType::kF32 ? "fp32->bf16" : "bf16->bf16";
  const std::uint64_t need = job_bytes + baseline_bytes;
  if (need > budget || need > available) {
    std::printf(
        "%-23s %5u %9s %-10s skipped: needs %s (memfds: slots 2*W*W*P + shards 2*W*P_sharded = %s; "
        "memcpy buffers W*W*P + W*P = %s), over %s\n",
        "allGather/reduceScatter", world, sizeText(part).c_str(), dtypes.c_str(), sizeText(need).c_str(),
        sizeText(job_bytes).c_str(), sizeText(baseline_bytes).c_str(),
        need > budget ? ("the budget of " + sizeText(budget) + " (--memory-budget)").c_str()
                      : ("80% of MemAvailable (" + sizeText(available) + ")").c_str());
    std::fflush(stdout);
    return;
  }
  if (world > kMaxRanks) die("at most 8 ranks");
  auto* shared =
      static_cast<Shared*>(::mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (shared == MAP_FAILED) die("mmap shared");
  new (shared) Shared{};
  Case c;
  c.world = world;
  c.part_bytes = part;
  c.sharded = sharded;
  c.job = "bw-" + std::to_string(world) + "-" + std::to_string(part / kMiB) + "-" +
          (sharded == dbuf::DType::kF32 ? "f32" : "bf16");
  c.socket = daemon.socket();
  // Ranks first (this process has no threads yet), then the baseline's
  // buffers and pool while they set up.
  const std::vector<pid_t> pids =
      spawnRanks(world, [&](std::uint32_t rank) { return bandwidthRank(c, rank, *shared); });
  std::vector<double> copy_s[kOpKinds];
  {
    Baseline baseline(world, part);
    auto waitFor = [&](const std::atomic<int>& counter, int value) {
      while (counter.load() < value && shared->failed.load() == 0) ::usleep(200);
      return shared->failed.load() == 0;
    };
    bool good = waitFor(shared->ready, static_cast<int>(world));
    int turn = 0;
    for (int kind = 0; kind < kOpKinds && good; ++kind) {
      if (kind == kAllGatherCold && !options.cold_rows) continue;
      for (int r = 0; r < options.repeats && good; ++r) {
        copy_s[kind].push_back(baseline.run());
        shared->gate.store(++turn);
        good = waitFor(shared->finished, turn * static_cast<int>(world));
      }
    }
  }
  if (!joinRanks(pids)) {
    ++failures;
    for (std::uint32_t r = 0; r < world; ++r) {
      if (shared->ranks[r].status != 0) {
        std::printf("%s: rank %u failed: %s\n", c.job.c_str(), r, shared->ranks[r].message);
      }
    }
    std::printf("  dbufd log: %s\n", daemon.logTail(600).c_str());
    ::munmap(shared, sizeof(Shared));
    return;
  }
  const auto shard_elems = static_cast<std::uint64_t>(shared->ranks[0].shard_elems);
  if (shard_elems * 2 != part) {
    std::printf("(note: the planner gave shards of %llu elements, not %llu: bytes below use the plan)\n",
                static_cast<unsigned long long>(shard_elems), static_cast<unsigned long long>(part / 2));
  }
  const std::uint64_t actual_part = shard_elems * 2;
  for (int kind = 0; kind < kOpKinds; ++kind) {
    if (kind == kAllGatherCold && !options.cold_rows) continue;
    std::vector<double> run_s;
    std::vector<double> wall_s;
    std::vector<double> faults;
    std::vector<double> cpu;
    std::vector<double> run_ratio;
    std::vector<double> wall_ratio;
    for (int r = 0; r < options.repeats; ++r) {
      std::int64_t last_submit = 0;
      std::int64_t last_done = 0;
      for (std::uint32_t rank = 0; rank < world; ++rank) {
        const Sample& sample = shared->ranks[rank].samples[kind][r];
        last_submit = std::max(last_submit, sample.submit_ns);
        last_done = std::max(last_done, sample.done_ns);
      }
      const Sample& first = shared->ranks[0].samples[kind][r];
      run_s.push_back(static_cast<double>(first.run_ns) / 1e9);
      wall_s.push_back(static_cast<double>(last_done - last_submit) / 1e9);
      faults.push_back(static_cast<double>(first.daemon_faults));
      cpu.push_back(first.daemon_cpu_s);
      if (run_s.back() > 0) run_ratio.push_back(copy_s[kind][static_cast<std::size_t>(r)] / run_s.back());
      if (wall_s.back() > 0) wall_ratio.push_back(copy_s[kind][static_cast<std::size_t>(r)] / wall_s.back());
    }
    Row row;
    row.run_ratio = median(run_ratio);
    row.wall_ratio = median(wall_ratio);
    row.op = kOpNames[kind];
    row.world = world;
    row.part = actual_part;
    row.dtypes = dtypes;
    row.bytes = world * world * actual_part;
    row.run_s = median(run_s);
    row.wall_s = median(wall_s);
    row.memcpy_s = median(copy_s[kind]);
    row.faults = median(faults);
    // CPU time comes in clock ticks (10 ms): only long enough runs tell.
    const double total_run = std::accumulate(run_s.begin(), run_s.end(), 0.0);
    if (total_run >= 0.25) row.cores = std::accumulate(cpu.begin(), cpu.end(), 0.0) / total_run;
    printRow(row);
    rows.push_back(row);
  }
  ::munmap(shared, sizeof(Shared));
}

// ------------------------------------------------------------- diagnostics

// No clones under ThreadSanitizer: their IFUNC resolvers run at relocation,
// before TSan's runtime is initialised, and crash the process at load.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
#define BENCH_CLONES __attribute__((target_clones("default", "arch=x86-64-v3")))
#else
#define BENCH_CLONES
#endif

/// out[i] = bf16(((0 + g0[i]) + g1[i]) + ... + g7[i]) in fp32: the
/// arithmetic of HostCollective's reduction (sum, pre = post = 1) in one pass,
/// the accumulator in a register. Compiled like kernels/ (baseline x86-64 and
/// x86-64-v3 clones).
BENCH_CLONES void fusedReduce8(const std::uint16_t* const* src, std::uint16_t* __restrict out, std::size_t n) {
  const std::uint16_t* __restrict g0 = src[0];
  const std::uint16_t* __restrict g1 = src[1];
  const std::uint16_t* __restrict g2 = src[2];
  const std::uint16_t* __restrict g3 = src[3];
  const std::uint16_t* __restrict g4 = src[4];
  const std::uint16_t* __restrict g5 = src[5];
  const std::uint16_t* __restrict g6 = src[6];
  const std::uint16_t* __restrict g7 = src[7];
  using dbuf::kernels::bf16ToFloat;
  for (std::size_t i = 0; i < n; ++i) {
    float a = 0.0F;
    a = a + bf16ToFloat(g0[i]);
    a = a + bf16ToFloat(g1[i]);
    a = a + bf16ToFloat(g2[i]);
    a = a + bf16ToFloat(g3[i]);
    a = a + bf16ToFloat(g4[i]);
    a = a + bf16ToFloat(g5[i]);
    a = a + bf16ToFloat(g6[i]);
    a = a + bf16ToFloat(g7[i]);
    out[i] = dbuf::kernels::floatToBf16(a);
  }
}

void diagnostics() {
  Pool pool(dbuf::kernels::defaultThreads());
  std::printf("\n== diagnostics: where a daemon step's time goes ==\n");
  // 1. jthread start + join (kernels/ starts threads - 1 per call).
  {
    constexpr int kRounds = 2000;
    const auto start = Clock::now();
    for (int i = 0; i < kRounds; ++i) {
      std::jthread thread([] {});
    }
    const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count() / kRounds;
    std::printf("std::jthread start + join (empty body), mean of %d: %.1f us\n", kRounds, us);
  }
  // 2. One step (4 Mi bf16 elements = 8 MiB) by kernels::copy vs the pool.
  {
    constexpr std::int64_t kStep = std::int64_t{1} << 22;
    constexpr std::size_t kBytes = static_cast<std::size_t>(kStep) * 2;
    constexpr int kSteps = 64;  // 512 MiB of distinct memory each way
    Buffer src(kBytes * kSteps);
    Buffer dst(kBytes * kSteps);
    std::memset(src.data, 1, src.bytes);
    std::memset(dst.data, 0, dst.bytes);
    dbuf::kernels::Options kernel_options;
    kernel_options.threads = dbuf::kernels::defaultThreads();
    auto kernelPass = [&] {
      for (int i = 0; i < kSteps; ++i) {
        const dbuf::kernels::Segment segment{0, 0, kStep, 0, 0};
        auto done = dbuf::kernels::copy({src.data + kBytes * static_cast<std::size_t>(i), dbuf::DType::kBF16, kStep},
                                        {dst.data + kBytes * static_cast<std::size_t>(i), dbuf::DType::kBF16, kStep},
                                        {&segment, 1}, kernel_options);
        if (!done) die("kernels::copy: " + done.error().message);
      }
    };
    const int threads = pool.threads();
    const std::function<void(int)> job = [&](int t) {
      for (int i = 0; i < kSteps; ++i) {
        const std::size_t slice = kBytes / static_cast<std::size_t>(threads);
        const std::size_t begin = slice * static_cast<std::size_t>(t);
        const std::size_t end = t == threads - 1 ? kBytes : begin + slice;
        std::memcpy(dst.data + kBytes * static_cast<std::size_t>(i) + begin,
                    src.data + kBytes * static_cast<std::size_t>(i) + begin, end - begin);
      }
    };
    std::vector<double> kernel_s;
    std::vector<double> pool_s;
    kernelPass();
    pool.run(job);
    for (int r = 0; r < std::max(options.repeats, 3); ++r) {
      auto start = Clock::now();
      kernelPass();
      kernel_s.push_back(std::chrono::duration<double>(Clock::now() - start).count());
      start = Clock::now();
      pool.run(job);
      pool_s.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    }
    const double total = static_cast<double>(kBytes) * kSteps;
    std::printf(
        "%d steps of 8 MiB (bf16, 4 Mi elements): kernels::copy (%d threads, started per call) %.2f GB/s, "
        "pool memcpy (%d threads) %.2f GB/s, ratio %.2f\n",
        kSteps, kernel_options.threads, total / median(kernel_s) / 1e9, threads, total / median(pool_s) / 1e9,
        median(pool_s) / median(kernel_s));
  }
  // 3. Reduce-scatter steps of 8 ranks (4 Mi bf16 elements from each, sum
  // into a bf16 shard) as HostCollective did them before kernels::reduce
  // (kernels::zero of the fp32 scratch, one kernels::accumulate per rank,
  // kernels::cast out; each call starting its own threads) against one fused
  // pass (fusedReduce8: the same fp32 adds in rank order, the accumulator in
  // a register, then the bf16 rounding, as kernels::reduce does now; checked
  // bitwise equal) on the pool.
  {
    constexpr std::uint32_t kRanks = 8;
    constexpr std::int64_t kStep = std::int64_t{1} << 22;
    constexpr std::size_t kBytes = static_cast<std::size_t>(kStep) * 2;
    constexpr int kSteps = 8;  // distinct memory: 8 steps * 8 ranks * 8 MiB = 512 MiB in
    std::vector<Buffer> grads;
    for (std::uint32_t r = 0; r < kRanks; ++r) {
      grads.emplace_back(kBytes * kSteps);
      auto* g = reinterpret_cast<std::uint16_t*>(grads.back().data);
      for (std::size_t i = 0; i < kBytes * kSteps / 2; ++i) {
        g[i] = dbuf::kernels::floatToBf16(static_cast<float>((i * 2654435761U + r * 40503U) % 1000U) / 64.0F - 7.0F);
      }
    }
    Buffer out_kernels(kBytes * kSteps);
    Buffer out_fused(kBytes * kSteps);
    std::memset(out_kernels.data, 0, out_kernels.bytes);
    std::memset(out_fused.data, 0, out_fused.bytes);
    std::unique_ptr<float[]> scratch(new float[static_cast<std::size_t>(kStep)]);
    dbuf::kernels::Options kernel_options;
    kernel_options.threads = dbuf::kernels::defaultThreads();
    auto kernelPass = [&] {
      const dbuf::kernels::MutBuffer sum{scratch.get(), dbuf::DType::kF32, kStep};
      for (int step = 0; step < kSteps; ++step) {
        const dbuf::kernels::Segment all{0, 0, kStep, 0, 0};
        const dbuf::kernels::Segment from{kStep * step, 0, kStep, 0, 0};
        const dbuf::kernels::Segment to{0, kStep * step, kStep, 0, 0};
        bool good = dbuf::kernels::zero(sum, {&all, 1}, kernel_options).ok();
        for (std::uint32_t r = 0; r < kRanks; ++r) {
          good = good && dbuf::kernels::accumulate({grads[r].data, dbuf::DType::kBF16, kStep * kSteps}, sum, 1.0F,
                                                   {&from, 1}, kernel_options)
                             .ok();
        }
        good = good &&
               dbuf::kernels::cast({scratch.get(), dbuf::DType::kF32, kStep},
                                   {out_kernels.data, dbuf::DType::kBF16, kStep * kSteps}, {&to, 1}, kernel_options)
                   .ok();
        if (!good) die("kernels reduce failed");
      }
    };
    const int threads = pool.threads();
    const std::function<void(int)> fused = [&](int t) {
      const std::size_t total = kBytes * kSteps / 2;
      const std::size_t slice = (total / static_cast<std::size_t>(threads) + 63) / 64 * 64;
      const std::size_t begin = std::min(total, slice * static_cast<std::size_t>(t));
      const std::size_t end = std::min(total, begin + slice);
      const std::uint16_t* src[kRanks];
      for (std::uint32_t r = 0; r < kRanks; ++r) src[r] = reinterpret_cast<const std::uint16_t*>(grads[r].data) + begin;
      if (end > begin) fusedReduce8(src, reinterpret_cast<std::uint16_t*>(out_fused.data) + begin, end - begin);
    };
    std::vector<double> kernel_s;
    std::vector<double> fused_s;
    kernelPass();
    pool.run(fused);
    for (int r = 0; r < std::max(options.repeats, 3); ++r) {
      auto start = Clock::now();
      kernelPass();
      kernel_s.push_back(std::chrono::duration<double>(Clock::now() - start).count());
      start = Clock::now();
      pool.run(fused);
      fused_s.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    }
    const bool same = std::memcmp(out_kernels.data, out_fused.data, out_kernels.bytes) == 0;
    const double read = static_cast<double>(kBytes) * kSteps * kRanks;
    std::printf(
        "reduce of %u ranks' bf16 grads (%d steps of 4 Mi elements; GB/s of grads read): old HostCollective "
        "path (zero + %u accumulate + cast, fp32 scratch) %.2f GB/s, fused one pass (%d threads) "
        "%.2f GB/s, ratio %.2f; results %s\n",
        kRanks, kSteps, kRanks, read / median(kernel_s) / 1e9, threads, read / median(fused_s) / 1e9,
        median(kernel_s) / median(fused_s), same ? "bitwise equal" : "DIFFER");
  }
  // 4. First touch: memcpy into a memfd whose pages were just given back.
  {
    constexpr std::size_t kBytes = 512 * kMiB;
    auto fd = dbuf::createMemfd("dbuf-bench-first-touch", kBytes);
    if (!fd) die("memfd: " + fd.error().message);
    auto map = dbuf::Mapping::map(fd->get(), kBytes);
    if (!map) die("mmap: " + map.error().message);
    Buffer src(kBytes);
    std::memset(src.data, 1, kBytes);
    const int threads = pool.threads();
    const std::function<void(int)> job = [&](int t) {
      const std::size_t slice = kBytes / static_cast<std::size_t>(threads);
      const std::size_t begin = slice * static_cast<std::size_t>(t);
      std::memcpy(map->data() + begin, src.data + begin, t == threads - 1 ? kBytes - begin : slice);
    };
    std::vector<double> cold;
    std::vector<double> warm;
    for (int r = 0; r < std::max(options.repeats, 3); ++r) {
      if (auto released = dbuf::releasePages(fd->get(), 0, kBytes); !released) die(released.error().message);
      auto start = Clock::now();
      pool.run(job);
      cold.push_back(std::chrono::duration<double>(Clock::now() - start).count());
      start = Clock::now();
      pool.run(job);
      warm.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    }
    const double bytes = static_cast<double>(kBytes);
    std::printf(
        "memcpy of 512 MiB into a memfd (%d threads): pages given back (punched) %.2f GB/s, resident %.2f GB/s, "
        "ratio %.2f (%.0f faults of 4 KiB: %.2f us each)\n",
        threads, bytes / median(cold) / 1e9, bytes / median(warm) / 1e9, median(warm) / median(cold), bytes / 4096,
        (median(cold) - median(warm)) / (bytes / 4096) * 1e6);
  }
  std::fflush(stdout);
}

// ------------------------------------------------------------------- model

struct ModelReport {
  int status = -1;
  char message[480] = {};
  std::uint64_t step_peak_slot = 0;  ///< rank 0's samples at every step
  std::uint64_t phase_peak[2] = {};  ///< the same, forward / backward
  std::uint64_t step_peak_files = 0;
  int steps_sampled = 0;
  std::uint64_t max_slot_file = 0;
  std::int64_t forward_ns = 0;
  std::int64_t backward_ns = 0;
  std::int64_t gather_run_ns = 0;  ///< sum of OpResult::run of the allGathers
  std::int64_t gather_count = 0;
  std::int64_t scatter_run_ns = 0;
  std::uint64_t gathered_bytes = 0;  ///< bytes written into all ranks' params by the allGathers
};

struct ModelShared {
  ModelReport ranks[2];
  std::atomic<int> phase{0};  ///< 1: stepping; 2: done
};

int modelRank(const std::vector<dbuf::planner::UnitSpec>& layers, const std::string& socket, const std::string& job,
              std::uint32_t rank, std::uint32_t world, ModelShared& shared) {
  ModelReport& report = shared.ranks[rank];
  auto bad = [&](const std::string& what) {
    report.status = 1;
    std::snprintf(report.message, sizeof(report.message), "%s", what.c_str());
    return 1;
  };
  const auto timeout = std::chrono::milliseconds(600000);
  auto client = dbuf::Client::connect({.socket_path = socket, .timeout = timeout});
  if (!client) return bad("connect: " + client.error().message);
  if (auto attached = client->attach({.job = job, .rank = rank, .world_size = world, .prefetch_depth = 1}); !attached) {
    return bad("attach: " + attached.error().message);
  }
  std::vector<dbuf::Group> groups;
  for (const auto& layer : layers) {
    dbuf::GroupSpec spec;
    spec.name = layer.name;
    spec.granularity = "element";
    spec.sharded_dtype = dbuf::DType::kBF16;
    spec.unsharded_dtype = dbuf::DType::kBF16;
    for (const auto& tensor : layer.tensors) spec.tensors.push_back({tensor.name, tensor.shape, "", -1});
    auto group = client->registerGroup(spec, timeout);
    if (!group) return bad("registerGroup " + layer.name + ": " + group.error().message);
    groups.push_back(std::move(*group));
  }
  int phase = 0;
  auto sample = [&] {
    if (rank != 0) return;
    const MemfdUsage usage = scanMemfds(daemon_pid, job);
    report.step_peak_slot = std::max(report.step_peak_slot, usage.slot_resident);
    report.phase_peak[phase] = std::max(report.phase_peak[phase], usage.slot_resident);
    report.step_peak_files =
        std::max<std::uint64_t>(report.step_peak_files, static_cast<std::uint64_t>(usage.slot_files));
    report.max_slot_file = std::max(report.max_slot_file, usage.slot_file);
    ++report.steps_sampled;
  };
  auto gathered = [&](const dbuf::OpResult& result, const dbuf::Group& group) {
    report.gather_run_ns += result.run.count();
    ++report.gather_count;
    report.gathered_bytes += static_cast<std::uint64_t>(group.plan().devices) * group.plan().devices *
                             static_cast<std::uint64_t>(group.plan().shard_elems) * 2;
  };
  auto unshard = [&](dbuf::Group& group) -> std::optional<dbuf::OpHandle> {
    if (auto acquired = group.acquireSlot(timeout); !acquired) {
      bad("acquireSlot " + group.name() + ": " + acquired.error().message);
      return std::nullopt;
    }
    auto handle = group.submitAllGather();
    if (!handle) {
      bad("allGather " + group.name() + ": " + handle.error().message);
      return std::nullopt;
    }
    return *handle;
  };
  auto wait = [&](dbuf::OpHandle handle, const dbuf::Group& group, bool gather) {
    auto done = client->wait(handle, timeout);
    if (!done) return bad("wait " + group.name() + ": " + done.error().message), false;
    if (gather) {
      gathered(*done, group);
    } else {
      report.scatter_run_ns += done->run.count();
    }
    return true;
  };
  /// "Compute" on an unsharded layer: read one byte per page of tensor 0.
  auto compute = [&](const dbuf::Group& group) {
    auto view = group.unshardedView(0);
    if (!view) return;
    volatile std::uint8_t sink = 0;
    const auto bytes = static_cast<std::size_t>(view->numel()) * 2;
    for (std::size_t at = 0; at < bytes; at += 4096) sink = sink + static_cast<std::uint8_t>(view->base[at]);
    (void)sink;
  };
  const auto layers_n = groups.size();
  if (auto met = client->barrier(timeout); !met) return bad("barrier: " + met.error().message);
  if (rank == 0) shared.phase.store(1);
  sample();
  // Forward.
  auto start = Clock::now();
  auto first = unshard(groups[0]);
  if (!first || !wait(*first, groups[0], true)) return 1;
  sample();
  for (std::size_t i = 0; i < layers_n; ++i) {
    std::optional<dbuf::OpHandle> next;
    if (i + 1 < layers_n) {
      next = unshard(groups[i + 1]);
      if (!next) return 1;
    }
    compute(groups[i]);
    sample();
    if (next && !wait(*next, groups[i + 1], true)) return 1;
    sample();
    if (auto released = groups[i].reshard(timeout); !released) return bad("reshard: " + released.error().message);
    sample();
  }
  report.forward_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
  // Backward: gather again (in reverse), write the grads, reduce-scatter them.
  phase = 1;
  start = Clock::now();
  auto last = unshard(groups[layers_n - 1]);
  if (!last || !wait(*last, groups[layers_n - 1], true)) return 1;
  sample();
  for (std::size_t i = layers_n; i-- > 0;) {
    std::optional<dbuf::OpHandle> next;
    if (i > 0) {
      next = unshard(groups[i - 1]);
      if (!next) return 1;
    }
    compute(groups[i]);
    for (std::size_t t = 0; t < groups[i].plan().tensors.size(); ++t) {
      auto grad = groups[i].unshardedGradView(t);
      if (!grad) return bad("unshardedGradView: " + grad.error().message);
      std::memset(grad->base, 0x3c, static_cast<std::size_t>(grad->numel()) * 2);
    }
    sample();
    auto scattered = groups[i].submitReduceScatter();
    if (!scattered) return bad("reduceScatter: " + scattered.error().message);
    if (!wait(*scattered, groups[i], false)) return 1;
    if (next && !wait(*next, groups[i - 1], true)) return 1;
    sample();
    if (auto released = groups[i].reshard(timeout); !released) return bad("reshard: " + released.error().message);
    sample();
  }
  report.backward_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
  if (auto met = client->barrier(timeout); !met) return bad("barrier: " + met.error().message);
  sample();
  if (rank == 0) shared.phase.store(2);
  if (auto detached = client->detach(); !detached) return bad("detach: " + detached.error().message);
  report.status = 0;
  return 0;
}

bool modelMemory(const dbuf::bench::DaemonProcess& daemon) {
  constexpr std::uint32_t kWorld = 2;
  constexpr std::uint32_t kDepth = 1;
  auto model = dbuf::plan_io::loadModelFile(options.model_path);
  if (!model) {
    std::printf("\n(unsharded memory: skipped, %s)\n", model.error().message.c_str());
    return true;
  }
  std::vector<dbuf::planner::UnitSpec> layers;
  for (const auto& unit : model->units) {
    if (unit.name.rfind("layers.", 0) != 0) continue;
    dbuf::planner::UnitSpec layer = unit;
    for (auto& tensor : layer.tensors) {
      for (auto& dim : tensor.shape) {
        if (dim >= 256) dim /= options.model_scale;
      }
    }
    layers.push_back(std::move(layer));
  }
  if (layers.empty()) {
    std::printf("\n(unsharded memory: skipped, %s has no 'layers.*' units)\n", options.model_path.c_str());
    return true;
  }
  std::uint64_t model_elems = 0;
  std::uint64_t largest = 0;
  for (const auto& layer : layers) {
    std::uint64_t elems = 0;
    for (const auto& tensor : layer.tensors) elems += static_cast<std::uint64_t>(tensor.numel());
    model_elems += elems;
    largest = std::max(largest, elems);
  }
  // Memory: shards (bf16, read by every allGather, written by every
  // reduceScatter) 2 * 2 bytes per element in all, plus a few slots.
  const std::uint64_t need = model_elems * 4 + 2 * kWorld * (kDepth + 1) * largest * 2 * 2;
  const auto budget = static_cast<std::uint64_t>(options.budget_gib * static_cast<double>(kGiB));
  std::printf(
      "\n== unsharded memory: %zu layers of %s, every dimension >= 256 divided by %d, %u ranks, prefetch "
      "depth %u ==\n",
      layers.size(), model->model.c_str(), options.model_scale, kWorld, kDepth);
  std::printf("model: %.1f M params per layer (largest), %.2f G params, %s in bf16 (one rank's unsharded params)\n",
              static_cast<double>(largest) / 1e6, static_cast<double>(model_elems) / 1e9,
              sizeText(model_elems * 2).c_str());
  if (need > budget || need > memAvailable() / 10 * 8) {
    std::printf("(skipped: needs ~%s of memfds, over the budget or 80%% of MemAvailable; raise --model-scale)\n",
                sizeText(need).c_str());
    return true;
  }
  auto* shared = static_cast<ModelShared*>(
      ::mmap(nullptr, sizeof(ModelShared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (shared == MAP_FAILED) die("mmap shared");
  new (shared) ModelShared{};
  const std::string job = "model";
  // The sampler starts after the fork (no thread may run across fork()).
  std::atomic<bool> stop{false};
  std::uint64_t sampler_peak = 0;
  std::uint64_t sampler_shards = 0;
  int sampler_samples = 0;
  std::thread sampler;
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  const pid_t parent = ::getpid();
  for (std::uint32_t r = 0; r < kWorld; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) die("fork");
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(90);
      int code = 92;
      try {
        code = modelRank(layers, daemon.socket(), job, r, kWorld, *shared);
      } catch (...) {
      }
      std::fflush(nullptr);
      ::_exit(code);
    }
    pids.push_back(pid);
  }
  sampler = std::thread([&] {
    while (!stop.load()) {
      if (shared->phase.load() >= 1) {
        const MemfdUsage usage = scanMemfds(daemon_pid, job);
        sampler_peak = std::max(sampler_peak, usage.slot_resident);
        sampler_shards = std::max(sampler_shards, usage.shard_resident);
        ++sampler_samples;
      }
      std::this_thread::sleep_for(2ms);
    }
  });
  bool good = true;
  for (const pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    good = good && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  stop.store(true);
  sampler.join();
  if (!good) {
    for (std::uint32_t r = 0; r < kWorld; ++r) {
      if (shared->ranks[r].status != 0) std::printf("model rank %u failed: %s\n", r, shared->ranks[r].message);
    }
    std::printf("  dbufd log: %s\n", daemon.logTail(600).c_str());
    ::munmap(shared, sizeof(ModelShared));
    return false;
  }
  const ModelReport& r0 = shared->ranks[0];
  // One rank's slot holds params + grads of the largest layer (both bf16) at
  // W * shard_elems each; the planner's padding makes shard_elems >=
  // ceil(elements / W), so the bound uses the largest slot file dbufd made.
  const std::uint64_t unit_slot = r0.max_slot_file / (kWorld * (kDepth + 1));
  const std::uint64_t bound = kWorld * (kDepth + 1) * unit_slot;
  const std::uint64_t model_unsharded = kWorld * model_elems * 2 * 2;  // params + grads, every rank
  const std::uint64_t peak = std::max(r0.step_peak_slot, sampler_peak);
  std::printf(
      "one layer's slot (params + grads, bf16, one rank): %.1f MiB; slot memfds of the job: %llu files, "
      "%.1f MiB in all\n",
      static_cast<double>(unit_slot) / static_cast<double>(kMiB), static_cast<unsigned long long>(r0.step_peak_files),
      static_cast<double>(r0.max_slot_file) / static_cast<double>(kMiB));
  std::printf("whole model unsharded (params + grads, %u ranks): %s\n", kWorld, sizeText(model_unsharded).c_str());
  std::printf(
      "peak resident slot memory: %.1f MiB at the %d steps sampled by rank 0, %.1f MiB over %d samples "
      "every 2 ms\n",
      static_cast<double>(r0.step_peak_slot) / static_cast<double>(kMiB), r0.steps_sampled,
      static_cast<double>(sampler_peak) / static_cast<double>(kMiB), sampler_samples);
  // Forward: every held slot has its params written, no grads. Backward: the
  // layer being reduced has params + grads; a released slot keeps its pages
  // (grads included) in the rank's pool, so once each of a rank's slots has
  // held a layer's grads, all of its slots are resident: the bound.
  const double half = static_cast<double>(unit_slot) / 2 / static_cast<double>(kMiB);
  std::printf(
      "  forward %.1f MiB (expected W * (depth + 1) * params = %.1f), backward %.1f MiB (expected W * "
      "(depth + 1) * (params + grads) = %.1f: released slots keep their pages)\n",
      static_cast<double>(r0.phase_peak[0]) / static_cast<double>(kMiB), kWorld * (kDepth + 1) * half,
      static_cast<double>(r0.phase_peak[1]) / static_cast<double>(kMiB), kWorld * (kDepth + 1) * 2 * half);
  std::printf(
      "bound ranks * (depth + 1) * layer slot = %u * %u * %.1f MiB = %.1f MiB: peak / bound = %.3f; peak / "
      "whole model = %.4f (1/%.0f) -> %s\n",
      kWorld, kDepth + 1, static_cast<double>(unit_slot) / static_cast<double>(kMiB),
      static_cast<double>(bound) / static_cast<double>(kMiB),
      bound > 0 ? static_cast<double>(peak) / static_cast<double>(bound) : 0.0,
      static_cast<double>(peak) / static_cast<double>(model_unsharded),
      peak > 0 ? static_cast<double>(model_unsharded) / static_cast<double>(peak) : 0.0,
      peak <= bound ? "within (prefetch depth + 1) layers per rank" : "OVER THE BOUND");
  std::printf("shard memfds resident at the end (bf16 params + grads, both ranks): %s\n",
              sizeText(sampler_shards).c_str());
  const double gather_s = static_cast<double>(r0.gather_run_ns) / 1e9;
  std::printf(
      "forward %.2f s, backward %.2f s; %lld allGathers into slots released by a previous reshard: "
      "%.1f ms each (daemon run), %.2f GB/s; reduceScatters %.1f ms each\n",
      static_cast<double>(r0.forward_ns) / 1e9, static_cast<double>(r0.backward_ns) / 1e9,
      static_cast<long long>(r0.gather_count),
      r0.gather_count > 0 ? gather_s * 1e3 / static_cast<double>(r0.gather_count) : 0.0,
      gather_s > 0 ? static_cast<double>(r0.gathered_bytes) / gather_s / 1e9 : 0.0,
      static_cast<double>(r0.scatter_run_ns) / 1e6 / static_cast<double>(layers.size()));
  std::fflush(stdout);
  ::munmap(shared, sizeof(ModelShared));
  return peak <= bound;
}

void describeOptions(CLI::App& app, bool& quick) {
  app.add_option("--worlds", options.worlds, "World sizes to measure")
      ->delimiter(',')
      ->allow_extra_args(false)
      ->type_name("W,...")
      ->check(CLI::Range(1U, static_cast<unsigned>(kMaxRanks)))
      ->capture_default_str();
  app.add_option("--sizes", options.sizes_mib, "Sizes in MiB per rank")
      ->delimiter(',')
      ->allow_extra_args(false)
      ->type_name("MIB,...")
      ->check(CLI::Range(std::uint64_t{1}, std::uint64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--repeats", options.repeats, "Repeats of each row")->check(CLI::Range(1, kMaxRepeats))
      ->capture_default_str();
  app.add_option("--memory-budget", options.budget_gib, "GiB the rows may take")->type_name("GIB")
      ->check(CLI::PositiveNumber)->capture_default_str();
  app.add_flag_callback("--no-cast", [] { options.cast_rows = false; }, "Leave out the casting rows");
  app.add_flag_callback("--no-cold", [] { options.cold_rows = false; }, "Leave out the cold-slot rows");
  app.add_flag_callback("--no-diagnostics", [] { options.diagnostics = false; }, "Leave out the diagnostics");
  auto* no_model = app.add_flag_callback("--no-model", [] { options.model = false; }, "Leave out the model run");
  auto* only_diagnostics = app.add_flag_callback(
      "--only-diagnostics", [] { options.bandwidth = options.model = false; }, "Only the diagnostics");
  auto* only_model = app.add_flag_callback(
      "--only-model", [] { options.bandwidth = options.diagnostics = false; }, "Only the model run");
  no_model->excludes(only_model);
  only_diagnostics->excludes(only_model);
  app.add_option("--model", options.model_path, "The model file of the model run")->type_name("FILE")
      ->capture_default_str();
  app.add_option("--model-scale", options.model_scale, "The model run's sizes divided by K")->type_name("K")
      ->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_option("--busy-poll-us", options.busy_poll_us, "dbufd's busy-poll time")->type_name("US")
      ->capture_default_str();
  app.add_flag("--quick", quick, "Sizes 1,4,16,64, 3 repeats, model scale 4 (where not given)");
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  CLI::App app{"bench_collectives: dbufd's all-gather and reduce-scatter against memcpy and gloo, and a model run",
               "bench_collectives"};
  dbuf::cli::useConventions(app);
  describeOptions(app, quick);
  if (const auto done = dbuf::cli::parse(app, argc, argv)) return *done;
  if (quick) {
    if (app.count("--sizes") == 0) options.sizes_mib = {1, 4, 16, 64};
    if (app.count("--repeats") == 0) options.repeats = 3;
    if (app.count("--model-scale") == 0) options.model_scale = 4;
  }

  const int threads = dbuf::kernels::defaultThreads();
  {
    std::ifstream load("/proc/loadavg");
    std::string one, five;
    load >> one >> five;
    std::printf("load average before the run: %s (1 min) %s (5 min); MemAvailable %s\n", one.c_str(), five.c_str(),
                sizeText(memAvailable()).c_str());
  }
  std::printf(
      "collectives through dbufd (host backend), %u cores online, kernels::defaultThreads() = %d, "
      "dbufd busy_poll_us %u, median of %d after one warm-up\n",
      std::thread::hardware_concurrency(), threads, options.busy_poll_us, options.repeats);
  dbuf::bench::DaemonSettings settings;
  settings.busy_poll_us = options.busy_poll_us;
  dbuf::bench::DaemonProcess daemon(dbuf::bench::dbufdExecutable(), settings);
  if (!daemon.ok()) {
    std::fprintf(stderr, "bench_collectives: %s\n", daemon.error().c_str());
    return 1;  // (not die(): the destructor removes the temp directory)
  }
  daemon_pid = daemon.pid();
  bool model_ok = true;
  {
    if (options.bandwidth) {
      std::printf(
          "\n== bandwidth: bytes = W*W*P (allGather: written into the W ranks' unsharded params; "
          "reduceScatter: read from their unsharded grads); cpy = memcpy of W*W copies of P bytes, %d threads; "
          "faults and cores = dbufd's minor faults and CPU seconds per op / run ==\n",
          threads);
      printRowsHeader();
      for (const std::uint32_t world : options.worlds) {
        for (const std::uint64_t mib : options.sizes_mib) bandwidthCase(daemon, world, mib * kMiB, dbuf::DType::kBF16);
        if (options.cast_rows) bandwidthCase(daemon, world, 64 * kMiB, dbuf::DType::kF32);
      }
      // The target: >= 0.8 of memcpy at 64 MiB per rank and above.
      std::printf("\ntarget (>= 0.80 of memcpy at 64 MiB per rank and above, run time):\n");
      for (const Row& row : rows) {
        if (row.part < 64 * kMiB || row.op == kOpNames[kAllGatherCold]) continue;
        const double ratio = row.run_ratio;
        std::printf("  %-14s %u ranks %8s %s: %.2f %s\n", row.op.c_str(), row.world, sizeText(row.part).c_str(),
                    row.dtypes.c_str(), ratio, ratio >= 0.8 ? "met" : "MISSED");
      }
    }
    if (options.diagnostics) diagnostics();
  }
  if (options.model) model_ok = modelMemory(daemon);
  {
    std::ifstream load("/proc/loadavg");
    std::string one, five;
    load >> one >> five;
    std::printf("\nload average after the run: %s (1 min) %s (5 min)\n", one.c_str(), five.c_str());
  }
  if (!daemon.stop()) {
    std::fprintf(stderr, "bench_collectives: dbufd did not exit cleanly\n");
    ++failures;
  }
  if (failures != 0 || !model_ok) {
    std::fprintf(stderr, "bench_collectives: %d failure(s)%s\n", failures, model_ok ? "" : ", memory over the bound");
    return 1;
  }
  return 0;
}
