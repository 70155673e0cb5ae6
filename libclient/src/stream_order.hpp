#pragma once
// Ops ordered on the trainer's CUDA stream (GPU memory): the session's
// stream counters (ipc::StreamCounters in its segment) registered for the
// session's GPU in this process. For an op with ticket k, the trainer's
// stream writes ready = k after the work queued before it and then waits for
// done >= k (written by dbufd's stream after the op) before the work queued
// after it: the host never blocks. A failed op poisons done, which releases
// the stream; the session's stream ordering is then over (the op's error
// comes back from wait()).

#include <cstdint>
#include <memory>

#include "dbuf/common/result.hpp"
#include "dbuf/ipc/ring.hpp"

namespace dbuf {

class StreamOrder {
 public:
  /// Registers the counters' page for `device` (the trainer's current GPU is
  /// restored). kUnavailable from a libdbuf built without CUDA.
  [[nodiscard]] static Result<std::unique_ptr<StreamOrder>> open(ipc::StreamCounters& counters, int device);
  virtual ~StreamOrder() = default;

  /// Queues the next op's two stream operations on `stream` (a
  /// cudaStream_t): ready = ticket, then wait for done >= ticket. Returns the
  /// ticket to submit the op with; kConflict once an op failed.
  [[nodiscard]] virtual Result<std::uint64_t> order(void* stream) = 0;
  /// Releases the stream's waits for good (the op could not be submitted).
  virtual void abandon() noexcept = 0;
};

}  // namespace dbuf
