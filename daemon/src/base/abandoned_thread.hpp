#pragma once
// Threads the daemon leaves running when what started them goes (an NCCL
// set-up or a node link that may block for a long time), counted so that
// dbufd can say at exit how many it did not wait for.

namespace dbuf::daemon {

/// One per abandoned thread, for that thread's life.
class AbandonedThread {
 public:
  AbandonedThread() noexcept;
  ~AbandonedThread();
  AbandonedThread(const AbandonedThread&) = delete;
  AbandonedThread& operator=(const AbandonedThread&) = delete;

  /// How many live now: abandonedThreads() (dbuf/daemon/server.hpp).
  [[nodiscard]] static int live() noexcept;
};

}  // namespace dbuf::daemon
