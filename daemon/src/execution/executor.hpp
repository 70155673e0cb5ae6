#pragma once
// Where a job's collectives run, and how the data plane learns that the work
// it queued is done. Three kinds:
//  - host: the engine (LocalCollective) through the CPU kernels over shared
//    memory, each step done when it returns;
//  - cuda, virtual ranks: the same engine through the CUDA kernels, every
//    rank's memory on one GPU, steps queued on one stream of the daemon's;
//  - nccl, one rank per GPU: each rank's own part cast / quantized by the
//    CUDA kernels on its GPU's stream, then grouped in-place NCCL calls.
// GPU executors report an op done when events recorded after its last step
// have completed; the data plane polls, it never waits.

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "dbuf/common/result.hpp"
#include "dbuf/ipc/ring.hpp"
#include "dbuf/kernels/runner.hpp"
#include "local_collective.hpp"

namespace dbuf::daemon {

/// A session's stream counters (ipc::StreamCounters) as the GPU stream that
/// runs its rank's part of ops writes them: registered for that GPU in the
/// daemon until destroyed (before the session's segment is unmapped).
class SessionCounters {
 public:
  virtual ~SessionCounters() = default;
  /// Queues "done = ticket" on that stream, after the work queued so far.
  [[nodiscard]] virtual Result<void> signalDone(std::uint64_t ticket) = 0;
};

class Executor {
 public:
  virtual ~Executor() = default;
  Executor() = default;
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  /// Makes this executor's GPU current on the calling thread (the data
  /// plane serves jobs on several GPUs in turn); nothing for the host.
  virtual void activate() noexcept {}
  /// Starts an op. `geometry` and `ranks` (world entries, the daemon's view
  /// of every rank's memory) outlive it. False: not yet (something the op
  /// needs is being made on another thread): call again later. An error:
  /// the op cannot run.
  [[nodiscard]] virtual Result<bool> begin(const CollectiveArgs& args, const GroupGeometry& geometry,
                                           std::span<const RankBuffers> ranks) = 0;
  /// Runs (host) or queues (GPU) the op's next step; true once its last step
  /// is. An error ends the op.
  [[nodiscard]] virtual Result<bool> step() = 0;
  /// Bytes the op has written so far (the data plane's turn budget).
  [[nodiscard]] virtual std::uint64_t bytesWritten() const noexcept = 0;
  /// The op's last step is queued; done() tells when it has run.
  [[nodiscard]] virtual Result<void> queued() = 0;
  /// Whether everything queued has run (never blocks).
  [[nodiscard]] virtual Result<bool> done() = 0;
  /// Waits until everything queued has run: memory it touches is about to go.
  virtual void quiesce() noexcept = 0;
  /// Whether the op waits for another thread (its step() would do nothing
  /// now); the loop is woken when that changes.
  [[nodiscard]] virtual bool waiting() const noexcept { return false; }
  /// Whether this executor wakes the loop itself when what an op waits for
  /// has happened (else the loop polls it while it waits, as for a GPU).
  [[nodiscard]] virtual bool wakesTheLoop() const noexcept { return false; }
  /// Whether barriers run here too (across nodes a barrier is an exchange
  /// with the other nodes), not only group ops.
  [[nodiscard]] virtual bool runsBarriers() const noexcept { return false; }
  /// Collective `sequence` ended with `error` on this node: an executor
  /// taking part in other nodes' collectives tells them, unless it took
  /// part in that one already.
  virtual void opFailed(std::uint64_t sequence, const Error& error) {
    static_cast<void>(sequence);
    static_cast<void>(error);
  }
  /// A rank of the job is gone: collective `sequence` (the next one) and
  /// every later one fail on every node, with `why`, until the rank is back
  /// (ranksAttached()).
  virtual void abandon(std::uint64_t sequence, const Error& why) {
    static_cast<void>(sequence);
    static_cast<void>(why);
  }
  /// Every rank of the job on this node is attached (again).
  virtual void ranksAttached() {}
  /// Why the job's collectives cannot run now (a job across nodes whose
  /// link to its other nodes was lost, until they meet again), or null: its
  /// ops then fail as they arrive, and so do those queued. Asking may start
  /// what ends it (the nodes' next meeting).
  [[nodiscard]] virtual const Error* unavailable() { return nullptr; }
  /// Rank `rank`'s session counters, for its stream-ordered ops; kUnavailable
  /// where no GPU stream runs the rank's ops (host memory).
  [[nodiscard]] virtual Result<std::unique_ptr<SessionCounters>> sessionCounters(std::uint32_t rank,
                                                                                 ipc::StreamCounters& counters);
};

/// The executors that run the engine, LocalCollective, over memory the
/// daemon addresses for every rank (host, and virtual ranks on one GPU).
class EngineExecutor : public Executor {
 public:
  Result<bool> begin(const CollectiveArgs& args, const GroupGeometry& geometry,
                     std::span<const RankBuffers> ranks) override;
  Result<bool> step() override { return op_.step(); }
  std::uint64_t bytesWritten() const noexcept override { return op_.bytesWritten(); }

 protected:
  [[nodiscard]] virtual kernels::Runner& runner() = 0;
  /// LocalCollective::kStepElements floats, addressable by the runner.
  [[nodiscard]] virtual std::span<float> scratch() = 0;

 private:
  std::vector<kernels::ConstBuffer> sources_;  // world entries, reused by every op
  LocalCollective op_;
};

/// The CPU kernels over host memory (each step done when step() returns).
/// `scratch` (LocalCollective::kStepElements floats) may be shared by every
/// host executor: the data plane runs one step at a time.
[[nodiscard]] std::unique_ptr<Executor> hostExecutor(std::span<float> scratch);

#if defined(DBUF_WITH_CUDA)
/// Virtual ranks: the CUDA kernels over memory on `device`, on a stream of
/// the daemon's.
[[nodiscard]] Result<std::unique_ptr<Executor>> cudaExecutor(int device);
/// One rank per GPU: rank r's memory is on devices[r] (distinct GPUs). The
/// NCCL communicators are made for the first op (and again after a failure
/// aborted them) on a thread of their own: the data plane keeps serving the
/// other jobs meanwhile.
[[nodiscard]] Result<std::unique_ptr<Executor>> ncclExecutor(std::vector<int> devices);
/// `counters` registered for `device`, done written by `stream` (a
/// cudaStream_t of the executor's: signalDone is called only while the
/// executor lives, and destroying what this returns does not touch it).
[[nodiscard]] Result<std::unique_ptr<SessionCounters>> cudaSessionCounters(ipc::StreamCounters& counters, int device,
                                                                           void* stream);
#endif

}  // namespace dbuf::daemon
