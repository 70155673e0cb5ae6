#pragma once
// What the GPU tests that run a real dbufd (its cuda backend) share: the
// daemon, in a fresh directory, started with the given arguments, its log
// kept (`skip` says why when dbufd found no usable GPU, and the test then
// skips; else the test fails if it did not start; SIGTERM and a clean exit
// are checked at the end), and a small group with values exact in bf16.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dbuf/client.hpp"
#include "support/child_process.hpp"
#include "support/temp_dir.hpp"
#include "support/text.hpp"

namespace dbuf::testing {

inline std::string dbufdPath() {
  // The GPU bundle runs its copies from bin/ (run exports DBUF_BIN_DIR).
  if (const char* dir = std::getenv("DBUF_BIN_DIR"); dir != nullptr) return std::string(dir) + "/dbufd";  // NOLINT
  return DBUFD_EXE;
}

/// Two tensors, fp32 shards gathered as bf16.
inline GroupSpec layer() {
  GroupSpec spec;
  spec.name = "layer";
  spec.tensors = {{"w", {64, 48}, "", -1}, {"b", {100}, "element", -1}};
  spec.granularity = "rows:1";
  spec.sharded_dtype = DType::kF32;
  spec.unsharded_dtype = DType::kBF16;
  return spec;
}

/// Small integers: exact in bf16, so the gathered bf16 copy is known exactly.
inline float valueOf(std::size_t tensor, std::int64_t element) {
  return static_cast<float>((static_cast<std::int64_t>(tensor) * 37 + element) % 201 - 100);
}

class GpuDbufd {
 public:
  explicit GpuDbufd(std::vector<std::string> args) : socket_(dir_.path("dbufd.sock")), log_(dir_.path("dbufd.log")) {
    args.insert(args.end(), {"--socket", socket_});
    Child::Options options;
    options.stderr_path = log_;
    daemon_.emplace(dbufdPath(), args, options);
    for (int i = 0; i < 1000 && !std::filesystem::exists(socket_); ++i) {
      if (daemon_->waitExit(std::chrono::milliseconds(0))) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (std::filesystem::exists(socket_)) return;
    const std::string text = log();
    if (text.find("no usable CUDA device") != std::string::npos) {
      skip_ = text;
    } else {
      ADD_FAILURE() << "dbufd did not start:\n" << text;
      skip_ = "dbufd did not start";
    }
  }
  ~GpuDbufd() {
    if (!daemon_ || !daemon_->running()) return;
    daemon_->signal(SIGTERM);
    EXPECT_EQ(daemon_->waitExit(std::chrono::milliseconds(10000)), std::optional<int>(0)) << log();
  }
  GpuDbufd(const GpuDbufd&) = delete;
  GpuDbufd& operator=(const GpuDbufd&) = delete;

  /// Why the test cannot run (no usable GPU, or dbufd did not start); empty when it runs.
  [[nodiscard]] const std::string& skip() const noexcept { return skip_; }
  [[nodiscard]] const std::string& socket() const noexcept { return socket_; }
  [[nodiscard]] std::string log() const { return readFile(log_); }

 private:
  TempDir dir_{"dbuf-gpu"};
  std::string socket_;
  std::string log_;
  std::optional<Child> daemon_;
  std::string skip_;
};

}  // namespace dbuf::testing
