// Report writers and the JSON reader, in-process on small hand-made units;
// plus dbuf-plan's argument parser.
#include "dbuf/plan_io/report.hpp"

#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "cli.hpp"
#include "dbuf/planner/unit_plan.hpp"

namespace dbuf::plan_io {
namespace {

using planner::GranularityRule;
using planner::TensorSpec;
using planner::UnitSpec;

TensorSpec tensor(std::string name, std::vector<std::int64_t> shape,
                  std::optional<GranularityRule> rule = std::nullopt) {
  TensorSpec spec;
  spec.name = std::move(name);
  spec.shape = std::move(shape);
  spec.granularity = rule;
  return spec;
}

GranularityRule rows(std::int64_t r) {
  return {.kind = GranularityRule::Kind::kRows, .rows = r};
}

/// The design brief's toy unit: A[5,4], B[3,2], C[7], bf16.
UnitSpec toyUnit() {
  return {"toy", {tensor("A", {5, 4}), tensor("B", {3, 2}), tensor("C", {7})}};
}

/// Two identical layers whose bound is close to ceil(N/V), and a unit whose
/// 32-row bands force the bound far above it at 4 or 8 ranks.
std::vector<UnitSpec> smallModel() {
  const UnitSpec layer{"layer.0", {tensor("A", {64, 32}), tensor("B", {32, 16}), tensor("C", {100})}};
  UnitSpec layer1 = layer;
  layer1.name = "layer.1";
  const UnitSpec coarse{"coarse", {tensor("W", {64, 1024}, rows(32)), tensor("norm", {1024})}};
  return {layer, layer1, coarse};
}

PlanReport reportOf(const std::vector<UnitSpec>& units, std::int64_t devices, bool ranks = false) {
  planner::PlanOptions options;
  options.devices = devices;
  auto plan = planner::planModel(units, options);
  EXPECT_TRUE(plan.ok()) << (plan.ok() ? "" : plan.error().message);
  ReportOptions report_options;
  report_options.model = "small";
  report_options.granularity = "element";
  report_options.ranks = ranks;
  auto report = makeReport(*plan, report_options);
  EXPECT_TRUE(report.ok());
  return std::move(report).value();
}

// ------------------------------------------------------------------- JSON --

TEST(CliReportJson, WriteReadWriteIsIdentical) {
  for (const bool ranks : {false, true}) {
    const PlanReport report = reportOf(smallModel(), 8, ranks);
    const std::string text = writePlanJson(report);
    auto read = readPlanJson(text);
    ASSERT_TRUE(read.ok()) << read.error().message;
    EXPECT_EQ(*read, report);
    EXPECT_EQ(writePlanJson(*read), text);
  }
}

TEST(CliReportJson, CarriesTheToyUnitsNumbers) {
  const PlanReport report = reportOf({toyUnit()}, 4);
  ASSERT_EQ(report.units.size(), 1u);
  const UnitReport& toy = report.units[0];
  EXPECT_EQ(toy.numel, 5 * 4 + 3 * 2 + 7);
  EXPECT_EQ(toy.fsdp2.shard_elems, 12);  // the design brief's reference vectors
  EXPECT_EQ(toy.zero3.shard_elems, 9);
  EXPECT_EQ(toy.megatron.shard_elems, 12);
  ASSERT_EQ(toy.tensors.size(), 3u);
  EXPECT_EQ(toy.tensors[0].shape, (std::vector<std::int64_t>{5, 4}));
  EXPECT_EQ(report.total.numel, toy.numel);
  EXPECT_EQ(report.total.allgather_elems, 4 * toy.shard_elems);
  const std::string text = writePlanJson(report);
  EXPECT_NE(text.find("{\"name\": \"A\", \"shape\": [5, 4], \"offset\": "), std::string::npos) << text;
  EXPECT_NE(text.find("\"model\": \"small\""), std::string::npos);
  auto read = readPlanJson(text);
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(writePlanJson(*read), text);
}

TEST(CliReportJson, DiagnosisRoundTrips) {
  const PlanReport report = reportOf(smallModel(), 8);
  const UnitReport& coarse = report.units[2];
  ASSERT_TRUE(coarse.diagnosis.has_value());
  EXPECT_EQ(coarse.diagnosis->forcing_tensors, std::vector<std::string>{"W"});
  auto read = readPlanJson(writePlanJson(report));
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(read->units[2].diagnosis, coarse.diagnosis);
  EXPECT_FALSE(read->units[0].diagnosis.has_value());
}

void expectReadError(const std::string& text, const std::string& needle) {
  auto read = readPlanJson(text);
  ASSERT_FALSE(read.ok()) << "accepted: " << text;
  EXPECT_NE(read.error().message.find(needle), std::string::npos) << read.error().message;
}

std::string replaced(std::string text, const std::string& from, const std::string& to) {
  const auto at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return text;
}

TEST(CliReportJson, ReaderNamesTheBadKey) {
  const std::string good = writePlanJson(reportOf(smallModel(), 4));
  expectReadError("{", "not valid JSON");
  expectReadError("[]", "expected an object");
  expectReadError(replaced(good, "\"devices\": 4", "\"devices\": \"4\""), "devices: expected an integer");
  expectReadError(replaced(good, "\"devices\": 4,", ""), "devices: missing");
  expectReadError(replaced(good, "\"name\": \"layer.0\"", "\"name\": 7"), "units[0].name: expected a string");
  expectReadError(replaced(good, "\"shape\": [64, 32]", "\"shape\": [64, 32.5]"), "units[0].tensors[0].shape[1]");
  expectReadError(replaced(good, "\"fsdp2\": {\"shard_elems\": ", "\"fsdp2\": {\"shard_elems\": null, \"z\": "),
                  "units[0].baselines.fsdp2.shard_elems");
  expectReadError(replaced(good, "\"plan_ms\": ", "\"plan_ms\": \"slow\", \"x\": "), "total.plan_ms");
  expectReadError(replaced(good, "\"offset\": ", "\"offset\": 18446744073709551615, \"y\": "),
                  "units[0].tensors[0].offset: integer out of range");
}

TEST(CliReportJson, ExtraKeysAreOptionalOnRead) {
  const std::string minimal = R"({"devices": 2, "granularity": "element", "align_elems": 8, "units": [
    {"name": "u", "numel": 8, "shard_elems": 8, "lower_bound_elems": 8, "padding_elems": 8, "split_blocks": 0,
     "plan_us": 1, "tensors": [{"name": "t", "shape": [8], "offset": 0, "numel": 8, "granularity_elems": 1}],
     "baselines": {"fsdp2": {"shard_elems": 8, "split_blocks": 0}, "fsdp1": {"shard_elems": 8, "split_blocks": 0},
                   "zero3": {"shard_elems": 8, "split_blocks": 0}, "megatron": {"shard_elems": 8, "split_blocks": 0}}}],
    "total": {"numel": 8, "allgather_elems": 16, "inflation": 2, "lower_bound_inflation": 2, "plan_ms": 0.1},
    "future_key": [1, 2, 3]})";
  auto read = readPlanJson(minimal);
  ASSERT_TRUE(read.ok()) << read.error().message;
  EXPECT_EQ(read->units[0].tensors[0].name, "t");
  EXPECT_DOUBLE_EQ(read->total.inflation, 2.0);
  EXPECT_FALSE(read->units[0].diagnosis.has_value());
}

TEST(CliReportJson, OnlyUnitRestrictsTheReport) {
  planner::PlanOptions options;
  options.devices = 4;
  auto plan = planner::planModel(smallModel(), options);
  ASSERT_TRUE(plan.ok());
  ReportOptions only;
  only.only_unit = "coarse";
  auto one = makeReport(*plan, only);
  ASSERT_TRUE(one.ok());
  ASSERT_EQ(one->units.size(), 1u);
  EXPECT_EQ(one->total.numel, 64 * 1024 + 1024);
  only.only_unit = "nope";
  auto none = makeReport(*plan, only);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.error().message.find("'nope'"), std::string::npos);
}

/// `layers` copies of a unit of one [64, 32] matrix in two 32-row bands: too
/// few blocks for 4 ranks alone (2x of N), balanced in pairs.
std::vector<UnitSpec> bandedLayers(int layers) {
  std::vector<UnitSpec> units;
  for (int i = 0; i < layers; ++i) {
    const std::string name = "layers." + std::to_string(i);
    units.push_back({name, {tensor(name + ".w", {64, 32}, rows(32))}});
  }
  return units;
}

/// The report `dbuf-plan --merge auto` makes: the merged units' plans, and
/// what the merge chose.
PlanReport mergedReportOf(const std::vector<UnitSpec>& units, std::int64_t devices, std::int64_t budget) {
  planner::PlanOptions options;
  options.devices = devices;
  auto merge = planner::planMerges(units, options, {.unsharded_budget_bytes = budget});
  EXPECT_TRUE(merge.ok()) << (merge.ok() ? "" : merge.error().message);
  if (!merge.ok()) return {};
  auto plan = planner::planModel(planner::mergedUnits(units, *merge), options);
  EXPECT_TRUE(plan.ok());
  ReportOptions report_options;
  report_options.model = "banded";
  report_options.granularity = "element";
  auto report = makeReport(*plan, report_options);
  EXPECT_TRUE(report.ok());
  report->merge = makeMergeReport(*merge);
  return std::move(report).value();
}

TEST(CliReportJson, MergeRoundTripsAndMatchesTheUnits) {
  const PlanReport report = mergedReportOf(bandedLayers(6), 4, 1 << 20);
  ASSERT_TRUE(report.merge.has_value());
  const MergeReport& merge = *report.merge;
  EXPECT_EQ(merge.units, 6);
  ASSERT_EQ(merge.runs.size(), 3u);
  ASSERT_EQ(report.units.size(), 3u);
  for (std::size_t r = 0; r < merge.runs.size(); ++r) {
    EXPECT_EQ(merge.runs[r].name, report.units[r].name);
    EXPECT_EQ(merge.runs[r].first, static_cast<std::int64_t>(2 * r));
    EXPECT_EQ(merge.runs[r].count, 2);
    EXPECT_EQ(merge.runs[r].allgather_elems, 4 * report.units[r].shard_elems);
    EXPECT_EQ(merge.runs[r].unsharded_bytes, 2 * merge.runs[r].allgather_elems);  // bf16
  }
  EXPECT_EQ(report.units[0].name, "layers.0+layers.1");
  EXPECT_EQ(merge.allgather_elems, report.total.allgather_elems);
  EXPECT_TRUE(merge.within_target);
  EXPECT_DOUBLE_EQ(merge.inflation, 1.0);
  EXPECT_DOUBLE_EQ(merge.unmerged_inflation, 2.0);
  const std::string text = writePlanJson(report);
  EXPECT_NE(text.find("\"merge\": {\n    \"budget_bytes\": 1048576,"), std::string::npos) << text;
  EXPECT_NE(text.find(R"({"name": "layers.0+layers.1", "first": 0, "count": 2, )"), std::string::npos) << text;
  auto read = readPlanJson(text);
  ASSERT_TRUE(read.ok()) << read.error().message;
  EXPECT_EQ(*read, report);
  EXPECT_EQ(writePlanJson(*read), text);
  expectReadError(replaced(text, "\"within_target\": true", "\"within_target\": 1"), "merge.within_target");
  expectReadError(replaced(text, "\"first\": 2", "\"first\": \"2\""), "merge.runs[1].first");
  // Without --merge auto there is no merge key.
  EXPECT_EQ(writePlanJson(reportOf(smallModel(), 4)).find("\"merge\""), std::string::npos);
}

// ------------------------------------------------------------------ table --

TEST(CliReportTable, MergeSummarySaysWhatMergingCost) {
  const std::string table = writePlanTable(mergedReportOf(bandedLayers(6), 4, 1 << 20));
  for (const char* needle :
       {"layers.0+layers.1", "layers.4+layers.5", "Merged with --merge auto under an unsharded budget of 1.00 MiB",
        "6 units as 3 (3 merges)", "1.0000x N merged, 2.0000x N without merging (within 1.05 N: yes)",
        "peak unsharded buffer per rank: 8.00 KiB merged, 8.00 KiB without merging"}) {
    EXPECT_NE(table.find(needle), std::string::npos) << needle << "\n" << table;
  }
  // A budget below one unit: nothing merges, every unit is named as above it.
  const std::string tight = writePlanTable(mergedReportOf(bandedLayers(3), 4, 4096));
  EXPECT_NE(tight.find("(within 1.05 N: no, the least volume within the budget)"), std::string::npos) << tight;
  EXPECT_NE(tight.find("above the budget alone, kept unmerged: layers.0 (8.00 KiB), layers.1 (8.00 KiB)"),
            std::string::npos)
      << tight;
}

TEST(CliReportTable, RowsTotalsBaselinesAndDiagnosis) {
  const std::string table = writePlanTable(reportOf(smallModel(), 8));
  for (const char* needle : {"layer.0", "layer.1", "coarse", "TOTAL", "ours", "lower bound", "FSDP2", "FSDP1", "ZeRO-3",
                             "Megatron-FSDP", "forced by: W", "model small, 8 ranks"}) {
    EXPECT_NE(table.find(needle), std::string::npos) << needle << "\n" << table;
  }
  // Every table line (header to TOTAL) has the same column separators.
  std::istringstream lines(table);
  std::string line;
  std::vector<std::size_t> bars;
  while (std::getline(lines, line)) {
    if (line.find(" | ") == std::string::npos || line.starts_with("model")) continue;
    bars.push_back(line.find(" | "));
  }
  ASSERT_GE(bars.size(), 5u);
  for (const std::size_t bar : bars) EXPECT_EQ(bar, bars.front()) << table;
}

TEST(CliReportTable, SummaryCollapsesIdenticalUnits) {
  const PlanReport report = reportOf(smallModel(), 4);
  const std::string full = writePlanTable(report);
  const std::string summary = writePlanTable(report, {.summary = true});
  EXPECT_EQ(full.find("(x2)"), std::string::npos);
  EXPECT_NE(summary.find("layer.0 .. layer.1 (x2)"), std::string::npos) << summary;
  // The TOTAL row does not change.
  const auto total = [](const std::string& text) {  // the TOTAL line, runs of spaces squeezed
    const auto at = text.find("TOTAL");
    std::string line;
    for (std::size_t i = at; at != std::string::npos && i < text.size() && text[i] != '\n'; ++i) {
      if (text[i] != ' ' || line.back() != ' ') line += text[i];
    }
    return line;
  };
  EXPECT_FALSE(total(full).empty());
  EXPECT_EQ(total(full), total(summary));
}

TEST(CliReportTable, SaysWhenNoBoundIsFar) {
  const std::string table = writePlanTable(reportOf({smallModel()[0]}, 8));
  EXPECT_NE(table.find("within 5% of ceil(N/V)"), std::string::npos) << table;
}

// -------------------------------------------------------------------- svg --

TEST(CliReportSvg, DrawsTheLargestUnitByDefault) {
  auto svg = writePlanSvg(reportOf(smallModel(), 8));
  ASSERT_TRUE(svg.ok());
  EXPECT_TRUE(svg->starts_with("<svg"));
  EXPECT_TRUE(svg->ends_with("</svg>\n"));
  EXPECT_NE(svg->find("unit coarse"), std::string::npos);
}

TEST(CliReportSvg, UnknownUnitIsAnError) {
  auto svg = writePlanSvg(reportOf(smallModel(), 8), {.unit = "missing"});
  ASSERT_FALSE(svg.ok());
  EXPECT_NE(svg.error().message.find("'missing'"), std::string::npos);
}

TEST(CliReportSvg, BandsAboveMaxRowsAndEscapesNames) {
  UnitSpec unit{"u<&>", {tensor("w<1>&\"x\"", {512, 64}), tensor("b", {64})}};
  const PlanReport report = reportOf({unit}, 200);
  auto svg = writePlanSvg(report, {.unit = "u<&>", .max_rows = 64});
  ASSERT_TRUE(svg.ok());
  EXPECT_NE(svg->find("band of 4 ranks"), std::string::npos);
  EXPECT_NE(svg->find("w&lt;1&gt;&amp;&quot;x&quot;"), std::string::npos);
  EXPECT_EQ(svg->find("w<1>"), std::string::npos);
  auto rows = writePlanSvg(report, {.unit = "u<&>", .max_rows = 256});
  ASSERT_TRUE(rows.ok());
  EXPECT_EQ(rows->find("bands of"), std::string::npos);
}

}  // namespace
}  // namespace dbuf::plan_io

// --------------------------------------------------------- argument parser --

namespace dbuf::plan_cli {
namespace {

Result<CliOptions> parse(std::vector<std::string> args) {
  return parseArgs(args);
}

TEST(CliArgs, DefaultsAndBothValueForms) {
  auto options = parse({"--model", "m.json", "--devices=64"});
  ASSERT_TRUE(options.ok()) << options.error().message;
  EXPECT_EQ(options->model, "m.json");
  EXPECT_EQ(options->devices, 64);
  EXPECT_EQ(options->granularity, "element");
  EXPECT_EQ(options->align_bytes, 16);
  EXPECT_EQ(options->format, "table");
  EXPECT_EQ(options->output, "");
  EXPECT_FALSE(options->ranks);
}

TEST(CliArgs, Errors) {
  EXPECT_FALSE(parse({"--model", "m.json", "--devices", "1048577"}).ok());
  EXPECT_FALSE(parse({"--model", "m.json", "--devices", "8", "--ranks=yes"}).ok());
  EXPECT_FALSE(parse({"--model=", "--devices", "8"}).ok());
  EXPECT_FALSE(parse({"--frob"}).ok());
  EXPECT_TRUE(parse({"--help"}).ok());
  EXPECT_TRUE(parse({"--help"})->help);
  EXPECT_TRUE(parse({"--version"})->version);
}

TEST(CliArgs, MergeAndItsBudget) {
  auto none = parse({"--model", "m.json", "--devices", "8"});
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->merge, "none");
  EXPECT_EQ(none->unsharded_budget, 0);
  auto merged = parse({"--model", "m.json", "--devices", "8", "--merge", "auto", "--unsharded-budget", "4GiB"});
  ASSERT_TRUE(merged.ok()) << merged.error().message;
  EXPECT_EQ(merged->merge, "auto");
  EXPECT_EQ(merged->unsharded_budget, std::int64_t{4} << 30);
  auto inline_form = parse({"--model", "m.json", "--devices", "8", "--merge=auto", "--unsharded-budget=512MiB"});
  ASSERT_TRUE(inline_form.ok());
  EXPECT_EQ(inline_form->unsharded_budget, std::int64_t{512} << 20);
  const auto error = [](std::vector<std::string> args) {
    auto parsed = parse(std::move(args));
    return parsed.ok() ? std::string("accepted") : parsed.error().message;
  };
  EXPECT_NE(error({"--model", "m.json", "--devices", "8", "--merge", "always"}).find("--merge: always not in {none,auto}"),
            std::string::npos);
  EXPECT_NE(error({"--model", "m.json", "--devices", "8", "--merge", "auto"}).find("needs --unsharded-budget"),
            std::string::npos);
  EXPECT_NE(error({"--model", "m.json", "--devices", "8", "--unsharded-budget", "1GiB"}).find("only with --merge"),
            std::string::npos);
  EXPECT_NE(error({"--model", "m.json", "--devices", "8", "--merge", "none", "--unsharded-budget", "1GiB"})
                .find("only with --merge auto"),
            std::string::npos);
}

TEST(CliArgs, ByteCounts) {
  const auto bytes = [](const std::string& text) {
    auto parsed = parseBytes("--unsharded-budget", text);
    return parsed.ok() ? *parsed : -1;
  };
  EXPECT_EQ(bytes("1"), 1);
  EXPECT_EQ(bytes("68719476736"), std::int64_t{64} << 30);
  EXPECT_EQ(bytes("64GiB"), std::int64_t{64} << 30);
  EXPECT_EQ(bytes("512MiB"), std::int64_t{512} << 20);
  EXPECT_EQ(bytes("3KiB"), 3072);
  EXPECT_EQ(bytes("2TiB"), std::int64_t{2} << 40);
  EXPECT_EQ(bytes("80GB"), std::int64_t{80} * 1000 * 1000 * 1000);
  EXPECT_EQ(bytes("5kB"), 5000);
  EXPECT_EQ(bytes("7B"), 7);
  for (const char* bad :
       {"", "0", "0GiB", "-1", "+1", "GiB", "1.5GiB", "12XB", "1 GiB", "1gib", "8388608TiB", "99999999999999999999"}) {
    auto parsed = parseBytes("--unsharded-budget", bad);
    ASSERT_FALSE(parsed.ok()) << "accepted '" << bad << "'";
    EXPECT_NE(parsed.error().message.find("--unsharded-budget: '" + std::string(bad) + "'"), std::string::npos)
        << parsed.error().message;
    EXPECT_NE(parsed.error().message.find("see --help"), std::string::npos);
  }
}

TEST(CliArgs, RunCliReportsOneLine) {
  std::ostringstream out, err;
  const std::vector<std::string> args = {"--devices", "8"};
  EXPECT_EQ(runCli(args, out, err), kExitBadInput);
  EXPECT_EQ(out.str(), "");
  EXPECT_EQ(err.str(), "dbuf-plan: missing --model FILE.json (see --help)\n");
}

}  // namespace
}  // namespace dbuf::plan_cli
