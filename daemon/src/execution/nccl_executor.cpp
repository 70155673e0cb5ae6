// The nccl executor (CUDA builds): one rank per GPU. Each rank's memory is
// on its own GPU (mapped into the daemon), each GPU has a stream of the
// daemon's and a CudaRunner on it, and the job's communicators (one per GPU,
// one ncclCommInitAll) are made at the job's first op and reused. An op is
// queued whole in one step: the per-rank fused kernels that turn each rank's
// own part into the wire dtype, then one grouped in-place NCCL call for all
// ranks; reductions go through NCCL in fp32, a chunk at a time through a
// per-GPU scratch (see reduceScatter). NCCL's asynchronous errors are polled
// with the op's events; the first aborts the communicators (the ranks get the
// error, never a hang) and the next op makes new ones.
//
// A job across nodes (ncclNodeExecutor) runs the same ops over this node's
// ranks of one communicator over every node's GPUs, set up when the nodes
// meet: the idle one every node's daemon holds for the set, else a new one
// (node 0's daemon puts its unique id in the meeting's keys; every daemon
// joins its ranks in one group). Each op first exchanges its header with
// the other nodes (nodeSync(): the k-th op of every node matches, a failure
// anywhere fails it everywhere), so NCCL is only called once every node
// will call it too; an op still running after the collective timeout, or an
// asynchronous NCCL error, aborts the communicator, and the nodes meet again
// with another. A communicator goes back to the daemon's idle ones when its
// job ends or loses its link.
#include <cuda_runtime_api.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "abandoned_thread.hpp"
#include "dbuf/common/cuda_status.hpp"
#include "dbuf/gpu/nccl.hpp"
#include "dbuf/kernels/cuda_runner.hpp"
#include "executor.hpp"
#include "nccl_meeting.hpp"
#include "node_executor.hpp"
#include "rank_gpu.hpp"

namespace dbuf::daemon {
namespace {

using kernels::ConstBuffer;
using kernels::MutBuffer;
using kernels::Segment;

class NcclExecutor final : public Executor {
 public:
  /// first_rank: the job's rank of gpus[0] (0 but across nodes); across:
  /// null on one node.
  NcclExecutor(std::vector<std::unique_ptr<RankGpu>> gpus, std::uint32_t first_rank,
               std::unique_ptr<AcrossNodes> across)
      : gpus_(std::move(gpus)), first_rank_(first_rank), across_(std::move(across)) {
    if (across_) across_->sync->whenLinkLost([this] { parkComms(); });
    for (const auto& gpu : gpus_) {
      devices_.push_back(gpu->device);
      streams_.push_back(gpu->stream);
    }
    buffers_.resize(gpus_.size());
    for (const auto& gpu : gpus_) scratch_buffers_.push_back(gpu->scratch);
  }
  ~NcclExecutor() override {
    if (making_.valid()) abandonSetUp();
    quiesce();
    if (across_) parkComms();  // for a later job over the same set
    comms_.reset();            // before the streams go
  }

  Result<bool> begin(const CollectiveArgs& args, const GroupGeometry& geometry,
                     std::span<const RankBuffers> ranks) override {
    if (ranks.size() != gpus_.size()) {
      return makeError(ErrorCode::kInternal, "nccl executor: " + std::to_string(gpus_.size()) + " GPUs but " +
                                                 std::to_string(ranks.size()) + " ranks");
    }
    phase_ = Phase::kIdle;
    if (across_) {
      auto ready = beginAcrossNodes(args, geometry, ranks);
      if (!ready || !*ready) return ready;
    } else if (!comms_ || comms_->failed()) {
      auto ready = communicators();
      if (!ready || !*ready) return ready;
    }
    args_ = args;
    geometry_ = &geometry;
    ranks_ = ranks;
    written_ = 0;
    phase_ = across_ ? Phase::kHeaders : Phase::kData;
    return true;
  }

  Result<bool> step() override {
    if (phase_ == Phase::kHeaders) {
      auto agreed = across_->sync->step();  // the op's header, to and from every other node
      if (!agreed || !*agreed) return agreed;
      phase_ = Phase::kData;
    }
    Result<void> queued;
    switch (args_.op) {
      case ipc::OpCode::kAllGather:
        queued = allGather();
        break;
      case ipc::OpCode::kReduceScatter:
        queued = reduceScatter();
        break;
      case ipc::OpCode::kAllReduce:
        queued = allReduce();
        break;
      case ipc::OpCode::kBroadcast:
        queued = broadcast();
        break;
      case ipc::OpCode::kNoop:
      case ipc::OpCode::kBarrier:
        break;  // no data
    }
    if (!queued) {
      // Across nodes, the other nodes run this op's NCCL calls and this node
      // may have queued only some of its own: the communicator is out of
      // step, so it ends, and the next op has the nodes meet again.
      if (across_) comms_->fail(queued.error());
      return std::move(queued).error();
    }
    queued_at_ = std::chrono::steady_clock::now();
    return true;  // the whole op is queued in one step
  }
  std::uint64_t bytesWritten() const noexcept override { return written_; }
  [[nodiscard]] bool waiting() const noexcept override {
    return phase_ == Phase::kHeaders && across_->sync->waiting();
  }
  // Across nodes the link's thread wakes the loop when the headers are in;
  // the GPUs are polled.
  [[nodiscard]] bool wakesTheLoop() const noexcept override { return across_ && phase_ != Phase::kData; }
  [[nodiscard]] bool runsBarriers() const noexcept override { return across_ != nullptr; }
  void opFailed(std::uint64_t sequence, const Error& error) override {
    if (across_) across_->sync->opFailed(sequence, error);
  }
  void abandon(std::uint64_t sequence, const Error& why) override {
    if (across_) across_->sync->abandon(sequence, why);
  }
  void ranksAttached() override {
    if (across_) across_->sync->ranksAttached();
  }
  [[nodiscard]] const Error* unavailable() override { return across_ ? across_->sync->unavailable() : nullptr; }

  Result<void> queued() override {
    for (const auto& gpu : gpus_) {
      if (auto r = cudaStatus(cudaSetDevice(gpu->device), "cudaSetDevice"); !r) return r;
      if (auto r = cudaStatus(cudaEventRecord(gpu->event, gpu->stream), "cudaEventRecord"); !r) return r;
    }
    return {};
  }
  Result<bool> done() override {
    // An asynchronous NCCL error aborts the communicators and fails the op.
    if (auto r = comms_->poll(); !r) return r.error();
    for (const auto& gpu : gpus_) {
      static_cast<void>(cudaSetDevice(gpu->device));
      const cudaError_t status = cudaEventQuery(gpu->event);
      if (status == cudaErrorNotReady) {
        if (!abortIfLate(queued_at_, "the op")) return false;
        const Result<void> aborted = comms_->poll();
        return aborted.error();
      }
      if (auto r = gpuFailed(status, "the job's GPU work", *gpu); !r) return r.error();
    }
    return true;
  }
  void quiesce() noexcept override {
    // Never a plain stream synchronize: NCCL kernels whose peers cannot
    // progress would hold it forever. Polling aborts failed communicators,
    // and a GPU in error aborts them too, which ends their kernels.
    const auto since = std::chrono::steady_clock::now();
    for (;;) {
      if (comms_) static_cast<void>(comms_->poll());
      bool idle = true;
      for (const auto& gpu : gpus_) {
        static_cast<void>(cudaSetDevice(gpu->device));
        const cudaError_t status = cudaStreamQuery(gpu->stream);
        if (status == cudaErrorNotReady) idle = false;
        static_cast<void>(gpuFailed(status, "quiescing the job's GPU work", *gpu));
      }
      if (idle) return;
      // Across nodes, kernels wait for the other nodes' part: bounded too.
      static_cast<void>(abortIfLate(since, "quiescing the job's GPU work"));
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  Result<std::unique_ptr<SessionCounters>> sessionCounters(std::uint32_t rank, ipc::StreamCounters& counters) override {
    if (rank >= gpus_.size()) return makeError(ErrorCode::kInternal, "nccl executor: no rank " + std::to_string(rank));
    return cudaSessionCounters(counters, gpus_[rank]->device, gpus_[rank]->stream);
  }

 private:
  /// A failed query of `gpu`'s work as an error. NCCL does not see a GPU
  /// fault: the other ranks' kernels would wait for the faulted one forever,
  /// so the communicators are aborted (the next op makes new ones).
  Result<void> gpuFailed(cudaError_t status, const std::string& what, const RankGpu& gpu) {
    if (status == cudaSuccess || status == cudaErrorNotReady) return {};
    Result<void> failed = cudaStatus(status, what + " on GPU " + std::to_string(gpu.device));
    if (comms_) comms_->fail(failed.error());
    return failed;
  }

  /// Across nodes, aborts the communicator when `what` (begun at `since`)
  /// has run past the collective timeout: its kernels wait for another
  /// node's part, which is late or will never come. Whether it did.
  bool abortIfLate(std::chrono::steady_clock::time_point since, const std::string& what) {
    if (!across_ || !comms_ || comms_->failed()) return false;
    if (std::chrono::steady_clock::now() - since < across_->timeout) return false;
    comms_->fail(Error{ErrorCode::kTimeout,
                       what + " did not end on the GPUs within " + std::to_string(across_->timeout.count()) +
                           " ms (another node's part of it is late): the job's NCCL communicator is aborted, and "
                           "its nodes meet again with a new one",
                       {}});
    return true;
  }

  /// A job across nodes: this meeting's communicator (taken when the link
  /// is up), then the op's headers. NCCL failed here (an asynchronous error,
  /// an op past the timeout): the nodes meet again, with another one.
  Result<bool> beginAcrossNodes(const CollectiveArgs& args, const GroupGeometry& geometry,
                                std::span<const RankBuffers> ranks) {
    takeMeetingComms();
    if (comms_ && comms_->failed()) {
      const Result<void> failure = comms_->poll();
      Error why = failure.error();
      comms_.reset();
      across_->sync->loseLink(args.sequence, why);
      return why;
    }
    auto begun = across_->sync->begin(args, geometry, ranks);
    if (!begun || !*begun) return begun;
    takeMeetingComms();
    if (!comms_) {
      return makeError(ErrorCode::kInternal, "dbufd: the nodes met but their NCCL communicator was not made (a bug)");
    }
    return true;
  }

  /// The communicator of the nodes' latest meeting, if one was made since
  /// the last look (the one it replaces ends).
  void takeMeetingComms() {
    std::optional<MeetingComms> latest;
    {
      const std::lock_guard lock(across_->made->mutex);
      latest = std::exchange(across_->made->latest, std::nullopt);
    }
    if (!latest) return;
    comms_ = std::move(latest->comms);
    comms_id_ = latest->id;
    comms_key_ = std::move(latest->key);
  }

  /// The link to the other nodes is lost (or the job ends): a communicator
  /// that did not fail goes to the daemon's idle ones, where the nodes'
  /// next meeting (or a later job's) finds it on every node, and needs no
  /// NCCL set-up. No op of it is in flight: the headers fail an op before
  /// NCCL is called, and a rank's loss waits its work out first.
  void parkComms() {
    if (comms_ && !comms_->failed()) across_->idle->put(comms_key_, IdleCommunicators::Entry{comms_id_, comms_});
    comms_.reset();
  }

  /// NCCL's set-up cannot be interrupted, and one that hangs must not hold
  /// the data plane when the job ends: it finishes on a thread of its own,
  /// which then destroys what it made (counted by AbandonedThread).
  void abandonSetUp() noexcept {
    auto pending = std::make_shared<decltype(making_)>(std::move(making_));
    auto counted = std::make_shared<AbandonedThread>();  // counted from now: the thread may not run yet
    try {
      std::thread([pending, counted]() mutable {
        pending->wait();
        pending.reset();  // the communicators, if made, go before the count drops
      }).detach();
    } catch (const std::system_error&) {
      pending->wait();  // no thread to spare: wait here after all
    }
  }

  /// Makes the communicators (the job's first op, or after a failure aborted
  /// them) on a thread of their own: ncclCommInitAll takes a while, and the
  /// data plane's thread serves every job. True once they are there.
  Result<bool> communicators() {
    if (!making_.valid()) {
      comms_.reset();
      making_ = std::async(std::launch::async, [devices = devices_] { return gpu::LocalComms::create(devices); });
    }
    if (making_.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return false;
    auto made = making_.get();  // making_ is empty again
    if (!made) return std::move(made).error();
    comms_ = std::make_shared<gpu::LocalComms>(std::move(*made));
    return true;
  }

  /// per_rank(r, rank r's memory, its GPU) for each rank, its GPU current.
  template <typename PerRank>
  Result<void> forEachRank(PerRank per_rank) {
    for (std::size_t r = 0; r < gpus_.size(); ++r) {
      if (auto made = cudaStatus(cudaSetDevice(gpus_[r]->device), "cudaSetDevice"); !made) return made;
      if (auto done = per_rank(static_cast<std::uint32_t>(r), ranks_[r], *gpus_[r]); !done) return done;
    }
    return {};
  }
  /// Every rank's buffer of one kind (params, grads, scales), for an NCCL call.
  template <typename T>
  std::span<void* const> everyRank(T* RankBuffers::*member) {
    for (std::size_t r = 0; r < ranks_.size(); ++r) buffers_[r] = ranks_[r].*member;
    return buffers_;
  }
  [[nodiscard]] std::int64_t unshardedElements() const { return geometry_->world * geometry_->shard_elems; }

  Result<void> allGather() {
    // Each rank's own part of its unsharded params (cast, or quantized with
    // its scales), then one in-place all-gather of the parts as bytes.
    const GroupGeometry& g = *geometry_;
    auto own_parts = forEachRank([&](std::uint32_t r, const RankBuffers& mine, RankGpu& gpu) {
      const std::uint32_t rank = first_rank_ + r;
      const ConstBuffer shard{mine.shard, g.sharded, g.shard_elems};
      const MutBuffer params{mine.params, g.unsharded, unshardedElements()};
      if (g.quantized()) {
        return gpu.runner->quantizeE4m3(shard, params, MutBuffer{mine.scales, DType::kF32, g.total_blocks},
                                        g.ranks[rank].segments);
      }
      const Segment own{0, rank * g.shard_elems, g.shard_elems, 0, 0};
      return gpu.runner->cast(shard, params, {&own, 1});
    });
    if (!own_parts) return own_parts;
    const auto part_bytes = static_cast<std::size_t>(g.shard_elems * sizeBytes(g.unsharded));
    if (auto r = comms_->allGather(everyRank(&RankBuffers::params), part_bytes, DType::kU8, streams_); !r) return r;
    written_ += part_bytes * g.world * gpus_.size();
    if (!g.quantized()) return {};
    scale_parts_.resize(g.world);  // every rank's, the other nodes' too
    for (std::size_t w = 0; w < scale_parts_.size(); ++w) {
      scale_parts_[w] = {static_cast<std::size_t>(g.ranks[w].first_scale), static_cast<std::size_t>(g.ranks[w].scales)};
    }
    return comms_->allGatherParts(everyRank(&RankBuffers::scales), scale_parts_, DType::kF32, streams_);
  }

  // Reductions run as the engine's do, in fp32 (fp64 for fp64 gradients):
  // every rank stages pre x its gradient in that dtype into its scratch (a
  // cast or copy, then a scale), NCCL sums it in place, and one fused reduce applies the factor (post,
  // / world for avg) and casts or accumulates. Only the order of the sum is
  // NCCL's: one or two ranks give the engine's bits (NaN payloads aside), more
  // may differ in the last bits. The unsharded gradient is only read
  // (reduce-scatter) or written once at the end (all-reduce). A chunk at a
  // time, so the scratch stays bounded; the buffers' pointers move with the
  // chunk instead of the segments' offsets, so every chunk reuses the same
  // device segment tables (no upload, no host wait for a free table copy).

  /// The scratch's capacity in elements of the dtype a reduction sums in.
  static std::int64_t scratchElements(DType summed) { return kScratchElements * 4 / sizeBytes(summed); }

  Result<void> reduceScatter() {
    const GroupGeometry& g = *geometry_;
    const DType summed = g.accumulation();
    const std::int64_t chunk = std::max<std::int64_t>(1, scratchElements(summed) / g.world);
    const kernels::ReduceOptions finish{1.0F, args_.factor(g.world, g.accumulation()), args_.accumulate};
    for (std::int64_t first = 0; first < g.shard_elems; first += chunk) {
      const std::int64_t count = std::min(chunk, g.shard_elems - first);
      // The scratch holds the chunk of every rank's part, part w at w * count.
      stage_segments_.clear();
      for (std::int64_t w = 0; w < g.world; ++w) stage_segments_.push_back({w * g.shard_elems, w * count, count, 0, 0});
      auto staged = forEachRank([&](std::uint32_t, const RankBuffers& mine, RankGpu& gpu) {
        return stage(ConstBuffer{elementAt(mine.grads, first, g.grad), g.grad, unshardedElements() - first},
                     g.world * count, stage_segments_, gpu);
      });
      if (!staged) return staged;
      if (auto r =
              comms_->reduceScatter(scratch_buffers_, static_cast<std::size_t>(count), summed, ncclSum, streams_);
          !r) {
        return r;
      }
      auto reduced = forEachRank([&](std::uint32_t r, const RankBuffers& mine, RankGpu& gpu) {
        const ConstBuffer sums{gpu.scratch, summed, g.world * count};
        const Segment own{(first_rank_ + r) * count, 0, count, 0, 0};
        return gpu.runner->reduce(
            {&sums, 1}, MutBuffer{elementAt(mine.shard_grad, first, g.sharded), g.sharded, g.shard_elems - first},
            finish, {&own, 1});
      });
      if (!reduced) return reduced;
      written_ +=
          static_cast<std::uint64_t>(count * (g.world * sizeBytes(summed) + sizeBytes(g.sharded))) * gpus_.size();
    }
    return {};
  }

  Result<void> allReduce() {
    const GroupGeometry& g = *geometry_;
    const std::int64_t elements = unshardedElements();
    const kernels::ReduceOptions finish{1.0F, args_.factor(g.world, g.accumulation()), false};
    const DType summed = g.accumulation();
    const std::int64_t capacity = scratchElements(summed);
    for (std::int64_t first = 0; first < elements; first += capacity) {
      const std::int64_t count = std::min(capacity, elements - first);
      const Segment whole{0, 0, count, 0, 0};
      auto staged = forEachRank([&](std::uint32_t, const RankBuffers& mine, RankGpu& gpu) {
        return stage(ConstBuffer{elementAt(mine.grads, first, g.grad), g.grad, elements - first}, count, {&whole, 1},
                     gpu);
      });
      if (!staged) return staged;
      if (auto r = comms_->allReduce(scratch_buffers_, static_cast<std::size_t>(count), summed, ncclSum, streams_);
          !r) {
        return r;
      }
      auto written = forEachRank([&](std::uint32_t, const RankBuffers& mine, RankGpu& gpu) {
        const ConstBuffer sums{gpu.scratch, summed, count};
        return gpu.runner->reduce({&sums, 1},
                                  MutBuffer{elementAt(mine.grads, first, g.grad), g.grad, elements - first}, finish,
                                  {&whole, 1});
      });
      if (!written) return written;
      written_ += static_cast<std::uint64_t>(count * (sizeBytes(summed) + sizeBytes(g.grad))) * gpus_.size();
    }
    return {};
  }

  /// pre x `grads` (along `segments`) into the first `elements` of the
  /// rank's scratch, on its GPU, in the dtype they are summed in.
  Result<void> stage(ConstBuffer grads, std::int64_t elements, std::span<const Segment> segments, RankGpu& gpu) const {
    const MutBuffer scratch{gpu.scratch, accumulationDType(grads.dtype), elements};
    auto staged = grads.dtype == scratch.dtype ? gpu.runner->copy(grads, scratch, segments)
                                               : gpu.runner->cast(grads, scratch, segments);
    if (!staged || args_.pre_scale == 1.0F) return staged;
    const Segment all{0, 0, elements, 0, 0};
    return gpu.runner->scale(scratch, args_.pre_scale, {&all, 1});
  }

  static std::byte* elementAt(std::byte* base, std::int64_t element, DType dtype) {
    return base + element * sizeBytes(dtype);
  }

  Result<void> broadcast() {
    const GroupGeometry& g = *geometry_;
    const auto bytes = static_cast<std::size_t>(unshardedElements() * sizeBytes(g.unsharded));
    const auto root = static_cast<int>(args_.root);
    if (auto r = comms_->broadcast(everyRank(&RankBuffers::params), bytes, DType::kU8, root, streams_); !r) return r;
    written_ += bytes * gpus_.size();
    if (!g.quantized()) return {};
    return comms_->broadcast(everyRank(&RankBuffers::scales), static_cast<std::size_t>(g.total_blocks), DType::kF32,
                             root, streams_);
  }

  enum class Phase : std::uint8_t { kIdle, kHeaders, kData };

  std::vector<std::unique_ptr<RankGpu>> gpus_;
  std::uint32_t first_rank_;
  std::unique_ptr<AcrossNodes> across_;
  Phase phase_ = Phase::kIdle;                     // of the op: its headers (across nodes), then NCCL
  std::chrono::steady_clock::time_point queued_at_;  // the op's NCCL work
  // gpus_' devices and streams side by side, as the NCCL calls take them.
  std::vector<int> devices_;
  std::vector<cudaStream_t> streams_;
  std::shared_ptr<gpu::LocalComms> comms_;  // across nodes: abortedWhenDropped
  std::uint64_t comms_id_ = 0;              // across nodes: its id and key (MeetingComms)
  std::string comms_key_;
  std::future<Result<gpu::LocalComms>> making_;  // the communicators being made
  // The op.
  CollectiveArgs args_;
  const GroupGeometry* geometry_ = nullptr;
  std::span<const RankBuffers> ranks_;
  std::uint64_t written_ = 0;
  // Per-rank argument arrays for the NCCL calls, reused by every op.
  std::vector<void*> buffers_;
  std::vector<void*> scratch_buffers_;   // every rank's fp32 scratch
  std::vector<Segment> stage_segments_;  // a reduce-scatter chunk's staging
  std::vector<gpu::LocalComms::Part> scale_parts_;  // every rank's scales, for fp8 all-gathers
};

}  // namespace

Result<std::unique_ptr<Executor>> ncclExecutor(std::vector<int> devices) {
  auto gpus = rankGpus(devices);
  if (!gpus) return std::move(gpus).error();
  return std::unique_ptr<Executor>(std::make_unique<NcclExecutor>(std::move(*gpus), 0, nullptr));
}

Result<std::unique_ptr<Executor>> ncclNodeExecutor(std::vector<int> devices, NodeJob job,
                                                   const ClusterContext& cluster) {
  auto gpus = rankGpus(devices);
  if (!gpus) return std::move(gpus).error();
  auto across = std::make_unique<AcrossNodes>();
  across->timeout = cluster.config->collective_timeout;
  across->idle = cluster.idle_gpu_communicators;
  job.after_meeting = meetingCommunicator(job, std::move(devices), *across);
  across->sync = nodeSync(job, cluster);
  return std::unique_ptr<Executor>(
      std::make_unique<NcclExecutor>(std::move(*gpus), job.first_rank, std::move(across)));
}

}  // namespace dbuf::daemon
