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

#include "dbuf/cli/command_line.hpp"
#include "dbuf/common/build_info.hpp"
#include "dbuf/common/dtype.hpp"
#include "dbuf/plan_io/model_file.hpp"
#include "dbuf/plan_io/report.hpp"
#include "dbuf/planner/granularity.hpp"
#include "dbuf/planner/merge.hpp"
#include "dbuf/planner/unit_plan.hpp"
#include "composed.hpp"

namespace dbuf::plan_cli {
namespace {

using cli::useConventions;

constexpr std::string_view kSeeHelp = " (see --help)";

Error usageError(const std::string& message) {
  return makeError(ErrorCode::kInvalidArgument, message + std::string(kSeeHelp));
}

Result<std::int64_t> parseCount(std::string_view flag, const std::string& text, std::int64_t max) {
  std::int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc() || ptr != end || value <= 0 || value > max) {
    const std::string named = flag.empty() ? std::string() : std::string(flag) + ": ";
    return usageError(named + "'" + text + "' is not an integer between 1 and " + std::to_string(max));
  }
  return value;
}

std::string byteCountHelp(std::string_view flag, const std::string& text, const std::string& why) {
  const std::string named = flag.empty() ? std::string() : std::string(flag) + ": ";
  return named + "'" + text + "' " + why +
         " (a positive number of bytes, optionally with B, KiB, MiB, GiB, TiB, kB, KB, MB, GB or TB)";
}

/// An error of the parsers here as a CLI11 check reports it (CLI11 names the option; "(see --help)" comes
/// with the usage error).
std::string checkMessage(const Error& error) {
  std::string message = error.message;
  if (message.ends_with(kSeeHelp)) message.resize(message.size() - kSeeHelp.size());
  return message;
}

CLI::Validator countUpTo(std::int64_t max) {
  return CLI::Validator(
      [max](std::string& text) {
        auto count = parseCount("", text, max);
        return count ? std::string() : checkMessage(count.error());
      },
      "1.." + std::to_string(max));
}

const CLI::Validator kNonEmpty(
    [](std::string& text) { return text.empty() ? std::string("needs a non-empty value") : std::string(); }, "");

/// Every option of dbuf-plan, bound to `options`: its --help is built from these.
void describe(CLI::App& app, CliOptions& options) {
  useConventions(app);
  app.description(
      "dbuf-plan: plans the RaggedShard layout of every FSDP unit of a model and reports it next to the proven\n"
      "lower bound and the FSDP2 / FSDP1 / ZeRO-3 / Megatron-FSDP baselines. Sizes are in elements of the unit's\n"
      "dtype.");
  app.footer("exit status: 0 success, 2 bad input (the error line names the file, unit and tensor), 1 internal error.");
  const auto count = [&app](const std::string& flag, std::int64_t& target, std::int64_t max, const std::string& help) {
    return app
        .add_option_function<std::string>(
            flag, [&target, max](const std::string& text) { target = *parseCount("", text, max); }, help)
        ->check(countUpTo(max))
        ->type_name("N");
  };
  app.add_option("--model", options.model, "The model file (see models/README.md); required")
      ->type_name("FILE.json")
      ->check(kNonEmpty);
  count("--devices", options.devices, kMaxDevices, "Ranks sharing each unit; required")
      ->type_name("V");
  app.add_option("--granularity", options.granularity,
                 "Default rule for 2D+ tensors without their own:\n"
                 "element | rows:R | block:RxC | matrix | N (elements)")
      ->type_name("RULE")
      ->check(kNonEmpty)
      ->capture_default_str();
  count("--align-bytes", options.align_bytes, kMaxAlignBytes, "Offset and shard alignment in bytes")
      ->type_name("A")
      ->default_str("16");
  app.add_option("--format", options.format, "table | json | svg")
      ->type_name("FMT")
      ->check(CLI::IsMember({"table", "json", "svg"}))
      ->capture_default_str();
  app.add_option("--output", options.output, "Write the report to FILE instead of stdout")
      ->type_name("FILE")
      ->check(kNonEmpty);
  app.add_option("--unit", options.unit,
                 "svg: the unit to draw (default: the largest);\ntable / json: report only this unit")
      ->type_name("NAME")
      ->check(kNonEmpty);
  app.add_flag("--ranks", options.ranks, "json: add every tensor's per-rank slices")->disable_flag_override();
  app.add_flag("--summary", options.summary, "table: one row per run of identical units")->disable_flag_override();
  app.add_option("--merge", options.merge,
                 "none | auto. auto merges consecutive units of one dtype to bring the whole\n"
                 "model's all-gather volume within 5% of N at the smallest peak unsharded buffer\n"
                 "or, where the budget does not allow that, to the least volume. The report's\n"
                 "units are then the merged ones (\"A+B\", \"A..C\"), and it ends with what\n"
                 "merging cost")
      ->type_name("MODE")
      ->check(CLI::IsMember({"none", "auto"}))
      ->capture_default_str();
  count("--tp", options.tp, kMaxDevices,
        "Tensor parallel degree (default: 1). Plans what one tp rank holds of every\n"
        "unit under the Megatron plan (q/k/v, gate/up, lm_head column parallel; o, down\n"
        "row parallel; embeddings by vocabulary; the rest replicated); tp ranks whose\n"
        "chunks differ are reported apart (\"layers.0@tp0-6\", \"layers.0@tp7\"). Ends\n"
        "with the granularities TP makes impossible")
      ->type_name("T");
  count("--ep", options.ep, kMaxDevices,
        "Expert parallel degree (default: 1; divides V and every unit's expert count):\n"
        "a unit's routed experts (\".experts.\" in the name) become a unit of their own\n"
        "(\"layers.3.experts\"), one ep rank's experts whole, sharded over V / E ranks")
      ->type_name("E");
  app.add_option_function<std::string>(
         "--unsharded-budget",
         [&options](const std::string& text) { options.unsharded_budget = *parseBytes("--unsharded-budget", text); },
         "With --merge auto: most bytes per rank of a merged unit's unsharded buffer\n"
         "(V*S elements of its dtype), e.g. 68719476736, 64GiB or 512MiB; a unit larger\n"
         "alone is kept as it is")
      ->type_name("BYTES")
      ->check(CLI::Validator(byteCountProblem, ""));
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
    out << usage();
    return kExitOk;
  }
  if (options.version) {
    out << versionText("dbuf-plan") << "\n";
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

std::string byteCountProblem(const std::string& text) {
  auto bytes = parseBytes("", text);
  return bytes ? std::string() : checkMessage(bytes.error());
}

std::string usage() {
  CliOptions options;
  CLI::App app{"", "dbuf-plan"};
  describe(app, options);
  return app.help();
}

Result<CliOptions> parseArgs(std::span<const std::string> args) {
  CliOptions options;
  CLI::App app{"", "dbuf-plan"};
  describe(app, options);
  try {
    cli::refuseMissingValues(app, args);
    app.parse(std::vector<std::string>(args.rbegin(), args.rend()));  // CLI11 takes them last first
  } catch (const CLI::CallForHelp&) {
    options.help = true;
    return options;
  } catch (const CLI::CallForVersion&) {
    options.version = true;
    return options;
  } catch (const CLI::ParseError& error) {
    return usageError(cli::inPlainWords(error));
  }
  if (app.count("--model") == 0) return usageError("missing --model FILE.json");
  if (app.count("--devices") == 0) return usageError("missing --devices V");
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

}  // namespace dbuf::plan_cli
