#include "backend.hpp"

#if defined(DBUF_WITH_CUDA)
#include "dbuf/kernels/cuda_ops.hpp"
#endif

namespace dbuf::daemon {
namespace {

/// Why the cuda backend cannot run here, or empty.
std::string cudaUnavailable() {
#if defined(DBUF_WITH_CUDA)
  const kernels::cuda::DeviceCheck device = kernels::cuda::checkDevice();
  return device.usable ? std::string() : "no usable CUDA device: " + device.reason;
#else
  return "this dbufd was built without CUDA (rebuild with -DDBUF_CUDA=ON)";
#endif
}

}  // namespace

Result<Backend> resolveBackend(Backend requested) {
  if (requested == Backend::kHost) return Backend::kHost;
  const std::string why = cudaUnavailable();
  if (requested == Backend::kAuto) return why.empty() ? Backend::kCuda : Backend::kHost;
  if (!why.empty()) return makeError(ErrorCode::kUnavailable, "backend \"cuda\": " + why);
  return Backend::kCuda;
}

}  // namespace dbuf::daemon
