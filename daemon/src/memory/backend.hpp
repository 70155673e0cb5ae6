#pragma once
// Which backend a daemon can actually run, decided once at start.

#include <vector>

#include "dbuf/common/gpu_uuid.hpp"
#include "dbuf/common/result.hpp"
#include "dbuf/daemon/config.hpp"

namespace dbuf::daemon {

/// host: host. cuda: cuda if this dbufd was built with CUDA and a CUDA
/// device is usable (every device's context is created here, not on a
/// client's first Hello), else an error saying which is missing. auto: cuda
/// when it would be accepted and a job could run on it (virtual ranks are on,
/// or NCCL loads for one rank per GPU), else host.
[[nodiscard]] Result<Backend> resolveBackend(const Config& config);

/// The GPUs the cuda backend places ranks on, by index as this process sees
/// them (CUDA_VISIBLE_DEVICES applies): their UUIDs (unknown where the
/// runtime would not say); none without CUDA.
[[nodiscard]] std::vector<GpuUuid> visibleGpus();

}  // namespace dbuf::daemon
