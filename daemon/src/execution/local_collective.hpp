#pragma once
// Collectives among ranks whose memory the daemon addresses itself: one
// matched op over every rank's buffers, run in steps of bounded size so that
// the scheduler can interleave jobs (a 1 GiB all-gather of one job never
// holds another's barrier for long). Built from the fused ops through a
// kernels::Runner, so the same algorithm serves the host backend (CPU ops
// over shared memory) and virtual ranks on one GPU (CUDA ops over device
// memory, queued on the runner's stream). Allocates nothing per op (the
// reduction's source table and scratch belong to the caller, in the
// runner's memory space).

#include <cstdint>
#include <span>
#include <string>

#include "dbuf/common/result.hpp"
#include "dbuf/ipc/ring.hpp"
#include "dbuf/kernels/runner.hpp"
#include "group_layout.hpp"

namespace dbuf::daemon {

/// One rank's memory as the daemon maps it.
struct RankBuffers {
  std::byte* shard = nullptr;       ///< shard_elems of the sharded dtype
  std::byte* shard_grad = nullptr;  ///< shard_elems of the sharded dtype
  std::byte* params = nullptr;      ///< world * shard_elems of the unsharded dtype (null: no slot)
  std::byte* grads = nullptr;       ///< world * shard_elems of the gradient dtype
  float* scales = nullptr;          ///< fp8 groups: total_blocks
};

/// The arguments every rank agreed on.
struct CollectiveArgs {
  std::uint64_t sequence = 0;  ///< the job's collective number
  ipc::OpCode op = ipc::OpCode::kBarrier;
  ipc::ReduceMode reduce = ipc::ReduceMode::kSum;
  bool accumulate = false;
  std::uint32_t root = 0;
  float pre_scale = 1.0F;
  float post_scale = 1.0F;
  /// In words ("allGather(group 'layer0')"); jobs across nodes only (the
  /// other nodes are told it when the ops differ).
  std::string description;

  /// What a reduction's sum is multiplied by: post, or post / world for avg,
  /// computed in the dtype the sum is in (fp32; fp64 for fp64 gradients).
  [[nodiscard]] double factor(std::uint32_t world, DType summed) const noexcept {
    if (reduce != ipc::ReduceMode::kAvg) return post_scale;
    if (summed == DType::kF64) return static_cast<double>(post_scale) / static_cast<double>(world);
    return post_scale / static_cast<float>(world);
  }
};

class LocalCollective {
 public:
  /// Elements one step handles at most (per kernel call).
  static constexpr std::int64_t kStepElements = std::int64_t{1} << 22;

  LocalCollective() = default;
  /// `ranks` and `sources` (an entry per rank the daemon addresses; `sources`
  /// is filled here with the ranks' gradients) and `scratch` (kStepElements
  /// floats, for the in-place all-reduce) must outlive the op; `geometry`
  /// too. `ranks` are ranks first_rank.. of the job's geometry->world: all of
  /// them on one node; a node's own for the local all-gather of a job across
  /// nodes (the only op that runs on part of a job).
  LocalCollective(const CollectiveArgs& args, const GroupGeometry* geometry, std::span<const RankBuffers> ranks,
                  std::span<kernels::ConstBuffer> sources, std::span<float> scratch, kernels::Runner& runner,
                  std::uint32_t first_rank = 0);

  /// Runs one step; true when the op is complete. An error ends the op.
  [[nodiscard]] Result<bool> step();
  /// Bytes written so far (for bandwidth figures).
  [[nodiscard]] std::uint64_t bytesWritten() const noexcept { return written_; }

 private:
  Result<bool> allGatherStep();
  /// One step of the all-gather's first phase for rank index_; true when
  /// that rank's own part is done.
  Result<bool> castOwnPartStep();
  Result<bool> quantizeOwnPartStep();
  /// One step of the second phase (parts copied between ranks).
  Result<bool> copyPartStep();
  Result<bool> reduceScatterStep();
  Result<bool> allReduceStep();
  Result<bool> broadcastStep();
  /// Copies [first, first + count) elements of rank `from`'s params into rank
  /// `to`'s (indices into ranks_).
  Result<void> copyParams(std::uint32_t from, std::uint32_t to, std::int64_t first, std::int64_t count);
  /// The reduction's scales (pre, CollectiveArgs::factor).
  [[nodiscard]] kernels::ReduceOptions reduction(bool accumulate) const noexcept;

  CollectiveArgs args_;
  const GroupGeometry* geometry_ = nullptr;
  std::span<const RankBuffers> ranks_;
  std::span<kernels::ConstBuffer> sources_;
  std::span<float> scratch_;
  kernels::Runner* runner_ = nullptr;
  std::uint32_t first_rank_ = 0;  // the job's rank of ranks_[0]
  // Cursor: phase, then an index (rank or rank pair), then an element offset.
  int phase_ = 0;
  std::uint64_t index_ = 0;
  std::int64_t offset_ = 0;
  std::size_t segment_ = 0;  // fp8 quantization: the next segment of the rank
  std::uint64_t written_ = 0;
};

}  // namespace dbuf::daemon
