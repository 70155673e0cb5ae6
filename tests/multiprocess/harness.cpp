#include "harness.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
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

/// A child that died must not take the test with it when we write to its stdin.
const bool kSigpipeIgnored = [] {
  ::signal(SIGPIPE, SIG_IGN);  // NOLINT(cert-err33-c): cannot fail for a valid signal
  return true;
}();

std::vector<char*> pointers(std::vector<std::string>& strings) {
  std::vector<char*> result;
  result.reserve(strings.size() + 1);
  for (std::string& text : strings) result.push_back(text.data());
  result.push_back(nullptr);
  return result;
}

std::string readText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

int millisecondsLeft(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(left);
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

bool startsWith(const std::string& text, const std::string& prefix) {
  return text.rfind(prefix, 0) == 0;
}
bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

bool eventually(const std::function<bool()>& done, milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    if (done()) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(milliseconds(5));
  }
}

// ----------------------------------------------------------------- TempDir

TempDir::TempDir() {
  std::filesystem::path base = std::filesystem::temp_directory_path();
  // A Unix socket path holds at most 107 bytes; keep room for "/dbufd.sock".
  if (base.string().size() > 64) base = "/tmp";
  std::string pattern = (base / "dbuf-mp-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) fatal("mkdtemp " + pattern);
  path_ = pattern;
  if (::chmod(path_.c_str(), 0711) != 0) fatal("chmod " + path_.string());
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

// ----------------------------------------------------------------- Child

Child::Child(const std::string& executable, const std::vector<std::string>& args, const Options& options) {
  int in_pipe[2] = {-1, -1};
  int out_pipe[2] = {-1, -1};
  // O_CLOEXEC: no other child may inherit our ends (a leaked stdin write end
  // would keep a rank from ever seeing EOF).
  if (options.pipe_stdin && ::pipe2(in_pipe, O_CLOEXEC) != 0) fatal("pipe2");
  if (options.pipe_stdout && ::pipe2(out_pipe, O_CLOEXEC) != 0) fatal("pipe2");

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (options.pipe_stdin) {
    posix_spawn_file_actions_adddup2(&actions, in_pipe[0], 0);
  } else {
    posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  }
  if (options.pipe_stdout) posix_spawn_file_actions_adddup2(&actions, out_pipe[1], 1);
  if (!options.stderr_path.empty()) {
    posix_spawn_file_actions_addopen(&actions, 2, options.stderr_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
  }
  std::vector<std::string> argv_storage{executable};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<std::string> env_storage = childEnvironment();
  auto argv = pointers(argv_storage);
  auto envp = pointers(env_storage);
  const int spawned = ::posix_spawn(&pid_, executable.c_str(), &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (options.pipe_stdin) ::close(in_pipe[0]);
  if (options.pipe_stdout) ::close(out_pipe[1]);
  if (spawned != 0) {
    if (options.pipe_stdin) ::close(in_pipe[1]);
    if (options.pipe_stdout) ::close(out_pipe[0]);
    fatal("posix_spawn " + executable, spawned);
  }
  stdin_fd_ = in_pipe[1];
  stdout_fd_ = out_pipe[0];
}

Child::~Child() {
  if (!reaped_) killAndReap();
  if (stdin_fd_ >= 0) ::close(stdin_fd_);
  if (stdout_fd_ >= 0) ::close(stdout_fd_);
}

void Child::send(const std::string& line) {
  if (reaped_) return;  // its answer will be "<eof>"
  const std::string text = line + "\n";
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(stdin_fd_, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      ADD_FAILURE() << "cannot write '" << line << "' to pid " << pid_ << ": " << std::strerror(errno);
      return;
    }
    done += static_cast<std::size_t>(n);
  }
}

std::optional<std::string> Child::readLine(milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    if (const auto end = buffer_.find('\n'); end != std::string::npos) {
      std::string line = buffer_.substr(0, end);
      buffer_.erase(0, end + 1);
      return line;
    }
    if (stdout_fd_ < 0) return std::nullopt;
    pollfd entry{stdout_fd_, POLLIN, 0};
    const int ready = ::poll(&entry, 1, millisecondsLeft(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) fatal("poll");
    if (ready == 0) return std::nullopt;
    char chunk[4096];
    const ssize_t n = ::read(stdout_fd_, chunk, sizeof chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(stdout_fd_);
      stdout_fd_ = -1;
      continue;
    }
    buffer_.append(chunk, static_cast<std::size_t>(n));
  }
}

void Child::signal(int signal) {
  if (!reaped_) ::kill(pid_, signal);
}

std::optional<int> Child::waitExit(milliseconds timeout) {
  if (reaped_) return std::nullopt;
  // A pidfd becomes readable when the process ends: no polling of waitpid.
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0));
  if (pidfd >= 0) {
    pollfd entry{pidfd, POLLIN, 0};
    const auto deadline = Clock::now() + timeout;
    int ready = 0;
    do {
      ready = ::poll(&entry, 1, millisecondsLeft(deadline));
    } while (ready < 0 && errno == EINTR);
    ::close(pidfd);
    if (ready == 0) return std::nullopt;
  }
  int status = 0;
  pid_t waited = 0;
  if (pidfd >= 0) {
    do {
      waited = ::waitpid(pid_, &status, 0);
    } while (waited < 0 && errno == EINTR);
  } else {
    // No pidfd (old kernel): poll waitpid until the deadline.
    const bool ended = eventually(
        [&] {
          waited = ::waitpid(pid_, &status, WNOHANG);
          return waited != 0;
        },
        timeout);
    if (!ended) return std::nullopt;
  }
  if (waited != pid_) fatal("waitpid " + std::to_string(pid_));
  reaped_ = true;
  return status;
}

bool Child::killAndReap() {
  if (reaped_) return false;
  ::kill(pid_, SIGKILL);
  int status = 0;
  pid_t waited = 0;
  do {
    waited = ::waitpid(pid_, &status, 0);
  } while (waited < 0 && errno == EINTR);
  reaped_ = true;
  return waited == pid_ && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
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
    : name_(std::move(name)), child_(DBUF_MP_RANK_EXE, rankArgs(uid, gid), Child::Options{}) {}

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
         std::to_string(maps_lines) + " (" + std::to_string(memfd_maps) + " of dbuf memfds)";
}

Daemon::Daemon(const std::filesystem::path& dir, const Settings& settings)
    : dir_(dir),
      socket_((dir / "dbufd.sock").string()),
      config_((dir / "dbufd.toml").string()),
      log_((dir / "dbufd.log").string()) {
  std::ostringstream text;
  text << "[daemon]\n"
       << "socket = \"" << socket_ << "\"\n"
       << "log_level = \"info\"\n"
       << "memory_limit = \"1GiB\"\n"
       << "[timeouts]\n"
       << "handshake_ms = " << settings.handshake_ms << "\n"
       << "register_ms = " << settings.register_ms << "\n"
       << "[persistence]\n"
       << "grace_period_s = " << settings.grace_period_s << "\n";
  if (settings.tenants_by_uid) {
    text << "[[tenant]]\nname = \"a\"\nuids = [0]\nmemory_quota = \"256MiB\"\n"
         << "[[tenant]]\nname = \"b\"\nuids = [65534]\nmemory_quota = \"256MiB\"\n";
  }
  std::ofstream out(config_);
  out << text.str();
  if (!out) fatal("cannot write " + config_);
}

Daemon::~Daemon() {
  if (process_ && process_->running()) process_->killAndReap();
}

void Daemon::start() {
  process_.reset();
  process_.emplace(DBUFD_EXE, std::vector<std::string>{"--config", config_, "--socket", socket_, "--log-level", "info"},
                   Child::Options{false, false, log_});
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
  Child second(DBUFD_EXE, {"--config", config_, "--socket", socket_, "--log-level", "info"},
               Child::Options{false, false, second_log});
  const auto status = second.waitExit(milliseconds(10000));
  return {status.value_or(-1), readText(second_log)};
}

pid_t Daemon::pid() const {
  return process_ ? process_->pid() : -1;
}
std::string Daemon::log() const {
  return readText(log_);
}

DaemonCounts Daemon::counts() const {
  DaemonCounts counts;
  for (const auto& [fd, target] : fdTargets(pid())) {
    if (startsWith(target, "/memfd:dbuf:")) ++counts.memfds;
    if (startsWith(target, "socket:")) ++counts.sockets;
  }
  std::istringstream maps(readText("/proc/" + std::to_string(pid()) + "/maps"));
  for (std::string line; std::getline(maps, line);) {
    ++counts.maps_lines;
    if (contains(line, "/memfd:dbuf:")) ++counts.memfd_maps;
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

std::vector<int> Daemon::memfdNumbers(const std::string& job) const {
  std::vector<int> numbers;
  for (const auto& [fd, target] : fdTargets(pid())) {
    if (startsWith(target, "/memfd:dbuf:" + job + ":")) numbers.push_back(fd);
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
    EXPECT_EQ(warm.call("unshard g"), "ok unshard");
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
