#include "reload.hpp"

#include <spdlog/spdlog.h>

#include <string>

#include "dbuf/daemon/logging.hpp"

namespace dbuf::daemon {

std::vector<std::string_view> keysNeedingRestart(const Config& running, const Config& fresh) {
  std::vector<std::string_view> keys;
  const auto note = [&](bool changed, std::string_view key) {
    if (changed) keys.push_back(key);
  };
  note(fresh.socket_path != running.socket_path, "daemon.socket");
  // running.backend is resolved ("auto" became host or cuda).
  note(fresh.backend != Backend::kAuto && fresh.backend != running.backend, "daemon.backend");
  note(fresh.virtual_ranks != running.virtual_ranks, "daemon.virtual_ranks");
  note(fresh.memory_limit_bytes != running.memory_limit_bytes, "daemon.memory_limit");
  note(fresh.ring_entries != running.ring_entries, "rings.entries");
  note(fresh.busy_poll != running.busy_poll, "rings.busy_poll_us");
  note(fresh.handshake_timeout != running.handshake_timeout, "timeouts.handshake_ms");
  note(fresh.register_timeout != running.register_timeout, "timeouts.register_ms");
  note(fresh.collective_timeout != running.collective_timeout, "timeouts.collective_ms");
  note(fresh.persistence_grace != running.persistence_grace, "persistence.grace_period_s");
  note(fresh.cluster_address != running.cluster_address, "cluster.address");
  note(fresh.cluster_store_hosts != running.cluster_store_hosts, "cluster.store_hosts");
  note(fresh.metrics_listen != running.metrics_listen, "metrics.listen");
  return keys;
}

void applyReload(Config& running, const Config& fresh, JobTable& jobs, std::uint32_t daemon_uid) {
  for (const std::string_view key : keysNeedingRestart(running, fresh)) {
    spdlog::warn("SIGHUP: {} changed; it takes effect when dbufd restarts", key);
  }
  running.tenants = jobs.retenant(effectiveTenants(fresh, daemon_uid));
  running.admin_uids = fresh.admin_uids;
  running.admin_gids = fresh.admin_gids;
  running.log_level = fresh.log_level;
  spdlog::default_logger()->set_level(toSpdlogLevel(running.log_level));
  std::string tenants;
  for (const Tenant& tenant : running.tenants) {
    tenants += (tenants.empty() ? "" : ", ") + tenant.name + " (quota " + std::to_string(tenant.memory_quota_bytes) +
               " bytes, at most " + std::to_string(tenant.max_jobs) + " jobs)";
  }
  spdlog::info("SIGHUP: configuration reloaded: tenants {}; log level {}", tenants, toString(running.log_level));
}

}  // namespace dbuf::daemon
