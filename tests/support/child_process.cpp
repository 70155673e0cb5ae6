#include "support/child_process.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <thread>

extern char** environ;  // NOLINT(readability-identifier-naming): POSIX name

namespace dbuf::testing {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

[[noreturn]] void fatal(const std::string& what, int error = errno) {
  throw std::runtime_error(what + ": " + std::strerror(error));
}

std::vector<char*> pointers(std::vector<std::string>& strings) {
  std::vector<char*> result;
  result.reserve(strings.size() + 1);
  for (std::string& text : strings) result.push_back(text.data());
  result.push_back(nullptr);
  return result;
}

int millisecondsLeft(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(left);
}

/// A child that died must not take the test with it when we write to its stdin.
void ignoreSigpipe() {
  static std::once_flag once;
  std::call_once(once, [] {
    ::signal(SIGPIPE, SIG_IGN);  // NOLINT(cert-err33-c): cannot fail for a valid signal
  });
}

}  // namespace

// ----------------------------------------------------------------- Child

Child::Child(const std::string& executable, const std::vector<std::string>& args, const Options& options) {
  if (options.pipe_stdin) ignoreSigpipe();
  int in_pipe[2] = {-1, -1};
  int out_pipe[2] = {-1, -1};
  int err_pipe[2] = {-1, -1};
  const auto close_all = [&] {
    for (int* ends : {in_pipe, out_pipe, err_pipe}) {
      for (int end = 0; end < 2; ++end) {
        if (ends[end] >= 0) ::close(ends[end]);
        ends[end] = -1;
      }
    }
  };
  for (auto [wanted, ends] : {std::pair{options.pipe_stdin, in_pipe}, std::pair{options.pipe_stdout, out_pipe},
                              std::pair{options.pipe_stderr, err_pipe}}) {
    if (wanted && ::pipe2(ends, O_CLOEXEC) != 0) {
      const int error = errno;
      close_all();
      fatal("pipe2", error);
    }
  }

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (options.pipe_stdin) {
    posix_spawn_file_actions_adddup2(&actions, in_pipe[0], 0);
  } else {
    posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  }
  if (options.pipe_stdout) posix_spawn_file_actions_adddup2(&actions, out_pipe[1], 1);
  if (options.pipe_stderr) {
    posix_spawn_file_actions_adddup2(&actions, err_pipe[1], 2);
  } else if (!options.stderr_path.empty()) {
    posix_spawn_file_actions_addopen(&actions, 2, options.stderr_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
  }
  std::vector<std::string> argv_storage{executable};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<std::string> env_storage = options.environment.value_or(std::vector<std::string>{});
  auto argv = pointers(argv_storage);
  auto envp = pointers(env_storage);
  const int spawned = ::posix_spawn(&pid_, executable.c_str(), &actions, nullptr, argv.data(),
                                    options.environment ? envp.data() : environ);
  posix_spawn_file_actions_destroy(&actions);
  stdin_fd_ = in_pipe[1];
  stdout_fd_ = out_pipe[0];
  stderr_fd_ = err_pipe[0];
  in_pipe[1] = out_pipe[0] = err_pipe[0] = -1;
  close_all();  // the child's ends
  if (spawned != 0) {
    for (int* fd : {&stdin_fd_, &stdout_fd_, &stderr_fd_}) {
      if (*fd >= 0) ::close(*fd);
      *fd = -1;
    }
    reaped_ = true;  // nothing to reap
    fatal("posix_spawn " + executable, spawned);
  }
}

Child::~Child() {
  if (!reaped_) killAndReap();
  for (const int fd : {stdin_fd_, stdout_fd_, stderr_fd_}) {
    if (fd >= 0) ::close(fd);
  }
}

void Child::send(const std::string& line) {
  if (reaped_) return;  // its answer will be EOF
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

void Child::closeStdout() {
  ::close(stdout_fd_);
  stdout_fd_ = -1;
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
      closeStdout();
      continue;
    }
    buffer_.append(chunk, static_cast<std::size_t>(n));
  }
}

bool Child::readToEnd(std::string& out, std::string& err, Clock::time_point deadline) {
  out += buffer_;
  buffer_.clear();
  pollfd fds[2] = {{stdout_fd_, POLLIN, 0}, {stderr_fd_, POLLIN, 0}};
  std::string* sinks[2] = {&out, &err};
  int* owners[2] = {&stdout_fd_, &stderr_fd_};
  char buffer[65536];
  for (;;) {
    if (fds[0].fd < 0 && fds[1].fd < 0) return true;
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return false;
    const int ready = ::poll(fds, 2, static_cast<int>(left.count()));
    if (ready < 0) {
      if (errno == EINTR) continue;
      fatal("poll");
    }
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      const ssize_t n = ::read(fds[i].fd, buffer, sizeof buffer);
      if (n > 0) {
        sinks[i]->append(buffer, static_cast<std::size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        *owners[i] = -1;
      }
    }
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
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      waited = ::waitpid(pid_, &status, WNOHANG);
      if (waited != 0) break;
      if (Clock::now() >= deadline) return std::nullopt;
      std::this_thread::sleep_for(milliseconds(5));
    }
  }
  if (waited != pid_) fatal("waitpid " + std::to_string(pid_));
  reaped_ = true;
  return status;
}

int Child::wait() {
  if (reaped_) throw std::logic_error("pid " + std::to_string(pid_) + " was already reaped");
  int status = 0;
  while (::waitpid(pid_, &status, 0) < 0) {
    if (errno != EINTR) fatal("waitpid " + std::to_string(pid_));
  }
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

// ----------------------------------------------------------------- runChild

ChildResult runChild(const std::string& executable, const std::vector<std::string>& args, int timeout_ms) {
  Child::Options options;
  options.pipe_stdout = true;
  options.pipe_stderr = true;
  Child child(executable, args, options);
  ChildResult result;
  if (!child.readToEnd(result.out, result.err, Clock::now() + milliseconds(timeout_ms))) {
    result.timed_out = true;
    child.signal(SIGKILL);
  }
  const int status = child.wait();
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) result.signal = WTERMSIG(status);
  return result;
}

}  // namespace dbuf::testing
