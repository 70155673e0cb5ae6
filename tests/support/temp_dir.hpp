#pragma once
/// \file
/// A unique temporary directory for one test, removed with its contents when
/// it dies. Include as "support/temp_dir.hpp" (target dbuf_test_util).

#include <sys/types.h>

#include <filesystem>
#include <optional>
#include <string>

namespace dbuf::testing {

/// A fresh directory from mkdtemp under the system temp dir (or /tmp when
/// that path is too long to leave room for a Unix socket in the directory:
/// a socket path holds at most 107 bytes). Removed recursively on destruction.
/// Not copyable.
class TempDir {
 public:
  /// `prefix` starts the directory's name (it tells which suite left a
  /// directory behind). `mode`, when given, is set with chmod after mkdtemp
  /// (which creates it 0700), e.g. 0711 to let other users reach a socket in
  /// it without listing it. Throws std::runtime_error when either fails.
  explicit TempDir(const std::string& prefix = "dbuf-test", std::optional<mode_t> mode = std::nullopt);
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  TempDir(TempDir&&) = delete;
  TempDir& operator=(TempDir&&) = delete;

  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }
  /// The full path of `name` inside the directory.
  [[nodiscard]] std::string path(const std::string& name) const;
  /// Writes `text` to `name` inside the directory; returns its full path.
  /// Throws std::runtime_error when the file cannot be written.
  std::string write(const std::string& name, const std::string& text) const;

 private:
  std::filesystem::path path_;
};

}  // namespace dbuf::testing
