#pragma once
// From a group registration to a plan and the byte layout of its memory:
// pure functions, no state.

#include <cstdint>
#include <optional>
#include <string>

#include "dbuf/common/dtype.hpp"
#include "dbuf/common/result.hpp"
#include "dbuf/ipc/protocol.hpp"
#include "dbuf/kernels/ops.hpp"
#include "dbuf/planner/unit_plan.hpp"

namespace dbuf::daemon {

inline constexpr std::uint64_t kRegionAlign = 256;  // every region starts 256-byte aligned
inline constexpr std::uint64_t kPageBytes = 4096;

/// The first difference between two ranks' specs of one group, in words, or
/// nullopt when they agree.
[[nodiscard]] std::optional<std::string> specDifference(const ipc::RegisterGroup& a, const ipc::RegisterGroup& b);

/// The shard file of one rank that no plan can go below: shards of
/// ceil(N / devices) elements (saturating; 0 for a dtype planGroup refuses).
/// Known before planning, which takes long for huge groups.
[[nodiscard]] std::uint64_t leastShardFileBytes(const ipc::RegisterGroup& spec, std::uint32_t devices);

/// Plans the group over `devices` ranks. Errors (bad dtype, rule, shape) are
/// the client's and name the tensor.
[[nodiscard]] Result<planner::UnitPlan> planGroup(const ipc::RegisterGroup& spec, std::uint32_t devices);

/// The reply every rank gets (fd aside): plan, regions of the shard file and
/// the size of an unsharded slot.
[[nodiscard]] ipc::GroupReady describeGroup(const ipc::RegisterGroup& spec, const planner::UnitPlan& plan,
                                            std::uint32_t group_id);

/// Layout of one unsharded slot for a group: params, grads, then (fp8 only)
/// one fp32 scale per granularity block.
struct SlotLayout {
  ipc::Region params;
  ipc::Region grads;
  ipc::Region scales;
  std::uint64_t file_bytes = 0;
};
[[nodiscard]] SlotLayout slotLayout(const ipc::GroupReady& group);

/// What the data plane needs to know about a group, computed once at
/// registration: dtypes, sizes and, for fp8 groups, each rank's quantization
/// segments (one per tensor slice: shard offset -> global offset, block =
/// the tensor's granularity) and its contiguous range of block scales.
struct GroupGeometry {
  std::uint32_t world = 1;
  std::int64_t shard_elems = 0;
  DType sharded = DType::kF32;
  DType unsharded = DType::kBF16;
  DType grad = DType::kBF16;
  std::int64_t total_blocks = 0;  ///< fp8: scales per slot
  struct RankBlocks {
    std::vector<kernels::Segment> segments;
    std::int64_t first_scale = 0;
    std::int64_t scales = 0;
  };
  std::vector<RankBlocks> ranks;  ///< fp8 groups only
  std::uint64_t digest = 0;       ///< planDigest(): equal on every node that planned the group alike
  [[nodiscard]] bool quantized() const noexcept { return isQuantizedGather(sharded, unsharded); }
  /// Whether the group reduces: not a gather-only group (see isGatherOnly).
  [[nodiscard]] bool reduces() const noexcept { return isReducedDType(sharded); }
  /// The dtype its reductions sum in (see accumulationDType).
  [[nodiscard]] DType accumulation() const noexcept { return accumulationDType(grad); }
};
[[nodiscard]] GroupGeometry groupGeometry(const ipc::GroupReady& group);

/// A hash of the group's plan as its ranks get it: nodes compare it before
/// their first collective of the group to be sure they planned it alike.
[[nodiscard]] std::uint64_t planDigest(const ipc::GroupReady& group);

}  // namespace dbuf::daemon
