#include "harness.hpp"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

extern char** environ;  // NOLINT(readability-identifier-naming): POSIX name

namespace dbuf::mp {
namespace {

[[noreturn]] void fatal(const std::string& what, int error = errno) {
  throw std::runtime_error(what + ": " + std::strerror(error));
}

/// The test's environment minus what would make a child behave differently
/// from a plain run (systemd notification, a socket chosen elsewhere).
std::vector<std::string> childEnvironment() {
  std::vector<std::string> environment;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string text(*entry);
    if (startsWith(text, "NOTIFY_SOCKET=") || startsWith(text, "WATCHDOG_") || startsWith(text, "DBUF_SOCKET=") ||
        startsWith(text, "LISTEN_")) {
      continue;
    }
    environment.push_back(text);
  }
  return environment;
}

/// Options for a child of the tests: stdin and stdout piped to the test or
/// not, stderr appended to `stderr_path` (empty: inherited), environment
/// without the variables above.
Child::Options childOptions(bool pipes, const std::string& stderr_path = "") {
  Child::Options options;
  options.pipe_stdin = pipes;
  options.pipe_stdout = pipes;
  options.stderr_path = stderr_path;
  options.environment = childEnvironment();
  return options;
}

/// readlink of every fd of `pid` (fds that close meanwhile are skipped).
std::vector<std::pair<int, std::string>> fdTargets(pid_t pid) {
  std::vector<std::pair<int, std::string>> targets;
  std::error_code error;
  const std::filesystem::path dir = "/proc/" + std::to_string(pid) + "/fd";
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    std::error_code link_error;
    const auto target = std::filesystem::read_symlink(entry.path(), link_error);
    if (link_error) continue;
    targets.emplace_back(std::stoi(entry.path().filename().string()), target.string());
  }
  return targets;
}

#ifndef DBUFD_EXE
#error "DBUFD_EXE must name the dbufd binary"
#endif
#ifndef DBUF_MP_RANK_EXE
#error "DBUF_MP_RANK_EXE must name the dbuf-mp-rank binary"
#endif

}  // namespace

bool eventually(const std::function<bool()>& done, milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    if (done()) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(milliseconds(5));
  }
}

// ----------------------------------------------------------------- Rank

namespace {

std::vector<std::string> rankArgs(std::optional<uid_t> uid, std::optional<gid_t> gid) {
  std::vector<std::string> args;
  if (uid) {
    args.insert(args.end(), {"--uid", std::to_string(*uid)});
    args.insert(args.end(), {"--gid", std::to_string(gid.value_or(static_cast<gid_t>(*uid)))});
  }
  return args;
}

}  // namespace

Rank::Rank(std::string name, std::optional<uid_t> uid, std::optional<gid_t> gid)
    : name_(std::move(name)), child_(DBUF_MP_RANK_EXE, rankArgs(uid, gid), childOptions(true)) {}

std::string Rank::call(const std::string& command, milliseconds timeout) {
  child_.send(command);
  return result(timeout);
}

void Rank::begin(const std::string& command) {
  child_.send(command);
  const auto line = child_.readLine(kReplyTimeout);
  const std::string verb = command.substr(0, command.find(' '));
  EXPECT_TRUE(line && *line == "begin " + verb) << name_ << ": " << command << " -> " << line.value_or("<none>");
}

std::string Rank::result(milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    const auto line = child_.readLine(std::chrono::ceil<milliseconds>(deadline - Clock::now()));
    if (!line) {
      if (!child_.running() || Clock::now() < deadline) return "<eof>";
      // A late answer would be taken for the next command's: end the rank so
      // that the rest of a failing test fails fast instead of out of step.
      child_.killAndReap();
      return "<timeout>";
    }
    if (startsWith(*line, "begin ")) continue;
    return *line;
  }
}

std::string Rank::attach(const std::string& socket, const std::string& job, std::uint32_t rank,
                         std::uint32_t world_size, bool persistent) {
  const std::string connected = call("connect " + socket);
  EXPECT_EQ(connected, "ok connect") << name_;
  std::string command = "attach " + job + " " + std::to_string(rank) + " " + std::to_string(world_size);
  if (persistent) command += " persistent";
  std::string attached = call(command);
  EXPECT_TRUE(startsWith(attached, "ok attach")) << name_ << ": " << attached;
  return attached;
}

std::string Rank::ids() {
  return child_.readLine(kReplyTimeout).value_or("<none>");
}

void Rank::kill9() {
  EXPECT_TRUE(child_.killAndReap()) << name_ << " (pid " << pid() << ") did not die of SIGKILL";
}

void Rank::exit() {
  child_.send("exit");
  const auto status = child_.waitExit(kReplyTimeout);
  EXPECT_TRUE(status && WIFEXITED(*status) && WEXITSTATUS(*status) == 0)
      << name_ << " did not exit cleanly (status " << status.value_or(-1) << ")";
}

// ----------------------------------------------------------------- Daemon

std::string DaemonCounts::text() const {
  return "memfds " + std::to_string(memfds) + ", sockets " + std::to_string(sockets) + ", maps lines " +
         std::to_string(maps_lines) + " (" + std::to_string(file_maps) + " of files, " + std::to_string(memfd_maps) +
         " of dbuf memfds), threads " + std::to_string(threads);
}

Daemon::Daemon(const std::filesystem::path& dir, const Settings& settings)
    : dir_(dir),
      socket_((dir / "dbufd.sock").string()),
      config_((dir / "dbufd.toml").string()),
      log_((dir / "dbufd.log").string()),
      extra_args_(settings.extra_args),
      launcher_(settings.launcher) {
  std::ostringstream text;
  text << "[daemon]\n"
       << "socket = \"" << socket_ << "\"\n"
       << "log_level = \"info\"\n"
       << "memory_limit = \"1GiB\"\n"
       << "[timeouts]\n"
       << "handshake_ms = " << settings.handshake_ms << "\n"
       << "register_ms = " << settings.register_ms << "\n"
       << "collective_ms = " << settings.collective_ms << "\n"
       << "[persistence]\n"
       << "grace_period_s = " << settings.grace_period_s << "\n";
  if (settings.tenants_by_uid) {
    text << "[[tenant]]\nname = \"a\"\nuids = [0]\nmemory_quota = \"256MiB\"\n"
         << "[[tenant]]\nname = \"b\"\nuids = [65534]\nmemory_quota = \"256MiB\"\n";
  }
  text << settings.extra_config;
  std::ofstream out(config_);
  out << text.str();
  if (!out) fatal("cannot write " + config_);
}

std::vector<std::string> Daemon::commandLine() const {
  std::vector<std::string> args{"--config", config_, "--socket", socket_, "--log-level", "info"};
  args.insert(args.end(), extra_args_.begin(), extra_args_.end());
  return args;
}

std::string dbufdExecutable() {
  // The GPU bundle runs its copies from its bin/ (its run script exports DBUF_BIN_DIR).
  if (const char* dir = std::getenv("DBUF_BIN_DIR"); dir != nullptr) return std::string(dir) + "/dbufd";  // NOLINT
  return DBUFD_EXE;
}

Daemon::~Daemon() {
  if (process_ && process_->running()) process_->killAndReap();
}

void Daemon::start() {
  process_.reset();
  if (launcher_.empty()) {
    process_.emplace(dbufdExecutable(), commandLine(), childOptions(false, log_));
  } else {
    std::vector<std::string> args(launcher_.begin() + 1, launcher_.end());
    args.push_back(dbufdExecutable());
    const std::vector<std::string> own = commandLine();
    args.insert(args.end(), own.begin(), own.end());
    process_.emplace(launcher_.front(), args, childOptions(false, log_));
  }
  // Ready when a connect succeeds: retry until a deadline (the socket does not
  // exist, or nobody listens yet), and stop early if the daemon died.
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, socket_.c_str(), socket_.size() + 1);
  bool ready = eventually(
      [&] {
        if (process_->waitExit(milliseconds(0))) return true;  // died: report below
        const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): the sockets API
        const bool connected = ::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) == 0;
        ::close(fd);
        return connected;
      },
      milliseconds(10000));
  ASSERT_TRUE(ready && process_->running()) << "dbufd did not start accepting on " << socket_ << "\n" << log();
}

std::pair<int, std::string> Daemon::startSecond() {
  const std::string second_log = (dir_ / "second.log").string();
  Child second(dbufdExecutable(), commandLine(), childOptions(false, second_log));
  const auto status = second.waitExit(milliseconds(10000));
  return {status.value_or(-1), dbuf::testing::readFile(second_log)};
}

pid_t Daemon::pid() const {
  return process_ ? process_->pid() : -1;
}
std::string Daemon::log() const {
  return dbuf::testing::readFile(log_);
}

DaemonCounts Daemon::counts() const {
  DaemonCounts counts;
  for (const auto& [fd, target] : fdTargets(pid())) {
    if (startsWith(target, "/memfd:dbuf:")) ++counts.memfds;
    if (startsWith(target, "socket:")) ++counts.sockets;
  }
  std::istringstream maps(dbuf::testing::readFile("/proc/" + std::to_string(pid()) + "/maps"));
  for (std::string line; std::getline(maps, line);) {
    ++counts.maps_lines;
    if (contains(line, "/memfd:dbuf:")) ++counts.memfd_maps;
    // address perms offset dev inode [path]: a file's path starts with '/'.
    if (contains(line, " /")) ++counts.file_maps;
  }
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/" + std::to_string(pid()) + "/task", error)) {
    (void)entry;
    ++counts.threads;
  }
  return counts;
}

int Daemon::memfdsOf(const std::string& job, const std::string& part) const {
  std::string prefix = "/memfd:dbuf:";
  prefix += job;
  prefix += ':';
  prefix += part;
  int count = 0;
  for (const auto& [fd, target] : fdTargets(pid())) {
    if (startsWith(target, prefix)) ++count;
  }
  return count;
}

std::vector<int> Daemon::memfdNumbers(const std::string& job, const std::string& part) const {
  std::string prefix = "/memfd:dbuf:";
  prefix += job;
  prefix += ':';
  prefix += part;
  std::vector<int> numbers;
  for (const auto& [fd, target] : fdTargets(pid())) {
    if (startsWith(target, prefix)) numbers.push_back(fd);
  }
  return numbers;
}

std::string Daemon::fdListing() const {
  std::string listing;
  for (const auto& [fd, target] : fdTargets(pid())) listing += std::to_string(fd) + " -> " + target + "\n";
  return listing;
}

void Daemon::warmUpAndTakeBaseline() {
  {
    Rank warm("warm-up");
    warm.attach(socket_, "warm-up", 0, 1);
    EXPECT_TRUE(startsWith(warm.call("register g"), "ok register"));
    EXPECT_TRUE(startsWith(warm.call("write g 1"), "ok write"));
    EXPECT_EQ(warm.call("unshard g"), "ok unshard");  // an all-gather: the data plane warms up too
    EXPECT_EQ(warm.call("reshard g"), "ok reshard");
    EXPECT_EQ(warm.call("detach"), "ok detach");
    warm.exit();
  }
  // Back to the listener alone, and no memfd: then the maps are what an idle
  // daemon that has served a job looks like.
  const bool idle = eventually([&] {
    const DaemonCounts now = counts();
    return now.sockets == 1 && now.memfds == 0;
  });
  baseline_ = counts();
  EXPECT_TRUE(idle) << "dbufd did not go idle after the warm-up job: " << baseline_.text() << "\n" << fdListing();
}

int Daemon::terminate(milliseconds timeout) {
  process_->signal(SIGTERM);
  return process_->waitExit(timeout).value_or(-1);
}

void Daemon::kill9() {
  EXPECT_TRUE(process_->killAndReap());
}

}  // namespace dbuf::mp
