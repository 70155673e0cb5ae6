#include "support/temp_dir.hpp"

#include <sys/stat.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>

namespace dbuf::testing {
namespace {

[[noreturn]] void fatal(const std::string& what) {
  throw std::runtime_error(what + ": " + std::strerror(errno));
}

/// Longest temp dir base that still leaves room for "/<prefix>-XXXXXX" and a
/// socket name inside it within a Unix socket path's 107 bytes.
constexpr std::size_t kMaxBaseLength = 64;

}  // namespace

TempDir::TempDir(const std::string& prefix, std::optional<mode_t> mode) {
  std::filesystem::path base = std::filesystem::temp_directory_path();
  if (base.string().size() > kMaxBaseLength) base = "/tmp";
  std::string pattern = (base / (prefix + "-XXXXXX")).string();
  if (::mkdtemp(pattern.data()) == nullptr) fatal("mkdtemp " + pattern);
  path_ = pattern;
  if (mode && ::chmod(path_.c_str(), *mode) != 0) {
    const int error = errno;
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
    errno = error;
    fatal("chmod " + path_.string());
  }
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

std::string TempDir::path(const std::string& name) const {
  return (path_ / name).string();
}

std::string TempDir::write(const std::string& name, const std::string& text) const {
  std::string full = path(name);
  std::ofstream out(full, std::ios::binary);
  out << text;
  if (!out) throw std::runtime_error("cannot write " + full);
  return full;
}

}  // namespace dbuf::testing
