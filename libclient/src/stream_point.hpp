#pragma once
// A point on a trainer's CUDA stream: the work queued there so far (a CUDA
// event recorded on it). What a stream-ordered reshard waits for before the
// slot is unmapped and given back. CUDA builds only; elsewhere record()
// says so. Move-only; one thread at a time.

#include <memory>

#include "dbuf/common/result.hpp"

namespace dbuf {

class StreamPoint {
 public:
  /// The point `stream` (a cudaStream_t of GPU `device`) has reached in
  /// queued work now.
  [[nodiscard]] static Result<StreamPoint> record(void* stream, int device);

  StreamPoint(StreamPoint&&) noexcept;
  StreamPoint& operator=(StreamPoint&&) noexcept;
  StreamPoint(const StreamPoint&) = delete;
  StreamPoint& operator=(const StreamPoint&) = delete;
  ~StreamPoint();

  /// Whether the stream has run everything queued before the point.
  [[nodiscard]] Result<bool> reached() const;
  /// Blocks until it has.
  [[nodiscard]] Result<void> wait() const;

 private:
  struct Event;
  explicit StreamPoint(std::unique_ptr<Event> event) noexcept;
  std::unique_ptr<Event> event_;
};

}  // namespace dbuf
