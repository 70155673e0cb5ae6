#pragma once
/// \file
/// The one place where CUDA runtime status codes become dbuf Errors (CUDA
/// backend only). Pure; thread-safe.

#include <driver_types.h>

#include <string_view>

#include "dbuf/common/result.hpp"

namespace dbuf {

/// cudaSuccess -> {}; otherwise an Error naming `what` and the CUDA error
/// (name and description): kUnavailable when there is no usable device or
/// driver, kDevice for everything else.
[[nodiscard]] Result<void> cudaStatus(cudaError_t status, std::string_view what);

}  // namespace dbuf
