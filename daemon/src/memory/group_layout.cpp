#include "group_layout.hpp"

#include <algorithm>
#include <limits>
#include <string_view>
#include <unordered_set>

#include "dbuf/common/int_math.hpp"

namespace dbuf::daemon {
namespace {

std::string shapeText(const std::vector<std::int64_t>& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

/// The plan's tensors back from their wire form.
std::vector<planner::PlannedTensor> plannedTensors(const ipc::GroupReady& group) {
  std::vector<planner::PlannedTensor> tensors;
  for (const auto& tensor : group.tensors) {
    tensors.push_back({tensor.name, tensor.shape, tensor.offset, tensor.numel, tensor.granularity});
  }
  return tensors;
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

namespace {

/// A rank's shard file: its shard, then its sharded gradient, page-aligned.
struct ShardFile {
  std::uint64_t shard_bytes = 0;
  std::uint64_t grad_offset = 0;
  std::uint64_t file_bytes = 0;
};

ShardFile shardFile(std::uint64_t shard_elems, DType sharded) {
  ShardFile file;
  file.shard_bytes = shard_elems * static_cast<std::uint64_t>(sizeBytes(sharded));
  file.grad_offset = alignUp(file.shard_bytes, kRegionAlign);
  file.file_bytes = alignUp(file.grad_offset + file.shard_bytes, kPageBytes);
  return file;
}

}  // namespace

std::uint64_t leastShardFileBytes(const ipc::RegisterGroup& spec, std::uint32_t devices) {
  const auto sharded = parseDType(spec.sharded_dtype);
  if (!sharded || devices == 0) return 0;
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  std::uint64_t elements = 0;
  for (const ipc::TensorDecl& tensor : spec.tensors) {
    std::uint64_t numel = 1;
    for (const std::int64_t dim : tensor.shape) {
      const auto d = static_cast<std::uint64_t>(std::max<std::int64_t>(dim, 0));
      numel = d != 0 && numel > kMax / d ? kMax : numel * d;
    }
    elements = numel > kMax - elements ? kMax : elements + numel;
  }
  const std::uint64_t per_rank = elements / devices + (elements % devices != 0 ? 1 : 0);
  if (per_rank > (std::uint64_t{1} << 56)) return kMax;  // far past any memory: no arithmetic that may wrap
  return shardFile(per_rank, *sharded).file_bytes;
}

Result<planner::UnitPlan> planGroup(const ipc::RegisterGroup& spec, std::uint32_t devices) {
  const auto sharded = parseDType(spec.sharded_dtype);
  if (!sharded) return makeError(ErrorCode::kInvalidArgument, "unknown sharded dtype '" + spec.sharded_dtype + "'");
  const auto unsharded = parseDType(spec.unsharded_dtype);
  if (!unsharded) {
    return makeError(ErrorCode::kInvalidArgument, "unknown unsharded dtype '" + spec.unsharded_dtype + "'");
  }
  if (!isGroupDTypePair(*sharded, *unsharded)) {
    return makeError(ErrorCode::kInvalidArgument,
                     "dtypes " + spec.sharded_dtype + " -> " + spec.unsharded_dtype +
                         ": a group shards fp32, bf16 or fp16 and gathers them as one of those or fp8_e4m3, "
                         "or holds another dtype and gathers it as it is: fp64, reduced in fp64, or fp8 and "
                         "integers, with no reductions");
  }
  auto rule = planner::GranularityRule::parse(spec.granularity);
  if (!rule) return std::move(rule).error();
  // Offsets are in elements and shared by both copies; align for the smaller
  // element, so the larger one is aligned too.
  const DType plan_dtype = sizeBytes(*sharded) < sizeBytes(*unsharded) ? *sharded : *unsharded;
  planner::UnitSpec unit{spec.name, {}};
  std::unordered_set<std::string_view> names;
  for (const ipc::TensorDecl& decl : spec.tensors) {
    // Clients find a tensor by its name: a second one of a name would be unreachable.
    if (!names.insert(decl.name).second) {
      return makeError(ErrorCode::kInvalidArgument,
                       "tensor '" + decl.name + "' is named twice: a tensor's name must be unique in its group");
    }
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
  const ShardFile file = shardFile(static_cast<std::uint64_t>(plan.shard_elems), *parseDType(spec.sharded_dtype));
  ready.sharded = {0, file.shard_bytes};
  ready.sharded_grad = {file.grad_offset, file.shard_bytes};
  ready.shard_file_bytes = file.file_bytes;
  ready.slot_bytes = slotLayout(ready).file_bytes;
  return ready;
}

SlotLayout slotLayout(const ipc::GroupReady& group) {
  const DType sharded = *parseDType(group.sharded_dtype);
  const DType unsharded = *parseDType(group.unsharded_dtype);
  const auto elements = static_cast<std::uint64_t>(group.devices) * static_cast<std::uint64_t>(group.shard_elems);
  SlotLayout layout;
  layout.params = {0, elements * static_cast<std::uint64_t>(sizeBytes(unsharded))};
  layout.grads = {alignUp(layout.params.bytes, kRegionAlign),
                  elements * static_cast<std::uint64_t>(sizeBytes(gradientDType(sharded, unsharded)))};
  std::uint64_t end = layout.grads.offset + layout.grads.bytes;
  if (isQuantizedGather(sharded, unsharded)) {
    const auto blocks = static_cast<std::uint64_t>(planner::numberBlocks(plannedTensors(group)).total);
    layout.scales = {alignUp(end, kRegionAlign), blocks * sizeof(float)};
    end = layout.scales.offset + layout.scales.bytes;
  }
  layout.file_bytes = alignUp(end, kPageBytes);
  return layout;
}

std::uint64_t planDigest(const ipc::GroupReady& group) {
  // FNV-1a over the reply as it goes on the wire: the plan, dtypes and sizes.
  std::uint64_t hash = 0xcbf29ce484222325ULL;
  if (auto bytes = ipc::encodePayload(ipc::Message{group})) {
    for (const std::byte b : *bytes) hash = (hash ^ static_cast<std::uint8_t>(b)) * 0x100000001b3ULL;
  }
  return hash;
}

GroupGeometry groupGeometry(const ipc::GroupReady& group) {
  GroupGeometry geometry;
  geometry.world = group.devices;
  geometry.shard_elems = group.shard_elems;
  geometry.sharded = *parseDType(group.sharded_dtype);
  geometry.unsharded = *parseDType(group.unsharded_dtype);
  geometry.grad = gradientDType(geometry.sharded, geometry.unsharded);
  geometry.digest = planDigest(group);
  if (!geometry.quantized()) return geometry;
  const std::vector<planner::PlannedTensor> tensors = plannedTensors(group);
  const planner::BlockNumbering blocks = planner::numberBlocks(tensors);
  geometry.total_blocks = blocks.total;
  geometry.ranks.resize(group.devices);
  for (std::uint32_t rank = 0; rank < group.devices; ++rank) {
    GroupGeometry::RankBlocks& mine = geometry.ranks[rank];
    mine.first_scale = blocks.total;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const auto slice = planner::sliceOnRank(tensors[i], group.shard_elems, rank);
      if (!slice) continue;
      const std::int64_t global = tensors[i].offset + slice->begin;
      const std::int64_t scale = blocks.first[i] + slice->begin / tensors[i].granularity;
      mine.segments.push_back({global - static_cast<std::int64_t>(rank) * group.shard_elems, global,
                               slice->end - slice->begin, tensors[i].granularity, scale});
      mine.first_scale = std::min(mine.first_scale, scale);
      mine.scales += slice->local_units;
    }
    if (mine.segments.empty()) mine.first_scale = 0;
  }
  return geometry;
}

}  // namespace dbuf::daemon
