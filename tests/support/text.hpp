#pragma once
/// \file
/// Small text helpers for test checks. Include as "support/text.hpp" (target
/// dbuf_test_util).

#include <string>

namespace dbuf::testing {

[[nodiscard]] bool startsWith(const std::string& text, const std::string& prefix);
[[nodiscard]] bool contains(const std::string& text, const std::string& part);

/// The whole content of a file, byte for byte ("" when it cannot be read).
[[nodiscard]] std::string readFile(const std::string& path);

}  // namespace dbuf::testing
