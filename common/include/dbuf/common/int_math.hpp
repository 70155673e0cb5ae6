#pragma once
/// \file
/// Small integer helpers used by layout arithmetic. All take non-negative
/// operands (divisors > 0) and are constexpr so layout rules can be checked at
/// compile time in tests.

#include <cstdint>
#include <numeric>

namespace dbuf {

[[nodiscard]] constexpr std::int64_t ceilDiv(std::int64_t num, std::int64_t den) noexcept {
  return (num + den - 1) / den;
}

/// Smallest multiple of `multiple` that is >= value.
[[nodiscard]] constexpr std::int64_t roundUp(std::int64_t value, std::int64_t multiple) noexcept {
  return ceilDiv(value, multiple) * multiple;
}

/// Mathematical modulo: result in [0, den) even for negative num.
[[nodiscard]] constexpr std::int64_t floorMod(std::int64_t num, std::int64_t den) noexcept {
  const std::int64_t r = num % den;
  return r < 0 ? r + den : r;
}

[[nodiscard]] constexpr std::int64_t lcm64(std::int64_t a, std::int64_t b) noexcept {
  return std::lcm(a, b);
}

}  // namespace dbuf
