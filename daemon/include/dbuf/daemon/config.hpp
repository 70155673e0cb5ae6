#pragma once
/// \file
/// dbufd configuration: struct defaults, then a TOML file, then command-line
/// flags. `config/dbufd.toml` documents every key with its default. Unknown
/// keys and bad values are errors naming the file, line and key.
/// Plain value types; thread-safe.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dbuf/common/result.hpp"

namespace dbuf::daemon {

enum class Backend : std::uint8_t { kHost, kCuda, kAuto };
enum class LogLevel : std::uint8_t { kTrace, kDebug, kInfo, kWarn, kError, kOff };

struct Tenant {
  std::string name;
  std::vector<std::uint32_t> uids;  ///< peers with one of these uids belong to the tenant
  std::vector<std::uint32_t> gids;  ///< ... or with one of these gids
  std::uint64_t memory_quota_bytes = std::uint64_t{16} << 30;
  std::uint32_t max_jobs = 16;
};

struct Config {
  std::string socket_path = "/run/dbufd/dbufd.sock";
  Backend backend = Backend::kHost;
  LogLevel log_level = LogLevel::kInfo;
  std::uint64_t memory_limit_bytes = std::uint64_t{64} << 30;  ///< all tenants together
  std::uint32_t ring_entries = 1024;                            ///< per session ring capacity (power of two)
  std::chrono::microseconds busy_poll{50};                      ///< spin before sleeping
  std::chrono::milliseconds handshake_timeout{2000};
  std::chrono::milliseconds register_timeout{30000};  ///< all ranks must register a group within it
  std::chrono::milliseconds collective_timeout{30000};
  std::chrono::seconds persistence_grace{300};
  /// Empty: a single tenant "default" admitting the daemon's own uid only.
  std::vector<Tenant> tenants;
};

/// Parses TOML text; `source` names the file in error messages.
[[nodiscard]] Result<Config> parseConfig(const std::string& text, const std::string& source);

/// Reads and parses a config file.
[[nodiscard]] Result<Config> loadConfig(const std::string& path);

/// Parses "123", "64KiB", "16MiB", "2GiB", "1TiB" (also KB/MB/GB as 10^3 powers).
[[nodiscard]] Result<std::uint64_t> parseBytes(const std::string& text);

[[nodiscard]] Result<Backend> parseBackend(const std::string& text);
[[nodiscard]] Result<LogLevel> parseLogLevel(const std::string& text);

}  // namespace dbuf::daemon
