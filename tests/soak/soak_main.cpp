// dbuf-soak: several jobs of several rank processes run random collectives
// through a real dbufd for a given time, every result checked against the
// reference (soak_rank.cpp), while a chaos loop kills random ranks with
// SIGKILL. Ranks of persistent jobs are started again and rejoin their job;
// the other jobs end cleanly when they lose a rank and start again as a new
// job. The daemon's RSS, fds and mappings are sampled throughout and must be
// back where they started once every job has ended. With --kill-daemon it
// finally kills dbufd itself under load: every rank's call must return
// kUnavailable within --unavailable-ms, and a new dbufd must serve on the
// same socket at once.
//
//   dbuf-soak [--dbufd PATH] [--duration S] [--jobs N] [--max-ranks R] [--seed N]
//             [--kill-every-ms MS] [--groups G] [--max-elements E] [--kill-daemon]
//             [--unavailable-ms MS] [--samples FILE.csv] [--no-resource-check] [--keep]
//   dbuf-soak rank ...   (one rank process; started by the supervisor)
//
// Exit status: 0 when nothing went wrong, 1 otherwise (the reasons are printed).
#include <dirent.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dbuf/cli/command_line.hpp"
#include "dbuf/common/result.hpp"
#include "soak_rank.hpp"
#include "soak_stats.hpp"
#include "support/child_process.hpp"
#include "support/sanitizers.hpp"
#include "support/temp_dir.hpp"
#include "support/text.hpp"

namespace dbuf::soak {
namespace {

using dbuf::testing::Child;
using std::chrono::milliseconds;

constexpr std::int64_t kMs = 1'000'000;  // ns

/// A deadline that only stops a hung process (dbufd starting or stopping, a
/// rank exiting, dbufd settling): longer under the sanitizers, where
/// everything is slower. Never a time the soak measures.
milliseconds hangLimit(int ms) { return dbuf::testing::sanitizerScaled(milliseconds(ms)); }
std::int64_t hangLimitNs(int ms) { return hangLimit(ms).count() * kMs; }

// ---------------------------------------------------------------- arguments

struct Options {
  std::string dbufd;
  int duration_s = 120;
  std::uint32_t jobs = 3;
  std::uint32_t max_ranks = 4;
  std::uint64_t seed = 1;
  int kill_every_ms = 2000;
  std::uint32_t groups = 3;
  std::int64_t max_elements = 1 << 17;
  bool kill_daemon = false;
  bool check_resources = true;  ///< dbufd back at its baseline at the end
  int unavailable_ms = 20;
  std::string samples;
  bool keep = false;
};

std::string selfExecutable() {
  return std::filesystem::read_symlink("/proc/self/exe").string();
}

/// What a run of the soak is told.
void describeSoak(CLI::App& app, Options& options) {
  options.dbufd = (std::filesystem::path(selfExecutable()).parent_path() / "dbufd").string();
  app.add_option("--dbufd", options.dbufd, "The dbufd to run (default: the one beside dbuf-soak)")
      ->type_name("PATH")
      ->capture_default_str();
  app.add_option("--duration", options.duration_s, "Seconds of chaos")->type_name("S")->check(CLI::Range(1, 1 << 30))
      ->capture_default_str();
  app.add_option("--jobs", options.jobs, "Jobs at once")->type_name("N")->check(CLI::Range(1U, 1U << 16))
      ->capture_default_str();
  app.add_option("--max-ranks", options.max_ranks, "Most ranks of a job")->type_name("R")
      ->check(CLI::Range(2U, 1U << 10))->capture_default_str();
  app.add_option("--seed", options.seed, "Seed of every random choice")->type_name("N")->capture_default_str();
  app.add_option("--kill-every-ms", options.kill_every_ms, "Mean time between rank kills (0: no kills)")
      ->type_name("MS")->check(CLI::Range(0, 1 << 30))->capture_default_str();
  app.add_option("--groups", options.groups, "Groups of each job")->type_name("G")->check(CLI::Range(1U, 1U << 10))
      ->capture_default_str();
  app.add_option("--max-elements", options.max_elements, "Elements of a job's largest group")->type_name("E")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 40))->capture_default_str();
  app.add_flag("--kill-daemon", options.kill_daemon,
               "Kill dbufd itself under load at the end: every call must fail within --unavailable-ms");
  app.add_option("--unavailable-ms", options.unavailable_ms, "Most a call may take to fail when dbufd dies")
      ->type_name("MS")->check(CLI::Range(1, 1 << 30))->capture_default_str();
  app.add_option("--samples", options.samples, "Write the daemon's RSS, fds and mappings over time here")
      ->type_name("FILE.csv");
  app.add_flag_callback(
      "--no-resource-check", [&options] { options.check_resources = false; },
      "Do not require dbufd back at its baseline (RSS, fds, mappings) at the end");
  app.add_flag("--keep", options.keep, "Keep the logs even when nothing went wrong");
}

/// `dbuf-soak rank ...`: one rank process, as the supervisor starts it.
CLI::App* describeRank(CLI::App& app, RankArgs& args) {
  CLI::App* rank = app.add_subcommand("rank", "One rank process (the supervisor starts them; not for people)");
  rank->add_option("--socket", args.socket, "dbufd's socket")->required();
  rank->add_option("--job", args.job, "The job's id")->required();
  rank->add_option("--rank", args.rank, "This rank")->required();
  rank->add_option("--world", args.world, "The job's ranks")->check(CLI::Range(1U, 1U << 10));
  rank->add_option("--seed", args.seed, "The job's seed: every rank draws the same groups and ops");
  rank->add_option("--persistent", args.persistent, "1: the supervisor restarts this rank when killed");
  rank->add_option("--stats", args.stats_path, "The RankStats file the supervisor made")->required();
  rank->add_option("--groups", args.groups, "Groups of the job")->check(CLI::Range(1U, 1U << 10));
  rank->add_option("--max-elements", args.max_elements, "Elements of the largest group")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 40));
  rank->add_option("--full-size", args.full_size, "1: every group that large");
  return rank;
}

// ---------------------------------------------------------------- the daemon

/// What /proc says of a process.
struct ProcessSample {
  std::int64_t rss_kib = 0;
  std::int64_t rss_anon_kib = 0;  ///< the daemon's own heap and stacks (shared memory is RssShmem)
  int fds = 0;
  int memfds = 0;  ///< of which dbuf memfds
  int maps = 0;    ///< lines of /proc/<pid>/maps
  std::string threads;  ///< the names of its threads
};

ProcessSample sample(pid_t pid) {
  ProcessSample s;
  const std::string proc = "/proc/" + std::to_string(pid);
  std::ifstream status(proc + "/status");
  for (std::string line; std::getline(status, line);) {
    std::istringstream fields(line);
    std::string name;
    std::int64_t kib = 0;
    fields >> name >> kib;
    if (name == "VmRSS:") s.rss_kib = kib;
    if (name == "RssAnon:") s.rss_anon_kib = kib;
  }
  if (DIR* fds = ::opendir((proc + "/fd").c_str()); fds != nullptr) {
    while (const dirent* entry = ::readdir(fds)) {
      if (entry->d_name[0] == '.') continue;
      ++s.fds;
      char target[256] = {};
      const std::string link = proc + "/fd/" + entry->d_name;
      if (::readlink(link.c_str(), target, sizeof target - 1) > 0 && std::strncmp(target, "/memfd:dbuf:", 12) == 0) {
        ++s.memfds;
      }
    }
    ::closedir(fds);
  }
  if (DIR* tasks = ::opendir((proc + "/task").c_str()); tasks != nullptr) {
    while (const dirent* entry = ::readdir(tasks)) {
      if (entry->d_name[0] == '.') continue;
      std::string name = dbuf::testing::readFile(proc + "/task/" + entry->d_name + "/comm");
      if (!name.empty() && name.back() == '\n') name.pop_back();
      s.threads += (s.threads.empty() ? "" : " ") + name;
    }
    ::closedir(tasks);
  }
  std::ifstream maps(proc + "/maps");
  for (std::string line; std::getline(maps, line);) ++s.maps;
  return s;
}

bool accepts(const std::string& socket) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, socket.c_str(), std::min(socket.size() + 1, sizeof address.sun_path - 1));
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): the sockets API
  const bool connected = ::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) == 0;
  ::close(fd);
  return connected;
}

class Daemon {
 public:
  Daemon(const Options& options, const dbuf::testing::TempDir& dir)
      : executable_(options.dbufd), socket_(dir.path("dbufd.sock")), log_(dir.path("dbufd.log")) {
    std::ostringstream config;
    config << "[daemon]\nsocket = \"" << socket_ << "\"\nlog_level = \"info\"\nmemory_limit = \"8GiB\"\n"
           << "[timeouts]\ncollective_ms = 20000\nregister_ms = 30000\n"
           << "[persistence]\ngrace_period_s = 1\n";
    config_ = dir.write("dbufd.toml", config.str());
  }

  /// Starts dbufd; the ms until it accepted, or nullopt if it did not within hangLimit(10 s).
  std::optional<double> start() {
    const std::int64_t started = monotonicNs();
    Child::Options options;
    options.stderr_path = log_;
    process_ = std::make_unique<Child>(executable_, std::vector<std::string>{"--config", config_}, options);
    while (monotonicNs() - started < hangLimitNs(10'000)) {
      if (process_->waitExit(milliseconds(0))) return std::nullopt;
      if (accepts(socket_)) return static_cast<double>(monotonicNs() - started) / kMs;
      std::this_thread::sleep_for(milliseconds(1));
    }
    return std::nullopt;
  }
  [[nodiscard]] bool alive() { return process_ && process_->running() && !process_->waitExit(milliseconds(0)); }
  [[nodiscard]] ProcessSample sample() const { return soak::sample(process_->pid()); }
  [[nodiscard]] std::string maps() const {
    return dbuf::testing::readFile("/proc/" + std::to_string(process_->pid()) + "/maps");
  }
  void kill9() { process_->killAndReap(); }
  int terminate() {
    process_->signal(SIGTERM);
    return process_->waitExit(hangLimit(10'000)).value_or(-1);
  }
  [[nodiscard]] const std::string& socket() const noexcept { return socket_; }
  [[nodiscard]] const std::string& log() const noexcept { return log_; }

 private:
  std::string executable_;
  std::string socket_;
  std::string log_;
  std::string config_;
  std::unique_ptr<Child> process_;
};

// ---------------------------------------------------------------- totals

struct Totals {
  std::uint64_t ops[kOpKinds] = {};
  std::uint64_t bytes = 0;
  std::uint64_t errors[kErrorCodes] = {};
  std::uint64_t shutdown_errors = 0;
  std::uint64_t resyncs = 0;
  std::uint64_t reattached = 0;
  std::uint64_t kills = 0;
  std::uint64_t restarts = 0;
  std::uint64_t jobs_ended = 0;  ///< jobs that ended cleanly after losing a rank
  std::uint64_t jobs_started = 0;

  void add(const RankStats& s) {
    for (std::uint32_t k = 0; k < kOpKinds; ++k) ops[k] += s.ops[k].load(std::memory_order_relaxed);
    bytes += s.bytes.load(std::memory_order_relaxed);
    for (std::uint32_t c = 0; c < kErrorCodes; ++c) errors[c] += s.errors[c].load(std::memory_order_relaxed);
    shutdown_errors += s.shutdown_errors.load(std::memory_order_relaxed);
    resyncs += s.resyncs.load(std::memory_order_relaxed);
    reattached += s.reattached.load(std::memory_order_relaxed);
  }
  [[nodiscard]] std::uint64_t collectives() const {
    std::uint64_t n = 0;
    for (std::uint32_t k = 0; k < kOpKinds; ++k) n += ops[k];
    return n;
  }
};

// ---------------------------------------------------------------- jobs and ranks

struct RankProcess {
  std::uint32_t rank = 0;
  std::unique_ptr<Child> child;
  RankStats* stats = nullptr;
  std::int64_t restart_at_ns = 0;  ///< a killed rank of a persistent job: when to start it again
};

struct SoakJob {
  std::uint32_t slot = 0;
  bool persistent = false;
  std::uint32_t world = 2;
  std::uint64_t seed = 0;
  std::uint32_t generation = 0;
  bool lost_rank = false;  ///< the chaos killed one of this generation's ranks
  std::string id;
  std::vector<RankProcess> ranks;
};

class Soak {
 public:
  Soak(const Options& options, const dbuf::testing::TempDir& dir)
      : options_(options), dir_(dir), daemon_(options, dir), rng_(options.seed), self_(selfExecutable()) {}

  int run() {
    if (!daemon_.start()) return fatal("dbufd did not start accepting (log: " + daemon_.log() + ")");
    std::printf("dbuf-soak: dbufd on %s, %d s, %u jobs of up to %u ranks, a kill every ~%d ms, seed %llu\n",
                daemon_.socket().c_str(), options_.duration_s, options_.jobs, options_.max_ranks,
                options_.kill_every_ms, static_cast<unsigned long long>(options_.seed));
    warmUp();
    const ProcessSample baseline = daemon_.sample();
    baseline_maps_ = daemon_.maps();
    openSamples();
    soakWithChaos();
    stopAll();
    if (options_.check_resources) checkBackToBaseline(baseline);
    if (options_.kill_daemon && daemon_.alive()) killDaemonUnderLoad();
    report(baseline);
    return problems_.empty() ? 0 : 1;
  }

 private:
  int fatal(const std::string& why) {
    problems_.push_back(why);
    report(ProcessSample{});
    return 1;
  }

  void problem(const std::string& why) {
    std::printf("PROBLEM: %s\n", why.c_str());
    std::fflush(stdout);
    problems_.push_back(why);
  }

  // ---- processes

  /// `max_elements`: of the job's largest group; 0: the soak's, groups of every size up to it.
  void startRank(SoakJob& job, RankProcess& rank, std::int64_t max_elements = 0) {
    const std::string stats = dir_.path("stats-" + job.id + "-r" + std::to_string(rank.rank) + "-" +
                                        std::to_string(++incarnations_));
    rank.stats = mapStats(stats, true);
    Child::Options options;
    options.stderr_path = dir_.path(job.id + ".log");
    rank.child = std::make_unique<Child>(
        self_,
        std::vector<std::string>{"rank", "--socket", daemon_.socket(), "--job", job.id, "--rank",
                                 std::to_string(rank.rank), "--world", std::to_string(job.world), "--seed",
                                 std::to_string(job.seed), "--persistent", job.persistent ? "1" : "0", "--stats",
                                 stats, "--groups", std::to_string(options_.groups), "--max-elements",
                                 std::to_string(max_elements > 0 ? max_elements : options_.max_elements),
                                 "--full-size", max_elements > 0 ? "1" : "0"},
        options);
    rank.restart_at_ns = 0;
  }

  /// Folds a finished process's counters into the totals.
  void retire(RankProcess& rank) {
    if (rank.stats == nullptr) return;
    totals_.add(*rank.stats);
    unmapStats(rank.stats);
    rank.stats = nullptr;
    rank.child.reset();
  }

  void startJob(SoakJob& job) {
    ++job.generation;
    job.lost_rank = false;
    job.id = std::string(job.persistent ? "soak-p" : "soak-e") + std::to_string(job.slot) + "-g" +
             std::to_string(job.generation) + "-" + std::to_string(phase_);
    job.seed = rng_();
    job.ranks.clear();
    job.ranks.resize(job.world);
    for (std::uint32_t r = 0; r < job.world; ++r) {
      job.ranks[r].rank = r;
      startRank(job, job.ranks[r]);
    }
    ++totals_.jobs_started;
  }

  void startJobs() {
    ++phase_;
    jobs_.clear();
    jobs_.resize(options_.jobs);
    for (std::uint32_t j = 0; j < options_.jobs; ++j) {
      SoakJob& job = jobs_[j];
      job.slot = j;
      job.persistent = j % 2 == 0;
      job.world = static_cast<std::uint32_t>(2 + rng_() % (options_.max_ranks - 1));
      startJob(job);
    }
  }

  /// A rank that exited by itself: judged by how it says it ended.
  void exited(SoakJob& job, RankProcess& rank, int status, bool stopping) {
    const auto end = static_cast<RankEnd>(rank.stats->end.load(std::memory_order_relaxed));
    const std::string who = job.id + " rank " + std::to_string(rank.rank);
    const bool clean_exit = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!clean_exit) {
      problem(who + " exited with status " + std::to_string(status) + " (" + rankEndName(end) + "; log " +
              dir_.path(job.id + ".log") + ")");
    } else if (end == RankEnd::kJobLostRank && !job.lost_rank && !stopping) {
      problem(who + " ended its job for a lost rank, but no rank of it was killed");
    } else if ((end == RankEnd::kStopped && !stopping) || end == RankEnd::kDaemonGone) {
      problem(who + " ended (" + std::string(rankEndName(end)) + ") without a reason");
    }
    retire(rank);
  }

  /// One pass over every process: reaps the ones that ended, restarts killed
  /// ranks of persistent jobs when due, starts over jobs that ended.
  void tend(std::int64_t now) {
    for (SoakJob& job : jobs_) {
      bool any_alive = false;
      for (RankProcess& rank : job.ranks) {
        if (rank.child) {
          if (const auto status = rank.child->waitExit(milliseconds(0))) {
            exited(job, rank, *status, false);
          } else {
            any_alive = true;
          }
        }
        if (!rank.child && rank.restart_at_ns != 0 && now >= rank.restart_at_ns) {
          startRank(job, rank);
          ++totals_.restarts;
          any_alive = true;
        }
      }
      const bool restarts_due = std::any_of(job.ranks.begin(), job.ranks.end(),
                                            [](const RankProcess& r) { return r.restart_at_ns != 0; });
      if (!any_alive && !restarts_due) {
        if (!job.persistent && job.lost_rank) ++totals_.jobs_ended;
        startJob(job);
      }
    }
  }

  void killOne(std::int64_t now) {
    std::vector<std::pair<SoakJob*, RankProcess*>> alive;
    for (SoakJob& job : jobs_) {
      for (RankProcess& rank : job.ranks) {
        if (rank.child) alive.emplace_back(&job, &rank);
      }
    }
    if (alive.empty()) return;
    auto [job, rank] = alive[rng_() % alive.size()];
    rank->child->killAndReap();
    retire(*rank);
    ++totals_.kills;
    job->lost_rank = true;
    if (job->persistent) rank->restart_at_ns = now + static_cast<std::int64_t>(rng_() % 500) * kMs;
  }

  // ---- phases

  /// One short job before the baseline, so that everything the daemon makes
  /// lazily exists when the baseline is taken: groups large enough that the
  /// kernels run on every thread they may use (glibc keeps the stacks of
  /// threads that ended, and their malloc arenas, for the next ones).
  void warmUp() {
    SoakJob job;
    job.slot = 99;
    job.world = 2;
    job.seed = rng_();
    job.id = "soak-warm-up";
    job.ranks.resize(2);
    for (std::uint32_t r = 0; r < 2; ++r) {
      job.ranks[r].rank = r;
      startRank(job, job.ranks[r], std::max<std::int64_t>(options_.max_elements, 1 << 20));
    }
    const std::int64_t deadline = monotonicNs() + hangLimitNs(10'000);
    while (monotonicNs() < deadline && job.ranks[0].stats->ops[0].load() + job.ranks[0].stats->ops[1].load() < 5) {
      std::this_thread::sleep_for(milliseconds(20));
    }
    stopJob(job);
    waitIdle(ProcessSample{}, hangLimit(10'000));
  }

  void soakWithChaos() {
    startJobs();
    const std::int64_t start = monotonicNs();
    const std::int64_t end = start + static_cast<std::int64_t>(options_.duration_s) * 1000 * kMs;
    std::exponential_distribution<double> gap(options_.kill_every_ms > 0 ? 1.0 / options_.kill_every_ms : 1.0);
    std::int64_t next_kill = options_.kill_every_ms > 0 ? start + static_cast<std::int64_t>(gap(rng_) * kMs) : end;
    std::int64_t next_sample = start;
    while (monotonicNs() < end) {
      const std::int64_t now = monotonicNs();
      if (!daemon_.alive()) {
        problem("dbufd died during the soak (log: " + daemon_.log() + ")");
        return;
      }
      tend(now);
      if (now >= next_kill) {
        killOne(now);
        next_kill = now + static_cast<std::int64_t>(gap(rng_) * kMs);
      }
      if (now >= next_sample) {
        writeSample(now - start);
        next_sample += 1000 * kMs;
      }
      std::this_thread::sleep_for(milliseconds(10));
    }
  }

  /// SIGTERM to every rank of the job; each must exit within hangLimit(10 s).
  void stopJob(SoakJob& job) {
    for (RankProcess& rank : job.ranks) {
      if (rank.child) rank.child->signal(SIGTERM);
      rank.restart_at_ns = 0;
    }
    for (RankProcess& rank : job.ranks) {
      if (!rank.child) continue;
      if (const auto status = rank.child->waitExit(hangLimit(10'000))) {
        exited(job, rank, *status, true);
      } else {
        problem(job.id + " rank " + std::to_string(rank.rank) + " hung: no exit " +
                std::to_string(hangLimit(10'000).count()) + " ms after SIGTERM");
        rank.child->killAndReap();
        retire(rank);
      }
    }
  }

  void stopAll() {
    for (SoakJob& job : jobs_) stopJob(job);
  }

  /// Polls until the daemon holds no memfd and as many fds and mappings as
  /// at `baseline` (zero fields: only no memfd).
  bool waitIdle(const ProcessSample& baseline, milliseconds timeout) {
    const std::int64_t deadline = monotonicNs() + timeout.count() * kMs;
    for (;;) {
      const ProcessSample now = daemon_.sample();
      const bool idle = now.memfds == 0 && (baseline.fds == 0 || (now.fds == baseline.fds && now.maps == baseline.maps));
      if (idle) return true;
      if (monotonicNs() > deadline) return false;
      std::this_thread::sleep_for(milliseconds(50));
    }
  }

  void checkBackToBaseline(const ProcessSample& baseline) {
    if (!daemon_.alive()) return;
    // Persistent jobs are kept for the grace period (1 s) once all their ranks are gone.
    const bool idle = waitIdle(baseline, hangLimit(10'000));
    final_ = daemon_.sample();
    if (!idle) {
      dir_.write("dbufd-maps-baseline.log", baseline_maps_);
      dir_.write("dbufd-maps-end.log", daemon_.maps());
      problem("dbufd did not return to its baseline: fds " + std::to_string(final_.fds) + " (baseline " +
              std::to_string(baseline.fds) + "), memfds " + std::to_string(final_.memfds) + ", mappings " +
              std::to_string(final_.maps) + " (baseline " + std::to_string(baseline.maps) + "), threads " +
              final_.threads + " (baseline " + baseline.threads + ")");
    }
    // The heap may keep some freed memory for reuse; a leak grows with the run.
    const std::int64_t allowed = baseline.rss_anon_kib + std::max<std::int64_t>(32 * 1024, baseline.rss_anon_kib / 4);
    if (final_.rss_anon_kib > allowed) {
      problem("dbufd's anonymous memory grew from " + std::to_string(baseline.rss_anon_kib) + " KiB to " +
              std::to_string(final_.rss_anon_kib) + " KiB over the run");
    }
  }

  void killDaemonUnderLoad() {
    startJobs();
    // Load: every job has done a few ops (or hangLimit(10 s) passed).
    const std::int64_t deadline = monotonicNs() + hangLimitNs(10'000);
    const auto busy = [&] {
      return std::all_of(jobs_.begin(), jobs_.end(), [](const SoakJob& job) {
        const RankStats& s = *job.ranks[0].stats;
        return s.ops[0].load() + s.ops[1].load() + s.ops[2].load() + s.ops[3].load() >= 3;
      });
    };
    while (monotonicNs() < deadline && !busy()) std::this_thread::sleep_for(milliseconds(10));
    const std::int64_t killed = monotonicNs();
    daemon_.kill9();
    const double reaped_ms = static_cast<double>(monotonicNs() - killed) / kMs;
    const std::optional<double> restart_ms = daemon_.start();
    std::vector<double> latencies;
    for (SoakJob& job : jobs_) {
      for (RankProcess& rank : job.ranks) {
        const auto status = rank.child->waitExit(hangLimit(5'000));
        const std::string who = job.id + " rank " + std::to_string(rank.rank);
        if (!status) {
          problem(who + " hung after dbufd was killed");
          rank.child->killAndReap();
        } else {
          const std::int64_t call = rank.stats->unavailable_call_ns.load();
          const std::int64_t returned = rank.stats->unavailable_return_ns.load();
          if (static_cast<RankEnd>(rank.stats->end.load()) != RankEnd::kDaemonGone || returned == 0) {
            problem(who + " did not see kUnavailable after dbufd was killed (" +
                    rankEndName(static_cast<RankEnd>(rank.stats->end.load())) + ")");
          } else {
            latencies.push_back(static_cast<double>(returned - std::max(call, killed)) / kMs);
            std::printf("  %s: its call started %+.2f ms from the kill and returned kUnavailable at %+.2f ms\n",
                        who.c_str(), static_cast<double>(call - killed) / kMs, static_cast<double>(returned - killed) / kMs);
          }
        }
        retire(rank);
      }
    }
    std::sort(latencies.begin(), latencies.end());
    std::printf("kill dbufd under load: %zu ranks returned kUnavailable within %.2f ms of the kill (median %.2f ms); "
                "dbufd was reaped %.1f ms after the SIGKILL, and a new one accepted on the same socket %.1f ms later\n",
                latencies.size(), latencies.empty() ? 0.0 : latencies.back(),
                latencies.empty() ? 0.0 : latencies[latencies.size() / 2], reaped_ms, restart_ms.value_or(-1.0));
    if (!latencies.empty() && latencies.back() > options_.unavailable_ms) {
      problem("a rank took " + std::to_string(latencies.back()) + " ms to see dbufd gone (limit " +
              std::to_string(options_.unavailable_ms) + " ms)");
    }
    if (!restart_ms) {
      problem("a new dbufd did not start on the same socket");
      return;
    }
    // The new daemon serves: one more short job on it.
    warmUp();
    if (daemon_.terminate() != 0) problem("the new dbufd did not stop cleanly on SIGTERM");
  }

  // ---- output

  void openSamples() {
    if (options_.samples.empty()) return;
    samples_.open(options_.samples);
    samples_ << "seconds,rss_kib,rss_anon_kib,fds,memfds,maps,collectives,kills\n";
  }

  void writeSample(std::int64_t elapsed_ns) {
    const ProcessSample s = daemon_.sample();
    peak_.rss_anon_kib = std::max(peak_.rss_anon_kib, s.rss_anon_kib);
    peak_.rss_kib = std::max(peak_.rss_kib, s.rss_kib);
    peak_.fds = std::max(peak_.fds, s.fds);
    peak_.maps = std::max(peak_.maps, s.maps);
    if (!samples_.is_open()) return;
    Totals now = totals_;
    for (const SoakJob& job : jobs_) {
      for (const RankProcess& rank : job.ranks) {
        if (rank.stats != nullptr) now.add(*rank.stats);
      }
    }
    samples_ << elapsed_ns / 1'000'000'000 << ',' << s.rss_kib << ',' << s.rss_anon_kib << ',' << s.fds << ','
             << s.memfds << ',' << s.maps << ',' << now.collectives() << ',' << totals_.kills << '\n'
             << std::flush;
  }

  void report(const ProcessSample& baseline) {
    const Totals& t = totals_;
    std::printf("collectives checked: %llu (", static_cast<unsigned long long>(t.collectives()));
    for (std::uint32_t k = 0; k < kOpKinds; ++k) {
      std::printf("%s%s %llu", k == 0 ? "" : ", ", opKindName(static_cast<OpKind>(k)),
                  static_cast<unsigned long long>(t.ops[k]));
    }
    std::printf("), %.2f GiB of results compared bitwise\n", static_cast<double>(t.bytes) / (1ULL << 30));
    std::printf("jobs started %llu; ranks killed %llu, restarted %llu (reattached to kept memory %llu); jobs ended "
                "cleanly after a lost rank %llu; resynchronisations %llu\n",
                static_cast<unsigned long long>(t.jobs_started), static_cast<unsigned long long>(t.kills),
                static_cast<unsigned long long>(t.restarts), static_cast<unsigned long long>(t.reattached),
                static_cast<unsigned long long>(t.jobs_ended), static_cast<unsigned long long>(t.resyncs));
    std::printf("failed calls by code:");
    bool any = false;
    for (std::uint32_t c = 0; c < kErrorCodes; ++c) {
      if (t.errors[c] == 0) continue;
      std::printf(" %s %llu", std::string(toString(static_cast<ErrorCode>(c))).c_str(),
                  static_cast<unsigned long long>(t.errors[c]));
      any = true;
    }
    std::printf("%s (and %llu while stopping)\n", any ? "" : " none", static_cast<unsigned long long>(t.shutdown_errors));
    std::printf("dbufd: anonymous RSS %lld KiB at the baseline, %lld KiB at the peak, %lld KiB at the end; fds %d / %d "
                "/ %d; mappings %d / %d / %d\n",
                static_cast<long long>(baseline.rss_anon_kib), static_cast<long long>(peak_.rss_anon_kib),
                static_cast<long long>(final_.rss_anon_kib), baseline.fds, peak_.fds, final_.fds, baseline.maps,
                peak_.maps, final_.maps);
    const std::uint64_t timeouts = t.errors[static_cast<std::uint32_t>(ErrorCode::kTimeout)];
    if (timeouts > 0) problems_.push_back(std::to_string(timeouts) + " calls timed out (nothing should hang)");
    if (problems_.empty()) {
      std::printf("dbuf-soak: PASS\n");
    } else {
      std::printf("dbuf-soak: FAIL\n");
      for (const std::string& p : problems_) std::printf("  - %s\n", p.c_str());
    }
    std::fflush(stdout);
  }

  const Options& options_;
  const dbuf::testing::TempDir& dir_;
  Daemon daemon_;
  std::mt19937_64 rng_;
  std::string self_;
  std::vector<SoakJob> jobs_;
  Totals totals_;
  std::uint64_t incarnations_ = 0;
  int phase_ = 0;
  ProcessSample peak_;
  ProcessSample final_;
  std::string baseline_maps_;
  std::ofstream samples_;
  std::vector<std::string> problems_;
};

}  // namespace
}  // namespace dbuf::soak

int main(int argc, char** argv) {
  using namespace dbuf::soak;  // NOLINT(google-build-using-namespace): the entry point
  Options options;
  RankArgs rank_args;
  CLI::App app{"dbuf-soak: several jobs run random collectives through a real dbufd, every result checked, while "
               "ranks are killed",
               "dbuf-soak"};
  dbuf::cli::useConventions(app);
  describeSoak(app, options);
  const CLI::App* rank = describeRank(app, rank_args);
  app.footer("exit status: 0 when nothing went wrong, 1 otherwise (the reasons are printed), 2 bad usage");
  if (const auto done = dbuf::cli::parse(app, argc, argv)) return *done;
  if (rank->parsed()) return runRank(rank_args);
  std::optional<dbuf::testing::TempDir> dir(std::in_place, "dbuf-soak");
  const int status = Soak(options, *dir).run();
  if (options.keep || status != 0) {
    // The temp dir goes with `dir`: the logs are copied out first.
    const std::filesystem::path kept = std::filesystem::temp_directory_path() / ("dbuf-soak-logs-" + std::to_string(::getpid()));
    std::filesystem::create_directories(kept);
    for (const auto& entry : std::filesystem::directory_iterator(dir->path())) {
      if (entry.path().extension() == ".log") std::filesystem::copy(entry.path(), kept / entry.path().filename());
    }
    std::printf("dbuf-soak: logs copied to %s\n", kept.c_str());
  }
  return status;
}
