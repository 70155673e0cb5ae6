#include "dbuf/daemon/config.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <exception>
#include <limits>
#include <span>
#include <system_error>
#include <utility>

#include "dbuf/common/unique_fd.hpp"
#include "tenants.hpp"
#include "toml_values.hpp"

// What toml++ throws (toml::parse_error) is caught in parseConfig(); nothing
// of toml++ leaves base/.
namespace dbuf::daemon {
namespace {

using config_file::invalid;
using config_file::Located;
using config_file::Position;
using config_file::positionOf;
using config_file::Problems;
using config_file::quoted;
using config_file::typeName;
using config_file::ValueReader;

constexpr std::size_t kMaxConfigFileBytes = std::size_t{1} << 20;

constexpr std::array<std::string_view, 8> kRootKeys{"daemon", "rings",   "timeouts", "persistence",
                                                    "cluster", "metrics", "admin",    "tenant"};
constexpr std::array<std::string_view, 5> kDaemonKeys{"socket", "backend", "log_level", "memory_limit",
                                                      "virtual_ranks"};
constexpr std::array<std::string_view, 2> kRingKeys{"entries", "busy_poll_us"};
constexpr std::array<std::string_view, 3> kTimeoutKeys{"handshake_ms", "register_ms", "collective_ms"};
constexpr std::array<std::string_view, 1> kPersistenceKeys{"grace_period_s"};
constexpr std::array<std::string_view, 2> kClusterKeys{"address", "store_hosts"};
constexpr std::size_t kMaxClusterNameLength = 255;
constexpr std::array<std::string_view, 1> kMetricsKeys{"listen"};
constexpr std::array<std::string_view, 2> kAdminKeys{"uids", "gids"};

/// An IP address or a host name: letters, digits, '.', '-', ':' (IPv6).
Result<void> validateHostName(const std::string& name) {
  if (name.empty() || name.size() > kMaxClusterNameLength) {
    return invalid("expected an IP address or host name of 1.." + std::to_string(kMaxClusterNameLength) +
                   " characters");
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '-' || c == ':';
    if (!ok) return invalid(quoted(name) + " is not an IP address or host name");
  }
  return {};
}

/// Reads the sections of the parsed document into a Config; each reports
/// through `problems` and leaves the default in place on error.
class SectionReader : public ValueReader {
 public:
  using ValueReader::ValueReader;

  void daemon(const toml::table& t, Config& config) {
    for (auto&& [key, node] : t) {
      const std::string path = "daemon." + std::string(key.str());
      if (key == "socket") {
        if (auto text = string(node, path)) {
          if (Result<void> valid = validateSocketPath(*text); !valid) {
            problems_.add(node.source(), path, valid.error().message);
          } else {
            config.socket_path = std::move(*text);
          }
        }
      } else if (key == "backend") {
        if (auto text = string(node, path)) {
          if (Result<Backend> backend = parseBackend(*text)) {
            config.backend = *backend;
          } else {
            problems_.add(node.source(), path, backend.error().message);
          }
        }
      } else if (key == "log_level") {
        if (auto text = string(node, path)) {
          if (Result<LogLevel> level = parseLogLevel(*text)) {
            config.log_level = *level;
          } else {
            problems_.add(node.source(), path, level.error().message);
          }
        }
      } else if (key == "memory_limit") {
        if (auto bytes = size(node, path)) config.memory_limit_bytes = *bytes;
      } else if (key == "virtual_ranks") {
        if (auto v = integer(node, path, 0, kMaxVirtualRanks)) config.virtual_ranks = static_cast<std::uint32_t>(*v);
      } else {
        unknownKey(key, path, kDaemonKeys);
      }
    }
  }

  void rings(const toml::table& t, Config& config) {
    for (auto&& [key, node] : t) {
      const std::string path = "rings." + std::string(key.str());
      if (key == "entries") {
        if (auto v = integer(node, path, kMinRingEntries, kMaxRingEntries)) {
          if ((*v & (*v - 1)) != 0) {
            problems_.add(node.source(), path, std::to_string(*v) + " is not a power of two");
          } else {
            config.ring_entries = static_cast<std::uint32_t>(*v);
          }
        }
      } else if (key == "busy_poll_us") {
        if (auto v = integer(node, path, 0, kMaxBusyPollUs, " us")) config.busy_poll = std::chrono::microseconds{*v};
      } else {
        unknownKey(key, path, kRingKeys);
      }
    }
  }

  void timeouts(const toml::table& t, Config& config) {
    for (auto&& [key, node] : t) {
      const std::string path = "timeouts." + std::string(key.str());
      std::chrono::milliseconds* target = nullptr;
      if (key == "handshake_ms") {
        target = &config.handshake_timeout;
      } else if (key == "register_ms") {
        target = &config.register_timeout;
      } else if (key == "collective_ms") {
        target = &config.collective_timeout;
      } else {
        unknownKey(key, path, kTimeoutKeys);
        continue;
      }
      if (auto v = integer(node, path, 1, kMaxTimeoutMs, " ms")) *target = std::chrono::milliseconds{*v};
    }
  }

  void persistence(const toml::table& t, Config& config) {
    for (auto&& [key, node] : t) {
      const std::string path = "persistence." + std::string(key.str());
      if (key == "grace_period_s") {
        if (auto v = integer(node, path, 0, kMaxGracePeriodS, " s"))
          config.persistence_grace = std::chrono::seconds{*v};
      } else {
        unknownKey(key, path, kPersistenceKeys);
      }
    }
  }

  void cluster(const toml::table& t, Config& config) {
    for (auto&& [key, node] : t) {
      const std::string path = "cluster." + std::string(key.str());
      if (key == "address") {
        if (auto text = string(node, path)) {
          if (auto valid = text->empty() ? Result<void>{} : validateHostName(*text); !valid) {
            problems_.add(node.source(), path, valid.error().message);
          } else {
            config.cluster_address = std::move(*text);
          }
        }
      } else if (key == "store_hosts") {
        config.cluster_store_hosts = storeHosts(node, path);
      } else {
        unknownKey(key, path, kClusterKeys);
      }
    }
  }

  void metrics(const toml::table& t, Config& config) {
    for (auto&& [key, node] : t) {
      const std::string path = "metrics." + std::string(key.str());
      if (key != "listen") {
        unknownKey(key, path, kMetricsKeys);
      } else if (auto text = string(node, path)) {
        if (auto valid = validateMetricsAddress(*text); !valid) {
          problems_.add(node.source(), path, valid.error().message);
        } else {
          config.metrics_listen = std::move(*text);
        }
      }
    }
  }

  void admin(const toml::table& t, Config& config) {
    for (auto&& [key, node] : t) {
      const std::string path = "admin." + std::string(key.str());
      if (key == "uids" || key == "gids") {
        auto& target = key == "uids" ? config.admin_uids : config.admin_gids;
        for (const Located& l : ids(node, path, key == "uids" ? "uid" : "gid")) target.push_back(l.id);
      } else {
        unknownKey(key, path, kAdminKeys);
      }
    }
  }

 private:
  std::vector<std::string> storeHosts(const toml::node& node, const std::string& path) {
    std::vector<std::string> out;
    const toml::array* list = node.as_array();
    if (list == nullptr) {
      problems_.add(node.source(), path, "expected an array of \"HOST:PORT\" strings, got " + std::string(typeName(node)));
      return out;
    }
    for (std::size_t i = 0; i < list->size(); ++i) {
      const toml::node& element = *list->get(i);
      const std::string element_path = path + "[" + std::to_string(i) + "]";
      auto text = string(element, element_path);
      if (!text) continue;
      const std::size_t colon = text->rfind(':');
      // A job's store is admitted when "HOST:PORT" of the port it parsed
      // equals an entry (cluster.cpp, checkStoreAllowed): a port outside
      // 1..65535 or with leading zeros could never match.
      const std::string_view port =
          colon == std::string::npos ? std::string_view{} : std::string_view(*text).substr(colon + 1);
      const bool port_ok = !port.empty() && port.size() <= 5 && port.front() != '0' &&
                           std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
                           std::stoul(std::string(port)) <= 65535;
      if (!port_ok || !validateHostName(text->substr(0, colon))) {
        problems_.add(element.source(), element_path,
                      quoted(*text) + " is not HOST:PORT (a TCP port 1..65535, without leading zeros)");
        continue;
      }
      out.push_back(std::move(*text));
    }
    return out;
  }
};

Result<Config> walk(const toml::table& root, const std::string& source) {
  Problems problems(source);
  SectionReader reader(problems);
  Config config;
  for (auto&& [key, node] : root) {
    const std::string path(key.str());
    if (key == "tenant") {
      config.tenants = readTenants(node, problems);
      continue;
    }
    void (SectionReader::*section)(const toml::table&, Config&) = nullptr;
    if (key == "daemon") {
      section = &SectionReader::daemon;
    } else if (key == "rings") {
      section = &SectionReader::rings;
    } else if (key == "timeouts") {
      section = &SectionReader::timeouts;
    } else if (key == "persistence") {
      section = &SectionReader::persistence;
    } else if (key == "cluster") {
      section = &SectionReader::cluster;
    } else if (key == "metrics") {
      section = &SectionReader::metrics;
    } else if (key == "admin") {
      section = &SectionReader::admin;
    } else {
      reader.unknownKey(key, path, kRootKeys, node.is_table() ? "table" : "key");
      continue;
    }
    if (const toml::table* t = reader.table(node, path)) (reader.*section)(*t, config);
  }
  if (!problems.empty()) return problems.toError();
  return config;
}

std::string errnoText(int err) {
  return std::generic_category().message(err);
}

}  // namespace

Result<Config> parseConfig(const std::string& text, const std::string& source) {
  // The boundary with toml++: whatever it throws becomes an Error here.
  try {
    toml::table root;
    try {
      root = toml::parse(text, source);
    } catch (const toml::parse_error& e) {
      const Position where = positionOf(e.source());
      return invalid(source + ":" + std::to_string(where.line) + ":" + std::to_string(where.column) + ": " +
                     std::string(e.description()));
    }
    return walk(root, source);
  } catch (const std::exception& e) {
    return makeError(ErrorCode::kInternal, source + ":1:1: " + e.what());
  }
}

Result<Config> loadConfig(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));  // NOLINT(cppcoreguidelines-pro-type-vararg)
  if (!fd) {
    const int err = errno;
    return makeError(err == ENOENT ? ErrorCode::kNotFound : ErrorCode::kIo,
                     "cannot open config file '" + path + "': " + errnoText(err));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return makeError(ErrorCode::kIo, "cannot stat '" + path + "': " + errnoText(errno));
  if (S_ISDIR(st.st_mode)) return makeError(ErrorCode::kIo, "config file '" + path + "' is a directory");
  // Not only regular files: `--config <(generate)` hands us a pipe.
  std::string text;
  std::array<char, 8192> buffer{};
  for (;;) {
    const ssize_t n = ::read(fd.get(), buffer.data(), buffer.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return makeError(ErrorCode::kIo, "cannot read config file '" + path + "': " + errnoText(errno));
    }
    if (n == 0) break;
    text.append(buffer.data(), static_cast<std::size_t>(n));
    if (text.size() > kMaxConfigFileBytes) {
      return makeError(ErrorCode::kIo, "config file '" + path + "' is larger than " +
                                           std::to_string(kMaxConfigFileBytes >> 20) + " MiB");
    }
  }
  return parseConfig(text, path);
}

Result<void> applyOverrides(Config& config, const ConfigOverrides& overrides) {
  Config updated = config;
  if (overrides.socket_path) {
    if (Result<void> valid = validateSocketPath(*overrides.socket_path); !valid) {
      return std::move(valid).error().withContext("--socket");
    }
    updated.socket_path = *overrides.socket_path;
  }
  if (overrides.log_level) {
    Result<LogLevel> level = parseLogLevel(*overrides.log_level);
    if (!level) return std::move(level).error().withContext("--log-level");
    updated.log_level = *level;
  }
  if (overrides.backend) {
    Result<Backend> backend = parseBackend(*overrides.backend);
    if (!backend) return std::move(backend).error().withContext("--backend");
    updated.backend = *backend;
  }
  if (overrides.metrics_listen) {
    if (Result<void> valid = validateMetricsAddress(*overrides.metrics_listen); !valid) {
      return std::move(valid).error().withContext("--metrics-listen");
    }
    updated.metrics_listen = *overrides.metrics_listen;
  }
  if (overrides.virtual_ranks) {
    const std::string& text = *overrides.virtual_ranks;
    char* end = nullptr;
    const long long value = std::strtoll(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0' || value < 0 || value > kMaxVirtualRanks) {
      return invalid("--virtual-ranks: expected a whole number from 0 to " + std::to_string(kMaxVirtualRanks) +
                     ", got " + quoted(text));
    }
    updated.virtual_ranks = static_cast<std::uint32_t>(value);
  }
  config = std::move(updated);
  return {};
}

Result<void> validateMetricsAddress(const std::string& listen) {
  if (listen.empty()) return {};
  const std::size_t colon = listen.rfind(':');
  const std::string_view port =
      colon == std::string::npos ? std::string_view{} : std::string_view(listen).substr(colon + 1);
  const bool port_ok = !port.empty() && port.size() <= 5 && (port == "0" || port.front() != '0') &&
                       std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
                       std::stoul(std::string(port)) <= 65535;
  std::string host = colon == std::string::npos ? listen : listen.substr(0, colon);
  // An IPv6 address in brackets ("[::1]:9478"), as in a URL.
  const bool bracketed = host.size() >= 2 && host.front() == '[' && host.back() == ']';
  if (bracketed) host = host.substr(1, host.size() - 2);
  const bool host_ok = !host.empty() && (bracketed || host.find(':') == std::string::npos) && validateHostName(host);
  if (!port_ok || !host_ok) {
    return invalid(quoted(listen) + " is not HOST:PORT or [IPV6]:PORT (a TCP port 0..65535, 0: any free one; " +
                   "empty: no metrics endpoint)");
  }
  return {};
}

std::vector<Tenant> effectiveTenants(const Config& config, std::uint32_t daemon_uid) {
  if (!config.tenants.empty()) return config.tenants;
  Tenant tenant;
  tenant.name = "default";
  tenant.uids.push_back(daemon_uid);
  return {std::move(tenant)};
}

std::optional<std::size_t> findTenant(const std::vector<Tenant>& tenants, std::uint32_t uid, std::uint32_t gid) {
  for (std::size_t t = 0; t < tenants.size(); ++t) {
    const Tenant& tenant = tenants[t];
    if (std::find(tenant.uids.begin(), tenant.uids.end(), uid) != tenant.uids.end() ||
        std::find(tenant.gids.begin(), tenant.gids.end(), gid) != tenant.gids.end()) {
      return t;
    }
  }
  return std::nullopt;
}

Result<void> validateSocketPath(const std::string& path) {
  if (path.empty()) return invalid("socket path is empty");
  if (path.find('\0') != std::string::npos) return invalid("socket path contains a NUL byte");
  if (path.size() > kMaxSocketPathLength) {
    return invalid("socket path is " + std::to_string(path.size()) +
                   " bytes long; a Unix socket address holds at most " + std::to_string(kMaxSocketPathLength));
  }
  return {};
}

Result<std::uint64_t> parseBytes(const std::string& text) {
  struct Unit {
    std::string_view suffix;
    std::uint64_t factor;
  };
  static constexpr std::array<Unit, 11> kUnits{{
      {"", 1},
      {"B", 1},
      {"KiB", std::uint64_t{1} << 10},
      {"MiB", std::uint64_t{1} << 20},
      {"GiB", std::uint64_t{1} << 30},
      {"TiB", std::uint64_t{1} << 40},
      {"kB", 1000},
      {"KB", 1000},
      {"MB", std::uint64_t{1000} * 1000},
      {"GB", std::uint64_t{1000} * 1000 * 1000},
      {"TB", std::uint64_t{1000} * 1000 * 1000 * 1000},
  }};
  const std::string_view s = text;
  if (s.empty()) return invalid("empty size");
  if (s.front() == '-') return invalid("negative size " + quoted(s));
  const auto is_digit = [](char c) { return c >= '0' && c <= '9'; };
  if (!is_digit(s.front())) return invalid("size " + quoted(s) + " does not start with a number");

  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  std::uint64_t number = 0;
  std::size_t i = 0;
  for (; i < s.size() && is_digit(s[i]); ++i) {
    const auto digit = static_cast<std::uint64_t>(s[i] - '0');
    if (number > (kMax - digit) / 10) return invalid("size " + quoted(s) + " does not fit in 64 bits");
    number = number * 10 + digit;
  }
  if (i < s.size() && (s[i] == '.' || s[i] == ',')) {
    return invalid("size " + quoted(s) + " is not a whole number; use a smaller unit (e.g. \"1536MiB\")");
  }
  std::size_t suffix_begin = i;
  while (suffix_begin < s.size() && s[suffix_begin] == ' ') ++suffix_begin;
  const std::string_view suffix = s.substr(suffix_begin);
  if (suffix_begin != i && suffix.empty()) return invalid("size " + quoted(s) + " has trailing spaces");

  const auto unit = std::find_if(kUnits.begin(), kUnits.end(), [&](const Unit& u) { return u.suffix == suffix; });
  if (unit == kUnits.end()) {
    return invalid("unknown unit " + quoted(suffix) + " in size " + quoted(s) +
                   " (expected B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)");
  }
  if (number > kMax / unit->factor) return invalid("size " + quoted(s) + " does not fit in 64 bits");
  return number * unit->factor;
}

Result<Backend> parseBackend(const std::string& text) {
  constexpr std::array<Backend, 3> kAll{Backend::kHost, Backend::kCuda, Backend::kAuto};
  for (Backend backend : kAll) {
    if (text == toString(backend)) return backend;
  }
  return invalid("unknown backend " + quoted(text) + " (expected \"host\", \"cuda\" or \"auto\")");
}

Result<LogLevel> parseLogLevel(const std::string& text) {
  constexpr std::array<LogLevel, 6> kAll{LogLevel::kTrace, LogLevel::kDebug, LogLevel::kInfo,
                                         LogLevel::kWarn,  LogLevel::kError, LogLevel::kOff};
  for (LogLevel level : kAll) {
    if (text == toString(level)) return level;
  }
  return invalid("unknown log level " + quoted(text) +
                 " (expected \"trace\", \"debug\", \"info\", \"warn\", \"error\" or \"off\")");
}

std::string_view toString(Backend backend) noexcept {
  switch (backend) {
    case Backend::kHost:
      return "host";
    case Backend::kCuda:
      return "cuda";
    case Backend::kAuto:
      return "auto";
  }
  return "unknown";
}

std::string_view toString(LogLevel level) noexcept {
  switch (level) {
    case LogLevel::kTrace:
      return "trace";
    case LogLevel::kDebug:
      return "debug";
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kWarn:
      return "warn";
    case LogLevel::kError:
      return "error";
    case LogLevel::kOff:
      return "off";
  }
  return "unknown";
}

}  // namespace dbuf::daemon
