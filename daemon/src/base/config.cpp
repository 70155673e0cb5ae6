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

// toml++ is built with exceptions in Debian (its ABI namespace is toml::v3::ex),
// so parse() throws toml::parse_error. It is caught in parseConfig() and
// nothing else from toml++ leaves this file.
#include <toml++/toml.h>

#include "dbuf/common/unique_fd.hpp"

namespace dbuf::daemon {
namespace {

constexpr std::size_t kMaxConfigFileBytes = std::size_t{1} << 20;
constexpr std::int64_t kMaxId = std::int64_t{std::numeric_limits<std::uint32_t>::max()} - 1;  // (uid_t)-1 means "none"

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
constexpr std::array<std::string_view, 5> kTenantKeys{"name", "uids", "gids", "memory_quota", "max_jobs"};

Error invalid(std::string message) {
  return makeError(ErrorCode::kInvalidArgument, std::move(message));
}

std::string joinNames(std::span<const std::string_view> names) {
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += i + 1 == names.size() ? " or " : ", ";
    out += names[i];
  }
  return out;
}

std::size_t editDistance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string_view typeName(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::table:
      return "a table";
    case toml::node_type::array:
      return "an array";
    case toml::node_type::string:
      return "a string";
    case toml::node_type::integer:
      return "an integer";
    case toml::node_type::floating_point:
      return "a floating-point number";
    case toml::node_type::boolean:
      return "a boolean";
    case toml::node_type::date:
      return "a date";
    case toml::node_type::time:
      return "a time";
    case toml::node_type::date_time:
      return "a date-time";
    case toml::node_type::none:
      break;
  }
  return "nothing";
}

std::string quoted(std::string_view text) {
  return "\"" + std::string(text) + "\"";
}

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

struct Position {
  std::uint32_t line = 1;
  std::uint32_t column = 1;
  // Not a defaulted <=>: clang-tidy's modernize-use-nullptr trips on its synthesized comparison with 0.
  bool operator<(const Position& other) const { return line != other.line ? line < other.line : column < other.column; }
};

Position positionOf(const toml::source_region& region) {
  // Implicitly created tables have no region (line 0); point at the file.
  if (region.begin.line == 0) return {};
  return {region.begin.line, std::max<std::uint32_t>(region.begin.column, 1)};
}

/// Collects every problem in the file so one run of dbufd reports them all.
class Problems {
 public:
  explicit Problems(const std::string& source) : source_(source) {}

  void add(const toml::source_region& where, std::string_view key, std::string_view what) {
    add(positionOf(where), key, what);
  }
  void add(Position where, std::string_view key, std::string_view what) {
    std::string text = "key '" + std::string(key) + "': " + std::string(what);
    problems_.push_back({where, std::move(text)});
  }

  [[nodiscard]] bool empty() const { return problems_.empty(); }
  [[nodiscard]] std::size_t count() const { return problems_.size(); }

  [[nodiscard]] Error toError() {
    std::stable_sort(problems_.begin(), problems_.end(),
                     [](const Entry& a, const Entry& b) { return a.where < b.where; });
    std::string message;
    for (const Entry& entry : problems_) {
      if (!message.empty()) message += '\n';
      message += source_ + ":" + std::to_string(entry.where.line) + ":" + std::to_string(entry.where.column) + ": " +
                 entry.text;
    }
    return invalid(std::move(message));
  }

 private:
  struct Entry {
    Position where;
    std::string text;
  };
  std::string source_;
  std::vector<Entry> problems_;
};

/// Walks the parsed document into a Config; every reader reports through
/// `problems` and leaves the default in place on error.
class Reader {
 public:
  explicit Reader(Problems& problems) : problems_(problems) {}

  /// `noun` is "key" or "table"; suggests a known key that is a likely typo.
  void unknownKey(const toml::key& key, std::string_view path, std::span<const std::string_view> known,
                  std::string_view noun = "key") {
    std::string what = "unknown " + std::string(noun) + " (expected " + joinNames(known) + ")";
    for (std::string_view candidate : known) {
      const std::string_view name = key.str();
      const bool prefix = name.size() >= 4 && (candidate.starts_with(name) || name.starts_with(candidate));
      if (prefix || editDistance(name, candidate) <= 2) {
        what = "unknown " + std::string(noun) + "; did you mean '" + std::string(candidate) + "'?";
        break;
      }
    }
    problems_.add(key.source(), path, what);
  }

  const toml::table* table(const toml::node& node, std::string_view path) {
    if (const toml::table* t = node.as_table()) return t;
    problems_.add(node.source(), path, "expected a table, got " + std::string(typeName(node)));
    return nullptr;
  }

  std::optional<std::int64_t> integer(const toml::node& node, std::string_view path, std::int64_t low,
                                      std::int64_t high, std::string_view unit = {}) {
    const auto* value = node.as_integer();
    if (value == nullptr) {
      problems_.add(node.source(), path, "expected an integer, got " + std::string(typeName(node)));
      return std::nullopt;
    }
    const std::int64_t v = value->get();
    if (v < low || v > high) {
      problems_.add(node.source(), path,
                    std::to_string(v) + std::string(unit) + " is out of range (" + std::to_string(low) + ".." +
                        std::to_string(high) + std::string(unit) + ")");
      return std::nullopt;
    }
    return v;
  }

  std::optional<std::string> string(const toml::node& node, std::string_view path) {
    if (const auto* value = node.as_string()) return value->get();
    problems_.add(node.source(), path, "expected a string, got " + std::string(typeName(node)));
    return std::nullopt;
  }

  /// A byte count: an integer (bytes) or a string with a unit; must be > 0.
  std::optional<std::uint64_t> size(const toml::node& node, std::string_view path) {
    std::uint64_t bytes = 0;
    if (const auto* number = node.as_integer()) {
      if (number->get() < 0) {
        problems_.add(node.source(), path, "negative size " + std::to_string(number->get()));
        return std::nullopt;
      }
      bytes = static_cast<std::uint64_t>(number->get());
    } else if (const auto* text = node.as_string()) {
      Result<std::uint64_t> parsed = parseBytes(text->get());
      if (!parsed) {
        problems_.add(node.source(), path, parsed.error().message);
        return std::nullopt;
      }
      bytes = *parsed;
    } else {
      problems_.add(node.source(), path,
                    "expected a size (an integer number of bytes or a string such as \"16GiB\"), got " +
                        std::string(typeName(node)));
      return std::nullopt;
    }
    if (bytes == 0) {
      problems_.add(node.source(), path, "must be greater than zero");
      return std::nullopt;
    }
    return bytes;
  }

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

  void tenants(const toml::node& node, Config& config) {
    const toml::array* list = node.as_array();
    if (list == nullptr) {
      problems_.add(
          node.source(), "tenant",
          "expected an array of tables (write each tenant as [[tenant]]), got " + std::string(typeName(node)));
      return;
    }
    std::vector<Parsed> parsed;
    for (std::size_t i = 0; i < list->size(); ++i) {
      const toml::node& element = *list->get(i);
      const std::string path = "tenant[" + std::to_string(i) + "]";
      if (const toml::table* t = table(element, path)) parsed.push_back(tenant(*t, path));
    }
    checkTenants(parsed);
    for (Parsed& p : parsed) config.tenants.push_back(std::move(p.tenant));
  }

 private:
  struct Located {
    std::uint32_t id = 0;
    Position where;
  };
  struct Parsed {
    Tenant tenant;
    std::string path;
    Position where;
    Position name_where;
    bool has_name = false;
    bool bad_ids = false;  ///< a uid or gid list had errors of its own
    std::vector<Located> uids;
    std::vector<Located> gids;
  };

  std::vector<Located> ids(const toml::node& node, const std::string& path, std::string_view what) {
    std::vector<Located> out;
    const toml::array* list = node.as_array();
    if (list == nullptr) {
      problems_.add(node.source(), path, "expected an array of integers, got " + std::string(typeName(node)));
      return out;
    }
    for (std::size_t i = 0; i < list->size(); ++i) {
      const toml::node& element = *list->get(i);
      const std::string element_path = path + "[" + std::to_string(i) + "]";
      if (auto v = integer(element, element_path, 0, kMaxId)) {
        const auto id = static_cast<std::uint32_t>(*v);
        const Position where = positionOf(element.source());
        const auto same = std::find_if(out.begin(), out.end(), [&](const Located& l) { return l.id == id; });
        if (same != out.end()) {
          problems_.add(where, element_path,
                        std::string(what) + " " + std::to_string(id) + " is listed twice (first at line " +
                            std::to_string(same->where.line) + ")");
          continue;
        }
        out.push_back({id, where});
      }
    }
    return out;
  }

  Parsed tenant(const toml::table& t, const std::string& path) {
    Parsed p;
    p.path = path;
    p.where = positionOf(t.source());
    for (auto&& [key, node] : t) {
      const std::string key_path = path + "." + std::string(key.str());
      if (key == "name") {
        if (auto text = string(node, key_path)) {
          if (Result<void> valid = validateTenantName(*text); !valid) {
            problems_.add(node.source(), key_path, valid.error().message);
          } else {
            p.tenant.name = std::move(*text);
            p.name_where = positionOf(node.source());
            p.has_name = true;
          }
        }
      } else if (key == "uids") {
        const std::size_t before = problems_.count();
        p.uids = ids(node, key_path, "uid");
        p.bad_ids |= problems_.count() != before;
        for (const Located& l : p.uids) p.tenant.uids.push_back(l.id);
      } else if (key == "gids") {
        const std::size_t before = problems_.count();
        p.gids = ids(node, key_path, "gid");
        p.bad_ids |= problems_.count() != before;
        for (const Located& l : p.gids) p.tenant.gids.push_back(l.id);
      } else if (key == "memory_quota") {
        if (auto bytes = size(node, key_path)) p.tenant.memory_quota_bytes = *bytes;
      } else if (key == "max_jobs") {
        if (auto v = integer(node, key_path, 1, kMaxTenantJobs)) p.tenant.max_jobs = static_cast<std::uint32_t>(*v);
      } else {
        unknownKey(key, key_path, kTenantKeys);
      }
    }
    if (t.get("name") == nullptr) problems_.add(p.where, path + ".name", "missing: every tenant needs a name");
    return p;
  }

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

  static Result<void> validateTenantName(const std::string& name) {
    if (name.empty()) return invalid("tenant name is empty");
    if (name.size() > kMaxTenantNameLength) {
      return invalid("tenant name is " + std::to_string(name.size()) + " characters long; at most " +
                     std::to_string(kMaxTenantNameLength) + " are allowed");
    }
    for (char c : name) {
      const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
                      c == '-' || c == '.';
      if (!ok) return invalid("tenant name " + quoted(name) + " may contain only letters, digits, '_', '-' and '.'");
    }
    return {};
  }

  /// Checks across tenants: unique names, someone admitted, and each uid and
  /// gid in at most one tenant so a peer's tenant is never ambiguous.
  void checkTenants(const std::vector<Parsed>& parsed) {
    for (std::size_t i = 0; i < parsed.size(); ++i) {
      const Parsed& p = parsed[i];
      const std::string label = p.has_name ? "tenant '" + p.tenant.name + "'" : "this tenant";
      // An id list that failed to parse already has its own error; only a
      // tenant whose lists are absent or empty "admits nobody".
      if (p.tenant.uids.empty() && p.tenant.gids.empty() && !p.bad_ids) {
        problems_.add(p.where, p.path, label + " admits nobody: give it uids or gids");
      }
      for (std::size_t j = 0; j < i; ++j) {
        const Parsed& earlier = parsed[j];
        if (p.has_name && earlier.has_name && p.tenant.name == earlier.tenant.name) {
          problems_.add(p.name_where, p.path + ".name",
                        "duplicate tenant name '" + p.tenant.name + "' (first at line " +
                            std::to_string(earlier.name_where.line) + ")");
        }
        overlap(p, &Parsed::uids, earlier, "uids", "uid");
        overlap(p, &Parsed::gids, earlier, "gids", "gid");
      }
    }
  }

  void overlap(const Parsed& p, std::vector<Located> Parsed::*list, const Parsed& earlier, std::string_view key,
               std::string_view what) {
    const std::vector<Located>& mine = p.*list;
    const std::vector<Located>& theirs = earlier.*list;
    for (std::size_t k = 0; k < mine.size(); ++k) {
      const auto clash =
          std::find_if(theirs.begin(), theirs.end(), [&](const Located& l) { return l.id == mine[k].id; });
      if (clash == theirs.end()) continue;
      const std::string owner = earlier.has_name ? "tenant '" + earlier.tenant.name + "'" : earlier.path;
      problems_.add(mine[k].where, p.path + "." + std::string(key) + "[" + std::to_string(k) + "]",
                    std::string(what) + " " + std::to_string(mine[k].id) + " already belongs to " + owner + " (line " +
                        std::to_string(clash->where.line) + ")");
    }
  }

  Problems& problems_;
};

Result<Config> walk(const toml::table& root, const std::string& source) {
  Problems problems(source);
  Reader reader(problems);
  Config config;
  for (auto&& [key, node] : root) {
    const std::string path(key.str());
    if (key == "tenant") {
      reader.tenants(node, config);
      continue;
    }
    void (Reader::*section)(const toml::table&, Config&) = nullptr;
    if (key == "daemon") {
      section = &Reader::daemon;
    } else if (key == "rings") {
      section = &Reader::rings;
    } else if (key == "timeouts") {
      section = &Reader::timeouts;
    } else if (key == "persistence") {
      section = &Reader::persistence;
    } else if (key == "cluster") {
      section = &Reader::cluster;
    } else if (key == "metrics") {
      section = &Reader::metrics;
    } else if (key == "admin") {
      section = &Reader::admin;
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
