#include "dbuf/gpu/driver.hpp"

#include <cuda_runtime_api.h>

#include <string>

#include "dbuf/common/cuda_status.hpp"

namespace dbuf::gpu {
namespace {

/// The driver ABI the entry points are asked for: 12.0. The signatures used
/// here (VMM, cuMemHostRegister_v2, cuStreamWrite/WaitValue64_v2) are the
/// same in 12.0 and 13.x, and asking for a version newer than the installed
/// driver fails, so the oldest that has them all is the one to name.
constexpr unsigned kDriverAbi = 12000;

/// Resolves `name` for kDriverAbi.
template <typename Fn>
Result<void> resolve(const char* name, Fn& fn) {
  void* address = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (auto r = cudaStatus(cudaGetDriverEntryPointByVersion(name, &address, kDriverAbi, cudaEnableDefault, &found),
                          std::string("resolving ") + name);
      !r) {
    return r;
  }
  if (found != cudaDriverEntryPointSuccess || address == nullptr) {
    return makeError(ErrorCode::kUnavailable,
                     std::string("the CUDA driver has no ") + name + " for CUDA 12.0 or later (driver too old?)");
  }
  fn = reinterpret_cast<Fn>(address);  // NOLINT(cppcoreguidelines-pro-type-reinterpret-cast): driver entry point
  return {};
}

Result<Driver> load() {
  Driver d;
  Result<void> r;
  const auto get = [&r](const char* name, auto& fn) {
    if (r) r = resolve(name, fn);
  };
  get("cuGetErrorName", d.getErrorName);
  get("cuDeviceGetAttribute", d.deviceGetAttribute);
  get("cuCtxGetCurrent", d.ctxGetCurrent);
  get("cuCtxSetCurrent", d.ctxSetCurrent);
  get("cuMemCreate", d.memCreate);
  get("cuMemRelease", d.memRelease);
  get("cuMemExportToShareableHandle", d.memExportToShareableHandle);
  get("cuMemImportFromShareableHandle", d.memImportFromShareableHandle);
  get("cuMemGetAllocationGranularity", d.memGetAllocationGranularity);
  get("cuMemAddressReserve", d.memAddressReserve);
  get("cuMemAddressFree", d.memAddressFree);
  get("cuMemMap", d.memMap);
  get("cuMemUnmap", d.memUnmap);
  get("cuMemSetAccess", d.memSetAccess);
  get("cuMemHostRegister", d.memHostRegister);
  get("cuMemHostUnregister", d.memHostUnregister);
  get("cuMemHostGetDevicePointer", d.memHostGetDevicePointer);
  get("cuStreamWriteValue64", d.streamWriteValue64);
  get("cuStreamWaitValue64", d.streamWaitValue64);
  if (!r) return r.error();
  return d;
}

}  // namespace

Result<const Driver*> driver() {
  static const Result<Driver> loaded = load();  // thread-safe once
  if (!loaded) return loaded.error();
  return &*loaded;
}

Result<void> cuStatus(CUresult status, std::string_view what) {
  if (status == CUDA_SUCCESS) return {};
  const char* name = nullptr;
  if (auto d = driver(); d && (*d)->getErrorName(status, &name) != CUDA_SUCCESS) name = nullptr;
  const bool no_device = status == CUDA_ERROR_NO_DEVICE || status == CUDA_ERROR_NOT_INITIALIZED ||
                         status == CUDA_ERROR_STUB_LIBRARY || status == CUDA_ERROR_SYSTEM_DRIVER_MISMATCH;
  return makeError(no_device ? ErrorCode::kUnavailable : ErrorCode::kDevice,
                   std::string(what) + ": " + (name != nullptr ? name : "CUresult " + std::to_string(status)));
}

}  // namespace dbuf::gpu
