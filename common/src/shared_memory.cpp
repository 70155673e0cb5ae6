#include "dbuf/common/shared_memory.hpp"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <utility>

namespace dbuf {
namespace {

Error systemError(const std::string& what) {
  return makeError(ErrorCode::kIo, what + ": " + std::strerror(errno));
}

}  // namespace

Result<UniqueFd> createMemfd(const std::string& name, std::size_t bytes) {
  // The name is only a label (/proc/PID/maps, /proc/PID/fd); the kernel refuses
  // names over 249 bytes, so cut longer ones instead of failing.
  constexpr std::size_t kMaxMemfdName = 249;
  UniqueFd fd(::memfd_create(name.substr(0, kMaxMemfdName).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) return systemError("memfd_create '" + name + "'");
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) return systemError("ftruncate memfd '" + name + "'");
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return systemError("sealing memfd '" + name + "'");
  }
  return fd;
}

Result<std::size_t> fileSize(int fd) {
  struct stat info {};
  if (::fstat(fd, &info) != 0) return systemError("fstat");
  return static_cast<std::size_t>(info.st_size);
}

Result<FileIdentity> fileIdentity(int fd) {
  struct stat info {};
  if (::fstat(fd, &info) != 0) return systemError("fstat");
  return FileIdentity{static_cast<std::uint64_t>(info.st_dev), static_cast<std::uint64_t>(info.st_ino)};
}

Result<void> releasePages(int fd, std::size_t offset, std::size_t bytes) {
  if (bytes == 0) return {};
  if (::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
                  static_cast<off_t>(bytes)) != 0) {
    return systemError("fallocate(PUNCH_HOLE)");
  }
  return {};
}

Mapping::Mapping(Mapping&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

Mapping& Mapping::operator=(Mapping&& other) noexcept {
  if (this != &other) {
    reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

Mapping::~Mapping() { reset(); }

void Mapping::reset() noexcept {
  if (data_ != nullptr) ::munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

Result<Mapping> Mapping::map(int fd, std::size_t bytes, std::size_t offset) {
  if (bytes == 0) return makeError(ErrorCode::kInvalidArgument, "cannot map 0 bytes");
  void* address = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, static_cast<off_t>(offset));
  if (address == MAP_FAILED) return systemError("mmap");
  Mapping mapping;
  mapping.data_ = static_cast<std::byte*>(address);
  mapping.size_ = bytes;
  return mapping;
}

}  // namespace dbuf
