// Ops ordered on the trainer's CUDA stream, through a real dbufd (cuda
// backend) and real rank processes using libdbuf:
//  - the submit returns while the stream is still busy (a spin kernel queued
//    before the shard's upload), dbufd starts the op only once that upload
//    has run (the gathered values prove it), and the stream's download queued
//    after the op sees its result; the same for a reduce-scatter. Two virtual
//    ranks on one GPU, and one rank through NCCL.
//  - a reshard ordered on the stream returns at once; the slot goes back to
//    the pool only once the stream has read it (a pool of one slot).
//  - a peer that dies before submitting: the survivor's stream is released
//    (it synchronises), wait() reports the disconnect, and the session's
//    stream ordering is over.
// Label `gpu`; skipped when dbufd finds no usable GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include "dbuf/client.hpp"
#include "dbuf/kernels/convert.hpp"
#include "forked_pair.hpp"
#include "gpu_dbufd.hpp"
#include "spin_kernel.hpp"

namespace dbuf {
namespace {

using Clock = std::chrono::steady_clock;

constexpr unsigned long long kBusyNanoseconds = 300'000'000;   // the stream's work before the op
constexpr auto kSubmitBound = std::chrono::milliseconds(100);  // a submit that blocked on the GPU takes longer

using testing::layer;
using testing::valueOf;

/// Pinned host memory (asynchronous copies on a stream need it).
template <typename T>
class Pinned {
 public:
  explicit Pinned(std::size_t count) : count_(count) {
    if (cudaMallocHost(&data_, count * sizeof(T)) != cudaSuccess) data_ = nullptr;
  }
  ~Pinned() {
    if (data_ != nullptr) static_cast<void>(cudaFreeHost(data_));
  }
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
  [[nodiscard]] T* data() const noexcept { return static_cast<T*>(data_); }
  [[nodiscard]] std::size_t size() const noexcept { return count_; }
  [[nodiscard]] std::size_t bytes() const noexcept { return count_ * sizeof(T); }

 private:
  void* data_ = nullptr;
  std::size_t count_;
};

SubmitOptions onStream(cudaStream_t stream) {
  SubmitOptions options;
  options.stream = static_cast<void*>(stream);
  return options;
}

/// The stream is busy, then the submit: returns 0 if it came back at once
/// while the stream was still busy, else the step.
int submittedWithoutWaiting(const Clock::time_point before, cudaStream_t stream, int step) {
  if (Clock::now() - before > kSubmitBound) return step;
  return cudaStreamQuery(stream) == cudaErrorNotReady ? 0 : step + 1;
}

/// One rank of a `world`-rank job, every op ordered on its stream; 0 or the failed step.
int orderedRank(std::uint32_t rank, std::uint32_t world, const std::string& socket) {
  alarm(120);  // a hung stream or collective ends the rank (SIGALRM) instead of the test run
  if (cudaSetDevice(0) != cudaSuccess) return 2;
  auto client = Client::connect({socket});
  if (!client || !client->attach({"ordered", rank, world, rank, 0})) return 3;
  auto group = client->registerGroup(layer());
  if (!group || !group->acquireSlot()) return 4;
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return 5;
  const std::size_t tensors = group->plan().tensors.size();

  // All-gather: the shard's upload waits behind the spin, the op behind the upload.
  if (testing::spinFor(stream, kBusyNanoseconds) != cudaSuccess) return 6;
  std::vector<std::unique_ptr<Pinned<float>>> shards;
  for (std::size_t t = 0; t < tensors; ++t) {
    const TensorView shard = group->shardView(t);
    shards.push_back(std::make_unique<Pinned<float>>(static_cast<std::size_t>(shard.numel())));
    for (std::size_t i = 0; i < shards[t]->size(); ++i) {
      shards[t]->data()[i] = valueOf(t, shard.begin + static_cast<std::int64_t>(i));
    }
    if (cudaMemcpyAsync(shard.base, shards[t]->data(), shards[t]->bytes(), cudaMemcpyHostToDevice, stream) !=
        cudaSuccess) {
      return 7;
    }
  }
  auto before = Clock::now();
  auto gather = group->submitAllGather(onStream(stream));
  if (!gather) return 8;
  if (int late = submittedWithoutWaiting(before, stream, 9); late != 0) return late;
  std::vector<std::unique_ptr<Pinned<std::uint16_t>>> gathered;
  for (std::size_t t = 0; t < tensors; ++t) {
    auto full = group->unshardedView(t);
    if (!full) return 11;
    gathered.push_back(std::make_unique<Pinned<std::uint16_t>>(static_cast<std::size_t>(full->numel())));
    if (cudaMemcpyAsync(gathered[t]->data(), full->base, gathered[t]->bytes(), cudaMemcpyDeviceToHost, stream) !=
        cudaSuccess) {
      return 12;
    }
  }
  if (cudaStreamSynchronize(stream) != cudaSuccess) return 13;
  for (std::size_t t = 0; t < tensors; ++t) {
    for (std::size_t i = 0; i < gathered[t]->size(); ++i) {
      if (gathered[t]->data()[i] != kernels::floatToBf16(valueOf(t, static_cast<std::int64_t>(i)))) return 14;
    }
  }
  if (!client->wait(*gather)) return 15;

  // Reduce-scatter (avg, post-scale 2) of gradients rank + 1, the same way.
  if (testing::spinFor(stream, kBusyNanoseconds) != cudaSuccess) return 16;
  std::vector<std::unique_ptr<Pinned<std::uint16_t>>> grads;
  for (std::size_t t = 0; t < tensors; ++t) {
    auto grad = group->unshardedGradView(t);
    if (!grad) return 17;
    grads.push_back(std::make_unique<Pinned<std::uint16_t>>(static_cast<std::size_t>(grad->numel())));
    for (std::size_t i = 0; i < grads[t]->size(); ++i) {
      grads[t]->data()[i] = kernels::floatToBf16(static_cast<float>(rank + 1));
    }
    if (cudaMemcpyAsync(grad->base, grads[t]->data(), grads[t]->bytes(), cudaMemcpyHostToDevice, stream) !=
        cudaSuccess) {
      return 18;
    }
  }
  before = Clock::now();
  auto reduce = group->submitReduceScatter({ReduceMode::kAvg, 1.0F, 2.0F, false}, onStream(stream));
  if (!reduce) return 19;
  if (int late = submittedWithoutWaiting(before, stream, 20); late != 0) return late;
  std::vector<std::unique_ptr<Pinned<float>>> reduced;
  for (std::size_t t = 0; t < tensors; ++t) {
    const TensorView view = group->shardGradView(t);
    reduced.push_back(std::make_unique<Pinned<float>>(static_cast<std::size_t>(view.numel())));
    if (cudaMemcpyAsync(reduced[t]->data(), view.base, reduced[t]->bytes(), cudaMemcpyDeviceToHost, stream) !=
        cudaSuccess) {
      return 22;
    }
  }
  if (cudaStreamSynchronize(stream) != cudaSuccess) return 23;
  const float expected = 2.0F * static_cast<float>(world * (world + 1) / 2) / static_cast<float>(world);
  for (const auto& part : reduced) {
    for (std::size_t i = 0; i < part->size(); ++i) {
      if (part->data()[i] != expected) return 24;
    }
  }
  if (!client->wait(*reduce)) return 25;
  if (!group->reshard() || !client->detach()) return 26;
  return cudaStreamDestroy(stream) == cudaSuccess ? 0 : 27;
}

TEST(StreamOrder, TwoVirtualRanksGatherAndReduceScatterOrderedOnTheirStreams) {
  testing::GpuDbufd daemon({"--backend", "cuda", "--virtual-ranks", "2"});
  if (!daemon.skip().empty()) GTEST_SKIP() << daemon.skip();
  const std::string socket = daemon.socket();
  const auto [rank0, rank1] = testing::runForkedPair([&](int) { return orderedRank(0, 2, socket); },
                                                     [&](int) { return orderedRank(1, 2, socket); });
  EXPECT_EQ(rank0, 0) << "rank 0 failed at step " << rank0 << "\n" << daemon.log();
  EXPECT_EQ(rank1, 0) << "rank 1 failed at step " << rank1 << "\n" << daemon.log();
}

TEST(StreamOrder, OneRankThroughNcclGathersAndReduceScattersOrderedOnItsStream) {
  testing::GpuDbufd daemon({"--backend", "cuda"});  // no virtual ranks: one rank per GPU, NCCL
  if (!daemon.skip().empty()) GTEST_SKIP() << daemon.skip();
  const std::string socket = daemon.socket();
  const auto [rank0, unused] =
      testing::runForkedPair([&](int) { return orderedRank(0, 1, socket); }, [](int) { return 0; });
  EXPECT_EQ(rank0, 0) << "rank 0 failed at step " << rank0 << "\n" << daemon.log();
}

/// A reshard ordered on the stream, with a pool of one slot: it returns while
/// the stream still reads the slot, the next group's acquireSlot waits for
/// that stream and then gets the slot, and what the stream read is what the
/// all-gather wrote (the slot was neither unmapped nor reused before). A
/// group that takes its slot back before the stream is there keeps it.
int reshardOnStreamRank(const std::string& socket) {
  alarm(120);
  if (cudaSetDevice(0) != cudaSuccess) return 2;
  auto client = Client::connect({socket});
  AttachOptions attach{"reshard-on-stream", 0, 1, 0, 0};
  attach.prefetch_depth = 0;  // one slot
  if (!client || !client->attach(attach)) return 3;
  GroupSpec spec_a = layer();
  spec_a.name = "a";
  GroupSpec spec_b = layer();
  spec_b.name = "b";
  auto a = client->registerGroup(spec_a);
  auto b = client->registerGroup(spec_b);
  if (!a || !b || !a->acquireSlot()) return 4;
  const std::size_t tensors = a->plan().tensors.size();
  for (std::size_t t = 0; t < tensors; ++t) {
    const TensorView shard = a->shardView(t);
    std::vector<float> values(static_cast<std::size_t>(shard.numel()));
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = valueOf(t, shard.begin + static_cast<std::int64_t>(i));
    if (cudaMemcpy(shard.base, values.data(), values.size() * sizeof(float), cudaMemcpyHostToDevice) != cudaSuccess) {
      return 5;
    }
  }
  if (cudaDeviceSynchronize() != cudaSuccess || !a->allGather()) return 6;

  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return 7;
  if (testing::spinFor(stream, kBusyNanoseconds) != cudaSuccess) return 8;
  std::vector<std::unique_ptr<Pinned<std::uint16_t>>> read;  // what the stream reads from the slot after the spin
  for (std::size_t t = 0; t < tensors; ++t) {
    auto full = a->unshardedView(t);
    if (!full) return 9;
    read.push_back(std::make_unique<Pinned<std::uint16_t>>(static_cast<std::size_t>(full->numel())));
    if (cudaMemcpyAsync(read[t]->data(), full->base, read[t]->bytes(), cudaMemcpyDeviceToHost, stream) != cudaSuccess) {
      return 10;
    }
  }
  const auto before = Clock::now();
  if (!a->reshardOnStream(stream)) return 11;
  if (int late = submittedWithoutWaiting(before, stream, 12); late != 0) return late;
  if (a->unsharded() || a->unshardedView(0)) return 14;  // resharded as far as the trainer is concerned
  if (!b->acquireSlot()) return 15;                      // the one slot: waits for the stream, then it is b's
  if (cudaStreamQuery(stream) != cudaSuccess) return 16;
  for (std::size_t t = 0; t < tensors; ++t) {
    for (std::size_t i = 0; i < read[t]->size(); ++i) {
      if (read[t]->data()[i] != kernels::floatToBf16(valueOf(t, static_cast<std::int64_t>(i)))) return 17;
    }
  }
  if (!b->reshard() || !a->acquireSlot()) return 18;

  // Taken back before the stream is there: a keeps its slot, at once.
  if (testing::spinFor(stream, kBusyNanoseconds) != cudaSuccess) return 19;
  if (!a->reshardOnStream(stream)) return 20;
  const auto again = Clock::now();
  if (!a->acquireSlot() || !a->unsharded()) return 21;
  if (int late = submittedWithoutWaiting(again, stream, 22); late != 0) return late;
  if (b->acquireSlot()) return 24;  // the pool's one slot is still a's
  if (!a->reshard() || !client->detach()) return 25;
  return cudaStreamDestroy(stream) == cudaSuccess ? 0 : 26;
}

TEST(StreamOrder, AReshardOnTheStreamReturnsAtOnceAndTheSlotGoesBackAfterTheStream) {
  testing::GpuDbufd daemon({"--backend", "cuda", "--virtual-ranks", "1"});
  if (!daemon.skip().empty()) GTEST_SKIP() << daemon.skip();
  const std::string socket = daemon.socket();
  const auto [rank0, unused] =
      testing::runForkedPair([&](int) { return reshardOnStreamRank(socket); }, [](int) { return 0; });
  EXPECT_EQ(rank0, 0) << "the rank failed at step " << rank0 << "\n" << daemon.log();
}

/// The survivor: its stream waits for an op the dead peer never joins.
int survivor(int peer, const std::string& socket) {
  alarm(120);
  if (cudaSetDevice(0) != cudaSuccess) return 2;
  auto client = Client::connect({socket});
  if (!client || !client->attach({"peer-dies", 0, 2, 0, 0})) return 3;
  auto group = client->registerGroup(layer());
  if (!group || !group->acquireSlot()) return 4;
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return 5;
  auto gather = group->submitAllGather(onStream(stream));
  if (!gather) return 6;
  const char die = 1;
  if (write(peer, &die, 1) != 1) return 7;
  // Released when dbufd fails the op (the peer disconnected): poisoned, not hung.
  if (cudaStreamSynchronize(stream) != cudaSuccess) return 8;
  auto result = client->wait(*gather);
  if (result || result.error().code != ErrorCode::kConflict ||
      result.error().message.find("disconnected") == std::string::npos) {
    return 9;
  }
  auto again = group->submitAllGather(onStream(stream));
  if (again || again.error().code != ErrorCode::kConflict) return 10;  // the session's stream ordering is over
  return 0;
}

/// The peer: attaches, registers, and exits without a word once told.
int peerThatDies(int survivor_socket, const std::string& socket) {
  alarm(120);
  if (cudaSetDevice(0) != cudaSuccess) return 2;
  auto client = Client::connect({socket});
  if (!client || !client->attach({"peer-dies", 1, 2, 1, 0})) return 3;
  auto group = client->registerGroup(layer());
  if (!group || !group->acquireSlot()) return 4;
  char die = 0;
  if (read(survivor_socket, &die, 1) != 1) return 5;
  _exit(0);  // no detach: the connection just ends
}

TEST(StreamOrder, APeerThatDiesReleasesTheSurvivorsStreamWithAnError) {
  testing::GpuDbufd daemon({"--backend", "cuda", "--virtual-ranks", "2"});
  if (!daemon.skip().empty()) GTEST_SKIP() << daemon.skip();
  const std::string socket = daemon.socket();
  const auto [alive, dead] = testing::runForkedPair([&](int peer) { return survivor(peer, socket); },
                                                    [&](int peer) { return peerThatDies(peer, socket); });
  EXPECT_EQ(alive, 0) << "the survivor failed at step " << alive << "\n" << daemon.log();
  EXPECT_EQ(dead, 0) << "the peer failed at step " << dead << "\n" << daemon.log();
}

}  // namespace
}  // namespace dbuf
