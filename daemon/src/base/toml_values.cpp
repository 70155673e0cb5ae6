#include "toml_values.hpp"

#include <algorithm>
#include <limits>
#include <utility>

#include "dbuf/daemon/config.hpp"

namespace dbuf::daemon::config_file {
namespace {

constexpr std::int64_t kMaxId = std::int64_t{std::numeric_limits<std::uint32_t>::max()} - 1;  // (uid_t)-1 means "none"

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

}  // namespace

Error invalid(std::string message) {
  return makeError(ErrorCode::kInvalidArgument, std::move(message));
}

std::string quoted(std::string_view text) {
  return "\"" + std::string(text) + "\"";
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

Position positionOf(const toml::source_region& region) {
  // Implicitly created tables have no region (line 0); point at the file.
  if (region.begin.line == 0) return {};
  return {region.begin.line, std::max<std::uint32_t>(region.begin.column, 1)};
}

void Problems::add(Position where, std::string_view key, std::string_view what) {
  std::string text = "key '" + std::string(key) + "': " + std::string(what);
  problems_.push_back({where, std::move(text)});
}

Error Problems::toError() {
  std::stable_sort(problems_.begin(), problems_.end(), [](const Entry& a, const Entry& b) { return a.where < b.where; });
  std::string message;
  for (const Entry& entry : problems_) {
    if (!message.empty()) message += '\n';
    message += source_ + ":" + std::to_string(entry.where.line) + ":" + std::to_string(entry.where.column) + ": " +
               entry.text;
  }
  return invalid(std::move(message));
}

void ValueReader::unknownKey(const toml::key& key, std::string_view path, std::span<const std::string_view> known,
                             std::string_view noun) {
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

const toml::table* ValueReader::table(const toml::node& node, std::string_view path) {
  if (const toml::table* t = node.as_table()) return t;
  problems_.add(node.source(), path, "expected a table, got " + std::string(typeName(node)));
  return nullptr;
}

std::optional<std::int64_t> ValueReader::integer(const toml::node& node, std::string_view path, std::int64_t low,
                                                 std::int64_t high, std::string_view unit) {
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

std::optional<std::string> ValueReader::string(const toml::node& node, std::string_view path) {
  if (const auto* value = node.as_string()) return value->get();
  problems_.add(node.source(), path, "expected a string, got " + std::string(typeName(node)));
  return std::nullopt;
}

std::optional<std::uint64_t> ValueReader::size(const toml::node& node, std::string_view path) {
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

std::vector<Located> ValueReader::ids(const toml::node& node, const std::string& path, std::string_view what) {
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

}  // namespace dbuf::daemon::config_file
