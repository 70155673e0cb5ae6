#include "cli.hpp"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <optional>
#include <string_view>
#include <vector>

#include "dbuf/common/dtype.hpp"
#include "dbuf/plan_io/model_file.hpp"
#include "dbuf/plan_io/report.hpp"
#include "dbuf/planner/granularity.hpp"
#include "dbuf/planner/merge.hpp"
#include "dbuf/planner/unit_plan.hpp"
#include "composed.hpp"

namespace dbuf::cli {
namespace {

constexpr const char* kUsage = R"(usage: dbuf-plan --model FILE.json --devices V [options]

Plans the RaggedShard layout of every FSDP unit of a model and reports it next
to the proven lower bound and the FSDP2 / FSDP1 / ZeRO-3 / Megatron-FSDP
baselines. Sizes are in elements of the unit's dtype.

required:
  --model FILE.json     model file (see models/README.md)
  --devices V           ranks sharing each unit (1 .. 1048576)

options:
  --granularity RULE    default rule for 2D+ tensors without their own:
                        element | rows:R | block:RxC | matrix | N (elements)
                        (default: element)
  --align-bytes A       offset and shard alignment in bytes (default: 16)
  --format FMT          table | json | svg (default: table)
  --output FILE         write the report to FILE instead of stdout
  --unit NAME           svg: the unit to draw (default: the largest);
                        table / json: report only this unit
  --ranks               json: add every tensor's per-rank slices
  --summary             table: one row per run of identical units
  --merge MODE          none | auto (default: none). auto merges consecutive
                        units of one dtype to bring the whole model's
                        all-gather volume within 5% of N at the smallest peak
                        unsharded buffer or, where the budget does not allow
                        that, to the least volume. The report's units are
                        then the merged ones ("A+B", "A..C"), and it ends
                        with what merging cost
  --tp T                tensor parallel degree (default: 1). Plans what one tp
                        rank holds of every unit under the Megatron plan
                        (q/k/v, gate/up, lm_head column parallel; o, down
                        row parallel; embeddings by vocabulary; the rest
                        replicated); tp ranks whose chunks differ are
                        reported apart ("layers.0@tp0-6", "layers.0@tp7").
                        Ends with the granularities TP makes impossible
  --ep E                expert parallel degree (default: 1; divides V and
                        every unit's expert count): a unit's routed experts
                        (".experts." in the name) become a unit of their
                        own ("layers.3.experts"), one ep rank's experts
                        whole, sharded over V / E ranks (torchtitan's EP)
  --unsharded-budget BYTES
                        with --merge auto: most bytes per rank of a merged
                        unit's unsharded buffer (V*S elements of its dtype),
                        e.g. 68719476736, 64GiB or 512MiB; a unit larger
                        alone is kept as it is
  --help                print this text

exit status: 0 success, 2 bad input (the error line names the file, unit and
tensor), 1 internal error.
)";

Error usageError(const std::string& message) {
  return makeError(ErrorCode::kInvalidArgument, message + " (see --help)");
}

Result<std::int64_t> parseCount(std::string_view flag, const std::string& text, std::int64_t max) {
  std::int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc() || ptr != end || value <= 0 || value > max) {
    return usageError(std::string(flag) + ": '" + text + "' is not an integer between 1 and " + std::to_string(max));
  }
  return value;
}

std::string byteCountHelp(std::string_view flag, const std::string& text, const std::string& why) {
  return std::string(flag) + ": '" + text + "' " + why +
         " (a positive number of bytes, optionally with B, KiB, MiB, GiB, TiB, kB, KB, MB, GB or TB)";
}

/// Writes `text` to `path`; the error names the file and the reason.
Result<void> writeFile(const std::string& path, const std::string& text) {
  errno = 0;
  std::FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr) {
    return makeError(ErrorCode::kIo, path + ": cannot write output file: " + std::strerror(errno));
  }
  const std::size_t written = std::fwrite(text.data(), 1, text.size(), file);
  const int write_error = errno;
  if (std::fclose(file) != 0 || written != text.size()) {
    const int error = write_error != 0 ? write_error : errno;
    return makeError(ErrorCode::kIo, path + ": cannot write output file: " + std::strerror(error));
  }
  return {};
}

/// --unit names a unit of the model file (checked before planning).
Result<void> findUnit(const std::vector<planner::UnitSpec>& units, const CliOptions& options) {
  if (options.unit.empty()) return {};
  for (const planner::UnitSpec& unit : units) {
    if (unit.name == options.unit) return {};
  }
  return makeError(ErrorCode::kNotFound, options.model + ": no unit named '" + options.unit + "'");
}

/// With --merge auto, --unit names a unit of the merged model: a model unit
/// merged with others goes by the name of the run that holds it.
Result<void> findMergedUnit(const std::vector<planner::UnitSpec>& units, const planner::MergePlan& plan,
                            const CliOptions& options) {
  if (options.unit.empty()) return {};
  for (const planner::MergedRun& run : plan.runs) {
    if (run.plan.name == options.unit) return {};
  }
  for (const planner::MergedRun& run : plan.runs) {
    for (std::size_t u = run.first; u < run.first + run.count; ++u) {
      if (units[u].name != options.unit) continue;
      return makeError(ErrorCode::kNotFound, options.model + ": unit '" + options.unit + "' is merged into '" +
                                                 run.plan.name + "' (--merge auto); --unit takes that name");
    }
  }
  return makeError(ErrorCode::kNotFound, options.model + ": no unit named '" + options.unit + "'");
}

int fail(std::ostream& err, const Error& error) {
  err << "dbuf-plan: " << error.message << "\n";
  return error.code == ErrorCode::kInternal ? kExitInternal : kExitBadInput;
}

int run(std::span<const std::string> args, std::ostream& out, std::ostream& err) {
  auto parsed = parseArgs(args);
  if (!parsed) return fail(err, parsed.error());
  const CliOptions& options = *parsed;
  if (options.help) {
    out << kUsage;
    return kExitOk;
  }
  auto rule = planner::GranularityRule::parse(options.granularity);
  if (!rule) return fail(err, std::move(rule).error().withContext("--granularity"));

  auto model = plan_io::loadModelFile(options.model);
  if (!model) return fail(err, model.error());
  const planner::ModelParallelism parallelism{.tp = options.tp, .ep = options.ep};
  const bool composing = options.tp > 1 || options.ep > 1;
  std::vector<ComposedUnit> composed;
  if (composing) {
    auto units = composedUnits(model->units, parallelism);
    if (!units) return fail(err, std::move(units).error().withContext(options.model));
    composed = std::move(*units);
    std::vector<planner::UnitSpec> specs;
    for (const ComposedUnit& unit : composed) specs.push_back(unit.unit);
    if (auto found = findUnit(specs, options); !found) return fail(err, found.error());
  } else if (options.merge != "auto") {  // with --merge auto, --unit names a merged unit: checked after merging
    if (auto found = findUnit(model->units, options); !found) return fail(err, found.error());
  }

  // The planner checks this too, but cannot say which flag and dtype clash.
  for (const planner::UnitSpec& unit : model->units) {
    const DType dtype = unit.tensors.front().dtype;
    if (options.align_bytes % sizeBytes(dtype) != 0) {
      return fail(err, makeError(ErrorCode::kInvalidArgument,
                                 options.model + ": unit '" + unit.name + "': --align-bytes " +
                                     std::to_string(options.align_bytes) + " is not a multiple of the " +
                                     std::string(toString(dtype)) + " element size (" +
                                     std::to_string(sizeBytes(dtype)) + " bytes)"));
    }
  }

  planner::PlanOptions plan_options;
  plan_options.devices = options.devices;
  plan_options.default_rule = *rule;
  plan_options.align_bytes = options.align_bytes;
  // --merge auto: the units planned and reported are the merged ones.
  std::optional<planner::MergePlan> merge;
  std::vector<planner::UnitSpec> merged_units;
  if (options.merge == "auto") {
    auto merged = planner::planMerges(model->units, plan_options, {.unsharded_budget_bytes = options.unsharded_budget});
    if (!merged) return fail(err, std::move(merged).error().withContext(options.model));
    merged_units = planner::mergedUnits(model->units, *merged);
    merge = std::move(*merged);
    if (auto found = findMergedUnit(model->units, *merge, options); !found) return fail(err, found.error());
  }
  auto plan = composing ? planComposed(composed, plan_options, options.ep)
                        : planner::planModel(merge ? merged_units : model->units, plan_options);
  if (!plan) return fail(err, std::move(plan).error().withContext(options.model));

  plan_io::ReportOptions report_options;
  report_options.model = model->model;
  report_options.granularity = options.granularity;
  report_options.align_bytes = options.align_bytes;
  report_options.ranks = options.ranks;
  // svg draws one unit out of the whole report; the other formats report only it.
  if (options.format != "svg") report_options.only_unit = options.unit;
  auto report = plan_io::makeReport(*plan, report_options);
  if (!report) return fail(err, std::move(report).error().withContext(options.model));
  if (merge) report->merge = plan_io::makeMergeReport(*merge);
  if (composing) {
    report->model_parallel = modelParallelReport(model->units, parallelism, *rule);
  }

  std::string text;
  if (options.format == "json") {
    text = plan_io::writePlanJson(*report);
  } else if (options.format == "svg") {
    auto svg = plan_io::writePlanSvg(*report, {.unit = options.unit, .max_rows = 64});
    if (!svg) return fail(err, std::move(svg).error().withContext(options.model));
    text = std::move(*svg);
  } else {
    text = plan_io::writePlanTable(*report, {.summary = options.summary});
  }

  if (options.output.empty()) {
    out << text;
    out.flush();
    if (!out) return fail(err, makeError(ErrorCode::kIo, "cannot write to standard output"));
    return kExitOk;
  }
  if (auto written = writeFile(options.output, text); !written) return fail(err, written.error());
  return kExitOk;
}

}  // namespace

Result<std::int64_t> parseBytes(std::string_view flag, const std::string& text) {
  struct Unit {
    std::string_view suffix;
    std::int64_t factor;
  };
  static constexpr Unit kUnits[] = {
      {"", 1},
      {"B", 1},
      {"KiB", std::int64_t{1} << 10},
      {"MiB", std::int64_t{1} << 20},
      {"GiB", std::int64_t{1} << 30},
      {"TiB", std::int64_t{1} << 40},
      {"kB", 1000},
      {"KB", 1000},
      {"MB", 1000 * 1000},
      {"GB", std::int64_t{1000} * 1000 * 1000},
      {"TB", std::int64_t{1000} * 1000 * 1000 * 1000},
  };
  std::int64_t number = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, number);
  if (text.empty() || ptr == text.data() || text.front() == '-' || text.front() == '+') {
    return usageError(byteCountHelp(flag, text, "is not a size"));
  }
  if (ec == std::errc::result_out_of_range) return usageError(byteCountHelp(flag, text, "is too large"));
  const std::string_view suffix(ptr, static_cast<std::size_t>(end - ptr));
  for (const Unit& unit : kUnits) {
    if (unit.suffix != suffix) continue;
    if (number <= 0) return usageError(byteCountHelp(flag, text, "is not positive"));
    if (number > std::numeric_limits<std::int64_t>::max() / unit.factor) {
      return usageError(byteCountHelp(flag, text, "is too large"));
    }
    return number * unit.factor;
  }
  return usageError(byteCountHelp(flag, text, "has an unknown unit"));
}

const char* usage() noexcept {
  return kUsage;
}

Result<CliOptions> parseArgs(std::span<const std::string> args) {
  CliOptions options;
  bool seen_devices = false;
  std::vector<std::string> seen;
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string flag = args[i];
    std::optional<std::string> inline_value;
    if (const auto equals = flag.find('='); flag.starts_with("--") && equals != std::string::npos) {
      inline_value = flag.substr(equals + 1);
      flag.resize(equals);
    }
    const bool is_switch = flag == "--help" || flag == "-h" || flag == "--ranks" || flag == "--summary";
    const bool is_option = flag == "--model" || flag == "--devices" || flag == "--granularity" ||
                           flag == "--align-bytes" || flag == "--format" || flag == "--output" || flag == "--unit" ||
                           flag == "--merge" || flag == "--unsharded-budget" || flag == "--tp" || flag == "--ep";
    if (!is_switch && !is_option) {
      if (!flag.starts_with("-")) return usageError("unexpected argument '" + args[i] + "'");
      return usageError("unknown option '" + flag + "'");
    }
    for (const std::string& before : seen) {
      if (before == flag) return usageError(flag + " given more than once");
    }
    seen.push_back(flag);
    if (is_switch) {
      if (inline_value) return usageError(flag + " takes no value");
      if (flag == "--ranks") {
        options.ranks = true;
      } else if (flag == "--summary") {
        options.summary = true;
      } else {
        options.help = true;
      }
      continue;
    }
    std::string value;
    if (inline_value) {
      value = *inline_value;
    } else {
      // A following option is not a value: `--devices --model x` is a missing value.
      if (i + 1 >= args.size() || args[i + 1].starts_with("--")) return usageError(flag + " needs a value");
      value = args[++i];
    }
    if (value.empty()) return usageError(flag + " needs a non-empty value");
    if (flag == "--model") {
      options.model = value;
    } else if (flag == "--devices") {
      auto devices = parseCount(flag, value, kMaxDevices);
      if (!devices) return std::move(devices).error();
      options.devices = *devices;
      seen_devices = true;
    } else if (flag == "--granularity") {
      options.granularity = value;
    } else if (flag == "--align-bytes") {
      auto align = parseCount(flag, value, kMaxAlignBytes);
      if (!align) return std::move(align).error();
      options.align_bytes = *align;
    } else if (flag == "--format") {
      if (value != "table" && value != "json" && value != "svg") {
        return usageError("--format: '" + value + "' is not one of table, json, svg");
      }
      options.format = value;
    } else if (flag == "--output") {
      options.output = value;
    } else if (flag == "--merge") {
      if (value != "none" && value != "auto") return usageError("--merge: '" + value + "' is not one of none, auto");
      options.merge = value;
    } else if (flag == "--tp" || flag == "--ep") {
      auto degree = parseCount(flag, value, kMaxDevices);
      if (!degree) return std::move(degree).error();
      (flag == "--tp" ? options.tp : options.ep) = *degree;
    } else if (flag == "--unsharded-budget") {
      auto budget = parseBytes(flag, value);
      if (!budget) return std::move(budget).error();
      options.unsharded_budget = *budget;
    } else {
      options.unit = value;
    }
  }
  if (options.help) return options;
  if (options.model.empty()) return usageError("missing --model FILE.json");
  if (!seen_devices) return usageError("missing --devices V");
  if (options.merge == "auto" && options.unsharded_budget == 0) {
    return usageError("--merge auto needs --unsharded-budget BYTES");
  }
  if (options.merge != "auto" && options.unsharded_budget != 0) {
    return usageError("--unsharded-budget applies only with --merge auto");
  }
  if (options.merge == "auto" && (options.tp > 1 || options.ep > 1)) {
    return usageError("--merge auto does not take --tp / --ep");
  }
  if (options.devices % options.ep != 0) {
    return usageError("--ep " + std::to_string(options.ep) + " does not divide --devices " +
                      std::to_string(options.devices) + " (a unit of experts is sharded over V / E ranks)");
  }
  return options;
}

int runCli(std::span<const std::string> args, std::ostream& out, std::ostream& err) {
  try {
    return run(args, out, err);
  } catch (const std::exception& error) {  // bad_alloc and the like: say so, do not crash
    err << "dbuf-plan: internal error: " << error.what() << "\n";
    return kExitInternal;
  }
}

}  // namespace dbuf::cli
