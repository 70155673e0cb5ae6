// dbufd: the per-node dbuf daemon. Configuration: defaults -> --config FILE
// -> flags. Everything else lives in the dbuf_daemon library.
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "dbuf/cli/command_line.hpp"
#include "dbuf/daemon/config.hpp"
#include "dbuf/daemon/logging.hpp"
#include "dbuf/daemon/server.hpp"
#include "dbuf/daemon/systemd_notify.hpp"

namespace {

using dbuf::daemon::Config;

struct Flags {
  std::optional<std::string> config;
  bool check = false;  ///< --check: validate the configuration and exit
  dbuf::daemon::ConfigOverrides overrides;
};

/// An option kept as given: the configuration's checks judge its value, with the file's.
void addOverride(CLI::App& app, const std::string& name, const std::string& value_name,
                 std::optional<std::string>& target, const std::string& help) {
  app.add_option_function<std::string>(name, [&target](const std::string& value) { target = value; }, help)
      ->type_name(value_name);
}

void describeFlags(CLI::App& app, Flags& flags) {
  addOverride(app, "--config", "FILE", flags.config,
              "The TOML configuration file (docs/operations.md); the flags below override what it sets");
  addOverride(app, "--socket", "PATH", flags.overrides.socket_path, "The socket trainers and dbufctl connect to");
  addOverride(app, "--log-level", "LEVEL", flags.overrides.log_level, "trace, debug, info, warn, error or off");
  addOverride(app, "--backend", "NAME", flags.overrides.backend, "host, cuda or auto");
  addOverride(app, "--virtual-ranks", "N", flags.overrides.virtual_ranks, "Ranks per GPU (cuda backend)");
  addOverride(app, "--metrics-listen", "HOST:PORT", flags.overrides.metrics_listen,
              "Where to serve Prometheus metrics (/metrics)");
  app.add_flag("--check", flags.check,
               "Check the configuration (defaults, file, flags), print what it sets and exit: 0 when it is "
               "valid, 2 with its errors on stderr when not");
}

/// Defaults, then the file, then the flags.
dbuf::Result<Config> layeredConfig(const Flags& flags) {
  Config config;
  if (flags.config) {
    auto loaded = dbuf::daemon::loadConfig(*flags.config);
    if (!loaded) return loaded;
    config = std::move(*loaded);
  }
  if (auto applied = dbuf::daemon::applyOverrides(config, flags.overrides); !applied) return applied.error();
  config.tenants = dbuf::daemon::effectiveTenants(config, static_cast<std::uint32_t>(::getuid()));
  return config;
}

std::optional<std::string> environment(const char* name) {
  const char* value = std::getenv(name);  // NOLINT(concurrency-mt-unsafe): read once at start-up
  return value ? std::optional<std::string>(value) : std::nullopt;
}

/// NCCL settings dbufd's use of it depends on, made before any thread
/// starts (NCCL reads them when its first communicator is made).
void setNcclEnvironment() {
  const auto force = [](const char* name, const char* value) {
    if (auto was = environment(name); was && *was != value) {
      spdlog::warn("{}={} overridden to {}: dbufd needs it", name, *was, value);
    }
    ::setenv(name, value, 1);  // NOLINT(concurrency-mt-unsafe): no other thread yet
  };
  // One process drives every GPU of a job, so NCCL would read and write the
  // peers' buffers directly; DBuffers come from the VMM API with access
  // granted to their own GPU only, which that would fault on. Through NCCL's
  // own buffers instead, as between the trainer processes of a plain job.
  force("NCCL_P2P_DIRECT_DISABLE", "1");
  // The executor's NCCL calls are written for blocking communicators.
  force("NCCL_COMM_BLOCKING", "1");
}

std::string bytesText(std::uint64_t bytes) {
  constexpr std::uint64_t kGiB = std::uint64_t{1} << 30;
  constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;
  if (bytes % kGiB == 0) return std::to_string(bytes / kGiB) + " GiB";
  if (bytes % kMiB == 0) return std::to_string(bytes / kMiB) + " MiB";
  return std::to_string(bytes) + " bytes";
}

/// ", uids 1, 2" for a non-empty list, else nothing.
std::string idList(const std::string& label, const std::vector<std::uint32_t>& ids) {
  std::string out;
  for (const std::uint32_t id : ids) out += (out.empty() ? label : ", ") + std::to_string(id);
  return out;
}

/// --check: what the valid configuration sets, for the operator to read
/// (the backend as configured: `auto` is resolved only when serving, since
/// that initialises CUDA).
void printCheckedConfig(const Config& config, const std::optional<std::string>& file) {
  std::cout << "dbufd: configuration " << (file ? *file : std::string("(defaults)")) << " is valid\n"
            << "  socket:             " << config.socket_path << "\n"
            << "  backend:            " << dbuf::daemon::toString(config.backend) << "\n"
            << "  log level:          " << dbuf::daemon::toString(config.log_level) << "\n"
            << "  memory limit:       " << bytesText(config.memory_limit_bytes) << "\n"
            << "  collective timeout: " << config.collective_timeout.count() << " ms\n"
            << "  cluster address:    " << (config.cluster_address.empty() ? "(one node)" : config.cluster_address)
            << "\n"
            << "  metrics:            "
            << (config.metrics_listen.empty() ? std::string("(none)") : "http://" + config.metrics_listen + "/metrics")
            << "\n"
            << "  administrators:     root, uid " << ::getuid() << idList(", uids ", config.admin_uids)
            << idList(", gids ", config.admin_gids) << "\n"
            << "  tenants:            " << config.tenants.size() << "\n";
  for (const auto& tenant : config.tenants) {
    std::cout << "    " << tenant.name << ": " << tenant.uids.size() << " uid(s), " << tenant.gids.size()
              << " gid(s), quota " << bytesText(tenant.memory_quota_bytes) << ", at most " << tenant.max_jobs
              << " jobs\n";
  }
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  CLI::App app{"dbufd: the per-node dbuf daemon (configuration: defaults, then --config FILE, then flags)", "dbufd"};
  dbuf::cli::useConventions(app);
  describeFlags(app, flags);
  if (const auto done = dbuf::cli::parse(app, argc, argv)) return *done;
  auto config = layeredConfig(flags);
  if (!config) {
    std::cerr << "dbufd: " << config.error().message << "\n";
    return 2;
  }
  if (flags.check) {
    printCheckedConfig(*config, flags.config);
    return 0;
  }
  dbuf::daemon::setupLogging(config->log_level);
  setNcclEnvironment();
  auto server = dbuf::daemon::Server::create(std::move(*config));
  if (!server) {
    spdlog::error("{}", server.error().message);
    return 1;
  }
  const dbuf::daemon::SystemdNotifier systemd(environment("NOTIFY_SOCKET").value_or(""), environment("WATCHDOG_USEC"));
  if (const auto period = systemd.heartbeatPeriod()) {
    (*server)->setHeartbeat(*period, [&systemd] { systemd.notify("WATCHDOG=1"); });
  }
  (*server)->setConfigSource([layers = flags] { return layeredConfig(layers); });
  systemd.notify("READY=1\nSTATUS=serving on " + (*server)->socketPath());
  (*server)->run(/*handle_signals=*/true);
  systemd.notify("STOPPING=1");
  (*server).reset();  // the Server, its jobs and their executors go now
  if (const int left = dbuf::daemon::abandonedThreads(); left > 0) {
    spdlog::warn("{} NCCL set-up(s) of ended jobs still running: exiting without waiting for them", left);
    spdlog::shutdown();
    std::_Exit(0);
  }
  return 0;
}
