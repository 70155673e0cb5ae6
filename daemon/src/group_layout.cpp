#include "group_layout.hpp"

#include <algorithm>

#include "dbuf/common/int_math.hpp"

namespace dbuf::daemon {
namespace {

std::string shapeText(const std::vector<std::int64_t>& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

std::uint64_t alignUp(std::uint64_t value, std::uint64_t multiple) {
  return static_cast<std::uint64_t>(roundUp(static_cast<std::int64_t>(value), static_cast<std::int64_t>(multiple)));
}

}  // namespace

std::optional<std::string> specDifference(const ipc::RegisterGroup& a, const ipc::RegisterGroup& b) {
  if (a.sharded_dtype != b.sharded_dtype) return "sharded dtype " + a.sharded_dtype + " vs " + b.sharded_dtype;
  if (a.unsharded_dtype != b.unsharded_dtype) {
    return "unsharded dtype " + a.unsharded_dtype + " vs " + b.unsharded_dtype;
  }
  if (a.granularity != b.granularity) return "granularity " + a.granularity + " vs " + b.granularity;
  if (a.align_bytes != b.align_bytes) {
    return "alignment " + std::to_string(a.align_bytes) + " vs " + std::to_string(b.align_bytes) + " bytes";
  }
  const std::size_t common = std::min(a.tensors.size(), b.tensors.size());
  for (std::size_t i = 0; i < common; ++i) {
    const ipc::TensorDecl& x = a.tensors[i];
    const ipc::TensorDecl& y = b.tensors[i];
    const std::string which = "tensor #" + std::to_string(i) + " '" + x.name + "'";
    if (x.name != y.name) return "tensor #" + std::to_string(i) + " name '" + x.name + "' vs '" + y.name + "'";
    if (x.shape != y.shape) return which + " shape " + shapeText(x.shape) + " vs " + shapeText(y.shape);
    if (x.granularity != y.granularity)
      return which + " granularity '" + x.granularity + "' vs '" + y.granularity + "'";
    if (x.tp_dim != y.tp_dim) return which + " tp_dim " + std::to_string(x.tp_dim) + " vs " + std::to_string(y.tp_dim);
  }
  if (a.tensors.size() != b.tensors.size()) {
    return std::to_string(a.tensors.size()) + " tensors vs " + std::to_string(b.tensors.size());
  }
  return std::nullopt;
}

Result<planner::UnitPlan> planGroup(const ipc::RegisterGroup& spec, std::uint32_t devices) {
  const auto sharded = parseDType(spec.sharded_dtype);
  if (!sharded) return makeError(ErrorCode::kInvalidArgument, "unknown sharded dtype '" + spec.sharded_dtype + "'");
  const auto unsharded = parseDType(spec.unsharded_dtype);
  if (!unsharded) {
    return makeError(ErrorCode::kInvalidArgument, "unknown unsharded dtype '" + spec.unsharded_dtype + "'");
  }
  auto rule = planner::GranularityRule::parse(spec.granularity);
  if (!rule) return std::move(rule).error();
  // Offsets are in elements and shared by both copies; align for the smaller
  // element, so the larger one is aligned too.
  const DType plan_dtype = sizeBytes(*sharded) < sizeBytes(*unsharded) ? *sharded : *unsharded;
  planner::UnitSpec unit{spec.name, {}};
  for (const ipc::TensorDecl& decl : spec.tensors) {
    planner::TensorSpec tensor{decl.name, decl.shape, plan_dtype, std::nullopt, std::nullopt};
    if (!decl.granularity.empty()) {
      auto own = planner::GranularityRule::parse(decl.granularity);
      if (!own) return std::move(own).error().withContext("tensor '" + decl.name + "'");
      tensor.granularity = *own;
    }
    if (decl.tp_dim >= 0) tensor.tp_dim = decl.tp_dim;
    unit.tensors.push_back(std::move(tensor));
  }
  planner::PlanOptions options;
  options.devices = devices;
  options.default_rule = *rule;
  options.align_bytes = spec.align_bytes;
  return planner::planUnit(unit, options);
}

ipc::GroupReady describeGroup(const ipc::RegisterGroup& spec, const planner::UnitPlan& plan, std::uint32_t group_id) {
  ipc::GroupReady ready;
  ready.group_id = group_id;
  ready.devices = static_cast<std::uint32_t>(plan.devices);
  ready.shard_elems = plan.shard_elems;
  ready.sharded_dtype = spec.sharded_dtype;
  ready.unsharded_dtype = spec.unsharded_dtype;
  for (const planner::PlannedTensor& tensor : plan.tensors) {
    ready.tensors.push_back({tensor.name, tensor.shape, tensor.offset, tensor.numel, tensor.granularity});
  }
  const auto shard_bytes = static_cast<std::uint64_t>(plan.shard_elems) *
                           static_cast<std::uint64_t>(sizeBytes(*parseDType(spec.sharded_dtype)));
  ready.sharded = {0, shard_bytes};
  ready.sharded_grad = {alignUp(shard_bytes, kRegionAlign), shard_bytes};
  ready.shard_file_bytes = alignUp(ready.sharded_grad.offset + shard_bytes, kPageBytes);
  ready.slot_bytes = slotLayout(ready).file_bytes;
  return ready;
}

SlotLayout slotLayout(const ipc::GroupReady& group) {
  const auto bytes = static_cast<std::uint64_t>(group.devices) * static_cast<std::uint64_t>(group.shard_elems) *
                     static_cast<std::uint64_t>(sizeBytes(*parseDType(group.unsharded_dtype)));
  SlotLayout layout;
  layout.params = {0, bytes};
  layout.grads = {alignUp(bytes, kRegionAlign), bytes};
  layout.file_bytes = alignUp(layout.grads.offset + bytes, kPageBytes);
  return layout;
}

}  // namespace dbuf::daemon
