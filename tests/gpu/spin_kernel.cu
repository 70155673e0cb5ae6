// A kernel that keeps a stream busy for a given wall time (the GPU's global
// nanosecond timer), for tests of cross-process ordering.
#include "spin_kernel.hpp"

namespace dbuf::testing {
namespace {

__global__ void spin(unsigned long long nanoseconds) {
  unsigned long long start = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (unsigned long long now = start; now - start < nanoseconds;) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  }
}

}  // namespace

cudaError_t spinFor(cudaStream_t stream, unsigned long long nanoseconds) {
  spin<<<1, 1, 0, stream>>>(nanoseconds);
  return cudaGetLastError();
}

}  // namespace dbuf::testing
