// A compute-bound kernel standing in for a trainer's math: dependent FMA
// chains in registers across the whole GPU, no memory traffic beyond one
// store per thread (so it competes with the daemon's work for SMs, not for
// memory bandwidth).
#include "gpu_compute_load.hpp"

namespace dbuf::bench {
namespace {

__global__ void fmaChains(float* out, int iterations) {
  float a = threadIdx.x * 1e-3F;
  float b = blockIdx.x * 1e-3F;
  float c = 1.0F;
  float d = 0.5F;
  for (int i = 0; i < iterations; ++i) {
    a = a * 0.999F + 0.001F;
    b = b * 0.999F + 0.002F;
    c = c * 0.999F + 0.003F;
    d = d * 0.999F + 0.004F;
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = a + b + c + d;
}

}  // namespace

cudaError_t launchComputeLoad(cudaStream_t stream, float* out, int blocks, int iterations) {
  fmaChains<<<blocks, kComputeThreads, 0, stream>>>(out, iterations);
  return cudaGetLastError();
}

}  // namespace dbuf::bench
