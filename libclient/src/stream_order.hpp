#pragma once
// Ops ordered on the trainer's CUDA stream (GPU memory): the session's
// stream counters (ipc::StreamCounters in its segment) registered for the
// session's GPU in this process. For an op with ticket k, a stream waits for
// ready >= k - 1 (so ready only grows even when ops alternate between
// streams), writes ready = k after the work queued before it, and waits for
// done >= k (written by dbufd's stream after the op) before the work queued
// after it: the host never blocks. A failed op poisons done, which releases
// the stream; the session's stream ordering is then over (the op's error
// comes back from wait()). A watcher thread poisons done too when dbufd goes
// away (its end of the socket closes), so a stream never waits for a daemon
// that died.

#include <cstdint>
#include <memory>

#include "dbuf/common/result.hpp"
#include "dbuf/ipc/ring.hpp"

namespace dbuf {

class StreamOrder {
 public:
  /// Registers the counters' page for `device` (the trainer's current GPU is
  /// restored) and starts watching `socket` (the connection to dbufd, which
  /// must stay open until stop()). kUnavailable from a libdbuf built without
  /// CUDA, or on a GPU without 64-bit stream memory operations.
  [[nodiscard]] static Result<std::unique_ptr<StreamOrder>> open(ipc::StreamCounters& counters, int device, int socket);
  virtual ~StreamOrder() = default;

  /// Queues the next op's stream operations on `stream` (a cudaStream_t).
  /// Returns the ticket to submit the op with; kConflict once an op failed.
  [[nodiscard]] virtual Result<std::uint64_t> order(void* stream) = 0;
  /// Releases every stream's waits for good: the session's ordering is over.
  virtual void release() noexcept = 0;
  /// Stops the watcher (before the socket closes) and releases the streams.
  virtual void stop() noexcept = 0;
};

}  // namespace dbuf
