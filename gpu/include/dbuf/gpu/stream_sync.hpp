#pragma once
/// \file
/// Ordering between a trainer's CUDA stream and the daemon's without
/// blocking either host: monotonic 64-bit counters in host shared memory
/// (e.g. the session segment), registered for device access in each process
/// that uses them. A stream bumps a counter when its work up to that point is
/// done (cuStreamWriteValue64) and another stream waits for a value
/// (cuStreamWaitValue64, "greater or equal"); the hosts can read and publish
/// too. When a peer dies, the survivor poisons the counter: every waiter is
/// released and sees isPoisoned(), and reports an error instead of hanging.
///
/// Values and poison: dbuf/common/stream_counter_word.hpp (the host side).
///
/// Ownership: DeviceMappedHost owns the registration (unregistered on
/// destruction); the memory itself belongs to the caller and must stay mapped
/// while it is registered. StreamCounter is a view. Thread safety: host
/// reads / publishes are atomic; signal / wait queue work on the given stream.

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "dbuf/common/result.hpp"
#include "dbuf/common/stream_counter_word.hpp"
#include "dbuf/gpu/driver.hpp"

namespace dbuf::gpu {

using dbuf::isPoisoned;
using dbuf::kPoisonOffset;

/// Whether `device` runs 64-bit stream memory operations (all GPUs from
/// Volta on with a recent driver; where not, IPC events are the fallback).
[[nodiscard]] Result<bool> streamMemOpsSupported(int device);

/// Host memory (whole pages) made addressable by the GPUs of this process.
class DeviceMappedHost {
 public:
  /// Registers through `device`'s primary context (made current on this
  /// thread first: host registration needs a context, unlike the VMM calls).
  [[nodiscard]] static Result<DeviceMappedHost> registerPages(void* pages, std::size_t bytes, int device);

  DeviceMappedHost(DeviceMappedHost&& other) noexcept;
  DeviceMappedHost& operator=(DeviceMappedHost&& other) noexcept;
  DeviceMappedHost(const DeviceMappedHost&) = delete;
  DeviceMappedHost& operator=(const DeviceMappedHost&) = delete;
  ~DeviceMappedHost();

  /// The device address of host address `p` inside the registered pages.
  [[nodiscard]] Result<CUdeviceptr> devicePointer(const void* p) const;

 private:
  DeviceMappedHost(void* pages, std::size_t bytes) noexcept : pages_(pages), bytes_(bytes) {}
  void release() noexcept;

  void* pages_ = nullptr;
  std::size_t bytes_ = 0;
};

/// Counter pages for stream ordering: kUnavailable (saying to order on the
/// host instead) where `device` lacks 64-bit stream memory operations, else
/// DeviceMappedHost::registerPages.
[[nodiscard]] Result<DeviceMappedHost> registerCounterPages(void* pages, std::size_t bytes, int device);

class StreamCounter {
 public:
  /// A view of the 8-byte aligned `word` inside `pages`.
  [[nodiscard]] static Result<StreamCounter> at(const DeviceMappedHost& pages, std::uint64_t* word);

  /// Queues "set the counter to `value`" on `stream`, after the work queued
  /// before it.
  [[nodiscard]] Result<void> signal(CUstream stream, std::uint64_t value) const;
  /// Queues "wait until the counter is >= `value` (or poisoned)" on
  /// `stream`, before the work queued after it.
  [[nodiscard]] Result<void> wait(CUstream stream, std::uint64_t value) const;

  /// Host side: the current value; publish a new one (release order, so
  /// host writes before it are visible to whoever sees the value).
  [[nodiscard]] std::uint64_t value() const noexcept;
  void publish(std::uint64_t value) const noexcept;
  /// Releases every waiter now and for good: value + 2^62, once (poisoning
  /// a poisoned counter changes nothing).
  void poison() const noexcept;

 private:
  StreamCounter(std::uint64_t* host, CUdeviceptr device) noexcept : host_(host), device_(device) {}
  std::uint64_t* host_ = nullptr;
  CUdeviceptr device_ = 0;
};

}  // namespace dbuf::gpu
