#include "executor.hpp"

#include "local_collective.hpp"

namespace dbuf::daemon {
namespace {

class HostExecutor final : public Executor {
 public:
  kernels::Runner& runner() override { return runner_; }
  std::span<float> scratch() override { return {scratch_.get(), LocalCollective::kStepElements}; }
  Result<void> queued() override { return {}; }
  Result<bool> done() override { return true; }
  void quiesce() noexcept override {}

 private:
  kernels::CpuRunner runner_{kernels::Options{kernels::defaultThreads()}};
  // Left uninitialised so its pages cost nothing until an all-reduce touches them.
  std::unique_ptr<float[]> scratch_{
      new float[LocalCollective::kStepElements]};  // NOLINT(cppcoreguidelines-owning-memory)
};

}  // namespace

std::unique_ptr<Executor> hostExecutor() {
  return std::make_unique<HostExecutor>();
}

}  // namespace dbuf::daemon
