// The CUDA kernels against the CPU ops, bit for bit, on the twin harness's
// calls (every op and dtype pair, random bit patterns with NaN / inf /
// subnormals, odd sizes, unaligned offsets and tails, multi-tile segments,
// partial fp8 blocks), through a reused DeviceTable and through temporary
// tables. Label `gpu`: skipped, saying why, where no CUDA device is usable.
// The argument checks need no device and run everywhere.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <vector>

#include "dbuf/kernels/cuda_ops.hpp"
#include "dbuf/kernels/cuda_runner.hpp"
#include "gpu_test_support.hpp"
#include "twin_harness.hpp"

namespace dbuf::kernels {
namespace {

void mustCuda(cudaError_t status, const char* what) {
  ASSERT_EQ(status, cudaSuccess) << what << ": " << cudaGetErrorString(status);
}

/// Device copies of a call's host buffers, copied back on download().
class DeviceBuffers {
 public:
  explicit DeviceBuffers(const twin::Buffers& host) {
    for (const auto& s : host.srcs) srcs_.push_back(upload(s));
    dst_ = upload(host.dst);
    scales_ = upload(host.scales);
  }
  ~DeviceBuffers() {
    for (void* p : srcs_) cudaFree(p);
    cudaFree(dst_);
    cudaFree(scales_);
  }
  DeviceBuffers(const DeviceBuffers&) = delete;
  DeviceBuffers& operator=(const DeviceBuffers&) = delete;

  twin::Views views(const twin::OpCall& call, const twin::Buffers& host) const {
    return twin::viewsOf(call, host, srcs_, dst_, scales_);
  }
  cudaError_t download(twin::Buffers& host) const {
    if (auto e = cudaMemcpy(host.dst.data(), dst_, host.dst.size(), cudaMemcpyDeviceToHost); e != cudaSuccess) return e;
    return cudaMemcpy(host.scales.data(), scales_, host.scales.size(), cudaMemcpyDeviceToHost);
  }

 private:
  static void* upload(const std::vector<unsigned char>& bytes) {
    void* p = nullptr;
    if (cudaMalloc(&p, bytes.size()) != cudaSuccess) return nullptr;
    cudaMemcpy(p, bytes.data(), bytes.size(), cudaMemcpyHostToDevice);
    return p;
  }
  std::vector<void*> srcs_;
  void* dst_ = nullptr;
  void* scales_ = nullptr;
};

/// Runs a call on the GPU on `stream`, through a cached table or temporary ones.
twin::Twin onGpu(cudaStream_t stream, bool cache_table) {
  return [=](const twin::OpCall& call, twin::Buffers& host) -> Result<void> {
    const DeviceBuffers device(host);
    cuda::CudaRunner runner(stream, call.tile, cache_table);
    if (auto r = twin::dispatch(call, device.views(call, host), runner); !r) return r;
    if (cudaStreamSynchronize(stream) != cudaSuccess || device.download(host) != cudaSuccess) {
      return makeError(ErrorCode::kDevice, std::string("CUDA: ") + cudaGetErrorString(cudaGetLastError()));
    }
    return {};
  };
}

TEST(CudaKernels, EveryOpMatchesTheCpuOpsBitForBit) {
  DBUF_SKIP_WITHOUT_GPU();
  cudaStream_t stream = nullptr;
  mustCuda(cudaStreamCreate(&stream), "cudaStreamCreate");
  const std::vector<twin::OpCall> calls = twin::allCalls();
  for (std::size_t i = 0; i < calls.size(); ++i) {
    EXPECT_EQ(twin::compareWithCpu(calls[i], onGpu(stream, true), static_cast<unsigned>(i)), "");
  }
  mustCuda(cudaStreamDestroy(stream), "cudaStreamDestroy");
}

TEST(CudaKernels, TemporaryTablesOnTheDefaultStreamGiveTheSameBits) {
  DBUF_SKIP_WITHOUT_GPU();
  const std::vector<twin::OpCall> calls = twin::allCalls();
  for (std::size_t i = 0; i < calls.size(); i += 7) {
    EXPECT_EQ(twin::compareWithCpu(calls[i], onGpu(nullptr, false), static_cast<unsigned>(i)), "");
  }
}

TEST(CudaKernels, LargeTilesAndOneThousandSegments) {
  DBUF_SKIP_WITHOUT_GPU();
  // The bench's shape: 1000 segments of mixed sizes in one launch, default tiles.
  twin::OpCall call;
  call.kind = twin::OpKind::kQuantize;
  call.src_type = DType::kBF16;
  call.dst_type = DType::kF8E4M3;
  call.tile = std::int64_t{1} << 15;
  call.name = "quantize bf16, 1000 segments";
  std::int64_t at = 0;
  std::int64_t scale = 0;
  for (int i = 0; i < 1000; ++i) {
    const std::int64_t count = 1 + (i * 7919) % 70000;
    const std::int64_t block = i % 3 == 0 ? 128 : (i % 3 == 1 ? 4096 : 1);
    call.segments.push_back({at, at, count, block, scale});
    at += count;
    scale += (count + block - 1) / block;
  }
  EXPECT_EQ(twin::compareWithCpu(call, onGpu(nullptr, true), 1), "");
}

TEST(CudaKernels, BadTablesAreRefusedBeforeAnythingIsQueued) {
  // No device needed: the checks are the CPU ops' and run first.
  std::vector<Segment> segments{{0, 0, 10, 0, 0}};
  float dummy = 0;
  const auto r = cuda::copy({&dummy, DType::kF32, 5}, {&dummy, DType::kF32, 100}, segments);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(r.error().message.find("kernels::copy: segment 0: source [0, +10) outside the buffer of 5 elements"),
            std::string::npos)
      << r.error().message;
  const auto q =
      cuda::quantizeE4m3({&dummy, DType::kF32, 10}, {&dummy, DType::kF8E4M3, 10}, {&dummy, DType::kF32, 1}, segments);
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.error().message.find("block must be > 0"), std::string::npos) << q.error().message;
}

TEST(CudaKernels, DeviceCheckSaysWhyNotWhenThereIsNoGpu) {
  const cuda::DeviceCheck device = cuda::checkDevice();
  if (device.usable) {
    EXPECT_TRUE(device.reason.empty());
  } else {
    EXPECT_FALSE(device.reason.empty());
  }
}

}  // namespace
}  // namespace dbuf::kernels
