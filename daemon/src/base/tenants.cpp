#include "tenants.hpp"

#include <algorithm>
#include <array>
#include <string>
#include <string_view>
#include <utility>

namespace dbuf::daemon::config_file {
namespace {

constexpr std::array<std::string_view, 5> kTenantKeys{"name", "uids", "gids", "memory_quota", "max_jobs"};

class TenantReader : public ValueReader {
 public:
  using ValueReader::ValueReader;

  std::vector<Tenant> tenants(const toml::node& node) {
    const toml::array* list = node.as_array();
    if (list == nullptr) {
      problems_.add(
          node.source(), "tenant",
          "expected an array of tables (write each tenant as [[tenant]]), got " + std::string(typeName(node)));
      return {};
    }
    std::vector<Parsed> parsed;
    for (std::size_t i = 0; i < list->size(); ++i) {
      const toml::node& element = *list->get(i);
      const std::string path = "tenant[" + std::to_string(i) + "]";
      if (const toml::table* t = table(element, path)) parsed.push_back(tenant(*t, path));
    }
    checkTenants(parsed);
    std::vector<Tenant> out;
    for (Parsed& p : parsed) out.push_back(std::move(p.tenant));
    return out;
  }

 private:
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

};

}  // namespace

std::vector<Tenant> readTenants(const toml::node& node, Problems& problems) {
  return TenantReader(problems).tenants(node);
}

}  // namespace dbuf::daemon::config_file
