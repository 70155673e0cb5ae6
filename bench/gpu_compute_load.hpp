#pragma once
// The overlap benchmark's stand-in for a trainer's compute (see the .cu).
#include <cuda_runtime_api.h>

namespace dbuf::bench {

inline constexpr int kComputeThreads = 256;

/// Queues one launch of `blocks` x kComputeThreads threads, each running
/// `iterations` rounds of four dependent FMAs; `out` holds one float per thread.
cudaError_t launchComputeLoad(cudaStream_t stream, float* out, int blocks, int iterations);

}  // namespace dbuf::bench
