#include "dbuf/common/cuda_status.hpp"

#include <cuda_runtime_api.h>

#include <string>

namespace dbuf {

Result<void> cudaStatus(cudaError_t status, std::string_view what) {
  if (status == cudaSuccess) return {};
  const bool no_device = status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver ||
                         status == cudaErrorCallRequiresNewerDriver;
  return makeError(no_device ? ErrorCode::kUnavailable : ErrorCode::kDevice,
                   std::string(what) + ": " + cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")");
}

}  // namespace dbuf
