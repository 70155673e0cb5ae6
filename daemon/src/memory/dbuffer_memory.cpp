#include "dbuffer_memory.hpp"

#include "dbuf/common/shared_memory.hpp"
#include "dbuf/common/unique_fd.hpp"

namespace dbuf::daemon {
namespace {

class HostMemory final : public DbufferMemory {
 public:
  HostMemory(UniqueFd fd, Mapping mapping, std::uint64_t bytes)
      : fd_(std::move(fd)), mapping_(std::move(mapping)), bytes_(bytes) {}
  int fd() const noexcept override { return fd_.get(); }
  std::uint64_t bytes() const noexcept override { return bytes_; }
  std::byte* data() const noexcept override { return mapping_.data(); }

 private:
  UniqueFd fd_;
  Mapping mapping_;
  std::uint64_t bytes_;
};

class HostAllocator final : public DbufferAllocator {
 public:
  Result<std::uint64_t> roundedSize(std::uint64_t bytes) const override { return bytes; }
  Result<std::unique_ptr<DbufferMemory>> allocate(const std::string& name, std::uint64_t bytes) override {
    auto fd = createMemfd(name, bytes);
    if (!fd) return std::move(fd).error();
    auto mapping = Mapping::map(fd->get(), bytes);
    if (!mapping) return std::move(mapping).error();
    return std::unique_ptr<DbufferMemory>(std::make_unique<HostMemory>(std::move(*fd), std::move(*mapping), bytes));
  }
};

}  // namespace

std::unique_ptr<DbufferAllocator> hostAllocator() {
  return std::make_unique<HostAllocator>();
}

}  // namespace dbuf::daemon
