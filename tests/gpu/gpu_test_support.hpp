#pragma once
// What every in-process GPU test starts with: skip, saying why, when no CUDA
// device is usable; otherwise make device 0 current (its primary context is
// created here, before anything that needs one).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "dbuf/kernels/cuda_ops.hpp"

#define DBUF_SKIP_WITHOUT_GPU()                                                                \
  do {                                                                                         \
    const ::dbuf::kernels::cuda::DeviceCheck gpu_check = ::dbuf::kernels::cuda::checkDevice(); \
    if (!gpu_check.usable) GTEST_SKIP() << "no usable CUDA device: " << gpu_check.reason;      \
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);                                                  \
  } while (false)
