#pragma once
// A DBuffer (a group's shard file, an unsharded slot) as this trainer maps
// it: a memfd mapped with mmap (host backend), or a CUDA VMM allocation
// imported from its fd and mapped on the session's GPU (cuda backend; CUDA
// builds of libdbuf only). Views into it are host or device addresses
// accordingly.
//
// Every mapping lands in a ReservedRange: address space that a group keeps
// for one DBuffer for as long as the group, or any pin of the range, lives.
// That gives a group's views one address for its whole life (each unshard
// maps the slot where the last one was), and it means a view never points at
// address space the process may reuse for something else. With host memory,
// an unmapped range holds private zero pages, so a view used after reshard,
// detach or the group's end reads zeros (its writes land in private pages
// that the next mapping replaces): it cannot fault. GPU ranges stay reserved but unmapped (the driver has no cheap
// equivalent of zero pages); kernels must not touch them after reshard.

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

/// Address space kept for one DBuffer of a group. Move-only.
class ReservedRange {
 public:
  ReservedRange();
  ~ReservedRange();
  ReservedRange(ReservedRange&&) noexcept;
  ReservedRange& operator=(ReservedRange&&) noexcept;
  ReservedRange(const ReservedRange&) = delete;
  ReservedRange& operator=(const ReservedRange&) = delete;

  /// Keeps the current address space reserved while held, even after this
  /// ReservedRange is destroyed (null before anything was mapped).
  [[nodiscard]] std::shared_ptr<const void> pin() const;

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

  /// Maps the first `used_bytes` of the `file_bytes` behind `fd` (not
  /// consumed) at the start of `range`, which is reserved (or re-reserved
  /// larger, at a new address) here and must outlive the mapping. Host: the
  /// memfd must be at least `file_bytes` long. Cuda: the allocation is
  /// imported whole (`file_bytes`) on site.device and mapped whole.
  [[nodiscard]] static Result<DbufferMapping> map(const MemorySite& site, int fd, std::uint64_t file_bytes,
                                                  std::uint64_t used_bytes, ReservedRange& range);

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
  /// The range stays reserved: zero pages for host memory.
  void reset(GpuWork work = GpuWork::kMayBePending) noexcept;

 private:
  struct Host;
  std::unique_ptr<Host> host_;
  struct Device;
  std::unique_ptr<Device> device_;
};

}  // namespace dbuf
