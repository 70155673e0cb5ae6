#pragma once
// Typed values of dbufd's TOML configuration, each problem reported with its
// place in the file. config.cpp reads the sections with it, tenants.cpp the
// [[tenant]] array. Internal to base/: toml++ goes no further.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

// toml++ is built with exceptions in Debian (its ABI namespace is toml::v3::ex),
// so parse() throws toml::parse_error. parseConfig() catches it.
#include <toml++/toml.h>

#include "dbuf/common/result.hpp"

namespace dbuf::daemon::config_file {

[[nodiscard]] Error invalid(std::string message);
/// "text" in double quotes.
[[nodiscard]] std::string quoted(std::string_view text);
/// "a table", "an integer"...: what a node is, for messages.
[[nodiscard]] std::string_view typeName(const toml::node& node);

/// A place in the file, 1-based.
struct Position {
  std::uint32_t line = 1;
  std::uint32_t column = 1;
  // Not a defaulted <=>: clang-tidy's modernize-use-nullptr trips on its synthesized comparison with 0.
  bool operator<(const Position& other) const { return line != other.line ? line < other.line : column < other.column; }
};

[[nodiscard]] Position positionOf(const toml::source_region& region);

/// Collects every problem in the file so one run of dbufd reports them all.
class Problems {
 public:
  explicit Problems(const std::string& source) : source_(source) {}

  void add(const toml::source_region& where, std::string_view key, std::string_view what) {
    add(positionOf(where), key, what);
  }
  void add(Position where, std::string_view key, std::string_view what);

  [[nodiscard]] bool empty() const { return problems_.empty(); }
  [[nodiscard]] std::size_t count() const { return problems_.size(); }

  /// Every problem, in the order of the file, one line each ("file:line:column: key 'k': what").
  [[nodiscard]] Error toError();

 private:
  struct Entry {
    Position where;
    std::string text;
  };
  std::string source_;
  std::vector<Entry> problems_;
};

/// A uid or gid and where the file gives it.
struct Located {
  std::uint32_t id = 0;
  Position where;
};

/// Reads typed values; each reader reports what is wrong through `problems`
/// and returns nothing, so the caller keeps its default.
class ValueReader {
 public:
  explicit ValueReader(Problems& problems) : problems_(problems) {}

  /// `noun` is "key" or "table"; suggests a known key that is a likely typo.
  void unknownKey(const toml::key& key, std::string_view path, std::span<const std::string_view> known,
                  std::string_view noun = "key");
  const toml::table* table(const toml::node& node, std::string_view path);
  std::optional<std::int64_t> integer(const toml::node& node, std::string_view path, std::int64_t low,
                                      std::int64_t high, std::string_view unit = {});
  std::optional<std::string> string(const toml::node& node, std::string_view path);
  /// A byte count: an integer (bytes) or a string with a unit; must be > 0.
  std::optional<std::uint64_t> size(const toml::node& node, std::string_view path);
  /// An array of distinct uids or gids (`what`), each below (uid_t)-1.
  std::vector<Located> ids(const toml::node& node, const std::string& path, std::string_view what);

 protected:
  Problems& problems_;
};

}  // namespace dbuf::daemon::config_file
