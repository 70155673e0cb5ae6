#pragma once
/// \file
/// What the CUDA runtime says about a device (CUDA builds only).

#include "dbuf/common/gpu_uuid.hpp"
#include "dbuf/common/result.hpp"

namespace dbuf {

/// The UUID of `device` (an index as this process sees its GPUs).
[[nodiscard]] Result<GpuUuid> gpuUuidOf(int device);

}  // namespace dbuf
