#pragma once
/// \file
/// The calling thread's CPU time so far (CLOCK_THREAD_CPUTIME_ID). Include as
/// "support/thread_cpu_time.hpp" (header only): tests that tell a waiter that
/// spins (CPU time) from one that sleeps (none).

#include <time.h>

#include <chrono>

namespace dbuf::testing {

inline std::chrono::nanoseconds threadCpuTime() {
  timespec now{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return std::chrono::seconds(now.tv_sec) + std::chrono::nanoseconds(now.tv_nsec);
}

}  // namespace dbuf::testing
