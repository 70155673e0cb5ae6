// parseBytes: the accepted spellings and every rejection.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "dbuf/daemon/config.hpp"

namespace dbuf::daemon {
namespace {

constexpr std::uint64_t kKi = std::uint64_t{1} << 10;
constexpr std::uint64_t kTi = std::uint64_t{1} << 40;

struct Good {
  const char* text;
  std::uint64_t bytes;
};

TEST(ParseBytes, Accepts) {
  const Good cases[] = {
      {"0", 0},
      {"123", 123},
      {"007", 7},
      {"1B", 1},
      {"64KiB", 64 * kKi},
      {"16MiB", 16 * kKi * kKi},
      {"2GiB", std::uint64_t{2} << 30},
      {"1TiB", kTi},
      {"64 GiB", std::uint64_t{64} << 30},
      {"1KB", 1000},
      {"1kB", 1000},
      {"5MB", 5000000},
      {"3GB", 3000000000},
      {"2TB", 2000000000000},
      {"18446744073709551615", std::numeric_limits<std::uint64_t>::max()},
      {"16777215TiB", std::uint64_t{16777215} * kTi},
  };
  for (const Good& c : cases) {
    Result<std::uint64_t> parsed = parseBytes(c.text);
    ASSERT_TRUE(parsed.ok()) << c.text << ": " << parsed.error().message;
    EXPECT_EQ(*parsed, c.bytes) << c.text;
  }
}

struct Bad {
  const char* text;
  const char* fragment;
};

TEST(ParseBytes, Rejects) {
  const Bad cases[] = {
      {"", "empty size"},
      {"-1", "negative size"},
      {"-1GiB", "negative size"},
      {"+1", "does not start with a number"},
      {"GiB", "does not start with a number"},
      {" 1", "does not start with a number"},
      {"1.5GiB", "not a whole number"},
      {"1,5GiB", "not a whole number"},
      {"1 ", "trailing spaces"},
      {"1GiB ", "unknown unit \"GiB \""},
      {"1gib", "unknown unit \"gib\""},
      {"1K", "unknown unit \"K\""},
      {"1PiB", "unknown unit"},
      {"1 2", "unknown unit \"2\""},
      {"18446744073709551616", "does not fit in 64 bits"},
      {"99999999999999999999999", "does not fit in 64 bits"},
      {"16777216TiB", "does not fit in 64 bits"},
      {"18446744073709552KB", "does not fit in 64 bits"},
  };
  for (const Bad& c : cases) {
    Result<std::uint64_t> parsed = parseBytes(c.text);
    ASSERT_FALSE(parsed.ok()) << '"' << c.text << "\" parsed as " << *parsed;
    EXPECT_EQ(parsed.error().code, ErrorCode::kInvalidArgument);
    EXPECT_NE(parsed.error().message.find(c.fragment), std::string::npos)
        << '"' << c.text << "\": " << parsed.error().message;
  }
}

}  // namespace
}  // namespace dbuf::daemon
