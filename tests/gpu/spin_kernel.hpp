#pragma once
#include <cuda_runtime_api.h>

namespace dbuf::testing {

/// Queues a one-thread kernel that returns after `nanoseconds` of GPU time.
cudaError_t spinFor(cudaStream_t stream, unsigned long long nanoseconds);

}  // namespace dbuf::testing
