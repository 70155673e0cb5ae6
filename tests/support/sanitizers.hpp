#pragma once
/// \file
/// Whether this build runs under a sanitizer, and deadlines scaled for it.
/// Include as "support/sanitizers.hpp" (header only). The whole build has
/// the same -fsanitize= (DBUF_SANITIZE), so what a test binary is built with
/// is also what the dbufd and rank processes it starts are built with.

#include <chrono>

namespace dbuf::testing {

#if defined(__SANITIZE_THREAD__)
inline constexpr bool kThreadSanitizer = true;
#else
inline constexpr bool kThreadSanitizer = false;
#endif
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kAddressSanitizer = true;
#else
inline constexpr bool kAddressSanitizer = false;
#endif

/// How many times longer than in a normal build work may take: TSan checks
/// every memory access (the fused kernels' loops included: 5 to 15 times
/// slower), ASan's are cheaper. For deadlines that only stop a hung test,
/// never for a time the test measures.
inline constexpr int kSanitizerSlowdown = kThreadSanitizer ? 10 : kAddressSanitizer ? 3 : 1;

/// `deadline` scaled by kSanitizerSlowdown.
template <typename Rep, typename Period>
[[nodiscard]] constexpr std::chrono::duration<Rep, Period> sanitizerScaled(
    std::chrono::duration<Rep, Period> deadline) {
  return deadline * kSanitizerSlowdown;
}

}  // namespace dbuf::testing
