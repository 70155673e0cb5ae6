// Plan reports as JSON. The writer builds an ordered_json (keys in the
// documented order) and prints it with a small printer of its own: containers
// that hold only scalars (a tensor, a rank slice, a shape, the totals) go on
// one line, so a unit with 800 tensors is 800 lines, not 8000. The reader
// checks every type and never lets a nlohmann exception escape.
#include <limits>
#include <nlohmann/json.hpp>

#include "dbuf/plan_io/report.hpp"

namespace dbuf::plan_io {
namespace {

using Json = nlohmann::ordered_json;

// ---------------------------------------------------------------- writing --

Json toJson(const BaselineReport& baseline) {
  Json out = Json::object();
  out["shard_elems"] = baseline.shard_elems;
  out["split_blocks"] = baseline.split_blocks;
  return out;
}

Json toJson(const TensorReport& tensor) {
  Json out = Json::object();
  out["name"] = tensor.name;
  out["shape"] = tensor.shape;
  out["offset"] = tensor.offset;
  out["numel"] = tensor.numel;
  out["granularity_elems"] = tensor.granularity_elems;
  if (tensor.ranks) {
    Json ranks = Json::array();
    for (const RankSliceReport& slice : *tensor.ranks) {
      Json entry = Json::object();
      entry["rank"] = slice.rank;
      entry["begin"] = slice.begin;
      entry["end"] = slice.end;
      entry["local_units"] = slice.local_units;
      ranks.push_back(std::move(entry));
    }
    out["ranks"] = std::move(ranks);
  }
  return out;
}

Json toJson(const UnitReport& unit, std::int64_t report_devices) {
  Json out = Json::object();
  out["name"] = unit.name;
  if (unit.devices != report_devices && unit.devices > 0) out["devices"] = unit.devices;
  out["numel"] = unit.numel;
  out["shard_elems"] = unit.shard_elems;
  out["lower_bound_elems"] = unit.lower_bound_elems;
  out["padding_elems"] = unit.padding_elems;
  out["split_blocks"] = unit.split_blocks;
  out["plan_us"] = unit.plan_us;
  Json tensors = Json::array();
  for (const TensorReport& tensor : unit.tensors) tensors.push_back(toJson(tensor));
  out["tensors"] = std::move(tensors);
  Json baselines = Json::object();
  baselines["fsdp2"] = toJson(unit.fsdp2);
  baselines["fsdp1"] = toJson(unit.fsdp1);
  baselines["zero3"] = toJson(unit.zero3);
  baselines["megatron"] = toJson(unit.megatron);
  out["baselines"] = std::move(baselines);
  out["dtype"] = unit.dtype;
  out["align_elems"] = unit.align_elems;
  out["ideal_elems"] = unit.ideal_elems;
  out["brief_lower_bound_elems"] = unit.brief_lower_bound_elems;
  out["strategy"] = unit.strategy;
  out["scan_complete"] = unit.scan_complete;
  out["proven_optimal"] = unit.proven_optimal;
  out["inflation"] = unit.inflation;
  if (unit.diagnosis) {
    const DiagnosisReport& diagnosis = *unit.diagnosis;
    Json node = Json::object();
    node["forcing_tensors"] = diagnosis.forcing_tensors;
    if (diagnosis.merge_units) node["merge_units"] = *diagnosis.merge_units;
    if (diagnosis.finer_rule) node["finer_rule"] = *diagnosis.finer_rule;
    if (diagnosis.hsdp_devices) node["hsdp_devices"] = *diagnosis.hsdp_devices;
    out["diagnosis"] = std::move(node);
  }
  return out;
}

Json toJson(const MergeReport& merge) {
  Json out = Json::object();
  out["budget_bytes"] = merge.budget_bytes;
  out["units"] = merge.units;
  out["numel"] = merge.numel;
  out["allgather_elems"] = merge.allgather_elems;
  out["inflation"] = merge.inflation;
  out["peak_unsharded_bytes"] = merge.peak_unsharded_bytes;
  out["within_target"] = merge.within_target;
  out["unmerged_allgather_elems"] = merge.unmerged_allgather_elems;
  out["unmerged_inflation"] = merge.unmerged_inflation;
  out["unmerged_peak_unsharded_bytes"] = merge.unmerged_peak_unsharded_bytes;
  out["merge_ms"] = merge.merge_ms;
  Json runs = Json::array();
  for (const MergeRunReport& run : merge.runs) {
    Json entry = Json::object();
    entry["name"] = run.name;
    entry["first"] = run.first;
    entry["count"] = run.count;
    entry["allgather_elems"] = run.allgather_elems;
    entry["unsharded_bytes"] = run.unsharded_bytes;
    entry["over_budget"] = run.over_budget;
    runs.push_back(std::move(entry));
  }
  out["runs"] = std::move(runs);
  return out;
}

Json toJson(const PlanReport& report) {
  Json out = Json::object();
  out["devices"] = report.devices;
  out["granularity"] = report.granularity;
  out["align_elems"] = report.align_elems;
  Json units = Json::array();
  for (const UnitReport& unit : report.units) units.push_back(toJson(unit, report.devices));
  out["units"] = std::move(units);
  Json total = Json::object();
  total["numel"] = report.total.numel;
  total["allgather_elems"] = report.total.allgather_elems;
  total["inflation"] = report.total.inflation;
  total["lower_bound_inflation"] = report.total.lower_bound_inflation;
  total["plan_ms"] = report.total.plan_ms;
  out["total"] = std::move(total);
  out["model"] = report.model;
  out["align_bytes"] = report.align_bytes;
  if (report.merge) out["merge"] = toJson(*report.merge);
  if (report.model_parallel) {
    Json parallel = Json::object();
    parallel["tp"] = report.model_parallel->tp;
    parallel["ep"] = report.model_parallel->ep;
    parallel["diagnoses"] = report.model_parallel->diagnoses;
    out["model_parallel"] = std::move(parallel);
  }
  return out;
}

bool isScalarArray(const Json& value) {
  if (!value.is_array()) return false;
  for (const Json& item : value) {
    if (!item.is_primitive()) return false;
  }
  return true;
}

/// A container printed on one line: only scalars and arrays of scalars inside.
bool isLeaf(const Json& value) {
  if (value.is_array()) return isScalarArray(value);
  for (const auto& item : value.items()) {
    if (!item.value().is_primitive() && !isScalarArray(item.value())) return false;
  }
  return true;
}

void print(const Json& value, int indent, bool inline_all, std::string& out) {
  if (value.is_primitive()) {
    // replace: a name with invalid UTF-8 (from a hand-made spec) is printed, not thrown.
    out += value.dump(-1, ' ', false, Json::error_handler_t::replace);
    return;
  }
  const bool is_object = value.is_object();
  const char open = is_object ? '{' : '[';
  const char close = is_object ? '}' : ']';
  if (value.empty()) {
    out += open;
    out += close;
    return;
  }
  const bool one_line = inline_all || isLeaf(value);
  const std::string pad(static_cast<std::size_t>(indent + 2), ' ');
  out += open;
  bool first = true;
  for (const auto& item : value.items()) {
    if (!first) out += ',';
    first = false;
    if (one_line) {
      if (out.back() == ',') out += ' ';
    } else {
      out += '\n';
      out += pad;
    }
    if (is_object) {
      out += Json(item.key()).dump(-1, ' ', false, Json::error_handler_t::replace);
      out += ": ";
    }
    print(item.value(), indent + 2, one_line, out);
  }
  if (!one_line) {
    out += '\n';
    out.append(static_cast<std::size_t>(indent), ' ');
  }
  out += close;
}

// ---------------------------------------------------------------- reading --

/// Collects the first error; every getter returns false once one happened.
class Reader {
 public:
  [[nodiscard]] bool failed() const noexcept { return error_.has_value(); }
  [[nodiscard]] Error takeError() { return std::move(*error_); }

  bool fail(const std::string& path, const std::string& what) {
    if (!error_) error_ = makeError(ErrorCode::kInvalidArgument, "plan JSON: " + path + ": " + what);
    return false;
  }

  const Json* find(const Json& object, const char* key, const std::string& path, bool required) {
    const auto it = object.find(key);
    if (it == object.end()) {
      if (required) fail(join(path, key), "missing");
      return nullptr;
    }
    return &*it;
  }

  const Json* object(const Json& parent, const char* key, const std::string& path) {
    const Json* node = find(parent, key, path, true);
    if (node == nullptr) return nullptr;
    if (!node->is_object()) {
      fail(join(path, key), "expected an object");
      return nullptr;
    }
    return node;
  }

  const Json* array(const Json& parent, const char* key, const std::string& path) {
    const Json* node = find(parent, key, path, true);
    if (node == nullptr) return nullptr;
    if (!node->is_array()) {
      fail(join(path, key), "expected an array");
      return nullptr;
    }
    return node;
  }

  bool toInt(const Json& node, const std::string& path, std::int64_t& out) {
    if (node.is_number_unsigned()) {
      const auto value = node.get<std::uint64_t>();
      if (value > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
        return fail(path, "integer out of range");
      }
      out = static_cast<std::int64_t>(value);
      return true;
    }
    if (!node.is_number_integer()) return fail(path, "expected an integer");
    out = node.get<std::int64_t>();
    return true;
  }

  bool integer(const Json& parent, const char* key, const std::string& path, std::int64_t& out, bool required = true) {
    const Json* node = find(parent, key, path, required);
    return node == nullptr ? !required : toInt(*node, join(path, key), out);
  }

  bool optionalInteger(const Json& parent, const char* key, const std::string& path, std::optional<std::int64_t>& out) {
    const Json* node = find(parent, key, path, false);
    if (node == nullptr) return true;
    std::int64_t value = 0;
    if (!toInt(*node, join(path, key), value)) return false;
    out = value;
    return true;
  }

  bool number(const Json& parent, const char* key, const std::string& path, double& out, bool required = true) {
    const Json* node = find(parent, key, path, required);
    if (node == nullptr) return !required;
    if (!node->is_number()) return fail(join(path, key), "expected a number");
    out = node->get<double>();
    return true;
  }

  bool string(const Json& parent, const char* key, const std::string& path, std::string& out, bool required = true) {
    const Json* node = find(parent, key, path, required);
    if (node == nullptr) return !required;
    if (!node->is_string()) return fail(join(path, key), "expected a string");
    out = node->get<std::string>();
    return true;
  }

  bool boolean(const Json& parent, const char* key, const std::string& path, bool& out) {
    const Json* node = find(parent, key, path, false);
    if (node == nullptr) return true;
    if (!node->is_boolean()) return fail(join(path, key), "expected true or false");
    out = node->get<bool>();
    return true;
  }

  static std::string join(const std::string& path, const char* key) {
    return path.empty() ? std::string(key) : path + "." + key;
  }
  static std::string index(const std::string& path, std::size_t i) { return path + "[" + std::to_string(i) + "]"; }

 private:
  std::optional<Error> error_;
};

bool readBaseline(Reader& reader, const Json& baselines, const char* key, const std::string& path,
                  BaselineReport& out) {
  const Json* node = reader.object(baselines, key, path);
  if (node == nullptr) return false;
  const std::string where = Reader::join(path, key);
  return reader.integer(*node, "shard_elems", where, out.shard_elems) &&
         reader.integer(*node, "split_blocks", where, out.split_blocks);
}

bool readTensor(Reader& reader, const Json& node, const std::string& path, TensorReport& out) {
  if (!node.is_object()) return reader.fail(path, "expected an object");
  if (!reader.string(node, "name", path, out.name)) return false;
  const Json* shape = reader.array(node, "shape", path);
  if (shape == nullptr) return false;
  for (std::size_t i = 0; i < shape->size(); ++i) {
    std::int64_t dim = 0;
    if (!reader.toInt((*shape)[i], Reader::index(Reader::join(path, "shape"), i), dim)) return false;
    out.shape.push_back(dim);
  }
  if (!reader.integer(node, "offset", path, out.offset) || !reader.integer(node, "numel", path, out.numel) ||
      !reader.integer(node, "granularity_elems", path, out.granularity_elems)) {
    return false;
  }
  if (node.contains("ranks")) {
    const Json* ranks = reader.array(node, "ranks", path);
    if (ranks == nullptr) return false;
    std::vector<RankSliceReport> slices;
    for (std::size_t i = 0; i < ranks->size(); ++i) {
      const std::string where = Reader::index(Reader::join(path, "ranks"), i);
      const Json& entry = (*ranks)[i];
      if (!entry.is_object()) return reader.fail(where, "expected an object");
      RankSliceReport slice;
      if (!reader.integer(entry, "rank", where, slice.rank) || !reader.integer(entry, "begin", where, slice.begin) ||
          !reader.integer(entry, "end", where, slice.end) ||
          !reader.integer(entry, "local_units", where, slice.local_units)) {
        return false;
      }
      slices.push_back(slice);
    }
    out.ranks = std::move(slices);
  }
  return true;
}

bool readDiagnosis(Reader& reader, const Json& unit, const std::string& path, std::optional<DiagnosisReport>& out) {
  if (!unit.contains("diagnosis")) return true;
  const Json* node = reader.object(unit, "diagnosis", path);
  if (node == nullptr) return false;
  const std::string where = Reader::join(path, "diagnosis");
  DiagnosisReport diagnosis;
  const Json* forcing = reader.array(*node, "forcing_tensors", where);
  if (forcing == nullptr) return false;
  for (std::size_t i = 0; i < forcing->size(); ++i) {
    if (!(*forcing)[i].is_string()) {
      return reader.fail(Reader::index(Reader::join(where, "forcing_tensors"), i), "expected a string");
    }
    diagnosis.forcing_tensors.push_back((*forcing)[i].get<std::string>());
  }
  if (!reader.optionalInteger(*node, "merge_units", where, diagnosis.merge_units) ||
      !reader.optionalInteger(*node, "hsdp_devices", where, diagnosis.hsdp_devices)) {
    return false;
  }
  if (node->contains("finer_rule")) {
    std::string rule;
    if (!reader.string(*node, "finer_rule", where, rule)) return false;
    diagnosis.finer_rule = std::move(rule);
  }
  out = std::move(diagnosis);
  return true;
}

bool readUnit(Reader& reader, const Json& node, const std::string& path, UnitReport& out) {
  if (!node.is_object()) return reader.fail(path, "expected an object");
  if (!reader.string(node, "name", path, out.name) || !reader.integer(node, "devices", path, out.devices, false) ||
      !reader.integer(node, "numel", path, out.numel) ||
      !reader.integer(node, "shard_elems", path, out.shard_elems) ||
      !reader.integer(node, "lower_bound_elems", path, out.lower_bound_elems) ||
      !reader.integer(node, "padding_elems", path, out.padding_elems) ||
      !reader.integer(node, "split_blocks", path, out.split_blocks) ||
      !reader.number(node, "plan_us", path, out.plan_us)) {
    return false;
  }
  const Json* tensors = reader.array(node, "tensors", path);
  if (tensors == nullptr) return false;
  out.tensors.resize(tensors->size());
  for (std::size_t i = 0; i < tensors->size(); ++i) {
    if (!readTensor(reader, (*tensors)[i], Reader::index(Reader::join(path, "tensors"), i), out.tensors[i])) {
      return false;
    }
  }
  const Json* baselines = reader.object(node, "baselines", path);
  if (baselines == nullptr) return false;
  const std::string where = Reader::join(path, "baselines");
  if (!readBaseline(reader, *baselines, "fsdp2", where, out.fsdp2) ||
      !readBaseline(reader, *baselines, "fsdp1", where, out.fsdp1) ||
      !readBaseline(reader, *baselines, "zero3", where, out.zero3) ||
      !readBaseline(reader, *baselines, "megatron", where, out.megatron)) {
    return false;
  }
  // Extra keys: optional, defaults when absent.
  return reader.string(node, "dtype", path, out.dtype, false) &&
         reader.integer(node, "align_elems", path, out.align_elems, false) &&
         reader.integer(node, "ideal_elems", path, out.ideal_elems, false) &&
         reader.integer(node, "brief_lower_bound_elems", path, out.brief_lower_bound_elems, false) &&
         reader.string(node, "strategy", path, out.strategy, false) &&
         reader.boolean(node, "scan_complete", path, out.scan_complete) &&
         reader.boolean(node, "proven_optimal", path, out.proven_optimal) &&
         reader.number(node, "inflation", path, out.inflation, false) &&
         readDiagnosis(reader, node, path, out.diagnosis);
}

bool readMerge(Reader& reader, const Json& root, std::optional<MergeReport>& out) {
  if (!root.contains("merge")) return true;
  const Json* node = reader.object(root, "merge", "");
  if (node == nullptr) return false;
  MergeReport merge;
  const std::string where = "merge";
  if (!reader.integer(*node, "budget_bytes", where, merge.budget_bytes) ||
      !reader.integer(*node, "units", where, merge.units) || !reader.integer(*node, "numel", where, merge.numel) ||
      !reader.integer(*node, "allgather_elems", where, merge.allgather_elems) ||
      !reader.number(*node, "inflation", where, merge.inflation) ||
      !reader.integer(*node, "peak_unsharded_bytes", where, merge.peak_unsharded_bytes) ||
      !reader.boolean(*node, "within_target", where, merge.within_target) ||
      !reader.integer(*node, "unmerged_allgather_elems", where, merge.unmerged_allgather_elems) ||
      !reader.number(*node, "unmerged_inflation", where, merge.unmerged_inflation) ||
      !reader.integer(*node, "unmerged_peak_unsharded_bytes", where, merge.unmerged_peak_unsharded_bytes) ||
      !reader.number(*node, "merge_ms", where, merge.merge_ms)) {
    return false;
  }
  const Json* runs = reader.array(*node, "runs", where);
  if (runs == nullptr) return false;
  for (std::size_t i = 0; i < runs->size(); ++i) {
    const std::string at = Reader::index(Reader::join(where, "runs"), i);
    const Json& entry = (*runs)[i];
    if (!entry.is_object()) return reader.fail(at, "expected an object");
    MergeRunReport run;
    if (!reader.string(entry, "name", at, run.name) || !reader.integer(entry, "first", at, run.first) ||
        !reader.integer(entry, "count", at, run.count) ||
        !reader.integer(entry, "allgather_elems", at, run.allgather_elems) ||
        !reader.integer(entry, "unsharded_bytes", at, run.unsharded_bytes) ||
        !reader.boolean(entry, "over_budget", at, run.over_budget)) {
      return false;
    }
    merge.runs.push_back(std::move(run));
  }
  out = std::move(merge);
  return true;
}

bool readModelParallel(Reader& reader, const Json& root, std::optional<ModelParallelReport>& out) {
  if (!root.contains("model_parallel")) return true;
  const Json* node = reader.object(root, "model_parallel", "");
  if (node == nullptr) return false;
  ModelParallelReport parallel;
  const std::string where = "model_parallel";
  if (!reader.integer(*node, "tp", where, parallel.tp) || !reader.integer(*node, "ep", where, parallel.ep)) {
    return false;
  }
  const Json* diagnoses = reader.array(*node, "diagnoses", where);
  if (diagnoses == nullptr) return false;
  for (std::size_t i = 0; i < diagnoses->size(); ++i) {
    if (!(*diagnoses)[i].is_string()) return reader.fail(Reader::index(Reader::join(where, "diagnoses"), i), "expected a string");
    parallel.diagnoses.push_back((*diagnoses)[i].get<std::string>());
  }
  out = std::move(parallel);
  return true;
}

bool readReport(Reader& reader, const Json& root, PlanReport& out) {
  if (!root.is_object()) return reader.fail("(top level)", "expected an object");
  if (!reader.integer(root, "devices", "", out.devices) || !reader.string(root, "granularity", "", out.granularity) ||
      !reader.integer(root, "align_elems", "", out.align_elems)) {
    return false;
  }
  const Json* units = reader.array(root, "units", "");
  if (units == nullptr) return false;
  out.units.resize(units->size());
  for (std::size_t i = 0; i < units->size(); ++i) {
    if (!readUnit(reader, (*units)[i], Reader::index("units", i), out.units[i])) return false;
    if (out.units[i].devices == 0) out.units[i].devices = out.devices;  // written only where it differs
  }
  const Json* total = reader.object(root, "total", "");
  if (total == nullptr) return false;
  return reader.integer(*total, "numel", "total", out.total.numel) &&
         reader.integer(*total, "allgather_elems", "total", out.total.allgather_elems) &&
         reader.number(*total, "inflation", "total", out.total.inflation) &&
         reader.number(*total, "lower_bound_inflation", "total", out.total.lower_bound_inflation) &&
         reader.number(*total, "plan_ms", "total", out.total.plan_ms) &&
         reader.string(root, "model", "", out.model, false) &&
         reader.integer(root, "align_bytes", "", out.align_bytes, false) && readMerge(reader, root, out.merge) &&
         readModelParallel(reader, root, out.model_parallel);
}

}  // namespace

std::string writePlanJson(const PlanReport& report) {
  std::string out;
  print(toJson(report), 0, false, out);
  out += '\n';
  return out;
}

Result<PlanReport> readPlanJson(std::string_view text) {
  const Json root = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return makeError(ErrorCode::kInvalidArgument, "plan JSON: not valid JSON");
  Reader reader;
  PlanReport report;
  if (!readReport(reader, root, report)) return reader.takeError();
  return report;
}

}  // namespace dbuf::plan_io
