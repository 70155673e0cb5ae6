#pragma once
// SIGHUP: what a running dbufd takes from its configuration file as it is now.

#include <cstdint>
#include <string_view>
#include <vector>

#include "dbuf/daemon/config.hpp"
#include "jobs.hpp"

namespace dbuf::daemon {

/// The keys of `fresh` that differ from what the daemon runs with
/// (`running`) and that only a restart applies.
[[nodiscard]] std::vector<std::string_view> keysNeedingRestart(const Config& running, const Config& fresh);

/// Applies to `running` what a reload may change: the tenants (through
/// JobTable::retenant, which keeps the jobs' memory accounted), [admin] and
/// the log level; warns once for each key only a restart applies.
void applyReload(Config& running, const Config& fresh, JobTable& jobs, std::uint32_t daemon_uid);

}  // namespace dbuf::daemon
