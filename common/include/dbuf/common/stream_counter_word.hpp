#pragma once
/// \file
/// The host side of a stream-ordering counter: a monotonic 64-bit word in
/// shared memory that GPU streams write (cuStreamWriteValue64) and wait on
/// (cuStreamWaitValue64, "greater or equal"), and that hosts read, publish
/// and poison. Here, with no CUDA, so that the daemon's data plane and the
/// ring layout can use them in every build; the GPU side is
/// dbuf/gpu/stream_sync.hpp.
///
/// Values count up from 0 and stay below kPoisonOffset (2^62). The driver's
/// GEQ test is (int64_t)(*addr - value) >= 0, so a poisoned counter is set to
/// its value + 2^62: at or past every target a waiter can have (they are
/// below 2^62 too), which an all-ones "poison" would not be.

#include <atomic>
#include <cstdint>

namespace dbuf {

inline constexpr std::uint64_t kPoisonOffset = std::uint64_t{1} << 62;

[[nodiscard]] constexpr bool isPoisoned(std::uint64_t value) noexcept {
  return value >= kPoisonOffset;
}

/// The word's value (acquire: what was written before it is visible).
[[nodiscard]] inline std::uint64_t counterValue(std::uint64_t& word) noexcept {
  return std::atomic_ref<std::uint64_t>(word).load(std::memory_order_acquire);
}

/// Sets the word (release: writes before it are visible to who sees it).
inline void publishCounter(std::uint64_t& word, std::uint64_t value) noexcept {
  std::atomic_ref<std::uint64_t>(word).store(value, std::memory_order_release);
}

/// Releases every waiter now and for good: value + 2^62, once (poisoning a
/// poisoned word changes nothing).
inline void poisonCounter(std::uint64_t& word) noexcept {
  std::atomic_ref<std::uint64_t> atomic(word);
  std::uint64_t value = atomic.load(std::memory_order_acquire);
  while (!isPoisoned(value) && !atomic.compare_exchange_weak(value, value + kPoisonOffset, std::memory_order_acq_rel)) {
  }
}

}  // namespace dbuf
