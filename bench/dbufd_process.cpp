#include "dbufd_process.hpp"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

namespace dbuf::bench {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

bool canConnect(const std::string& path) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path.size() >= sizeof(address.sun_path)) return false;
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const bool connected = ::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0;
  ::close(fd);
  return connected;
}

}  // namespace

std::string dbufdExecutable() {
  if (const char* env = std::getenv("DBUFD"); env != nullptr && *env != '\0') return env;
#if defined(DBUF_BENCH_DBUFD_EXE)
  if (std::filesystem::exists(DBUF_BENCH_DBUFD_EXE)) return DBUF_BENCH_DBUFD_EXE;
#endif
  std::error_code error;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", error);
  return error ? std::string("dbufd") : (self.parent_path() / "dbufd").string();
}

DaemonProcess::DaemonProcess(const std::string& executable, const DaemonSettings& settings) {
  char tmpl[] = "/tmp/dbuf-bench-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) {
    error_ = std::string("mkdtemp: ") + std::strerror(errno);
    return;
  }
  dir_ = tmpl;
  socket_ = dir_ + "/dbufd.sock";
  config_ = dir_ + "/dbufd.toml";
  log_ = dir_ + "/dbufd.log";
  {
    std::ofstream out(config_);
    out << "[daemon]\n"
        << "socket = \"" << socket_ << "\"\n"
        << "log_level = \"" << settings.log_level << "\"\n"
        << "memory_limit = \"" << settings.memory_limit << "\"\n"
        << "[rings]\n"
        << "busy_poll_us = " << settings.busy_poll_us << "\n"
        << "[timeouts]\n"
        << "collective_ms = " << settings.collective_ms << "\n"
        << "register_ms = " << settings.collective_ms << "\n"
        << "[persistence]\n"
        << "grace_period_s = 0\n"
        << "[[tenant]]\n"
        << "name = \"bench\"\n"
        << "uids = [" << ::getuid() << "]\n"
        << "memory_quota = \"" << settings.memory_quota << "\"\n";
    if (!out) {
      error_ = "cannot write " + config_;
      return;
    }
  }
  std::fflush(nullptr);
  const pid_t parent = ::getpid();
  pid_ = ::fork();
  if (pid_ < 0) {
    error_ = std::string("fork: ") + std::strerror(errno);
    return;
  }
  if (pid_ == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(126);
    if (settings.cpu >= 0) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(static_cast<std::size_t>(settings.cpu), &set);
      ::sched_setaffinity(0, sizeof(set), &set);
    } else {
      // Undo any pinning inherited from the benchmark process.
      cpu_set_t set;
      CPU_ZERO(&set);
      const long cpus = ::sysconf(_SC_NPROCESSORS_ONLN);
      for (long cpu = 0; cpu < cpus && cpu < CPU_SETSIZE; ++cpu) CPU_SET(static_cast<std::size_t>(cpu), &set);
      ::sched_setaffinity(0, sizeof(set), &set);
    }
    const int log = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (log >= 0) {
      ::dup2(log, STDERR_FILENO);
      ::dup2(log, STDOUT_FILENO);
    }
    const int null = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (null >= 0) ::dup2(null, STDIN_FILENO);
    std::vector<std::string> args{executable, "--config", config_};
    args.insert(args.end(), settings.extra_args.begin(), settings.extra_args.end());
    std::vector<char*> argv;
    for (auto& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    ::execv(executable.c_str(), argv.data());
    std::fprintf(stderr, "exec %s: %s\n", executable.c_str(), std::strerror(errno));
    ::_exit(127);
  }
  const auto deadline = Clock::now() + 10s;
  while (!canConnect(socket_)) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      error_ = "dbufd (" + executable + ") exited before accepting connections: " + logTail();
      return;
    }
    if (Clock::now() > deadline) {
      error_ = "dbufd did not accept connections within 10 s: " + logTail();
      return;
    }
    std::this_thread::sleep_for(2ms);
  }
}

std::string DaemonProcess::logTail(std::size_t bytes) const {
  std::ifstream in(log_);
  std::stringstream text;
  text << in.rdbuf();
  std::string all = text.str();
  if (all.size() > bytes) all = all.substr(all.size() - bytes);
  while (!all.empty() && (all.back() == '\n' || all.back() == ' ')) all.pop_back();
  return all;
}

bool DaemonProcess::stop() {
  if (pid_ <= 0) return false;
  const pid_t pid = pid_;
  pid_ = -1;
  ::kill(pid, SIGTERM);
  const auto deadline = Clock::now() + 5s;
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (Clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return false;
    }
    std::this_thread::sleep_for(1ms);
  }
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

DaemonProcess::~DaemonProcess() {
  stop();
  if (!dir_.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
}

}  // namespace dbuf::bench
