// Fuzzes dbufd's configuration file parser (daemon/include/dbuf/daemon/config.hpp):
// parseConfig over the input as TOML text, and parseBytes over it as a size.
//
// Properties: bad input is an error value (kInvalidArgument; kInternal would
// mean toml++ threw something parseConfig did not expect), never a crash,
// and a config that parses satisfies every limit config.hpp and
// docs/configuration.md promise. A size that parses prints back as its
// number of bytes, which parses to the same value.
//
// Seeds: config/dbufd.toml, config/examples/*.toml and a few sizes.

#include <cstdint>
#include <cstdlib>
#include <string>

#include "dbuf/daemon/config.hpp"
#include "fuzz_util.hpp"

namespace {

using namespace dbuf::daemon;  // NOLINT(google-build-using-namespace)
using dbuf::ErrorCode;
using dbuf::fuzz::check;

void checkLimits(const Config& config) {
  check(validateSocketPath(config.socket_path).ok(), "the socket path is valid");
  check(config.virtual_ranks <= kMaxVirtualRanks, "virtual_ranks <= 1024");
  check(config.memory_limit_bytes > 0, "memory_limit > 0");
  check(config.ring_entries >= kMinRingEntries && config.ring_entries <= kMaxRingEntries &&
            (config.ring_entries & (config.ring_entries - 1)) == 0,
        "ring entries: a power of two in 16..65536");
  check(config.busy_poll.count() >= 0 && config.busy_poll.count() <= kMaxBusyPollUs, "busy_poll_us in 0..100000");
  for (const auto timeout : {config.handshake_timeout, config.register_timeout, config.collective_timeout}) {
    check(timeout.count() >= 1 && timeout.count() <= kMaxTimeoutMs, "timeouts in 1..3600000 ms");
  }
  check(config.persistence_grace.count() >= 0 && config.persistence_grace.count() <= kMaxGracePeriodS,
        "grace_period_s in 0..86400");
  // A Redis store a job names is admitted when "HOST:PORT" of its parsed
  // port (daemon/src/cluster/cluster.cpp, checkStoreAllowed) equals a listed entry:
  // an entry whose port is not a TCP port in that spelling admits nothing.
  for (const std::string& host : config.cluster_store_hosts) {
    const std::size_t colon = host.rfind(':');
    check(colon != std::string::npos && colon > 0, "a store host is HOST:PORT");
    const std::string port = host.substr(colon + 1);
    const long value = std::strtol(port.c_str(), nullptr, 10);
    check(value >= 1 && value <= 65535 && std::to_string(value) == port,
          "a store host's port is a TCP port, written as a job's store would be compared");
  }
  for (const Tenant& tenant : config.tenants) {
    check(!tenant.name.empty() && tenant.name.size() <= kMaxTenantNameLength, "tenant names 1..64 bytes");
    check(tenant.max_jobs >= 1 && tenant.max_jobs <= kMaxTenantJobs, "tenant max_jobs in 1..65536");
    check(tenant.memory_quota_bytes > 0, "tenant memory_quota > 0");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);  // NOLINT
  auto config = parseConfig(text, "fuzz.toml");
  if (config) {
    checkLimits(*config);
    (void)effectiveTenants(*config, 1000);
  } else {
    check(config.error().code == ErrorCode::kInvalidArgument, "a bad config is kInvalidArgument");
    check(config.error().message.starts_with("fuzz.toml:"), "a config error names the file");
  }

  auto bytes = parseBytes(text);
  if (bytes) {
    auto again = parseBytes(std::to_string(*bytes));
    check(again.ok() && *again == *bytes, "a parsed size prints as bytes that parse to the same size");
  } else {
    check(bytes.error().code == ErrorCode::kInvalidArgument, "a bad size is kInvalidArgument");
  }
  return 0;
}
