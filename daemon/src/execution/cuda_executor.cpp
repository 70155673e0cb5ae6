// The cuda executor (CUDA builds): virtual ranks' collectives as CUDA
// kernels on one stream of the daemon's, completion observed through an
// event, never waited for on the data plane's thread (except to quiesce
// before a dead rank's memory is freed).
#include <cuda_runtime_api.h>

#include <string>

#include "dbuf/common/cuda_status.hpp"
#include "dbuf/kernels/cuda_runner.hpp"
#include "executor.hpp"
#include "local_collective.hpp"

namespace dbuf::daemon {
namespace {

class CudaExecutor final : public EngineExecutor {
 public:
  CudaExecutor(int device, cudaStream_t stream, cudaEvent_t event, float* scratch)
      : device_(device), stream_(stream), event_(event), scratch_(scratch), runner_(stream) {}
  ~CudaExecutor() override {
    activate();
    quiesce();
    static_cast<void>(cudaFree(scratch_));
    static_cast<void>(cudaEventDestroy(event_));
    static_cast<void>(cudaStreamDestroy(stream_));
  }

  void activate() noexcept override { static_cast<void>(cudaSetDevice(device_)); }
  Result<void> queued() override { return cudaStatus(cudaEventRecord(event_, stream_), "cudaEventRecord"); }
  Result<bool> done() override {
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) return false;
    if (auto r = cudaStatus(status, "the job's GPU work"); !r) return r.error();
    return true;
  }
  void quiesce() noexcept override { static_cast<void>(cudaStreamSynchronize(stream_)); }
  Result<std::unique_ptr<SessionCounters>> sessionCounters(std::uint32_t /*rank*/,
                                                           ipc::StreamCounters& counters) override {
    return cudaSessionCounters(counters, device_, stream_);  // every rank's part runs on the one stream
  }

 protected:
  kernels::Runner& runner() override { return runner_; }
  std::span<float> scratch() override { return {scratch_, LocalCollective::kStepElements}; }

 private:
  int device_;
  cudaStream_t stream_;
  cudaEvent_t event_;
  float* scratch_;
  kernels::cuda::CudaRunner runner_;
};

}  // namespace

Result<std::unique_ptr<Executor>> cudaExecutor(int device) {
  if (auto r = cudaStatus(cudaSetDevice(device), "cudaSetDevice " + std::to_string(device)); !r) return r.error();
  cudaStream_t stream = nullptr;
  if (auto r = cudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate"); !r) {
    return r.error();
  }
  cudaEvent_t event = nullptr;
  void* scratch = nullptr;
  Result<void> made = cudaStatus(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
  if (made) {
    made = cudaStatus(cudaMalloc(&scratch, LocalCollective::kStepElements * sizeof(float)),
                      "cudaMalloc (all-reduce scratch)");
  }
  if (!made) {
    if (event != nullptr) static_cast<void>(cudaEventDestroy(event));
    static_cast<void>(cudaStreamDestroy(stream));
    return made.error();
  }
  return std::unique_ptr<Executor>(std::make_unique<CudaExecutor>(device, stream, event, static_cast<float*>(scratch)));
}

}  // namespace dbuf::daemon
