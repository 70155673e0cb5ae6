// dbufd's cuda backend end to end: a real dbufd (--backend cuda
// --virtual-ranks 2) and two real rank processes using libdbuf. Each rank
// writes its fp32 shard in GPU memory, unshards (an all-gather with the cast
// to bf16, run by the daemon's CUDA kernels), reads every gathered element
// back, writes bf16 gradients, reduce-scatters them (avg, post-scale 2)
// into its fp32 shard gradient and checks it, reshards and re-unshards (its
// slot comes back at the same address), and detaches. Label `gpu`; skipped
// when dbufd finds no usable GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "dbuf/client.hpp"
#include "dbuf/kernels/convert.hpp"
#include "forked_pair.hpp"
#include "gpu_dbufd.hpp"

namespace dbuf {
namespace {

constexpr std::uint32_t kWorld = 2;

using testing::layer;
using testing::valueOf;

/// Copies to the device and waits until it has landed: a host-to-device
/// cudaMemcpy from pageable memory may return before, and the daemon's
/// kernels (another process) read it next.
template <typename T>
bool upload(const TensorView& view, const std::vector<T>& host) {
  return cudaMemcpy(view.base, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess &&
         cudaDeviceSynchronize() == cudaSuccess;
}

template <typename T>
std::vector<T> download(const TensorView& view) {
  std::vector<T> host(static_cast<std::size_t>(view.numel()));
  if (cudaMemcpy(host.data(), view.base, host.size() * sizeof(T), cudaMemcpyDeviceToHost) != cudaSuccess) return {};
  return host;
}

/// One rank; returns 0 or the step that failed.
int rankMain(std::uint32_t rank, const std::string& socket) {
  alarm(120);  // a hung CUDA call or collective ends the rank (SIGALRM) instead of the test run
  if (cudaSetDevice(0) != cudaSuccess) return 2;
  auto client = Client::connect({socket});
  if (!client || !client->attach({"gpu-job", rank, kWorld, rank, 0})) return 3;
  auto group = client->registerGroup(layer());
  if (!group) return 4;
  const std::size_t tensors = group->plan().tensors.size();
  for (std::size_t t = 0; t < tensors; ++t) {
    const TensorView shard = group->shardView(t);
    std::vector<float> host(static_cast<std::size_t>(shard.numel()));
    for (std::size_t i = 0; i < host.size(); ++i) host[i] = valueOf(t, shard.begin + static_cast<std::int64_t>(i));
    if (!upload(shard, host)) return 5;
  }
  if (!group->unshard()) return 6;
  std::byte* first_address = nullptr;
  for (std::size_t t = 0; t < tensors; ++t) {
    auto full = group->unshardedView(t);
    if (!full) return 7;
    if (t == 0) first_address = full->base;
    const auto got = download<std::uint16_t>(*full);
    if (got.size() != static_cast<std::size_t>(full->numel())) return 8;
    for (std::size_t i = 0; i < got.size(); ++i) {
      if (got[i] != kernels::floatToBf16(valueOf(t, static_cast<std::int64_t>(i)))) return 9;
    }
    auto grad = group->unshardedGradView(t);
    if (!grad) return 10;
    const std::vector<std::uint16_t> mine(static_cast<std::size_t>(grad->numel()),
                                          kernels::floatToBf16(static_cast<float>(rank + 1)));
    if (!upload(*grad, mine)) return 11;
  }
  if (!group->reduceScatter({ReduceMode::kAvg, 1.0F, 2.0F, false})) return 12;
  for (std::size_t t = 0; t < tensors; ++t) {
    const TensorView view = group->shardGradView(t);
    const auto grads = download<float>(view);
    if (grads.size() != static_cast<std::size_t>(view.numel())) return 13;
    for (const float g : grads) {
      if (g != 3.0F) return 13;  // 2 * (1 + 2) / 2
    }
  }
  if (!group->reshard() || !group->unshard()) return 14;
  auto again = group->unshardedView(0);
  if (!again || again->base != first_address) return 15;  // the slot came back at the same address
  if (!group->reshard() || !client->detach()) return 16;
  return 0;
}

TEST(DbufdCuda, VirtualRanksGatherAndReduceScatterThroughTheDaemonOnTheGpu) {
  testing::GpuDbufd daemon({"--backend", "cuda", "--virtual-ranks", "2"});
  if (!daemon.skip().empty()) GTEST_SKIP() << daemon.skip();
  const std::string socket = daemon.socket();
  const auto [rank0, rank1] =
      testing::runForkedPair([&](int) { return rankMain(0, socket); }, [&](int) { return rankMain(1, socket); });
  EXPECT_EQ(rank0, 0) << "rank 0 failed at step " << rank0 << "\n" << daemon.log();
  EXPECT_EQ(rank1, 0) << "rank 1 failed at step " << rank1 << "\n" << daemon.log();
}

}  // namespace
}  // namespace dbuf
