#pragma once
/// \file
/// The fallback for ordering two processes' streams where 64-bit stream
/// memory operations are unavailable (see stream_sync.hpp): a CUDA IPC event
/// made by one process and opened by another from its 64-byte handle. The
/// producer records it after its work; the consumer's stream waits for it.
///
/// Semantics to respect: cudaStreamWaitEvent waits for the most recent
/// record made *before the wait is queued*, so the producer must record
/// before it tells the consumer (e.g. before it submits the op to its ring),
/// and a wait queued before a record does not wait for that record. Unlike a
/// stream counter an event cannot be poisoned: a consumer must not queue a
/// wait on the event of a peer it knows to be dead (the daemon checks the
/// rank's session first), and an event recorded by a process that then dies
/// completes when the driver tears that process's work down.
///
/// Ownership: IpcEvent owns its cudaEvent_t (destroyed with it; an opened
/// event is the consumer's own handle to the producer's event). Move-only.
/// Thread safety: one thread at a time.

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>

#include "dbuf/common/result.hpp"

namespace dbuf::gpu {

class IpcEvent {
 public:
  using Handle = std::array<std::byte, sizeof(cudaIpcEventHandle_t)>;

  /// An interprocess event (no timing) on the current device.
  [[nodiscard]] static Result<IpcEvent> create();
  /// Another process's event, from the handle it sent.
  [[nodiscard]] static Result<IpcEvent> open(const Handle& handle);

  IpcEvent(IpcEvent&& other) noexcept;
  IpcEvent& operator=(IpcEvent&& other) noexcept;
  IpcEvent(const IpcEvent&) = delete;
  IpcEvent& operator=(const IpcEvent&) = delete;
  ~IpcEvent();

  /// The bytes to send to the other process.
  [[nodiscard]] Result<Handle> handle() const;
  /// Records the event after the work queued on `stream` so far.
  [[nodiscard]] Result<void> record(cudaStream_t stream) const;
  /// Makes `stream`'s later work wait for the event's latest record.
  [[nodiscard]] Result<void> wait(cudaStream_t stream) const;
  /// Whether the latest record's work is done (host side, no waiting).
  [[nodiscard]] Result<bool> done() const;

 private:
  explicit IpcEvent(cudaEvent_t event) noexcept : event_(event) {}
  cudaEvent_t event_ = nullptr;
};

}  // namespace dbuf::gpu
