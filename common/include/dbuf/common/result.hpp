#pragma once
/// \file
/// Result<T>: either a value or an Error {code, message}. Recoverable errors are
/// values in dbuf; exceptions and aborts are reserved for broken invariants.
/// Thread safety: plain value types, no shared state.

#include <cassert>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace dbuf {

/// Broad error classes; the message carries the specifics for a human.
enum class ErrorCode : std::uint8_t {
  kInvalidArgument,   ///< the caller's input is malformed or out of range
  kNotFound,          ///< a named thing (file, unit, tensor) does not exist
  kIo,                ///< reading or writing a file or socket failed
  kInfeasible,        ///< the request is well formed but cannot be satisfied (e.g. over quota)
  kInternal,          ///< a bug in dbuf; the message says which invariant broke
  kPermissionDenied,  ///< the caller is not allowed to do this
  kConflict,          ///< clashes with the state of others (rank taken, specs disagree)
  kTimeout,           ///< a deadline passed
  kUnavailable,       ///< the peer (daemon) is gone or shutting down
  kWouldBlock,        ///< no room now (a full ring) and the caller asked not to wait
  kDevice,            ///< the GPU, its driver or NCCL failed (the message has their error name)
  kCancelled,         ///< the caller's interrupt check asked a wait to stop (ClientOptions::interrupted)
};

[[nodiscard]] constexpr std::string_view toString(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return "invalid argument";
    case ErrorCode::kNotFound:
      return "not found";
    case ErrorCode::kIo:
      return "i/o error";
    case ErrorCode::kInfeasible:
      return "infeasible";
    case ErrorCode::kInternal:
      return "internal error";
    case ErrorCode::kPermissionDenied:
      return "permission denied";
    case ErrorCode::kConflict:
      return "conflict";
    case ErrorCode::kTimeout:
      return "timeout";
    case ErrorCode::kUnavailable:
      return "unavailable";
    case ErrorCode::kWouldBlock:
      return "would block";
    case ErrorCode::kDevice:
      return "device error";
    case ErrorCode::kCancelled:
      return "cancelled";
  }
  return "unknown error";
}

struct Error {
  ErrorCode code = ErrorCode::kInternal;
  std::string message;
  /// The ranks the error is about, ascending, where it names some: those
  /// that did not arrive (a timeout), died, or disagreed (a mismatch). Empty
  /// otherwise. The message names them too, for a human.
  std::vector<std::uint32_t> ranks = {};

  /// Prefixes the message with context ("file x.json: unit y: ...") so callers
  /// up the stack can say where an error happened without losing what it was.
  [[nodiscard]] Error withContext(std::string_view context) && {
    message = std::string(context) + ": " + message;
    return std::move(*this);
  }
};

[[nodiscard]] inline Error makeError(ErrorCode code, std::string message) {
  return Error{code, std::move(message)};
}

/// Expected-style holder. Accessing value() of an error (or error() of a value)
/// is a programming error and asserts.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : state_(std::in_place_index<0>, std::move(value)) {}      // NOLINT(google-explicit-constructor)
  Result(Error error) : state_(std::in_place_index<1>, std::move(error)) {}  // NOLINT(google-explicit-constructor)

  [[nodiscard]] bool ok() const noexcept { return state_.index() == 0; }
  explicit operator bool() const noexcept { return ok(); }

  [[nodiscard]] T& value() & {
    assert(ok());
    return std::get<0>(state_);
  }
  [[nodiscard]] const T& value() const& {
    assert(ok());
    return std::get<0>(state_);
  }
  [[nodiscard]] T&& value() && {
    assert(ok());
    return std::get<0>(std::move(state_));
  }
  [[nodiscard]] const Error& error() const& {
    assert(!ok());
    return std::get<1>(state_);
  }
  [[nodiscard]] Error&& error() && {
    assert(!ok());
    return std::get<1>(std::move(state_));
  }

  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Error> state_;
};

/// Result of an operation that yields nothing but may fail.
template <>
class [[nodiscard]] Result<void> {
 public:
  Result() = default;
  Result(Error error) : error_(std::move(error)), ok_(false) {}  // NOLINT(google-explicit-constructor)

  [[nodiscard]] bool ok() const noexcept { return ok_; }
  explicit operator bool() const noexcept { return ok_; }
  [[nodiscard]] const Error& error() const& {
    assert(!ok_);
    return error_;
  }
  [[nodiscard]] Error&& error() && {
    assert(!ok_);
    return std::move(error_);
  }

 private:
  Error error_;
  bool ok_ = true;
};

}  // namespace dbuf
