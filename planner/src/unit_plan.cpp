#include "dbuf/planner/unit_plan.hpp"

#include <algorithm>
#include <chrono>
#include <unordered_map>

#include "dbuf/common/int_math.hpp"
#include "dbuf/planner/bounds.hpp"

namespace dbuf::planner {
namespace {

constexpr double kDiagnosisThreshold = 1.05;  // bound more than 5% above ceil(N/V)
constexpr std::int64_t kMaxDevices = std::int64_t{1} << 24;
constexpr std::int64_t kMaxBufferElems = std::int64_t{1} << 60;

bool boundIsFar(std::int64_t lower_bound, std::int64_t numel, std::int64_t devices) {
  return static_cast<double>(lower_bound) > kDiagnosisThreshold * static_cast<double>(ceilDiv(numel, devices));
}

/// Identical shapes, granularities and expert flags give identical plans and
/// baselines (names aside). The key is the raw bytes of those.
std::string unitSignature(const UnitSpec& unit, const LayoutProblem& problem) {
  std::string key;
  const auto append = [&key](std::int64_t value) { key.append(reinterpret_cast<const char*>(&value), sizeof value); };
  append(static_cast<std::int64_t>(unit.tensors.front().dtype));
  for (std::size_t i = 0; i < unit.tensors.size(); ++i) {
    append(-static_cast<std::int64_t>(unit.tensors[i].shape.size()));  // negative: a separator no dim can equal
    for (const std::int64_t dim : unit.tensors[i].shape) append(dim);
    append(problem.items[i].granularity);
    append(isExpertParameter(unit.tensors[i].name) ? 1 : 0);  // Megatron buckets them apart
  }
  return key;
}

std::int64_t boundOf(const UnitSpec& unit, const PlanOptions& options) {
  auto problem = buildProblem(unit, options);
  return problem ? computeLowerBound(*problem).shard_elems : 0;
}

UnitSpec mergeUnits(const std::vector<UnitSpec>& units, std::size_t first, std::size_t count) {
  UnitSpec merged{"merged", {}};
  for (std::size_t u = first; u < first + count; ++u) {
    merged.tensors.insert(merged.tensors.end(), units[u].tensors.begin(), units[u].tensors.end());
  }
  return merged;
}

std::int64_t unitNumel(const UnitSpec& unit) {
  std::int64_t n = 0;
  for (const TensorSpec& tensor : unit.tensors) n += tensor.numel();
  return n;
}

/// Smallest window of consecutive units containing `index` whose merged bound
/// is within 5% of its ideal.
std::optional<std::int64_t> unitsToMerge(const std::vector<UnitSpec>& units, std::size_t index,
                                         const PlanOptions& options) {
  for (std::size_t count = 2; count <= units.size(); ++count) {
    const std::size_t first = std::min(index, units.size() - count);
    const UnitSpec merged = mergeUnits(units, first, count);
    if (!boundIsFar(boundOf(merged, options), unitNumel(merged), options.devices)) {
      return static_cast<std::int64_t>(count);
    }
  }
  return std::nullopt;
}

/// Rows per block of a row-banded rule (rows / block / matrix) for `tensor`,
/// or 0 when its rule is not banded (element, explicit count, vectors).
std::int64_t bandRows(const TensorSpec& tensor, const GranularityRule& default_rule) {
  if (tensor.shape.size() < 2) return 0;
  const GranularityRule rule = tensor.granularity.value_or(default_rule);
  switch (rule.kind) {
    case GranularityRule::Kind::kRows:
    case GranularityRule::Kind::kBlock: return rule.rows;
    case GranularityRule::Kind::kMatrix: return tensor.shape[tensor.shape.size() - 2];
    case GranularityRule::Kind::kElement:
    case GranularityRule::Kind::kCount: return 0;
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

BoundDiagnosis diagnose(const std::vector<UnitSpec>& units, std::size_t index, const UnitPlan& plan,
                        const PlanOptions& options) {
  BoundDiagnosis diagnosis;
  auto problem = buildProblem(units[index], options);
  if (problem) {
    for (const std::uint32_t item : computeLowerBound(*problem).forcing_items) {
      diagnosis.forcing_tensors.push_back(plan.tensors[item].name);
    }
  }
  diagnosis.merge_units = unitsToMerge(units, index, options);
  diagnosis.finer_rule = finerRule(units[index], diagnosis.forcing_tensors, options);
  diagnosis.hsdp_devices = hsdpDevices(units[index], options);
  return diagnosis;
}

}  // namespace

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
    return makeError(ErrorCode::kInternal, "unit '" + unit.name + "': planner produced an invalid layout: " + violation);
  }
  UnitPlan plan;
  plan.name = unit.name;
  plan.devices = options.devices;
  plan.align_elems = problem.align_elems;
  plan.dtype = unit.tensors.front().dtype;
  plan.numel = totalNumel(problem);
  plan.shard_elems = found.layout.shard_elems;
  plan.lower_bound_elems = computeLowerBound(problem).shard_elems;
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

std::vector<RankSlice> rankSlices(const UnitPlan& plan, std::size_t index) {
  const PlannedTensor& tensor = plan.tensors[index];
  const std::int64_t shard = plan.shard_elems;
  std::vector<RankSlice> slices;
  const std::int64_t end = tensor.offset + tensor.numel;
  for (std::int64_t rank = tensor.offset / shard; rank * shard < end; ++rank) {
    const std::int64_t begin = std::max(tensor.offset, rank * shard) - tensor.offset;
    const std::int64_t stop = std::min(end, (rank + 1) * shard) - tensor.offset;
    const std::int64_t units = (stop - 1) / tensor.granularity - begin / tensor.granularity + 1;
    slices.push_back({rank, begin, stop, units});
  }
  return slices;
}

Result<ModelPlan> planModel(const std::vector<UnitSpec>& units, const PlanOptions& options) {
  const auto started = std::chrono::steady_clock::now();
  ModelPlan model;
  std::vector<LayoutProblem> problems;
  std::vector<std::size_t> source;  // index of the unit each plan was first made for
  std::unordered_map<std::string, std::size_t> planned;  // signature -> that index
  for (std::size_t u = 0; u < units.size(); ++u) {
    const auto unit_started = std::chrono::steady_clock::now();
    auto problem = buildProblem(units[u], options);
    if (!problem) return std::move(problem).error();
    const auto [hit, inserted] = planned.try_emplace(unitSignature(units[u], *problem), u);
    if (!inserted) {
      UnitPlan copy = model.units[hit->second];
      copy.name = units[u].name;
      for (std::size_t i = 0; i < units[u].tensors.size(); ++i) copy.tensors[i].name = units[u].tensors[i].name;
      copy.plan_us = microsSince(unit_started);  // the look-up, not a search
      model.units.push_back(std::move(copy));
      source.push_back(hit->second);
      continue;
    }
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
  std::size_t next_problem = 0;
  for (std::size_t u = 0; u < units.size(); ++u) {
    UnitPlan& plan = model.units[u];
    if (source[u] == u) {
      addBaselines(plan, units[u], problems[next_problem++]);
    } else {
      plan.baselines = model.units[source[u]].baselines;
    }
    if (boundIsFar(plan.lower_bound_elems, plan.numel, plan.devices)) plan.diagnosis = diagnose(units, u, plan, options);
  }
  return model;
}

}  // namespace dbuf::planner
