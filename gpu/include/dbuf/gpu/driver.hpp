#pragma once
/// \file
/// The CUDA driver API entry points dbuf uses (virtual memory management,
/// host registration, stream memory operations), resolved at run time
/// through the CUDA runtime (cudaGetDriverEntryPointByVersion). Nothing
/// links libcuda.so, so dbuf's binaries start on machines without a GPU
/// driver and say so as an error when the CUDA backend is asked for.
/// Thread safety: driver() may be called from any thread; the table is
/// filled once and never changes.

#include <cuda.h>

#include <string_view>

#include "dbuf/common/result.hpp"

namespace dbuf::gpu {

struct Driver {
  decltype(&::cuGetErrorName) getErrorName = nullptr;
  decltype(&::cuDeviceGetAttribute) deviceGetAttribute = nullptr;
  decltype(&::cuCtxGetCurrent) ctxGetCurrent = nullptr;
  decltype(&::cuCtxSetCurrent) ctxSetCurrent = nullptr;
  decltype(&::cuMemCreate) memCreate = nullptr;
  decltype(&::cuMemRelease) memRelease = nullptr;
  decltype(&::cuMemExportToShareableHandle) memExportToShareableHandle = nullptr;
  decltype(&::cuMemImportFromShareableHandle) memImportFromShareableHandle = nullptr;
  decltype(&::cuMemGetAllocationGranularity) memGetAllocationGranularity = nullptr;
  decltype(&::cuMemAddressReserve) memAddressReserve = nullptr;
  decltype(&::cuMemAddressFree) memAddressFree = nullptr;
  decltype(&::cuMemMap) memMap = nullptr;
  decltype(&::cuMemUnmap) memUnmap = nullptr;
  decltype(&::cuMemSetAccess) memSetAccess = nullptr;
  decltype(&::cuMemHostRegister) memHostRegister = nullptr;
  decltype(&::cuMemHostUnregister) memHostUnregister = nullptr;
  decltype(&::cuMemHostGetDevicePointer) memHostGetDevicePointer = nullptr;
  decltype(&::cuStreamWriteValue64) streamWriteValue64 = nullptr;
  decltype(&::cuStreamWaitValue64) streamWaitValue64 = nullptr;
};

/// The entry points, loaded on first use (which initialises the CUDA
/// runtime). kUnavailable without a usable driver, naming what is missing.
[[nodiscard]] Result<const Driver*> driver();

/// CUDA_SUCCESS -> {}; otherwise an Error naming `what` and the driver's
/// error name: kUnavailable for no device / no driver, kDevice otherwise.
/// The one place a CUresult becomes an Error.
[[nodiscard]] Result<void> cuStatus(CUresult status, std::string_view what);

}  // namespace dbuf::gpu
