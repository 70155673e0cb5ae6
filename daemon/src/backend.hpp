#pragma once
// Which backend a daemon can actually run, decided once at start.

#include "dbuf/common/result.hpp"
#include "dbuf/daemon/config.hpp"

namespace dbuf::daemon {

/// host: host. cuda: cuda if this dbufd was built with CUDA and a CUDA
/// device is usable, else an error saying which is missing. auto: cuda when
/// it would be accepted, else host.
[[nodiscard]] Result<Backend> resolveBackend(Backend requested);

}  // namespace dbuf::daemon
