#pragma once
// From a group registration to a plan and the byte layout of its memory:
// pure functions, no state.

#include <cstdint>
#include <optional>
#include <string>

#include "dbuf/common/dtype.hpp"
#include "dbuf/common/result.hpp"
#include "dbuf/ipc/protocol.hpp"
#include "dbuf/planner/unit_plan.hpp"

namespace dbuf::daemon {

inline constexpr std::uint64_t kRegionAlign = 256;  // every region starts 256-byte aligned
inline constexpr std::uint64_t kPageBytes = 4096;

/// The first difference between two ranks' specs of one group, in words, or
/// nullopt when they agree.
[[nodiscard]] std::optional<std::string> specDifference(const ipc::RegisterGroup& a, const ipc::RegisterGroup& b);

/// Plans the group over `devices` ranks. Errors (bad dtype, rule, shape) are
/// the client's and name the tensor.
[[nodiscard]] Result<planner::UnitPlan> planGroup(const ipc::RegisterGroup& spec, std::uint32_t devices);

/// The reply every rank gets (fd aside): plan, regions of the shard file and
/// the size of an unsharded slot.
[[nodiscard]] ipc::GroupReady describeGroup(const ipc::RegisterGroup& spec, const planner::UnitPlan& plan,
                                            std::uint32_t group_id);

/// Layout of one unsharded slot for a group: params then grads.
struct SlotLayout {
  ipc::Region params;
  ipc::Region grads;
  std::uint64_t file_bytes = 0;
};
[[nodiscard]] SlotLayout slotLayout(const ipc::GroupReady& group);

}  // namespace dbuf::daemon
