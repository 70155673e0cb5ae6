#include "dbuf/planner/unit_plan.hpp"

#include <algorithm>
#include <chrono>
#include <map>
#include <unordered_map>

#include "dbuf/common/int_math.hpp"
#include "dbuf/planner/bounds.hpp"

namespace dbuf::planner {
namespace {

constexpr double kDiagnosisThreshold = 1.05;  // bound more than 5% above ceil(N/V)
constexpr std::int64_t kMaxDevices = std::int64_t{1} << 24;
constexpr std::int64_t kMaxBufferElems = std::int64_t{1} << 60;
constexpr std::int64_t kMaxAlignBytes = 4096;

bool boundIsFar(std::int64_t lower_bound, std::int64_t numel, std::int64_t devices) {
  return static_cast<double>(lower_bound) > kDiagnosisThreshold * static_cast<double>(ceilDiv(numel, devices));
}

std::int64_t boundOf(const UnitSpec& unit, const PlanOptions& options) {
  auto problem = buildProblem(unit, options);
  return problem ? computeLowerBound(*problem).shard_elems : 0;
}

std::int64_t unitNumel(const UnitSpec& unit) {
  std::int64_t n = 0;
  for (const TensorSpec& tensor : unit.tensors) n += tensor.numel();
  return n;
}

/// Rows per block of a row-banded rule (rows / block / matrix) for `tensor`,
/// or 0 when its rule is not banded (element, explicit count, vectors).
std::int64_t bandRows(const TensorSpec& tensor, const GranularityRule& default_rule) {
  if (tensor.shape.size() < 2) return 0;
  const GranularityRule rule = tensor.granularity.value_or(default_rule);
  switch (rule.kind) {
    case GranularityRule::Kind::kRows:
    case GranularityRule::Kind::kBlock:
      return rule.rows;
    case GranularityRule::Kind::kMatrix:
      return tensor.shape[tensor.shape.size() - 2];
    case GranularityRule::Kind::kElement:
    case GranularityRule::Kind::kCount:
      return 0;
  }
  return 0;
}

/// Coarsest `rows:R'` (R' halving from the forcing tensors' rule) that, applied
/// to every banded tensor of the unit coarser than it, brings the bound within
/// 5%. All banded tensors change together: refining only the forcing ones
/// would let the next-coarsest tensor force the bound instead.
std::optional<std::string> finerRule(const UnitSpec& unit, const std::vector<std::string>& forcing,
                                     const PlanOptions& options) {
  std::int64_t rows = 0;
  for (const TensorSpec& tensor : unit.tensors) {
    if (std::find(forcing.begin(), forcing.end(), tensor.name) != forcing.end()) {
      rows = std::max(rows, bandRows(tensor, options.default_rule));
    }
  }
  for (std::int64_t finer = rows / 2; finer >= 1; finer /= 2) {
    UnitSpec trial = unit;
    const GranularityRule rule{.kind = GranularityRule::Kind::kRows, .rows = finer};
    for (TensorSpec& tensor : trial.tensors) {
      if (bandRows(tensor, options.default_rule) > finer) tensor.granularity = rule;
    }
    if (!boundIsFar(boundOf(trial, options), unitNumel(trial), options.devices)) return rule.toString();
  }
  return std::nullopt;
}

/// Largest proper divisor of V at which the unit's bound is within 5%: the
/// shard-group size an HSDP configuration would need (groups must tile V).
std::optional<std::int64_t> hsdpDevices(const UnitSpec& unit, const PlanOptions& options) {
  std::vector<std::int64_t> divisors;
  for (std::int64_t d = 1; d * d <= options.devices; ++d) {
    if (options.devices % d != 0) continue;
    divisors.push_back(d);
    divisors.push_back(options.devices / d);
  }
  std::sort(divisors.rbegin(), divisors.rend());
  for (const std::int64_t devices : divisors) {
    if (devices == options.devices) continue;
    PlanOptions trial = options;
    trial.devices = devices;
    if (!boundIsFar(boundOf(unit, trial), unitNumel(unit), devices)) return devices;
  }
  return std::nullopt;
}

/// Diagnoses for the units of one model whose bound is far above ceil(N/V).
/// Identical units (same `source`) share everything but their names, and
/// merge windows are memoised by the distinct units they contain, so a model of
/// 58 identical layers costs little more than one.
class Diagnoser {
 public:
  Diagnoser(const std::vector<UnitSpec>& units, const std::vector<std::size_t>& source, const PlanOptions& options)
      : units_(units), source_(source), options_(options) {}

  BoundDiagnosis diagnose(std::size_t index) {
    const std::size_t origin = source_[index];
    auto cached = per_source_.find(origin);
    if (cached == per_source_.end()) cached = per_source_.emplace(origin, diagnoseDistinct(origin)).first;
    const auto& [forcing, partial] = cached->second;
    BoundDiagnosis diagnosis = partial;
    for (const std::uint32_t item : forcing) diagnosis.forcing_tensors.push_back(units_[index].tensors[item].name);
    diagnosis.merge_units = unitsToMerge(index);
    return diagnosis;
  }

 private:
  /// Forcing tensors (by index), finer rule and HSDP size of a distinct unit.
  std::pair<std::vector<std::uint32_t>, BoundDiagnosis> diagnoseDistinct(std::size_t origin) {
    const LayoutProblem& problem = problemOf(origin);
    std::vector<std::uint32_t> forcing = computeLowerBound(problem).forcing_items;
    std::vector<std::string> names;
    names.reserve(forcing.size());
    for (const std::uint32_t item : forcing) names.push_back(units_[origin].tensors[item].name);
    BoundDiagnosis partial;
    partial.finer_rule = finerRule(units_[origin], names, options_);
    partial.hsdp_devices = hsdpDevices(units_[origin], options_);
    return {std::move(forcing), std::move(partial)};
  }

  const LayoutProblem& problemOf(std::size_t origin) {
    auto found = problems_.find(origin);
    if (found == problems_.end()) {
      // The unit was planned already, so building its problem cannot fail.
      found = problems_.emplace(origin, std::move(buildProblem(units_[origin], options_).value())).first;
    }
    return found->second;
  }

  /// Smallest window of consecutive units containing `index` (one DBuffer,
  /// so one dtype) whose merged bound is within 5% of its ideal.
  std::optional<std::int64_t> unitsToMerge(std::size_t index) {
    const std::size_t count_max = units_.size();
    for (std::size_t count = 2; count <= count_max; ++count) {
      const std::size_t first = std::min(index, units_.size() - count);
      std::vector<std::size_t> key(source_.begin() + static_cast<std::ptrdiff_t>(first),
                                   source_.begin() + static_cast<std::ptrdiff_t>(first + count));
      auto memo = window_far_.find(key);
      if (memo == window_far_.end()) memo = window_far_.emplace(key, windowIsFar(key)).first;
      if (!memo->second) return static_cast<std::int64_t>(count);
    }
    return std::nullopt;
  }

  bool windowIsFar(const std::vector<std::size_t>& origins) {
    LayoutProblem merged = problemOf(origins.front());
    const DType dtype = units_[origins.front()].tensors.front().dtype;
    for (std::size_t i = 1; i < origins.size(); ++i) {
      if (units_[origins[i]].tensors.front().dtype != dtype) return true;  // cannot share a DBuffer
      const auto& items = problemOf(origins[i]).items;
      merged.items.insert(merged.items.end(), items.begin(), items.end());
    }
    return boundIsFar(computeLowerBound(merged).shard_elems, totalNumel(merged), merged.devices);
  }

  const std::vector<UnitSpec>& units_;
  const std::vector<std::size_t>& source_;
  const PlanOptions& options_;
  std::unordered_map<std::size_t, LayoutProblem> problems_;
  std::unordered_map<std::size_t, std::pair<std::vector<std::uint32_t>, BoundDiagnosis>> per_source_;
  std::map<std::vector<std::size_t>, bool> window_far_;
};

}  // namespace

namespace {

/// What a tensor's plan depends on, besides the options, is equal.
bool samePlanInputs(const TensorSpec& x, const TensorSpec& y) {
  return x.shape == y.shape && x.dtype == y.dtype && x.granularity == y.granularity && x.tp_dim == y.tp_dim &&
         isExpertParameter(x.name) == isExpertParameter(y.name);  // Megatron-FSDP buckets experts apart
}

std::uint64_t mix(std::uint64_t hash, std::uint64_t value) {
  return (hash ^ value) * 0x100000001b3ULL + (hash >> 29);
}

std::uint64_t planInputsHash(const UnitSpec& unit) {
  std::uint64_t hash = mix(0xcbf29ce484222325ULL, unit.tensors.size());
  for (const TensorSpec& tensor : unit.tensors) {
    for (const std::int64_t dim : tensor.shape) hash = mix(hash, static_cast<std::uint64_t>(dim));
    hash = mix(hash, static_cast<std::uint64_t>(tensor.dtype) << 8 | tensor.shape.size());
    if (tensor.granularity) {
      const GranularityRule& rule = *tensor.granularity;
      hash = mix(hash, static_cast<std::uint64_t>(rule.kind) + 1);
      hash = mix(hash, static_cast<std::uint64_t>(rule.rows ^ rule.cols << 20 ^ rule.count << 40));
    }
    if (tensor.tp_dim) hash = mix(hash, static_cast<std::uint64_t>(*tensor.tp_dim) + 1000);
  }
  return hash;
}

}  // namespace

std::optional<std::size_t> DistinctUnits::findOrAdd(const UnitSpec& unit) {
  const std::uint64_t hash = planInputsHash(unit);
  const auto [first, last] = by_hash_.equal_range(hash);
  for (auto it = first; it != last; ++it) {
    const UnitSpec& known = *units_[it->second];
    if (std::equal(known.tensors.begin(), known.tensors.end(), unit.tensors.begin(), unit.tensors.end(),
                   [](const TensorSpec& x, const TensorSpec& y) { return samePlanInputs(x, y); })) {
      return it->second;
    }
  }
  by_hash_.emplace(hash, units_.size());
  units_.push_back(&unit);
  return std::nullopt;
}

Result<LayoutProblem> buildProblem(const UnitSpec& unit, const PlanOptions& options) {
  if (options.devices <= 0 || options.devices > kMaxDevices) {
    return makeError(ErrorCode::kInvalidArgument, "device count must be in [1, " + std::to_string(kMaxDevices) + "]");
  }
  if (auto valid = validateUnit(unit); !valid) return std::move(valid).error();
  const std::int64_t elem_bytes = sizeBytes(unit.tensors.front().dtype);
  if (options.align_bytes <= 0 || options.align_bytes % elem_bytes != 0) {
    return makeError(ErrorCode::kInvalidArgument, "alignment of " + std::to_string(options.align_bytes) +
                                                      " bytes is not a positive multiple of the element size");
  }
  // Periods are lcm(alignment, block) <= alignment * block: with blocks of at
  // most 2^50 elements (validateUnit), this keeps them inside int64. (A
  // RegisterGroup carries any u32 here.)
  if (options.align_bytes > kMaxAlignBytes) {
    return makeError(ErrorCode::kInvalidArgument, "alignment of " + std::to_string(options.align_bytes) +
                                                      " bytes exceeds the maximum " + std::to_string(kMaxAlignBytes));
  }
  LayoutProblem problem;
  problem.devices = options.devices;
  problem.align_elems = options.align_bytes / elem_bytes;
  for (const TensorSpec& tensor : unit.tensors) {
    auto granularity = tensorGranularity(tensor, options.default_rule);
    if (!granularity) {
      return std::move(granularity).error().withContext("unit '" + unit.name + "': tensor '" + tensor.name + "'");
    }
    problem.items.push_back({tensor.numel(), *granularity});
  }
  // Every position the planner computes is below 2 * V * N; keep that in int64.
  if (totalNumel(problem) > kMaxBufferElems / options.devices) {
    return makeError(ErrorCode::kInvalidArgument, "unit '" + unit.name + "' is too large to plan over " +
                                                      std::to_string(options.devices) + " devices");
  }
  return problem;
}

namespace {

/// Layout part of a plan: everything but the baselines and the diagnosis.
Result<UnitPlan> planLayout(const UnitSpec& unit, const LayoutProblem& problem, const PlanOptions& options) {
  const SearchResult found = solveLayout(problem, options.search);
  if (const std::string violation = describeViolation(problem, found.layout); !violation.empty()) {
    return makeError(ErrorCode::kInternal,
                     "unit '" + unit.name + "': planner produced an invalid layout: " + violation);
  }
  UnitPlan plan;
  plan.name = unit.name;
  plan.devices = options.devices;
  plan.align_elems = problem.align_elems;
  plan.dtype = unit.tensors.front().dtype;
  plan.numel = totalNumel(problem);
  plan.shard_elems = found.layout.shard_elems;
  plan.placement_bound_elems = computeLowerBound(problem).shard_elems;
  plan.lower_bound_elems = found.proven_bound_elems;
  plan.brief_lower_bound_elems = briefLowerBound(problem);
  plan.ideal_elems = ceilDiv(plan.numel, options.devices);
  plan.padding_elems = options.devices * plan.shard_elems - plan.numel;
  plan.strategy = found.strategy;
  plan.scan_complete = found.scan_complete;
  plan.proven_optimal = found.proven_optimal;
  plan.tensors.reserve(unit.tensors.size());
  for (std::size_t i = 0; i < unit.tensors.size(); ++i) {
    const LayoutItem& item = problem.items[i];
    const std::int64_t offset = found.layout.offsets[i];
    plan.split_blocks += splitBlocks(item, offset, plan.shard_elems);
    plan.tensors.push_back({unit.tensors[i].name, unit.tensors[i].shape, offset, item.numel, item.granularity});
  }
  return plan;
}

void addBaselines(UnitPlan& plan, const UnitSpec& unit, const LayoutProblem& problem) {
  std::vector<std::vector<std::int64_t>> shapes;
  std::vector<std::string> names;
  shapes.reserve(unit.tensors.size());
  names.reserve(unit.tensors.size());
  for (const TensorSpec& tensor : unit.tensors) {
    shapes.push_back(tensor.shape);
    names.push_back(tensor.name);
  }
  plan.baselines = computeBaselines(shapes, problem.items, problem.devices, problem.align_elems, names);
}

double microsSince(std::chrono::steady_clock::time_point started) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - started).count();
}

}  // namespace

Result<UnitPlan> planUnit(const UnitSpec& unit, const PlanOptions& options) {
  const auto started = std::chrono::steady_clock::now();
  auto problem = buildProblem(unit, options);
  if (!problem) return std::move(problem).error();
  auto plan = planLayout(unit, *problem, options);
  if (!plan) return plan;
  plan->plan_us = microsSince(started);
  addBaselines(*plan, unit, *problem);
  return plan;
}

std::optional<RankSlice> sliceOnRank(const PlannedTensor& tensor, std::int64_t shard_elems, std::int64_t rank) {
  const std::int64_t rank_begin = rank * shard_elems;
  const std::int64_t first = std::max(tensor.offset, rank_begin);
  const std::int64_t last = std::min(tensor.offset + tensor.numel, rank_begin + shard_elems);
  if (first >= last) return std::nullopt;
  const std::int64_t begin = first - tensor.offset;
  const std::int64_t end = last - tensor.offset;
  return RankSlice{rank, begin, end, (end - 1) / tensor.granularity - begin / tensor.granularity + 1};
}

BlockNumbering numberBlocks(const std::vector<PlannedTensor>& tensors) {
  std::vector<std::size_t> by_offset;
  by_offset.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) by_offset.push_back(i);
  std::sort(by_offset.begin(), by_offset.end(), [&](std::size_t a, std::size_t b) {
    return tensors[a].offset != tensors[b].offset ? tensors[a].offset < tensors[b].offset : a < b;
  });
  BlockNumbering numbering;
  numbering.first.assign(tensors.size(), 0);
  for (const std::size_t i : by_offset) {
    numbering.first[i] = numbering.total;
    numbering.total += (tensors[i].numel + tensors[i].granularity - 1) / tensors[i].granularity;
  }
  return numbering;
}

std::vector<RankSlice> rankSlices(const UnitPlan& plan, std::size_t index) {
  const PlannedTensor& tensor = plan.tensors[index];
  std::vector<RankSlice> slices;
  const std::int64_t end = tensor.offset + tensor.numel;
  for (std::int64_t rank = tensor.offset / plan.shard_elems; rank * plan.shard_elems < end; ++rank) {
    if (auto slice = sliceOnRank(tensor, plan.shard_elems, rank)) slices.push_back(*slice);
  }
  return slices;
}

/// The plan of an identical unit under `unit`'s names. Its tensors are
/// built with the new names (copying the plan's would copy every name only to
/// replace it: a MoE unit has thousands); `plan` is left as it was.
UnitPlan renamedCopy(UnitPlan& plan, const UnitSpec& unit) {
  std::vector<PlannedTensor> tensors = std::move(plan.tensors);
  UnitPlan copy = plan;  // everything but the tensors
  plan.tensors = std::move(tensors);
  copy.name = unit.name;
  copy.tensors.reserve(plan.tensors.size());
  for (std::size_t i = 0; i < plan.tensors.size(); ++i) {
    const PlannedTensor& planned = plan.tensors[i];
    copy.tensors.push_back({unit.tensors[i].name, planned.shape, planned.offset, planned.numel, planned.granularity});
  }
  return copy;
}

Result<ModelPlan> planModel(const std::vector<UnitSpec>& units, const PlanOptions& options) {
  const auto started = std::chrono::steady_clock::now();
  ModelPlan model;
  std::vector<LayoutProblem> problems;
  std::vector<std::size_t> source;    // index of the unit each plan was first made for
  std::vector<std::size_t> first_of;  // per distinct unit: that index
  DistinctUnits distinct;
  for (std::size_t u = 0; u < units.size(); ++u) {
    const auto unit_started = std::chrono::steady_clock::now();
    if (const auto known = distinct.findOrAdd(units[u])) {
      const std::size_t first = first_of[*known];
      model.units.push_back(renamedCopy(model.units[first], units[u]));
      model.units.back().plan_us = microsSince(unit_started);  // the look-up, not a search
      source.push_back(first);
      continue;
    }
    first_of.push_back(u);
    auto problem = buildProblem(units[u], options);
    if (!problem) return std::move(problem).error();
    auto plan = planLayout(units[u], *problem, options);
    if (!plan) return std::move(plan).error();
    plan->plan_us = microsSince(unit_started);
    model.units.push_back(std::move(*plan));
    problems.push_back(std::move(*problem));
    source.push_back(u);
  }
  model.plan_ms = microsSince(started) / 1000.0;

  // Reporting, outside the timed part: baselines once per distinct unit, and
  // a diagnosis wherever the bound itself is far above ceil(N/V).
  Diagnoser diagnoser(units, source, options);
  std::size_t next_problem = 0;
  for (std::size_t u = 0; u < units.size(); ++u) {
    UnitPlan& plan = model.units[u];
    if (source[u] == u) {
      addBaselines(plan, units[u], problems[next_problem++]);
    } else {
      plan.baselines = model.units[source[u]].baselines;
    }
    if (boundIsFar(plan.placement_bound_elems, plan.numel, plan.devices)) plan.diagnosis = diagnoser.diagnose(u);
  }
  return model;
}

}  // namespace dbuf::planner
