#pragma once
// Where a job's collectives run: the fused kernels (through a Runner), an
// fp32 scratch in the same memory for the in-place all-reduce, and how the
// data plane learns that the work it queued is done. The host executor runs
// each step before returning; the cuda executor (virtual ranks: every rank's
// memory on one GPU) queues the steps on its own stream and reports them done
// when an event recorded after the op's last step has completed.

#include <memory>
#include <span>

#include "dbuf/common/result.hpp"
#include "dbuf/kernels/runner.hpp"

namespace dbuf::daemon {

class Executor {
 public:
  virtual ~Executor() = default;
  Executor() = default;
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  /// Makes this executor's GPU current on the calling thread (the data
  /// plane serves jobs on several GPUs in turn); nothing for the host.
  virtual void activate() noexcept {}
  [[nodiscard]] virtual kernels::Runner& runner() = 0;
  /// LocalCollective::kStepElements floats, addressable by the runner.
  [[nodiscard]] virtual std::span<float> scratch() = 0;
  /// The op's last step is queued; done() tells when it has run.
  [[nodiscard]] virtual Result<void> queued() = 0;
  /// Whether everything queued has run (never blocks).
  [[nodiscard]] virtual Result<bool> done() = 0;
  /// Waits until everything queued has run: memory it touches is about to go.
  virtual void quiesce() noexcept = 0;
};

/// The CPU kernels over host memory (each step done when step() returns).
/// `scratch` (LocalCollective::kStepElements floats) may be shared by every
/// host executor: the data plane runs one step at a time.
[[nodiscard]] std::unique_ptr<Executor> hostExecutor(std::span<float> scratch);

#if defined(DBUF_WITH_CUDA)
/// The CUDA kernels over memory on `device`, on a stream of the daemon's.
[[nodiscard]] Result<std::unique_ptr<Executor>> cudaExecutor(int device);
#endif

}  // namespace dbuf::daemon
