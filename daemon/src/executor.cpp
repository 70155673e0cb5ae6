#include "executor.hpp"

namespace dbuf::daemon {
namespace {

class HostExecutor final : public Executor {
 public:
  explicit HostExecutor(std::span<float> scratch) : scratch_(scratch) {}
  kernels::Runner& runner() override { return runner_; }
  std::span<float> scratch() override { return scratch_; }
  Result<void> queued() override { return {}; }
  Result<bool> done() override { return true; }
  void quiesce() noexcept override {}

 private:
  kernels::CpuRunner runner_{kernels::Options{kernels::defaultThreads()}};
  std::span<float> scratch_;
};

}  // namespace

std::unique_ptr<Executor> hostExecutor(std::span<float> scratch) {
  return std::make_unique<HostExecutor>(scratch);
}

}  // namespace dbuf::daemon
