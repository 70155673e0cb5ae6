#include "executor.hpp"

namespace dbuf::daemon {

Result<std::unique_ptr<SessionCounters>> Executor::sessionCounters(std::uint32_t /*rank*/,
                                                                   ipc::StreamCounters& /*counters*/) {
  return makeError(ErrorCode::kUnavailable, "stream-ordered ops need GPU memory; this job's memory is on the host");
}

Result<bool> EngineExecutor::begin(const CollectiveArgs& args, const GroupGeometry& geometry,
                                   std::span<const RankBuffers> ranks) {
  sources_.resize(ranks.size());  // allocates only for the job's first op
  op_ = LocalCollective(args, &geometry, ranks, sources_, scratch(), runner());
  return true;
}

namespace {

class HostExecutor final : public EngineExecutor {
 public:
  explicit HostExecutor(std::span<float> scratch) : scratch_(scratch) {}
  Result<void> queued() override { return {}; }
  Result<bool> done() override { return true; }
  void quiesce() noexcept override {}

 protected:
  kernels::Runner& runner() override { return runner_; }
  std::span<float> scratch() override { return scratch_; }

 private:
  kernels::CpuRunner runner_{kernels::Options{kernels::defaultThreads()}};
  std::span<float> scratch_;
};

}  // namespace

std::unique_ptr<Executor> hostExecutor(std::span<float> scratch) {
  return std::make_unique<HostExecutor>(scratch);
}

}  // namespace dbuf::daemon
