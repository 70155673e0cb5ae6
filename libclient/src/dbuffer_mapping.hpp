#pragma once
// A DBuffer (a group's shard file, an unsharded slot) as this trainer maps
// it: a memfd mapped with mmap (host backend), or a CUDA VMM allocation
// imported from its fd and mapped on the session's GPU (cuda backend; CUDA
// builds of libdbuf only). Views into it are host or device addresses
// accordingly.

#include <cstddef>
#include <cstdint>
#include <memory>

#include "dbuf/common/result.hpp"
#include "dbuf/common/shared_memory.hpp"
#include "dbuf/ipc/protocol.hpp"

namespace dbuf {

/// Where the daemon put this session's memory (from its Welcome).
struct MemorySite {
  ipc::MemoryKind kind = ipc::MemoryKind::kHost;
  int device = 0;
};

/// Device addresses a group keeps across reshard / unshard, so each slot it
/// gets lands at the same address (cuda); unused for host memory. Move-only.
class ReservedRange {
 public:
  ReservedRange();
  ~ReservedRange();
  ReservedRange(ReservedRange&&) noexcept;
  ReservedRange& operator=(ReservedRange&&) noexcept;
  ReservedRange(const ReservedRange&) = delete;
  ReservedRange& operator=(const ReservedRange&) = delete;

  struct Impl;
  std::unique_ptr<Impl> impl;
};

class DbufferMapping {
 public:
  DbufferMapping();
  ~DbufferMapping();
  DbufferMapping(DbufferMapping&&) noexcept;
  DbufferMapping& operator=(DbufferMapping&&) noexcept;
  DbufferMapping(const DbufferMapping&) = delete;
  DbufferMapping& operator=(const DbufferMapping&) = delete;

  /// Maps the `bytes` behind `fd` (not consumed). Host: the memfd must be at
  /// least that long. Cuda: imported on site.device and mapped at the start
  /// of `range` (reserved, or re-reserved larger, here), or of a range of its
  /// own when `range` is null. `range` must outlive the mapping.
  [[nodiscard]] static Result<DbufferMapping> map(const MemorySite& site, int fd, std::uint64_t bytes,
                                                  ReservedRange* range = nullptr);

  [[nodiscard]] std::byte* data() const noexcept;
  /// The bytes mapped (0 when unmapped).
  [[nodiscard]] std::uint64_t size() const noexcept;
  [[nodiscard]] bool valid() const noexcept { return data() != nullptr; }
  /// Whether this process's GPU work may still use the mapping.
  enum class GpuWork {
    kMayBePending,  ///< unmapping waits for all of it first
    kDone,          ///< the caller knows none is left (a stream point reached)
  };
  /// Unmaps (the daemon keeps the memory; another process may still map it).
  void reset(GpuWork work = GpuWork::kMayBePending) noexcept;

 private:
  Mapping host_;
  struct Device;
  std::unique_ptr<Device> device_;
};

}  // namespace dbuf
