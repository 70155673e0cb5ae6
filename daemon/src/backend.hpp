#pragma once
// Which backend a daemon can actually run, decided once at start.

#include "dbuf/common/result.hpp"
#include "dbuf/daemon/config.hpp"

namespace dbuf::daemon {

/// host: host. cuda: cuda if this dbufd was built with CUDA and a CUDA
/// device is usable (every device's context is created here, not on a
/// client's first Hello), else an error saying which is missing. auto: cuda
/// when it would be accepted and virtual ranks are on (without them the cuda
/// backend takes only one-rank jobs), else host.
[[nodiscard]] Result<Backend> resolveBackend(const Config& config);

}  // namespace dbuf::daemon
