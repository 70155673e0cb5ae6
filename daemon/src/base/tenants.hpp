#pragma once
// The [[tenant]] array of dbufd's configuration: each tenant's keys, then
// the rules across tenants (unique names, each uid and gid in one tenant,
// nobody's tenant ambiguous). Internal to base/ (config.cpp).

#include <vector>

#include "dbuf/daemon/config.hpp"
#include "toml_values.hpp"

namespace dbuf::daemon::config_file {

/// The tenants `node` (the root's "tenant" key) gives; problems go to `problems`.
[[nodiscard]] std::vector<Tenant> readTenants(const toml::node& node, Problems& problems);

}  // namespace dbuf::daemon::config_file
