// NCCL through gpu::LocalComms: loaded at run time, in-place grouped
// all-gather and reduce-scatter over the node's GPUs (one rank per GPU; with
// one GPU a one-rank communicator), asynchronous error polling, and NCCL's
// refusal of two ranks on one GPU (why virtual ranks exist) coming back as an
// error, not a hang. Label `gpu`; loading NCCL needs no device.
#include "dbuf/gpu/nccl.hpp"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "dbuf/kernels/cuda_ops.hpp"
#include "gpu_test_support.hpp"

namespace dbuf::gpu {
namespace {

#define SKIP_WITHOUT_NCCL()                                                              \
  do {                                                                                   \
    if (auto n = nccl(); !n) GTEST_SKIP() << "NCCL not loadable: " << n.error().message; \
  } while (false)

int deviceCount() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

TEST(Nccl, LoadsAtRunTimeAndMapsDtypes) {
  SKIP_WITHOUT_NCCL();
  EXPECT_GE((*nccl())->version, 22000) << "dbuf needs NCCL 2.20 or newer";
  EXPECT_EQ(*ncclType(DType::kBF16), ncclBfloat16);
  EXPECT_EQ(*ncclType(DType::kF8E4M3), ncclFloat8e4m3);
  const auto error = ncclStatus(ncclInvalidUsage, "test");
  ASSERT_FALSE(error.ok());
  EXPECT_EQ(error.error().code, ErrorCode::kDevice);
}

/// Each local rank r fills its own part with r + 1, gathers in place,
/// then reduce-scatters (sum) in place.
TEST(Nccl, GroupedInPlaceAllGatherAndReduceScatterOverLocalGpus) {
  DBUF_SKIP_WITHOUT_GPU();
  SKIP_WITHOUT_NCCL();
  const int ranks = deviceCount();
  std::vector<int> devices(static_cast<std::size_t>(ranks));
  std::iota(devices.begin(), devices.end(), 0);
  auto comms = LocalComms::create(devices);
  ASSERT_TRUE(comms.ok()) << comms.error().message;
  constexpr std::size_t kCount = (std::size_t{1} << 20) + 3;  // odd: NCCL handles any count
  std::vector<void*> buffers(devices.size());
  std::vector<cudaStream_t> streams(devices.size());
  for (std::size_t r = 0; r < devices.size(); ++r) {
    ASSERT_EQ(cudaSetDevice(devices[r]), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&buffers[r], kCount * devices.size() * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking), cudaSuccess);
    std::vector<float> own(kCount, static_cast<float>(r + 1));
    ASSERT_EQ(cudaMemcpy(static_cast<float*>(buffers[r]) + r * kCount, own.data(), kCount * sizeof(float),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    // From pageable memory it may return before the data has landed, and
    // the streams NCCL runs on (made non-blocking here) do not wait for the legacy stream.
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  auto gathered = comms->allGather(buffers, kCount, DType::kF32, streams);
  ASSERT_TRUE(gathered.ok()) << gathered.error().message;
  auto reduced = comms->reduceScatter(buffers, kCount, DType::kF32, ncclSum, streams);
  ASSERT_TRUE(reduced.ok()) << reduced.error().message;
  for (std::size_t r = 0; r < devices.size(); ++r) {
    ASSERT_EQ(cudaSetDevice(devices[r]), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(streams[r]), cudaSuccess);
  }
  EXPECT_TRUE(comms->poll().ok());
  for (std::size_t r = 0; r < devices.size(); ++r) {
    std::vector<float> all(kCount * devices.size());
    ASSERT_EQ(cudaMemcpy(all.data(), buffers[r], all.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    // After the gather every part q held q + 1; the sum over ranks of part r
    // is ranks * (r + 1).
    const auto want = static_cast<float>(devices.size() * (r + 1));
    EXPECT_EQ(all[r * kCount], want);
    EXPECT_EQ(all[r * kCount + kCount - 1], want);
    cudaFree(buffers[r]);
    cudaStreamDestroy(streams[r]);
  }
}

TEST(Nccl, TwoRanksOnOneGpuAreRefusedWithAnError) {
  DBUF_SKIP_WITHOUT_GPU();
  SKIP_WITHOUT_NCCL();
  const std::vector<int> same_gpu{0, 0};
  auto comms = LocalComms::create(same_gpu);
  ASSERT_FALSE(comms.ok()) << "NCCL accepted two ranks on one GPU";
  EXPECT_EQ(comms.error().code, ErrorCode::kDevice);
  EXPECT_NE(comms.error().message.find("ncclCommInitAll"), std::string::npos) << comms.error().message;
}

TEST(Nccl, MismatchedBuffersAreRefusedBeforeNcclIsCalled) {
  DBUF_SKIP_WITHOUT_GPU();
  SKIP_WITHOUT_NCCL();
  const std::vector<int> one{0};
  auto comms = LocalComms::create(one);
  ASSERT_TRUE(comms.ok()) << comms.error().message;
  const std::vector<void*> none;
  const std::vector<cudaStream_t> streams{nullptr};
  const auto r = comms->allGather(none, 16, DType::kF32, streams);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, ErrorCode::kInvalidArgument);
}

}  // namespace
}  // namespace dbuf::gpu
