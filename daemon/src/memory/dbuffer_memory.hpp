#pragma once
// Memory for DBuffers (a rank's shard file, an unsharded slot) as the daemon
// holds it: the fd a trainer is sent (a memfd for the host backend; a CUDA
// VMM allocation exported as a POSIX fd for the cuda backend) and the
// daemon's own address of the same memory, which the data plane reads and
// writes (a host address, or a device address the CUDA kernels use).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "dbuf/common/result.hpp"

namespace dbuf::daemon {

/// One allocation; freed (in the daemon) with the object. Trainers that
/// mapped it keep their mappings.
class DbufferMemory {
 public:
  virtual ~DbufferMemory() = default;
  DbufferMemory() = default;
  DbufferMemory(const DbufferMemory&) = delete;
  DbufferMemory& operator=(const DbufferMemory&) = delete;

  /// The fd to send with SCM_RIGHTS (owned by this object).
  [[nodiscard]] virtual int fd() const noexcept = 0;
  /// Its size: at least what was asked for (CUDA rounds up to its granularity).
  [[nodiscard]] virtual std::uint64_t bytes() const noexcept = 0;
  /// The daemon's address of the first byte.
  [[nodiscard]] virtual std::byte* data() const noexcept = 0;
};

class DbufferAllocator {
 public:
  virtual ~DbufferAllocator() = default;
  DbufferAllocator() = default;
  DbufferAllocator(const DbufferAllocator&) = delete;
  DbufferAllocator& operator=(const DbufferAllocator&) = delete;

  /// What an allocation of `bytes` really takes (and is charged): `bytes`
  /// for host memory, rounded up to the allocation granularity on a GPU.
  [[nodiscard]] virtual Result<std::uint64_t> roundedSize(std::uint64_t bytes) const = 0;
  /// `bytes` (> 0) of zeroed memory; `name` labels it where the kind allows
  /// (memfd names show in /proc/PID/fd).
  [[nodiscard]] virtual Result<std::unique_ptr<DbufferMemory>> allocate(const std::string& name,
                                                                        std::uint64_t bytes) = 0;
};

/// memfd shared memory (sealed against shrinking), mapped by the daemon.
[[nodiscard]] std::unique_ptr<DbufferAllocator> hostAllocator();

#if defined(DBUF_WITH_CUDA)
/// GPU memory on `device`: cuMemCreate with POSIX-fd handles, mapped into a
/// daemon-side address range with read-write access for the device, zeroed.
[[nodiscard]] std::unique_ptr<DbufferAllocator> cudaAllocator(int device);
#endif

}  // namespace dbuf::daemon
