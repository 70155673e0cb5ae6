// Control round-trip latency between two processes: a client (this process,
// timed) and a responder (a forked child), each pinned to its own core when
// two or more are usable. Every row is measured in the same run, so the
// ratios against the bare shared-memory ping-pong (the lower limit) hold for
// this machine at this moment. Figures go to docs/.
//
//   bench_control [--iterations N] [--quick] [--baseline-dbufd PATH] [--rounds R]
//
//   1. bare shared-memory ping-pong: one atomic counter per side in a
//      MAP_SHARED memfd, both spinning;
//   2. Unix socket ping-pong: socketpair, 8-byte messages, blocking read/write;
//   3. Boost.Interprocess message_queue ping-pong: two queues;
//   4. dbuf rings, busy-poll: trySubmit(noop) + wakeDaemon, waitForCompletion
//      (long busy-poll), tryReap; the responder spins on take / complete /
//      wakeClient (the rings' own cost, without dbufd);
//   5. dbuf rings, sleeping: the client never busy-polls (futex) and the
//      responder sleeps on the session eventfd (setSleeping, re-check, poll);
//   6. through dbufd: a real dbufd (spawned with a temp config and socket,
//      pinned to the responder's core) and a libdbuf Client attached as a
//      1-rank job, round trip = Client::submitNoop + Client::wait; busy-poll
//      (daemon busy_poll_us = 100000: it keeps spinning, and the client spins
//      the Welcome's busy_poll_us) and sleeping (busy_poll_us = 0: the daemon
//      sleeps in epoll on the session doorbell, the client on a futex).
//      dbufd is $DBUFD, else the build's dbufd; the rows are skipped (with a
//      line saying why) when it cannot be started.
//
//   7. through dbufd, a barrier of the 1-rank job: the smallest collective,
//      matched, recorded (flight recorder, metrics) and completed by the data
//      plane; with --baseline-dbufd PATH (a build of another revision, the
//      same protocol) it runs in rounds alternating between that dbufd and
//      this one (each its own daemon, both spinning 50 us after work, as
//      shipped, on the responder's core) and prints each round's p50 and the
//      ratio: what a change of the data plane costs the smallest op.
//
// --iterations N times N round trips on the spinning rows (default 200000)
// and N / 10 on the blocking ones (default 20000); --quick is N = 20000.
// Each row first runs max(N / 10, 100) untimed round trips. One clock read
// per round trip (consecutive time stamps) is part of every figure.
//
// To add a row, set up its peer, then
//   rows.push_back(measure("name", config.busy_iterations, [&] { ... one round trip ... }));
// before printTable().
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dbuf/cli/command_line.hpp"
#include "dbuf/client.hpp"
#include "dbuf/common/shared_memory.hpp"
#include "dbuf/ipc/ring.hpp"
#include "dbufd_process.hpp"

#if defined(DBUF_BENCH_HAVE_BOOST_INTERPROCESS)
#include <boost/interprocess/ipc/message_queue.hpp>
#endif

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr std::uint64_t kStop = ~std::uint64_t{0};

struct Config {
  std::size_t busy_iterations = 200000;     ///< rows where both sides spin
  std::size_t blocking_iterations = 20000;  ///< rows where a side sleeps in the kernel
  int client_cpu = -1;                      ///< -1: not pinned
  int peer_cpu = -1;
  bool spin_yields = false;  ///< one usable core: spinning waits yield instead
};
Config config;

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "bench_control: %s\n", what.c_str());
  std::exit(1);
}

template <typename T>
T must(dbuf::Result<T> result, const char* what) {
  if (!result.ok()) die(std::string(what) + ": " + result.error().message);
  return std::move(*result);
}

/// Spin-wait step. With a single usable core the peer can only run if we
/// give the core up, so it yields then.
inline void relax() noexcept {
  if (config.spin_yields) {
    sched_yield();
    return;
  }
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

bool pinTo(int cpu) {
  if (cpu < 0) return true;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(static_cast<std::size_t>(cpu), &set);
  return sched_setaffinity(0, sizeof(set), &set) == 0;
}

/// Chooses the two cores (the first two this process may use) and pins this
/// process; returns a line that says what was done.
std::string setUpPinning() {
  const unsigned online = std::thread::hardware_concurrency();
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0) {
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
      if (CPU_ISSET(static_cast<std::size_t>(cpu), &allowed)) cpus.push_back(cpu);
    }
  }
  std::string line = std::to_string(online) + " cores online, " + std::to_string(cpus.size()) + " usable; ";
  if (cpus.size() < 2) {
    config.spin_yields = true;
    return line + "pinning: none (one usable core: client and responder share it, spinning waits yield)";
  }
  config.client_cpu = cpus[0];
  config.peer_cpu = cpus[1];
  if (!pinTo(config.client_cpu)) {
    const std::string why = std::strerror(errno);
    config.client_cpu = config.peer_cpu = -1;
    return line + "pinning: none (sched_setaffinity: " + why + ")";
  }
  return line + "pinning: client on cpu " + std::to_string(config.client_cpu) + ", responder on cpu " +
         std::to_string(config.peer_cpu);
}

// ------------------------------------------------------------- measurement

struct Stats {
  std::string name;
  std::size_t iterations = 0;
  double p50_us = 0;
  double p99_us = 0;
  double mean_us = 0;
};

/// Runs `round_trip` max(iterations / 10, 100) times untimed, then
/// `iterations` times timed, and summarises the timed ones.
template <typename Fn>
Stats measure(const char* name, std::size_t iterations, Fn&& round_trip) {
  const std::size_t warm_up = std::max<std::size_t>(iterations / 10, 100);
  for (std::size_t i = 0; i < warm_up; ++i) round_trip();
  std::vector<std::int64_t> ns(iterations);
  auto previous = Clock::now();
  for (std::size_t i = 0; i < iterations; ++i) {
    round_trip();
    const auto now = Clock::now();
    ns[i] = std::chrono::duration_cast<std::chrono::nanoseconds>(now - previous).count();
    previous = now;
  }
  Stats stats;
  stats.name = name;
  stats.iterations = iterations;
  if (ns.empty()) return stats;
  double total = 0;
  for (const auto value : ns) total += static_cast<double>(value);
  std::sort(ns.begin(), ns.end());
  const std::size_t n = ns.size();
  stats.p50_us = static_cast<double>(ns[n / 2]) / 1e3;
  stats.p99_us = static_cast<double>(ns[std::min(n - 1, n * 99 / 100)]) / 1e3;
  stats.mean_us = total / static_cast<double>(n) / 1e3;
  return stats;
}

/// Rows in order; ratios against row `baseline` (p50 over p50) and how many
/// times below row `socket` each row's p50 is (socket p50 over row p50).
void printTable(const std::vector<Stats>& rows, std::size_t baseline, std::size_t socket) {
  std::printf("%-3s %-46s %11s %9s %9s %9s %10s %12s\n", "#", "path", "round trips", "p50 us", "p99 us", "mean us",
              "p50/bare", "socket/p50");
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Stats& row = rows[i];
    const double base = rows[baseline].p50_us;
    const double sock = rows[socket].p50_us;
    std::printf("%-3zu %-46s %11zu %9.2f %9.2f %9.2f %10.2f %12.2f\n", i + 1, row.name.c_str(), row.iterations,
                row.p50_us, row.p99_us, row.mean_us, base > 0 ? row.p50_us / base : 0.0,
                row.p50_us > 0 ? sock / row.p50_us : 0.0);
  }
}

// --------------------------------------------------------------- responder

/// The responder: a forked child on the peer core that runs `body` and exits
/// with its return value. It dies with this process (PR_SET_PDEATHSIG).
class Peer {
 public:
  explicit Peer(const std::function<int()>& body) {
    std::fflush(nullptr);
    const pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ < 0) die(std::string("fork: ") + std::strerror(errno));
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(90);
      if (!pinTo(config.peer_cpu)) ::_exit(91);
      int code = 92;
      try {
        code = body();
      } catch (...) {
      }
      ::_exit(code);
    }
  }
  Peer(const Peer&) = delete;
  Peer& operator=(const Peer&) = delete;
  ~Peer() {
    if (pid_ > 0) {
      const int code = join();
      if (code != 0) std::fprintf(stderr, "bench_control: responder exited with %d\n", code);
    }
  }

  /// Waits up to 10 s for the responder to exit (then kills it, by its pid);
  /// its exit code, or -1.
  int join() {
    if (pid_ <= 0) return -1;
    const pid_t pid = std::exchange(pid_, -1);
    const auto deadline = Clock::now() + 10s;
    int status = 0;
    while (::waitpid(pid, &status, WNOHANG) == 0) {
      if (Clock::now() > deadline) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        return -1;
      }
      std::this_thread::sleep_for(1ms);
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

 private:
  pid_t pid_ = -1;
};

int failures = 0;

void expectJoined(Peer& peer, const char* row) {
  const int code = peer.join();
  if (code != 0) {
    std::fprintf(stderr, "bench_control: %s: responder exited with %d\n", row, code);
    ++failures;
  }
}

// ---------------------------------------------------------------- the rows

Stats bareSharedMemory() {
  constexpr const char* kName = "bare shared-memory ping-pong (spin)";
  const dbuf::UniqueFd fd = must(dbuf::createMemfd("dbuf-bench-bare", 4096), "memfd");
  const dbuf::Mapping map = must(dbuf::Mapping::map(fd.get(), 4096), "mmap");
  // One counter per side, each on its own cache line.
  std::atomic_ref<std::uint64_t> ping(*reinterpret_cast<std::uint64_t*>(map.data()));
  std::atomic_ref<std::uint64_t> pong(*reinterpret_cast<std::uint64_t*>(map.data() + 64));
  Peer peer([&] {
    std::uint64_t last = 0;
    while (true) {
      std::uint64_t value = 0;
      while ((value = ping.load(std::memory_order_acquire)) == last) relax();
      if (value == kStop) return 0;
      pong.store(value, std::memory_order_release);
      last = value;
    }
  });
  std::uint64_t sequence = 0;
  Stats stats = measure(kName, config.busy_iterations, [&] {
    ping.store(++sequence, std::memory_order_release);
    while (pong.load(std::memory_order_acquire) != sequence) relax();
  });
  ping.store(kStop, std::memory_order_release);
  expectJoined(peer, kName);
  return stats;
}

bool readFull(int fd, void* data, std::size_t bytes) {
  auto* at = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::read(fd, at, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    at += n;
    bytes -= static_cast<std::size_t>(n);
  }
  return true;
}

bool writeFull(int fd, const void* data, std::size_t bytes) {
  const auto* at = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, at, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    at += n;
    bytes -= static_cast<std::size_t>(n);
  }
  return true;
}

Stats unixSocket() {
  constexpr const char* kName = "Unix socket ping-pong (socketpair, blocking)";
  int fds[2] = {-1, -1};
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0)
    die(std::string("socketpair: ") + std::strerror(errno));
  dbuf::UniqueFd mine(fds[0]);
  dbuf::UniqueFd theirs(fds[1]);
  Peer peer([&] {
    mine.reset();  // so that the client's close reads as EOF here
    std::uint64_t value = 0;
    while (readFull(theirs.get(), &value, sizeof(value))) {
      if (!writeFull(theirs.get(), &value, sizeof(value))) return 1;
    }
    return 0;
  });
  theirs.reset();
  std::uint64_t sequence = 0;
  Stats stats = measure(kName, config.blocking_iterations, [&] {
    std::uint64_t value = ++sequence;
    if (!writeFull(mine.get(), &value, sizeof(value)) || !readFull(mine.get(), &value, sizeof(value)) ||
        value != sequence) {
      die("socket ping-pong broke");
    }
  });
  mine.reset();
  expectJoined(peer, kName);
  return stats;
}

#if defined(DBUF_BENCH_HAVE_BOOST_INTERPROCESS)
Stats boostMessageQueue() {
  namespace bip = boost::interprocess;
  constexpr const char* kName = "Boost.Interprocess message_queue ping-pong";
  const std::string base = "dbuf-bench-control-" + std::to_string(::getpid());
  const std::string to_peer = base + "-request";
  const std::string to_client = base + "-reply";
  bip::message_queue::remove(to_peer.c_str());
  bip::message_queue::remove(to_client.c_str());
  Stats stats;
  try {
    bip::message_queue requests(bip::create_only, to_peer.c_str(), 16, sizeof(std::uint64_t));
    bip::message_queue replies(bip::create_only, to_client.c_str(), 16, sizeof(std::uint64_t));
    Peer peer([&] {
      try {
        bip::message_queue in(bip::open_only, to_peer.c_str());
        bip::message_queue out(bip::open_only, to_client.c_str());
        while (true) {
          std::uint64_t value = 0;
          bip::message_queue::size_type received = 0;
          unsigned priority = 0;
          in.receive(&value, sizeof(value), received, priority);
          if (received != sizeof(value)) return 2;
          if (value == kStop) return 0;
          out.send(&value, sizeof(value), 0);
        }
      } catch (const bip::interprocess_exception&) {
        return 3;
      }
    });
    std::uint64_t sequence = 0;
    stats = measure(kName, config.blocking_iterations, [&] {
      std::uint64_t value = ++sequence;
      requests.send(&value, sizeof(value), 0);
      bip::message_queue::size_type received = 0;
      unsigned priority = 0;
      replies.receive(&value, sizeof(value), received, priority);
      if (received != sizeof(value) || value != sequence) die("message_queue ping-pong broke");
    });
    const std::uint64_t stop = kStop;
    requests.send(&stop, sizeof(stop), 0);
    expectJoined(peer, kName);
  } catch (const bip::interprocess_exception& error) {
    bip::message_queue::remove(to_peer.c_str());
    bip::message_queue::remove(to_client.c_str());
    die(std::string("message_queue: ") + error.what());
  }
  bip::message_queue::remove(to_peer.c_str());
  bip::message_queue::remove(to_client.c_str());
  return stats;
}
#endif

/// One session segment (memfd) and its eventfd, as dbufd would create them.
struct Session {
  static constexpr std::uint32_t kCapacity = 64;
  dbuf::UniqueFd memfd;
  dbuf::Mapping map;
  dbuf::UniqueFd eventfd;
  dbuf::ipc::DaemonRings daemon;
  dbuf::ipc::ClientRings client;

  Session() {
    const std::size_t bytes = dbuf::ipc::segmentBytes(kCapacity);
    memfd = must(dbuf::createMemfd("dbuf-bench-session", bytes), "memfd");
    map = must(dbuf::Mapping::map(memfd.get(), bytes), "mmap");
    daemon = must(dbuf::ipc::DaemonRings::format({map.data(), bytes}, kCapacity), "format");
    client = must(dbuf::ipc::ClientRings::attach({map.data(), bytes}), "attach");
    eventfd = dbuf::UniqueFd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!eventfd.valid()) die(std::string("eventfd: ") + std::strerror(errno));
  }
};

/// The responder's loop: answers every submission with a completion
/// carrying its handle; spins when `sleep` is false, else sleeps on the
/// eventfd. Returns at the kStop handle.
int respond(dbuf::ipc::DaemonRings& daemon, int eventfd, bool sleep) {
  using dbuf::ipc::TakeResult;
  while (true) {
    dbuf::ipc::Submission submission;
    const TakeResult result = daemon.take(submission);
    if (result == TakeResult::kCorrupt) return 2;
    if (result == TakeResult::kTaken) {
      dbuf::ipc::OpCode op{};
      if (!dbuf::ipc::opCodeFrom(submission.op, op) || op != dbuf::ipc::OpCode::kNoop) return 3;
      while (daemon.completionSpace() == 0) relax();
      dbuf::ipc::Completion completion;
      completion.handle = submission.handle;
      daemon.complete(completion);
      daemon.wakeClient();
      if (submission.handle == kStop) return 0;
      continue;
    }
    if (!sleep) {
      relax();
      continue;
    }
    daemon.setSleeping(true);
    if (!daemon.hasSubmission()) {
      pollfd readable{eventfd, POLLIN, 0};
      if (::poll(&readable, 1, -1) < 0 && errno != EINTR) return 4;
    }
    daemon.setSleeping(false);
    std::uint64_t count = 0;
    [[maybe_unused]] const auto drained = ::read(eventfd, &count, sizeof(count));
  }
}

/// One noop round trip on the client side; false if the ring misbehaved.
bool noopRoundTrip(Session& session, std::uint64_t handle, std::chrono::microseconds busy_poll,
                   Clock::time_point deadline) {
  dbuf::ipc::Submission submission;
  submission.op = static_cast<std::uint8_t>(dbuf::ipc::OpCode::kNoop);
  submission.handle = handle;
  if (!session.client.trySubmit(submission)) return false;
  session.client.wakeDaemon(session.eventfd.get());
  if (config.spin_yields && busy_poll.count() > 0) {
    // One core: a busy-poll would only keep the responder off it.
    while (!session.client.hasCompletion()) relax();
  } else if (!session.client.waitForCompletion(deadline, busy_poll)) {
    return false;
  }
  dbuf::ipc::Completion completion;
  std::size_t message_bytes = 0;
  return session.client.tryReap(completion, {}, message_bytes) && completion.handle == handle;
}

Stats dbufRings(bool sleeping) {
  const char* name = sleeping ? "dbuf rings, sleeping (futex + eventfd)" : "dbuf rings, busy-poll (noop)";
  Session session;
  Peer peer([&] { return respond(session.daemon, session.eventfd.get(), sleeping); });
  const auto busy_poll = sleeping ? 0us : std::chrono::microseconds(1s);
  const auto deadline = Clock::now() + 1h;
  std::uint64_t sequence = 0;
  Stats stats = measure(name, sleeping ? config.blocking_iterations : config.busy_iterations, [&] {
    if (!noopRoundTrip(session, ++sequence, busy_poll, deadline)) die(std::string(name) + ": round trip failed");
  });
  if (!noopRoundTrip(session, kStop, busy_poll, Clock::now() + 10s)) ++failures;
  expectJoined(peer, name);
  return stats;
}

/// A real dbufd on the responder's core with this process attached as the
/// 1-rank job's client; `failed` says why not.
struct AttachedDaemon {
  AttachedDaemon(const std::string& executable, std::uint32_t busy_poll_us) {
    dbuf::bench::DaemonSettings settings;
    settings.busy_poll_us = busy_poll_us;
    settings.cpu = config.peer_cpu;
    daemon.emplace(executable, settings);
    if (!daemon->ok()) {
      failed = daemon->error();
      return;
    }
    auto connected =
        dbuf::Client::connect({.socket_path = daemon->socket(), .timeout = std::chrono::milliseconds(10000)});
    if (!connected) {
      failed = "connect: " + connected.error().message;
      return;
    }
    client.emplace(std::move(*connected));
    if (auto attached = client->attach({.job = "bench-control", .rank = 0, .world_size = 1}); !attached) {
      failed = "attach: " + attached.error().message;
    }
  }
  /// Detaches and stops the daemon; false (and a line) if either failed.
  bool stop(const char* name) {
    bool ok = true;
    if (auto detached = client->detach(); !detached) {
      std::fprintf(stderr, "bench_control: %s: detach: %s\n", name, detached.error().message.c_str());
      ok = false;
    }
    if (!daemon->stop()) {
      std::fprintf(stderr, "bench_control: %s: dbufd did not exit cleanly\n", name);
      ok = false;
    }
    return ok;
  }
  /// One round trip: a noop (the rings and the daemon's loop) or a barrier
  /// (also the data plane's match, completion and recording).
  void roundTrip(const char* name, bool barrier) {
    auto handle = barrier ? client->submitBarrier() : client->submitNoop();
    if (!handle) die(std::string(name) + ": submit: " + handle.error().message);
    auto done = client->wait(*handle);
    if (!done) die(std::string(name) + ": wait: " + done.error().message);
  }

  std::optional<dbuf::bench::DaemonProcess> daemon;
  std::optional<dbuf::Client> client;
  std::string failed;
};

/// Rows 6 and 7: dbufd busy-polling (noop, barrier) or sleeping (noop);
/// nullopt (and a line saying why) when dbufd cannot be started or attached to.
std::optional<Stats> throughDbufd(bool sleeping, bool barrier) {
  const char* name = sleeping  ? "through dbufd, sleeping (busy_poll_us 0)"
                     : barrier ? "through dbufd, busy-poll (1-rank barrier)"
                               : "through dbufd, busy-poll (noop)";
  AttachedDaemon attached(dbuf::bench::dbufdExecutable(), sleeping ? 0 : 100000);
  if (!attached.failed.empty()) {
    std::printf("(%s: skipped, %s)\n", name, attached.failed.c_str());
    return std::nullopt;
  }
  Stats stats = measure(name, sleeping ? config.blocking_iterations : config.busy_iterations,
                        [&] { attached.roundTrip(name, barrier); });
  if (!attached.stop(name)) ++failures;
  return stats;
}

/// Row 7 against `baseline`'s dbufd, in `rounds` alternating rounds of
/// config.busy_iterations barriers each. Returns false if it could not run.
bool barrierAgainstBaseline(const std::string& baseline, std::size_t rounds) {
  constexpr std::uint32_t kShippedBusyPollUs = 50;  // the idle one of the two sleeps within 50 us
  AttachedDaemon mine(dbuf::bench::dbufdExecutable(), kShippedBusyPollUs);
  AttachedDaemon theirs(baseline, kShippedBusyPollUs);
  for (const AttachedDaemon* d : {&mine, &theirs}) {
    if (!d->failed.empty()) {
      std::printf("(barrier against %s: skipped, %s)\n", baseline.c_str(), d->failed.c_str());
      return false;
    }
  }
  std::printf("\n1-rank barrier through dbufd, %zu rounds of %zu, alternating: this build's dbufd vs %s\n", rounds,
              config.busy_iterations, baseline.c_str());
  std::printf("%-6s %14s %14s %8s\n", "round", "this p50 us", "baseline p50 us", "ratio");
  std::vector<double> ratios;
  for (std::size_t round = 0; round < rounds; ++round) {
    const bool mine_first = round % 2 == 0;
    Stats first =
        measure("first", config.busy_iterations, [&] { (mine_first ? mine : theirs).roundTrip("barrier", true); });
    Stats second =
        measure("second", config.busy_iterations, [&] { (mine_first ? theirs : mine).roundTrip("barrier", true); });
    const Stats& this_build = mine_first ? first : second;
    const Stats& base = mine_first ? second : first;
    ratios.push_back(this_build.p50_us / base.p50_us);
    std::printf("%-6zu %14.3f %14.3f %8.3f\n", round, this_build.p50_us, base.p50_us, ratios.back());
  }
  std::sort(ratios.begin(), ratios.end());
  std::printf("ratio (this / baseline) of the p50s: median %.3f, best %.3f, worst %.3f\n", ratios[ratios.size() / 2],
              ratios.front(), ratios.back());
  if (!mine.stop("barrier") || !theirs.stop("barrier (baseline)")) ++failures;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t iterations = 200000;
  std::size_t rounds = 9;
  std::string baseline;
  bool quick = false;
  CLI::App app{"bench_control: control round trips between two processes, bare shared memory, a Unix socket, a "
               "message queue and dbuf's session rings",
               "bench_control"};
  dbuf::cli::useConventions(app);
  app.add_option("--iterations", iterations, "Round trips per spinning row (blocking rows: N / 10)")
      ->type_name("N")->check(CLI::Range(std::size_t{1}, std::size_t{1} << 40))->capture_default_str();
  app.add_flag("--quick", quick, "Same as --iterations 20000");
  app.add_option("--baseline-dbufd", baseline, "Also time the 1-rank barrier against this dbufd, alternating")
      ->type_name("PATH");
  app.add_option("--rounds", rounds, "Rounds of that comparison")->type_name("R")
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 20))->capture_default_str();
  if (const auto done = dbuf::cli::parse(app, argc, argv)) return *done;
  if (quick && app.count("--iterations") == 0) iterations = 20000;
  config.busy_iterations = iterations;
  config.blocking_iterations = std::max<std::size_t>(iterations / 10, 1);

  const std::string pinning = setUpPinning();
  std::printf("control round trip, client -> responder -> client, two processes\n%s\n", pinning.c_str());
  std::printf("round trips: %zu per spinning row, %zu per blocking row (after %zu / %zu untimed)\n\n",
              config.busy_iterations, config.blocking_iterations,
              std::max<std::size_t>(config.busy_iterations / 10, 100),
              std::max<std::size_t>(config.blocking_iterations / 10, 100));
  std::fflush(stdout);

  std::vector<Stats> rows;
  rows.push_back(bareSharedMemory());
  rows.push_back(unixSocket());
#if defined(DBUF_BENCH_HAVE_BOOST_INTERPROCESS)
  rows.push_back(boostMessageQueue());
#else
  std::printf("(Boost.Interprocess message_queue: skipped, built without Boost headers)\n");
#endif
  const std::size_t ring_busy = rows.size();
  rows.push_back(dbufRings(false));
  rows.push_back(dbufRings(true));
  std::optional<std::size_t> dbufd_busy;
  std::optional<std::size_t> dbufd_sleeping;
  if (auto row = throughDbufd(false, false)) {
    dbufd_busy = rows.size();
    rows.push_back(*row);
  }
  if (auto row = throughDbufd(true, false)) {
    dbufd_sleeping = rows.size();
    rows.push_back(*row);
  }
  if (auto row = throughDbufd(false, true)) rows.push_back(*row);

  constexpr std::size_t kBare = 0;
  constexpr std::size_t kSocket = 1;
  printTable(rows, kBare, kSocket);
  const auto overBare = [&](std::size_t row) {
    return rows[kBare].p50_us > 0 ? rows[row].p50_us / rows[kBare].p50_us : 0.0;
  };
  const auto belowSocket = [&](std::size_t row) {
    return rows[row].p50_us > 0 ? rows[kSocket].p50_us / rows[row].p50_us : 0.0;
  };
  std::printf("\ntarget: ring p50 / bare p50 = %.2f (goal <= 2)\n", overBare(ring_busy));
  if (dbufd_busy) {
    std::printf(
        "target: through dbufd, busy-poll: p50 / bare p50 = %.2f (goal <= 2); socket p50 / p50 = %.1f "
        "(goal >= 20)\n",
        overBare(*dbufd_busy), belowSocket(*dbufd_busy));
  }
  if (dbufd_sleeping) {
    std::printf("through dbufd, sleeping: p50 / bare p50 = %.2f; socket p50 / p50 = %.2f\n", overBare(*dbufd_sleeping),
                belowSocket(*dbufd_sleeping));
  }
  if (!baseline.empty() && !barrierAgainstBaseline(baseline, rounds)) ++failures;
  if (failures != 0) {
    std::fprintf(stderr, "bench_control: %d responder failure(s)\n", failures);
    return 1;
  }
  return 0;
}
