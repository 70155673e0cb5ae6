#pragma once
// A unique temporary directory for one test, removed with its contents.

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

namespace dbuf::daemon::testing {

class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "dbuf-config-test-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }

  [[nodiscard]] std::string path(const std::string& name) const { return (path_ / name).string(); }

  /// Writes `text` to `name` in the directory and returns the full path.
  std::string write(const std::string& name, const std::string& text) const {
    const std::string full = path(name);
    std::ofstream out(full, std::ios::binary);
    out << text;
    return full;
  }

 private:
  std::filesystem::path path_;
};

}  // namespace dbuf::daemon::testing
