#pragma once
/// \file
/// A GPU's UUID: names one physical GPU whatever CUDA_VISIBLE_DEVICES a
/// process runs with (device indices do not: a trainer started with
/// CUDA_VISIBLE_DEVICES=3 calls that GPU 0). Pure, no CUDA; CUDA builds get
/// a device's UUID from dbuf/common/cuda_device.hpp.

#include <array>
#include <cstdint>
#include <cstdio>
#include <string>

namespace dbuf {

struct GpuUuid {
  std::uint64_t high = 0;  ///< bytes 0-7, big-endian
  std::uint64_t low = 0;   ///< bytes 8-15, big-endian

  /// All zero: unknown (a client that did not say).
  [[nodiscard]] bool known() const noexcept { return high != 0 || low != 0; }

  [[nodiscard]] static GpuUuid fromBytes(const std::array<std::uint8_t, 16>& bytes) noexcept {
    GpuUuid uuid;
    for (std::size_t i = 0; i < 8; ++i) {
      uuid.high = (uuid.high << 8) | bytes[i];
      uuid.low = (uuid.low << 8) | bytes[8 + i];
    }
    return uuid;
  }

  /// As nvidia-smi -L prints it: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.
  [[nodiscard]] std::string text() const {
    std::array<char, 48> out{};
    std::snprintf(out.data(), out.size(), "GPU-%08x-%04x-%04x-%04x-%012llx", static_cast<unsigned>(high >> 32),
                  static_cast<unsigned>((high >> 16) & 0xffffU), static_cast<unsigned>(high & 0xffffU),
                  static_cast<unsigned>(low >> 48), static_cast<unsigned long long>(low & 0xffffffffffffULL));
    return out.data();
  }

  friend bool operator==(const GpuUuid&, const GpuUuid&) = default;
};

}  // namespace dbuf
