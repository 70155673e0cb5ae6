#pragma once
/// \file
/// dbufd configuration: struct defaults, then a TOML file, then command-line
/// flags. `config/dbufd.toml` documents every key with its default. Unknown
/// keys and bad values are errors naming the file, line and key.
/// Plain value types; thread-safe (no shared state; every function is
/// reentrant). docs/configuration.md describes every key and the error format.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dbuf/common/result.hpp"

namespace dbuf::daemon {

/// Limits the config file is checked against (also used for flags).
inline constexpr std::uint32_t kMinRingEntries = 16;
inline constexpr std::uint32_t kMaxRingEntries = 65536;
inline constexpr std::int64_t kMaxBusyPollUs = 100000;
inline constexpr std::int64_t kMaxVirtualRanks = 1024;
inline constexpr std::int64_t kMaxTimeoutMs = 3600000;  ///< timeouts are 1 ms .. 1 h
inline constexpr std::int64_t kMaxGracePeriodS = 86400;
inline constexpr std::uint32_t kMaxTenantJobs = 65536;
inline constexpr std::size_t kMaxTenantNameLength = 64;
/// Longest socket path a sockaddr_un holds, leaving room for the NUL.
inline constexpr std::size_t kMaxSocketPathLength = 107;

enum class Backend : std::uint8_t { kHost, kCuda, kAuto };
enum class LogLevel : std::uint8_t { kTrace, kDebug, kInfo, kWarn, kError, kOff };

struct Tenant {
  std::string name;
  std::vector<std::uint32_t> uids;  ///< peers with one of these uids belong to the tenant
  std::vector<std::uint32_t> gids;  ///< ... or with one of these gids
  std::uint64_t memory_quota_bytes = std::uint64_t{16} << 30;
  std::uint32_t max_jobs = 16;

  bool operator==(const Tenant&) const = default;
};

struct Config {
  std::string socket_path = "/run/dbufd/dbufd.sock";
  Backend backend = Backend::kHost;
  /// cuda backend: how many ranks of a job may share one GPU (their
  /// collectives then run as the daemon's own kernels on that GPU); 0: one
  /// rank per GPU.
  std::uint32_t virtual_ranks = 0;
  LogLevel log_level = LogLevel::kInfo;
  std::uint64_t memory_limit_bytes = std::uint64_t{64} << 30;  ///< all tenants together
  std::uint32_t ring_entries = 1024;                           ///< per session ring capacity (power of two)
  std::chrono::microseconds busy_poll{50};                     ///< spin before sleeping
  std::chrono::milliseconds handshake_timeout{2000};
  std::chrono::milliseconds register_timeout{30000};  ///< all ranks must register a group within it
  std::chrono::milliseconds collective_timeout{30000};
  std::chrono::seconds persistence_grace{300};
  /// Empty: a single tenant "default" admitting the daemon's own uid only.
  std::vector<Tenant> tenants;
  /// [cluster]: jobs across nodes. The address (IP or host name) this
  /// daemon's inter-node connections bind to and its peers reach it at;
  /// empty: jobs across nodes are refused.
  std::string cluster_address;
  /// Redis stores ("redis:HOST:PORT") a job may name, as "HOST:PORT"; file
  /// stores need no listing (the directory must belong to the job's user).
  std::vector<std::string> cluster_store_hosts;
  /// [metrics]: where the Prometheus endpoint listens ("HOST:PORT",
  /// "[IPV6]:PORT"; port 0: any free one); empty: no endpoint. The shipped
  /// config/dbufd.toml sets 127.0.0.1:9478 (loopback only).
  std::string metrics_listen;
  /// [admin]: who may ask the daemon about every job and drain it (dbufctl),
  /// besides root and the uid dbufd runs as: peers with one of these uids, or
  /// with one of these gids as their primary or a supplementary group.
  std::vector<std::uint32_t> admin_uids;
  std::vector<std::uint32_t> admin_gids;

  bool operator==(const Config&) const = default;
};

/// Values given on the command line; each one set replaces the file's value.
struct ConfigOverrides {
  std::optional<std::string> socket_path;    ///< --socket
  std::optional<std::string> log_level;      ///< --log-level
  std::optional<std::string> backend;        ///< --backend
  std::optional<std::string> virtual_ranks;  ///< --virtual-ranks
  std::optional<std::string> metrics_listen; ///< --metrics-listen
};

/// Parses TOML text; `source` names the file in error messages.
/// Starts from the struct defaults; keys absent from the text keep them. An
/// empty tenant list stays empty (see effectiveTenants()). Every problem found
/// is reported, one per line, sorted by position, each as
/// `SOURCE:LINE:COLUMN: key 'table.key': what is wrong`. Never throws.
[[nodiscard]] Result<Config> parseConfig(const std::string& text, const std::string& source);

/// Reads and parses a config file. A missing file is kNotFound, an unreadable
/// one kIo, a bad one kInvalidArgument.
[[nodiscard]] Result<Config> loadConfig(const std::string& path);

/// Applies command-line flags on top of `config` (layering: defaults, then the
/// file, then flags). Errors name the flag; `config` is unchanged on error.
[[nodiscard]] Result<void> applyOverrides(Config& config, const ConfigOverrides& overrides);

/// The tenants the daemon admits: `config.tenants`, or when that is empty a
/// single tenant "default" admitting `daemon_uid` (pass getuid()) with the
/// Tenant struct's default quota and job limit.
[[nodiscard]] std::vector<Tenant> effectiveTenants(const Config& config, std::uint32_t daemon_uid);

/// The tenant a peer belongs to: the first of `tenants` that lists its uid
/// or its primary gid, or nullopt.
[[nodiscard]] std::optional<std::size_t> findTenant(const std::vector<Tenant>& tenants, std::uint32_t uid,
                                                    std::uint32_t gid);

/// Checks a [metrics] listen value: empty, or "HOST:PORT" / "[IPV6]:PORT"
/// with a port 0..65535 (no leading zeros).
[[nodiscard]] Result<void> validateMetricsAddress(const std::string& listen);

/// Checks a socket path: not empty, no NUL byte, fits in sockaddr_un::sun_path.
[[nodiscard]] Result<void> validateSocketPath(const std::string& path);

/// Parses "123", "64KiB", "16MiB", "2GiB", "1TiB" (also KB/MB/GB as 10^3 powers).
/// Binary suffixes: B, KiB, MiB, GiB, TiB. Decimal: kB or KB, MB, GB, TB. Spaces
/// may separate number and suffix. Rejects empty text, signs, fractions,
/// unknown suffixes and values that do not fit in 64 bits.
[[nodiscard]] Result<std::uint64_t> parseBytes(const std::string& text);

/// "host", "cuda" or "auto" (lower case).
[[nodiscard]] Result<Backend> parseBackend(const std::string& text);
/// "trace", "debug", "info", "warn", "error" or "off" (lower case).
[[nodiscard]] Result<LogLevel> parseLogLevel(const std::string& text);

/// The spellings parseBackend() / parseLogLevel() accept.
[[nodiscard]] std::string_view toString(Backend backend) noexcept;
[[nodiscard]] std::string_view toString(LogLevel level) noexcept;

}  // namespace dbuf::daemon
