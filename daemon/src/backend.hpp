#pragma once
// Which backend a daemon can actually run, decided once at start.

#include "dbuf/common/result.hpp"
#include "dbuf/daemon/config.hpp"

namespace dbuf::daemon {

/// host: host. cuda: cuda if this dbufd was built with CUDA and a CUDA
/// device is usable (every device's context is created here, not on a
/// client's first Hello), else an error saying which is missing. auto: cuda
/// when it would be accepted and a job could run on it (virtual ranks are on,
/// or NCCL loads for one rank per GPU), else host.
[[nodiscard]] Result<Backend> resolveBackend(const Config& config);

/// The GPUs the cuda backend places ranks on: 0 .. visibleGpus() - 1 as this
/// process sees them (CUDA_VISIBLE_DEVICES applies); 0 without CUDA.
[[nodiscard]] int visibleGpus();

}  // namespace dbuf::daemon
