#pragma once
/// \file
/// GPU memory through the CUDA driver's virtual memory management API: the
/// physical allocations behind DBuffers (cuMemCreate with POSIX fd handles,
/// so the daemon can pass them to trainers over its Unix socket) and the
/// reserved address ranges they are mapped into. A group's unsharded slot
/// range is reserved once and physical chunks are mapped into it on unshard
/// and unmapped on reshard, so a trainer's addresses stay the same while its
/// resident memory stays bounded by the slot pool.
///
/// Ownership: PhysicalMemory owns its allocation handle (released on
/// destruction; the memory lives on while any process still maps it or holds
/// an exported fd). AddressRange owns its reservation and unmaps whatever is
/// still mapped in it when destroyed. Both are move-only. Thread safety: one
/// thread per object; the driver calls themselves are thread-safe.

#include <cstddef>
#include <cstdint>
#include <map>

#include "dbuf/common/result.hpp"
#include "dbuf/common/unique_fd.hpp"
#include "dbuf/gpu/driver.hpp"

namespace dbuf::gpu {

/// Makes `device`'s primary context current on this thread (cudaSetDevice),
/// creating it on first use: the driver calls that need a context (host
/// registration, stream operations) then find one.
[[nodiscard]] Result<void> useDevice(int device);

/// The size every allocation, mapping and reservation on `device` is a
/// multiple of (the driver's minimum granularity, 2 MiB on current GPUs).
[[nodiscard]] Result<std::size_t> allocationGranularity(int device);

/// Whether `device` can hold DBuffers shared with trainer processes: the
/// virtual memory management API, export as POSIX fds, and a compute mode
/// that lets the daemon and the trainers hold contexts on it together: the
/// default one, or exclusive-process under MPS (kUnavailable naming what is
/// missing).
[[nodiscard]] Result<void> checkSharedMemorySupport(int device);

/// `bytes` rounded up to a multiple of `granularity`.
[[nodiscard]] constexpr std::size_t roundUp(std::size_t bytes, std::size_t granularity) noexcept {
  return (bytes + granularity - 1) / granularity * granularity;
}

class PhysicalMemory {
 public:
  /// `bytes` (> 0) of memory on `device`, rounded up to the granularity,
  /// exportable as a POSIX fd.
  [[nodiscard]] static Result<PhysicalMemory> create(int device, std::size_t bytes);
  /// The allocation behind an fd from exportFd() in another process; `bytes`
  /// is its size as the exporter reported it (checked against granularity).
  /// The fd is not consumed.
  [[nodiscard]] static Result<PhysicalMemory> import(int fd, std::size_t bytes, int device);

  PhysicalMemory(PhysicalMemory&& other) noexcept;
  PhysicalMemory& operator=(PhysicalMemory&& other) noexcept;
  PhysicalMemory(const PhysicalMemory&) = delete;
  PhysicalMemory& operator=(const PhysicalMemory&) = delete;
  ~PhysicalMemory();

  /// A new fd for the allocation, to send with SCM_RIGHTS.
  [[nodiscard]] Result<UniqueFd> exportFd() const;

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] CUmemGenericAllocationHandle handle() const noexcept { return handle_; }

 private:
  PhysicalMemory(CUmemGenericAllocationHandle handle, std::size_t size, int device) noexcept
      : handle_(handle), size_(size), device_(device) {}
  void release() noexcept;

  CUmemGenericAllocationHandle handle_ = 0;
  std::size_t size_ = 0;
  int device_ = 0;
};

class AddressRange {
 public:
  /// `bytes` of device virtual address space for `device` (rounded up to the
  /// granularity), nothing mapped yet.
  [[nodiscard]] static Result<AddressRange> reserve(std::size_t bytes, int device);

  AddressRange(AddressRange&& other) noexcept;
  AddressRange& operator=(AddressRange&& other) noexcept;
  AddressRange(const AddressRange&) = delete;
  AddressRange& operator=(const AddressRange&) = delete;
  ~AddressRange();

  /// Maps the first `bytes` of `memory` (0: all of it; else rounded up to
  /// the granularity, at most its size) at `offset` (a multiple of the
  /// granularity, inside the range, not overlapping a current mapping) and
  /// gives this range's device read / write access to it. The mapping keeps
  /// the physical memory alive until unmapped, even if `memory` is destroyed.
  [[nodiscard]] Result<void> map(std::size_t offset, const PhysicalMemory& memory, std::size_t bytes = 0);
  /// Unmaps the mapping made at `offset`.
  [[nodiscard]] Result<void> unmap(std::size_t offset);

  [[nodiscard]] CUdeviceptr base() const noexcept { return base_; }
  [[nodiscard]] void* pointer(std::size_t offset = 0) const noexcept;
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] bool mapped(std::size_t offset) const noexcept { return mappings_.contains(offset); }
  /// Bytes of the mapping made at `offset` (0 if none).
  [[nodiscard]] std::size_t mappedBytes(std::size_t offset) const noexcept {
    const auto it = mappings_.find(offset);
    return it == mappings_.end() ? 0 : it->second;
  }

 private:
  AddressRange(CUdeviceptr base, std::size_t size, std::size_t granularity, int device) noexcept
      : base_(base), size_(size), granularity_(granularity), device_(device) {}
  void release() noexcept;

  CUdeviceptr base_ = 0;
  std::size_t size_ = 0;
  std::size_t granularity_ = 0;
  int device_ = 0;
  std::map<std::size_t, std::size_t> mappings_;  // offset -> bytes
};

}  // namespace dbuf::gpu
