#pragma once
/// \file
/// Anonymous shared memory passed by file descriptor only (memfd): nothing is
/// openable by name in /dev/shm. `Mapping` owns one mmap of such a file.
/// Thread safety: value types; a Mapping must not be used after it moves.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "dbuf/common/result.hpp"
#include "dbuf/common/unique_fd.hpp"

namespace dbuf {

/// A new memfd of `bytes` bytes (zero-filled, close-on-exec), sealed against
/// shrinking so a peer that maps it cannot be made to fault by a truncate.
/// `name` labels the file in /proc (cut to the kernel's 249-byte limit).
[[nodiscard]] Result<UniqueFd> createMemfd(const std::string& name, std::size_t bytes);

/// Size in bytes of the file behind `fd`.
[[nodiscard]] Result<std::size_t> fileSize(int fd);

/// Which file an fd refers to (two fds of one memfd compare equal).
struct FileIdentity {
  std::uint64_t device = 0;
  std::uint64_t inode = 0;
  friend bool operator==(const FileIdentity&, const FileIdentity&) = default;
};
[[nodiscard]] Result<FileIdentity> fileIdentity(int fd);

/// Gives the pages of [offset, offset + bytes) back to the kernel; the range
/// reads as zeros afterwards and costs no memory until written again.
[[nodiscard]] Result<void> releasePages(int fd, std::size_t offset, std::size_t bytes);

/// One shared, read-write mapping; unmapped on destruction.
class Mapping {
 public:
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  Mapping(Mapping&& other) noexcept;
  Mapping& operator=(Mapping&& other) noexcept;
  ~Mapping();

  /// Maps `bytes` bytes of `fd` from `offset` (a multiple of the page size).
  [[nodiscard]] static Result<Mapping> map(int fd, std::size_t bytes, std::size_t offset = 0);

  [[nodiscard]] std::byte* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] bool valid() const noexcept { return data_ != nullptr; }
  void reset() noexcept;

 private:
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace dbuf
