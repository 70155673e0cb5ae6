#pragma once
/// \file
/// Test helpers: run a real executable as a child process with its output
/// captured (posix_spawn and pipes, no shell), and a unique temporary
/// directory removed on destruction.

#include <filesystem>
#include <string>
#include <vector>

namespace dbuf::testing {

struct ChildResult {
  int exit_code = -1;  ///< -1 when the child did not exit normally
  int signal = 0;      ///< the signal that ended it, else 0
  bool timed_out = false;
  std::string out;
  std::string err;
};

/// Runs `executable` with `args` (argv[1..]), stdin from /dev/null. Kills the
/// child (SIGKILL, by its pid) if it runs longer than `timeout_ms`.
[[nodiscard]] ChildResult runChild(const std::string& executable, const std::vector<std::string>& args,
                                   int timeout_ms = 30000);

/// A fresh directory from mkdtemp under the system temp dir; removed with its
/// contents when this object dies. Not copyable.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }
  /// Writes `text` to `name` inside the directory; returns its full path.
  std::string write(const std::string& name, const std::string& text) const;

 private:
  std::filesystem::path path_;
};

/// The whole content of a file ("" when it cannot be read).
[[nodiscard]] std::string readFile(const std::string& path);

}  // namespace dbuf::testing
