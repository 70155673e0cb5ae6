#pragma once
// Shared by the libFuzzer harnesses: a property check that aborts (so that
// libFuzzer keeps the input as a crash), and the `--write-seeds DIR` mode a
// harness offers when its seed corpus is generated from real encodings.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dbuf::fuzz {

/// A property the harness asserts: prints `what` and aborts when it fails.
inline void check(bool holds, std::string_view what) {
  if (holds) return;
  std::fprintf(stderr, "fuzz property violated: %.*s\n", static_cast<int>(what.size()), what.data());
  std::abort();
}

/// Writes one seed file `dir/name`.
inline void writeSeed(const std::string& dir, const std::string& name, std::span<const std::byte> bytes) {
  const std::string path = dir + "/" + name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));  // NOLINT
  if (!out) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::exit(1);
  }
}
inline void writeSeed(const std::string& dir, const std::string& name, std::string_view text) {
  writeSeed(dir, name, std::as_bytes(std::span(text.data(), text.size())));
}

/// From LLVMFuzzerInitialize: with `--write-seeds DIR` among the arguments,
/// runs `write(DIR)` and exits (libFuzzer never starts); else returns.
inline void seedMode(int* argc, char*** argv, const std::function<void(const std::string&)>& write) {
  for (int i = 1; i + 1 < *argc; ++i) {
    if (std::strcmp((*argv)[i], "--write-seeds") == 0) {
      write((*argv)[i + 1]);
      std::exit(0);
    }
  }
}

/// Little-endian reads of fuzz bytes, zero past the end.
class Bytes {
 public:
  Bytes(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  [[nodiscard]] bool empty() const noexcept { return position_ >= size_; }
  [[nodiscard]] std::size_t left() const noexcept { return empty() ? 0 : size_ - position_; }
  template <typename T>
  T take() {
    std::uint64_t bits = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i) {
      const std::uint64_t byte = position_ < size_ ? data_[position_] : 0;
      ++position_;
      bits |= byte << (8U * i);
    }
    return static_cast<T>(bits);
  }
  /// Up to `count` bytes (fewer at the end).
  std::span<const std::uint8_t> span(std::size_t count) {
    const std::size_t n = count < left() ? count : left();
    const std::span<const std::uint8_t> out(data_ + position_, n);
    position_ += n;
    return out;
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t position_ = 0;
};

}  // namespace dbuf::fuzz
