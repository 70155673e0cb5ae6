#pragma once
/// \file
/// Internal: little-endian field writer and bounds-checked field reader for the
/// dbuf wire protocol. Both are "sticky": the first failure is recorded with
/// the path of the field it happened in ("RegisterGroup.tensors[3].shape") and
/// every later call is a no-op, so message codecs read as a flat list of
/// fields. The same field list drives encoding and decoding (see protocol.cpp),
/// which keeps the two sides symmetric by construction.
/// Not part of the public API; not thread-safe (one instance per message).

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "dbuf/common/result.hpp"
#include "dbuf/ipc/protocol.hpp"

namespace dbuf::ipc::wire {

/// Where in a message the codec is: the message name, then nested fields and
/// array indices. Error messages are built from it only on failure, so the
/// happy path allocates nothing for field names.
class FieldPath {
 public:
  explicit FieldPath(std::string_view root) : root_(root) {}

  void push(std::string_view field, std::optional<std::size_t> index = std::nullopt) {
    segments_.push_back(Segment{field, index});
  }
  void pop() { segments_.pop_back(); }

  /// "Root.outer[3].leaf" (leaf omitted when empty).
  [[nodiscard]] std::string render(std::string_view leaf) const {
    std::string out(root_);
    for (const Segment& segment : segments_) {
      out += '.';
      out += segment.field;
      if (segment.index) {
        out += '[';
        out += std::to_string(*segment.index);
        out += ']';
      }
    }
    if (!leaf.empty()) {
      out += '.';
      out += leaf;
    }
    return out;
  }

 private:
  struct Segment {
    std::string_view field;
    std::optional<std::size_t> index;
  };
  std::string_view root_;
  std::vector<Segment> segments_;
};

/// Why `value` is not acceptable as a wire string of at most `max_bytes`
/// (nullopt when it is).
[[nodiscard]] inline std::optional<std::string> stringProblem(std::string_view value,
                                                             std::uint32_t max_bytes = kMaxStringBytes) {
  if (value.size() > max_bytes) {
    return "length " + std::to_string(value.size()) + " exceeds " + std::to_string(max_bytes);
  }
  if (value.find('\0') != std::string_view::npos) {
    return "embedded NUL byte at offset " + std::to_string(value.find('\0'));
  }
  return std::nullopt;
}

/// Common part of Writer and Reader: the sticky error and the field path.
class Codec {
 public:
  explicit Codec(std::string_view root) : path_(root) {}

  [[nodiscard]] bool ok() const noexcept { return !error_.has_value(); }

  /// Records `message` against `field` unless an earlier failure is recorded.
  void fail(std::string_view field, const std::string& message) {
    if (error_) return;
    error_ = makeError(ErrorCode::kInvalidArgument, path_.render(field) + ": " + message);
  }
  /// fail() when `problem` holds a reason.
  void require(std::string_view field, const std::optional<std::string>& problem) {
    if (problem) fail(field, *problem);
  }

  /// Runs `body` with `field` (and `index`) appended to the path.
  template <typename Body>
  void nested(std::string_view field, std::optional<std::size_t> index, Body&& body) {
    path_.push(field, index);
    body();
    path_.pop();
  }

  [[nodiscard]] Error takeError() {
    Error error = std::move(*error_);
    error_.reset();
    return error;
  }

 private:
  FieldPath path_;
  std::optional<Error> error_;
};

/// Appends fields to a byte vector. Values are taken by const reference so the
/// shared field lists in protocol.cpp can call the same member names on a
/// Writer (const message) and a Reader (mutable message).
class Writer : public Codec {
 public:
  explicit Writer(std::string_view root) : Codec(root) {}

  template <typename T>
  requires std::is_integral_v<T> &&(!std::is_same_v<T, bool>)void integer(std::string_view /*field*/, const T& value) {
    if (!ok()) return;
    using U = std::make_unsigned_t<T>;
    auto bits = static_cast<U>(value);
    for (std::size_t i = 0; i < sizeof(T); ++i) {
      bytes_.push_back(static_cast<std::byte>(bits & 0xFFU));
      if constexpr (sizeof(T) > 1) bits = static_cast<U>(bits >> 8U);
    }
  }

  void boolean(std::string_view field, const bool& value) {
    integer<std::uint8_t>(field, value ? std::uint8_t{1} : std::uint8_t{0});
  }

  /// `valid` says whether the enumerator is one of the declared ones.
  template <typename E>
  requires std::is_enum_v<E>
  void enumeration(std::string_view field, const E& value, bool (*valid)(E) noexcept) {
    if (!valid(value)) {
      fail(field, "value " + std::to_string(static_cast<std::underlying_type_t<E>>(value)) + " is out of range");
      return;
    }
    integer(field, static_cast<std::underlying_type_t<E>>(value));
  }

  void string(std::string_view field, const std::string& value, std::uint32_t max_bytes = kMaxStringBytes) {
    if (!ok()) return;
    if (auto problem = stringProblem(value, max_bytes)) {
      fail(field, *problem);
      return;
    }
    integer(field, static_cast<std::uint32_t>(value.size()));
    for (const char c : value) bytes_.push_back(static_cast<std::byte>(c));
  }

  /// u32 count, then each item through `item(element)`. `noun` names the
  /// count in the error ("rank 9 exceeds 8", "count 9000 exceeds 8192").
  template <typename T, typename Item>
  void array(std::string_view field, const std::vector<T>& values, std::uint32_t max, std::string_view noun,
             std::size_t /*min_item_bytes*/, Item&& item) {
    if (!ok()) return;
    if (values.size() > max) {
      fail(field, std::string(noun) + " " + std::to_string(values.size()) + " exceeds " + std::to_string(max));
      return;
    }
    integer(field, static_cast<std::uint32_t>(values.size()));
    for (std::size_t i = 0; i < values.size() && ok(); ++i) {
      nested(field, i, [&] { item(values[i]); });
    }
  }

  [[nodiscard]] std::vector<std::byte>& bytes() noexcept { return bytes_; }

 private:
  std::vector<std::byte> bytes_;
};

/// Reads fields from a byte span. Every length is checked against what is
/// left before anything is allocated; after a failure reads return zeros and
/// arrays come back empty.
class Reader : public Codec {
 public:
  Reader(std::string_view root, std::span<const std::byte> bytes) : Codec(root), bytes_(bytes) {}

  template <typename T>
  requires std::is_integral_v<T> &&(!std::is_same_v<T, bool>)void integer(std::string_view field, T& value) {
    value = T{};
    if (!ok() || !need(field, sizeof(T))) return;
    using U = std::make_unsigned_t<T>;
    U bits = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i) {
      bits = static_cast<U>(bits | static_cast<U>(static_cast<U>(bytes_[position_ + i]) << (8U * i)));
    }
    position_ += sizeof(T);
    value = static_cast<T>(bits);
  }

  void boolean(std::string_view field, bool& value) {
    value = false;
    std::uint8_t raw = 0;
    integer(field, raw);
    if (!ok()) return;
    if (raw > 1) {
      fail(field, "bool byte " + std::to_string(raw) + " is neither 0 nor 1");
      return;
    }
    value = raw == 1;
  }

  template <typename E>
  requires std::is_enum_v<E>
  void enumeration(std::string_view field, E& value, bool (*valid)(E) noexcept) {
    std::underlying_type_t<E> raw{};
    integer(field, raw);
    if (!ok()) return;
    if (!valid(static_cast<E>(raw))) {
      fail(field, "value " + std::to_string(raw) + " is out of range");
      return;
    }
    value = static_cast<E>(raw);
  }

  void string(std::string_view field, std::string& value, std::uint32_t max_bytes = kMaxStringBytes) {
    value.clear();
    std::uint32_t length = 0;
    integer(field, length);
    if (!ok()) return;
    if (length > max_bytes) {
      fail(field, "length " + std::to_string(length) + " exceeds " + std::to_string(max_bytes));
      return;
    }
    if (!need(field, length)) return;
    const std::span<const std::byte> raw = bytes_.subspan(position_, length);
    for (std::size_t i = 0; i < raw.size(); ++i) {
      if (raw[i] == std::byte{0}) {
        fail(field, "embedded NUL byte at offset " + std::to_string(i));
        return;
      }
    }
    value.resize(length);
    for (std::size_t i = 0; i < raw.size(); ++i) value[i] = static_cast<char>(raw[i]);
    position_ += length;
  }

  /// u32 count (<= max, and count * min_item_bytes <= bytes left), then each
  /// item through `item(element)`.
  template <typename T, typename Item>
  void array(std::string_view field, std::vector<T>& values, std::uint32_t max, std::string_view noun,
             std::size_t min_item_bytes, Item&& item) {
    values.clear();
    std::uint32_t count = 0;
    integer(field, count);
    if (!ok()) return;
    if (count > max) {
      fail(field, std::string(noun) + " " + std::to_string(count) + " exceeds " + std::to_string(max));
      return;
    }
    const std::size_t least = std::size_t{count} * min_item_bytes;
    if (least > remaining()) {
      fail(field, "truncated: " + std::to_string(count) + " items need at least " + std::to_string(least) + " bytes, " +
                      std::to_string(remaining()) + " left");
      return;
    }
    values.resize(count);
    for (std::size_t i = 0; i < count && ok(); ++i) {
      nested(field, i, [&] { item(values[i]); });
    }
    if (!ok()) values.clear();
  }

  [[nodiscard]] std::size_t remaining() const noexcept { return bytes_.size() - position_; }

  /// Succeeds when every byte was consumed and no field failed.
  [[nodiscard]] Result<void> finish() {
    if (ok() && remaining() != 0) {
      fail("", std::to_string(remaining()) + (remaining() == 1 ? " trailing byte" : " trailing bytes") +
                   " after the last field");
    }
    if (!ok()) return takeError();
    return {};
  }

 private:
  bool need(std::string_view field, std::size_t bytes) {
    if (bytes <= remaining()) return true;
    fail(field, "truncated: needs " + std::to_string(bytes) + " bytes, " + std::to_string(remaining()) + " left");
    return false;
  }

  std::span<const std::byte> bytes_;
  std::size_t position_ = 0;
};

}  // namespace dbuf::ipc::wire
