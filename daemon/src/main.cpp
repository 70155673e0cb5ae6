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

#include "dbuf/daemon/config.hpp"
#include "dbuf/daemon/logging.hpp"
#include "dbuf/daemon/server.hpp"
#include "dbuf/daemon/systemd_notify.hpp"

namespace {

using dbuf::daemon::Config;

constexpr const char* kUsage =
    "usage: dbufd [--config FILE] [--socket PATH] [--log-level trace|debug|info|warn|error|off]\n"
    "             [--backend host|cuda|auto] [--virtual-ranks N]\n";

struct Flags {
  std::optional<std::string> config;
  dbuf::daemon::ConfigOverrides overrides;
};

std::optional<Flags> parseFlags(const std::vector<std::string>& args, std::string& error) {
  Flags flags;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& flag = args[i];
    std::optional<std::string>* target = flag == "--config"          ? &flags.config
                                         : flag == "--socket"        ? &flags.overrides.socket_path
                                         : flag == "--log-level"     ? &flags.overrides.log_level
                                         : flag == "--backend"       ? &flags.overrides.backend
                                         : flag == "--virtual-ranks" ? &flags.overrides.virtual_ranks
                                                                     : nullptr;
    if (target == nullptr) {
      error = "unknown argument '" + flag + "'";
      return std::nullopt;
    }
    if (i + 1 == args.size()) {
      error = flag + " needs a value";
      return std::nullopt;
    }
    *target = args[++i];
  }
  return flags;
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

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    std::cout << kUsage;
    return 0;
  }
  std::string error;
  const auto flags = parseFlags(args, error);
  if (!flags) {
    std::cerr << "dbufd: " << error << "\n" << kUsage;
    return 2;
  }
  auto config = layeredConfig(*flags);
  if (!config) {
    std::cerr << "dbufd: " << config.error().message << "\n";
    return 2;
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
