// dbuf-plan driven as a real child process: every bad input is one error line
// naming what is wrong and exit status 2; good inputs give valid plans in
// every format.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dbuf/common/build_info.hpp"
#include "dbuf/plan_io/report.hpp"
#include "support/child_process.hpp"
#include "support/temp_dir.hpp"
#include "support/text.hpp"

namespace dbuf::testing {
namespace {

using Json = nlohmann::ordered_json;

const std::string kExe = DBUF_PLAN_EXE;
const std::string kModels = DBUF_MODELS_DIR;
const std::string kLlama = kModels + "/llama3-8b.json";

ChildResult plan(const std::vector<std::string>& args) {
  return runChild(kExe, args);
}

/// Exit status 2, nothing on stdout, exactly one line on stderr, containing
/// every one of `needles`.
void expectBadInput(const ChildResult& result, const std::vector<std::string>& needles) {
  EXPECT_FALSE(result.timed_out);
  EXPECT_EQ(result.signal, 0) << "crashed; stderr: " << result.err;
  EXPECT_EQ(result.exit_code, 2) << "stderr: " << result.err;
  EXPECT_EQ(result.out, "");
  ASSERT_FALSE(result.err.empty());
  EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << result.err;
  EXPECT_EQ(result.err.back(), '\n');
  for (const std::string& needle : needles) {
    EXPECT_NE(result.err.find(needle), std::string::npos) << "'" << needle << "' not in: " << result.err;
  }
}

void expectOk(const ChildResult& result) {
  ASSERT_FALSE(result.timed_out);
  ASSERT_EQ(result.signal, 0) << result.err;
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_EQ(result.err, "");
}

/// A model file with one unit holding `tensors` (a JSON array's text).
std::string modelWith(const std::string& tensors, const std::string& unit = "blk") {
  return R"({"model": "bad", "fsdp_units": [{"name": ")" + unit + R"(", "tensors": )" + tensors + "}]}";
}

// ------------------------------------------------------------ usage errors --

TEST(CliUsage, NoArgumentsAsksForTheModel) {
  expectBadInput(plan({}), {"--model"});
}

TEST(CliUsage, MissingDevices) {
  expectBadInput(plan({"--model", kLlama}), {"--devices"});
}

TEST(CliUsage, UnknownFlag) {
  expectBadInput(plan({"--model", kLlama, "--devices", "8", "--frobnicate"}), {"unknown option", "--frobnicate"});
}

TEST(CliUsage, StrayArgument) {
  expectBadInput(plan({"--model", kLlama, "--devices", "8", "extra"}), {"unexpected argument", "extra"});
}

TEST(CliUsage, MissingValueAtTheEnd) {
  expectBadInput(plan({"--model", kLlama, "--devices"}), {"--devices", "needs a value"});
}

TEST(CliUsage, MissingValueBeforeAnotherFlag) {
  expectBadInput(plan({"--devices", "--model", kLlama}), {"--devices", "needs a value"});
}

TEST(CliUsage, NonNumericDevices) {
  expectBadInput(plan({"--model", kLlama, "--devices", "eight"}), {"--devices", "'eight'"});
  expectBadInput(plan({"--model", kLlama, "--devices", "8x"}), {"--devices", "'8x'"});
}

TEST(CliUsage, ZeroAndNegativeDevices) {
  expectBadInput(plan({"--model", kLlama, "--devices", "0"}), {"--devices", "'0'"});
  expectBadInput(plan({"--model", kLlama, "--devices", "-4"}), {"--devices", "'-4'"});
  expectBadInput(plan({"--model", kLlama, "--devices=-4"}), {"--devices", "'-4'"});
}

TEST(CliUsage, HugeDevices) {
  expectBadInput(plan({"--model", kLlama, "--devices", "99999999999999999999"}), {"--devices"});
}

TEST(CliUsage, UnknownGranularityRule) {
  expectBadInput(plan({"--model", kLlama, "--devices", "8", "--granularity", "tiles:4"}),
                 {"--granularity", "'tiles:4'"});
  expectBadInput(plan({"--model", kLlama, "--devices", "8", "--granularity", "rows:0"}), {"--granularity", "rows:0"});
}

TEST(CliUsage, UnknownFormat) {
  expectBadInput(plan({"--model", kLlama, "--devices", "8", "--format", "xml"}), {"--format", "xml not in {table,json,svg}"});
}

TEST(CliUsage, BadAlignment) {
  expectBadInput(plan({"--model", kLlama, "--devices", "8", "--align-bytes", "0"}), {"--align-bytes"});
  // 3 bytes is not a multiple of bf16's 2.
  expectBadInput(plan({"--model", kLlama, "--devices", "8", "--align-bytes", "3"}),
                 {kLlama, "unit 'embed'", "--align-bytes 3", "bf16"});
}

TEST(CliUsage, FlagGivenTwice) {
  expectBadInput(plan({"--model", kLlama, "--devices", "8", "--devices", "16"}), {"--devices", "more than once"});
}

TEST(CliUsage, UnknownUnit) {
  expectBadInput(plan({"--model", kLlama, "--devices", "8", "--format", "svg", "--unit", "layers.99"}),
                 {kLlama, "'layers.99'"});
}

TEST(CliUsage, UnknownMergeMode) {
  expectBadInput(plan({"--model", kLlama, "--devices", "8", "--merge", "always"}), {"--merge", "always not in {none,auto}"});
}

TEST(CliUsage, MergeAutoNeedsABudgetAndABudgetNeedsMergeAuto) {
  expectBadInput(plan({"--model", kLlama, "--devices", "8", "--merge", "auto"}), {"--unsharded-budget"});
  expectBadInput(plan({"--model", kLlama, "--devices", "8", "--unsharded-budget", "1GiB"}), {"--merge auto"});
}

TEST(CliUsage, BadUnshardedBudget) {
  for (const char* bad : {"0", "-1", "1.5GiB", "12XB", "lots", "99999999999999999999"}) {
    expectBadInput(plan({"--model", kLlama, "--devices", "8", "--merge", "auto", "--unsharded-budget", bad}),
                   {"--unsharded-budget", "'" + std::string(bad) + "'"});
  }
}

TEST(CliUsage, UnitMergedIntoALargerOne) {
  // At 1024 ranks with rows:32, Llama-3-8B's layers merge within 16 GiB.
  expectBadInput(plan({"--model", kLlama, "--devices", "1024", "--granularity", "rows:32", "--merge", "auto",
                       "--unsharded-budget", "16GiB", "--unit", "layers.5"}),
                 {kLlama, "'layers.5' is merged into 'layers.0..final'"});
  expectBadInput(plan({"--model", kLlama, "--devices", "8", "--merge", "auto", "--unsharded-budget", "16GiB", "--unit",
                       "layers.99"}),
                 {kLlama, "no unit named 'layers.99'"});
}

TEST(CliUsage, HelpGoesToStdout) {
  const ChildResult result = plan({"--help"});
  expectOk(result);
  EXPECT_NE(result.out.find("Usage: dbuf-plan [OPTIONS]"), std::string::npos);
  EXPECT_NE(result.out.find("--granularity"), std::string::npos);
  EXPECT_NE(result.out.find("--merge MODE"), std::string::npos);
  EXPECT_NE(result.out.find("--unsharded-budget BYTES"), std::string::npos);
}

TEST(CliUsage, VersionNamesTheBuild) {
  const ChildResult result = plan({"--version"});
  expectOk(result);
  EXPECT_TRUE(result.out.starts_with("dbuf-plan " + std::string(buildInfo().version) + " (commit " +
                                     std::string(buildInfo().commit) + ")\n"))
      << result.out;
}

// ------------------------------------------------------- model file errors --

TEST(CliModelFile, NonexistentFile) {
  const TempDir dir;
  const std::string path = (dir.path() / "missing.json").string();
  expectBadInput(plan({"--model", path, "--devices", "8"}), {path, "cannot open", "No such file"});
}

TEST(CliModelFile, DirectoryInsteadOfFile) {
  const TempDir dir;
  expectBadInput(plan({"--model", dir.path().string(), "--devices", "8"}), {dir.path().string(), "directory"});
}

TEST(CliModelFile, MalformedJson) {
  const TempDir dir;
  const std::string path = dir.write("broken.json", "{\"model\": \"x\", \"fsdp_units\": [\n  {\"name\": }\n]}");
  expectBadInput(plan({"--model", path, "--devices", "8"}), {path, "not valid JSON", "line 2"});
}

TEST(CliModelFile, EmptyFile) {
  const TempDir dir;
  const std::string path = dir.write("empty.json", "");
  expectBadInput(plan({"--model", path, "--devices", "8"}), {path, "not valid JSON"});
}

TEST(CliModelFile, WrongTopLevel) {
  const TempDir dir;
  const std::string path = dir.write("array.json", "[1, 2]");
  expectBadInput(plan({"--model", path, "--devices", "8"}), {path, "object"});
  const std::string no_units = dir.write("nounits.json", R"({"model": "x"})");
  expectBadInput(plan({"--model", no_units, "--devices", "8"}), {no_units, "fsdp_units"});
}

TEST(CliModelFile, UnknownDtype) {
  const TempDir dir;
  const std::string path =
      dir.write("dtype.json", modelWith(R"([{"name": "w", "shape": [4, 4], "dtype": "fp7"}])", "layer.0"));
  expectBadInput(plan({"--model", path, "--devices", "2"}), {path, "unit 'layer.0'", "tensor 'w'", "dtype 'fp7'"});
}

TEST(CliModelFile, ZeroDimension) {
  const TempDir dir;
  const std::string path = dir.write(
      "zero.json",
      modelWith(R"([{"name": "ok", "shape": [4], "dtype": "bf16"}, {"name": "w", "shape": [4, 0], "dtype": "bf16"}])"));
  expectBadInput(plan({"--model", path, "--devices", "2"}), {path, "unit 'blk'", "tensor 'w'", "dimension 0"});
}

TEST(CliModelFile, NegativeDimension) {
  const TempDir dir;
  const std::string path = dir.write("neg.json", modelWith(R"([{"name": "w", "shape": [-3, 4], "dtype": "bf16"}])"));
  expectBadInput(plan({"--model", path, "--devices", "2"}), {path, "unit 'blk'", "tensor 'w'", "dimension -3"});
}

TEST(CliModelFile, NonIntegerDimension) {
  const TempDir dir;
  const std::string path = dir.write("float.json", modelWith(R"([{"name": "w", "shape": [2.5, 4]}])"));
  expectBadInput(plan({"--model", path, "--devices", "2"}), {path, "unit 'blk'", "tensor 'w'", "shape"});
}

TEST(CliModelFile, EmptyUnit) {
  const TempDir dir;
  const std::string path = dir.write("empty_unit.json", modelWith("[]", "layers.7"));
  expectBadInput(plan({"--model", path, "--devices", "2"}), {path, "unit 'layers.7'", "no tensors"});
}

TEST(CliModelFile, MixedDtypesInOneUnit) {
  const TempDir dir;
  const std::string path = dir.write(
      "mixed.json",
      modelWith(R"([{"name": "a", "shape": [4], "dtype": "bf16"}, {"name": "b", "shape": [4], "dtype": "fp32"}])"));
  expectBadInput(plan({"--model", path, "--devices", "2"}), {path, "unit 'blk'", "tensor 'b'", "dtype"});
}

TEST(CliModelFile, PerTensorRuleThatDoesNotDivide) {
  const TempDir dir;
  const std::string path = dir.write(
      "rule.json", modelWith(R"([{"name": "w", "shape": [4, 4], "dtype": "bf16", "granularity": 5}])", "layer.0"));
  expectBadInput(plan({"--model", path, "--devices", "2"}), {path, "unit 'layer.0'", "tensor 'w'", "does not divide"});
}

TEST(CliModelFile, PerTensorUnknownRule) {
  const TempDir dir;
  const std::string path =
      dir.write("rule.json", modelWith(R"([{"name": "w", "shape": [4, 4], "granularity": "diagonal"}])"));
  expectBadInput(plan({"--model", path, "--devices", "2"}), {path, "unit 'blk'", "tensor 'w'", "'diagonal'"});
}

TEST(CliModelFile, DefaultRuleThatDoesNotDivide) {
  // 7 divides no tensor of Llama-3-8B; the first 2D tensor is the embedding.
  expectBadInput(plan({"--model", kLlama, "--devices", "8", "--granularity", "7"}),
                 {kLlama, "unit 'embed'", "tensor 'model.embed_tokens.weight'", "does not divide"});
}

TEST(CliOutputFile, UnwritableOutput) {
  const TempDir dir;
  const std::string path = (dir.path() / "no-such-dir" / "plan.json").string();
  expectBadInput(plan({"--model", kLlama, "--devices", "8", "--format", "json", "--output", path}),
                 {path, "cannot write"});
  // A directory is not writable as a file either (this holds for root too).
  expectBadInput(plan({"--model", kLlama, "--devices", "8", "--output", dir.path().string()}),
                 {dir.path().string(), "cannot write"});
}

// ------------------------------------------------------------ good outputs --

plan_io::PlanReport readJsonOutput(const ChildResult& result) {
  auto report = plan_io::readPlanJson(result.out);
  EXPECT_TRUE(report.ok()) << (report.ok() ? "" : report.error().message);
  return report.ok() ? std::move(report).value() : plan_io::PlanReport{};
}

/// The layout rules of DESIGN.md section 3, checked on the report alone.
void expectValidPlan(const plan_io::PlanReport& report) {
  ASSERT_FALSE(report.units.empty());
  const std::int64_t v = report.devices;
  std::int64_t numel = 0, allgather = 0;
  for (const plan_io::UnitReport& unit : report.units) {
    SCOPED_TRACE("unit " + unit.name);
    const std::int64_t s = unit.shard_elems;
    EXPECT_GE(s, unit.lower_bound_elems);
    EXPECT_EQ(unit.split_blocks, 0);
    EXPECT_EQ(s % unit.align_elems, 0);
    EXPECT_EQ(unit.padding_elems, v * s - unit.numel);
    std::vector<std::pair<std::int64_t, std::int64_t>> spans;
    std::int64_t unit_numel = 0;
    for (const plan_io::TensorReport& tensor : unit.tensors) {
      SCOPED_TRACE("tensor " + tensor.name);
      EXPECT_GE(tensor.offset, 0);
      EXPECT_LE(tensor.offset + tensor.numel, v * s);
      EXPECT_EQ(tensor.offset % unit.align_elems, 0);
      std::int64_t product = 1;
      for (const std::int64_t dim : tensor.shape) product *= dim;
      EXPECT_EQ(product, tensor.numel);
      // No shard boundary inside a block.
      for (std::int64_t b = (tensor.offset / s + 1) * s; b < tensor.offset + tensor.numel; b += s) {
        EXPECT_EQ((b - tensor.offset) % tensor.granularity_elems, 0) << "boundary " << b;
      }
      spans.emplace_back(tensor.offset, tensor.offset + tensor.numel);
      unit_numel += tensor.numel;
    }
    std::sort(spans.begin(), spans.end());
    for (std::size_t i = 1; i < spans.size(); ++i) EXPECT_LE(spans[i - 1].second, spans[i].first) << "overlap";
    EXPECT_EQ(unit_numel, unit.numel);
    numel += unit.numel;
    allgather += v * s;
  }
  EXPECT_EQ(report.total.numel, numel);
  EXPECT_EQ(report.total.allgather_elems, allgather);
  EXPECT_DOUBLE_EQ(report.total.inflation, static_cast<double>(allgather) / static_cast<double>(numel));
}

std::vector<std::string> keysOf(const Json& object) {
  std::vector<std::string> keys;
  for (const auto& item : object.items()) keys.push_back(item.key());
  return keys;
}

/// `keys` appear first, in this order (extra keys may follow).
void expectLeadingKeys(const Json& object, const std::vector<std::string>& keys) {
  const std::vector<std::string> actual = keysOf(object);
  ASSERT_GE(actual.size(), keys.size());
  EXPECT_EQ(std::vector<std::string>(actual.begin(), actual.begin() + static_cast<std::ptrdiff_t>(keys.size())), keys);
}

TEST(CliJson, Llama8bAt8DevicesIsValidWithDocumentedKeys) {
  const ChildResult result = plan({"--model", kLlama, "--devices", "8", "--format", "json"});
  expectOk(result);
  const Json root = Json::parse(result.out, nullptr, false);
  ASSERT_FALSE(root.is_discarded());
  expectLeadingKeys(root, {"devices", "granularity", "align_elems", "units", "total"});
  EXPECT_EQ(root["devices"], 8);
  EXPECT_EQ(root["granularity"], "element");
  EXPECT_EQ(root["align_elems"], 8);  // 16 bytes of bf16
  ASSERT_EQ(root["units"].size(), 34u);
  const Json& unit = root["units"][1];
  expectLeadingKeys(unit, {"name", "numel", "shard_elems", "lower_bound_elems", "padding_elems", "split_blocks",
                           "plan_us", "tensors", "baselines"});
  expectLeadingKeys(unit["tensors"][0], {"name", "shape", "offset", "numel", "granularity_elems"});
  expectLeadingKeys(unit["baselines"], {"fsdp2", "fsdp1", "zero3", "megatron"});
  for (const char* baseline : {"fsdp2", "fsdp1", "zero3", "megatron"}) {
    expectLeadingKeys(unit["baselines"][baseline], {"shard_elems", "split_blocks"});
  }
  expectLeadingKeys(root["total"], {"numel", "allgather_elems", "inflation", "lower_bound_inflation", "plan_ms"});
  EXPECT_EQ(root["total"]["numel"], 8030261248);  // Llama-3-8B: 8.03B parameters

  const plan_io::PlanReport report = readJsonOutput(result);
  expectValidPlan(report);
}

TEST(CliJson, BlockRuleAtManyRanksIsValid) {
  const ChildResult result = plan({"--model", kLlama, "--devices=256", "--granularity=block:128x128", "--format=json"});
  expectOk(result);
  const plan_io::PlanReport report = readJsonOutput(result);
  EXPECT_EQ(report.granularity, "block:128x128");
  expectValidPlan(report);
  for (const plan_io::UnitReport& unit : report.units) {
    for (const plan_io::TensorReport& tensor : unit.tensors) {
      if (tensor.shape.size() == 2) {
        EXPECT_EQ(tensor.granularity_elems, 128 * tensor.shape[1]) << tensor.name;
      }
    }
  }
}

TEST(CliJson, RoundTripIsIdentical) {
  const ChildResult result = plan(
      {"--model", kModels + "/gpt-oss-20b.json", "--devices", "64", "--granularity", "rows:32", "--format", "json"});
  expectOk(result);
  const plan_io::PlanReport report = readJsonOutput(result);
  EXPECT_EQ(plan_io::writePlanJson(report), result.out);
}

TEST(CliJson, RanksListEveryRankSlice) {
  const ChildResult result =
      plan({"--model", kLlama, "--devices", "8", "--format", "json", "--ranks", "--unit", "layers.0"});
  expectOk(result);
  const plan_io::PlanReport report = readJsonOutput(result);
  ASSERT_EQ(report.units.size(), 1u);  // --unit restricts json to that unit
  const plan_io::UnitReport& unit = report.units[0];
  EXPECT_EQ(unit.name, "layers.0");
  EXPECT_EQ(report.total.numel, unit.numel);
  EXPECT_EQ(plan_io::writePlanJson(report), result.out);
  const std::int64_t s = unit.shard_elems;
  for (const plan_io::TensorReport& tensor : unit.tensors) {
    SCOPED_TRACE(tensor.name);
    ASSERT_TRUE(tensor.ranks.has_value());
    std::int64_t covered = 0;
    for (const plan_io::RankSliceReport& slice : *tensor.ranks) {
      EXPECT_EQ(slice.begin, covered);  // slices tile the tensor in rank order
      EXPECT_GE(tensor.offset + slice.begin, slice.rank * s);
      EXPECT_LE(tensor.offset + slice.end, (slice.rank + 1) * s);
      EXPECT_GT(slice.local_units, 0);
      covered = slice.end;
    }
    EXPECT_EQ(covered, tensor.numel);
  }
}

TEST(CliTable, HasTotalAndEveryBaseline) {
  const ChildResult result = plan({"--model", kLlama, "--devices", "8"});
  expectOk(result);
  for (const char* needle :
       {"TOTAL", "ours", "lower bound", "FSDP2", "FSDP1", "ZeRO-3", "Megatron-FSDP", "layers.31", "8030261248"}) {
    EXPECT_NE(result.out.find(needle), std::string::npos) << needle;
  }
}

TEST(CliTable, SummaryCollapsesIdenticalLayers) {
  const ChildResult result = plan({"--model", kLlama, "--devices", "64", "--summary"});
  expectOk(result);
  EXPECT_NE(result.out.find("layers.0 .. layers.31 (x32)"), std::string::npos) << result.out;
  EXPECT_EQ(result.out.find("layers.17 "), std::string::npos);
}

TEST(CliTable, ExplainsBoundsFarAboveIdeal) {
  const ChildResult result = plan(
      {"--model", kModels + "/deepseek-v3.json", "--devices", "1024", "--granularity", "block:128x128", "--summary"});
  expectOk(result);
  EXPECT_NE(result.out.find("more than 5% above ceil(N/V)"), std::string::npos);
  EXPECT_NE(result.out.find("forced by:"), std::string::npos);
  EXPECT_NE(result.out.find("merge "), std::string::npos);
}

// --merge auto: the report's units are the merged ones, followed by what
// merging cost. Llama-3-8B at 1024 ranks with rows:32 is 3.88x of N unit by
// unit; within 16 GiB it merges every layer and the final norm and head.
const std::vector<std::string> kMergedLlama = {
    "--model", kLlama, "--devices",          "1024", "--granularity", "rows:32",
    "--merge", "auto", "--unsharded-budget", "16GiB"};

TEST(CliJson, MergeAutoReportsTheMergedUnitsAndRoundTrips) {
  std::vector<std::string> args = kMergedLlama;
  args.insert(args.end(), {"--format", "json"});
  const ChildResult result = plan(args);
  expectOk(result);
  const plan_io::PlanReport report = readJsonOutput(result);
  expectValidPlan(report);
  EXPECT_EQ(plan_io::writePlanJson(report), result.out);
  ASSERT_TRUE(report.merge.has_value());
  const plan_io::MergeReport& merge = *report.merge;
  EXPECT_EQ(merge.budget_bytes, std::int64_t{16} << 30);
  EXPECT_EQ(merge.units, 34);
  ASSERT_EQ(merge.runs.size(), report.units.size());
  std::int64_t next = 0;
  for (std::size_t r = 0; r < merge.runs.size(); ++r) {
    EXPECT_EQ(merge.runs[r].name, report.units[r].name);
    EXPECT_EQ(merge.runs[r].first, next);
    next += merge.runs[r].count;
    EXPECT_EQ(merge.runs[r].allgather_elems, report.devices * report.units[r].shard_elems);
    EXPECT_LE(merge.runs[r].unsharded_bytes, merge.budget_bytes);
  }
  EXPECT_EQ(next, 34);
  EXPECT_LT(merge.runs.size(), 34u);
  EXPECT_EQ(merge.allgather_elems, report.total.allgather_elems);
  EXPECT_EQ(merge.numel, 8030261248);
  EXPECT_TRUE(merge.within_target);
  EXPECT_GT(merge.unmerged_inflation, 3.0);
  EXPECT_GT(merge.peak_unsharded_bytes, merge.unmerged_peak_unsharded_bytes);
  const Json root = Json::parse(result.out, nullptr, false);
  expectLeadingKeys(root["merge"], {"budget_bytes", "units", "numel", "allgather_elems", "inflation",
                                    "peak_unsharded_bytes", "within_target", "unmerged_allgather_elems",
                                    "unmerged_inflation", "unmerged_peak_unsharded_bytes", "merge_ms", "runs"});
  expectLeadingKeys(root["merge"]["runs"][0],
                    {"name", "first", "count", "allgather_elems", "unsharded_bytes", "over_budget"});
  // --merge none (the default) has no merge key.
  const ChildResult plain = plan({"--model", kLlama, "--devices", "8", "--format", "json", "--merge", "none"});
  expectOk(plain);
  EXPECT_FALSE(Json::parse(plain.out, nullptr, false).contains("merge"));
}

// ------------------------------------------------------------ tensor / expert parallelism --

TEST(CliJson, TensorAndExpertParallelUnitsAreWhatOneRankHolds) {
  const ChildResult result = plan({"--model", kModels + "/gpt-oss-20b.json", "--devices", "64", "--tp", "8", "--ep",
                                   "8", "--format", "json"});
  expectOk(result);
  const plan_io::PlanReport report = readJsonOutput(result);
  EXPECT_EQ(plan_io::writePlanJson(report), result.out);
  ASSERT_TRUE(report.model_parallel.has_value());
  EXPECT_EQ(report.model_parallel->tp, 8);
  EXPECT_EQ(report.model_parallel->ep, 8);
  std::int64_t volume = 0;
  bool saw_experts = false;
  for (const plan_io::UnitReport& unit : report.units) {
    volume += unit.devices * unit.shard_elems;
    if (unit.name == "layers.0.experts") {
      saw_experts = true;
      EXPECT_EQ(unit.devices, 8);  // 64 dp ranks / ep 8
      EXPECT_EQ(unit.tensors.front().shape, (std::vector<std::int64_t>{4, 2880, 5760}));  // 32 experts / 8, whole
    }
    if (unit.name == "layers.0") {
      EXPECT_EQ(unit.devices, 64);
      EXPECT_TRUE(std::none_of(unit.tensors.begin(), unit.tensors.end(),
                               [](const auto& t) { return t.name.find(".experts.") != std::string::npos; }));
      const auto q = std::find_if(unit.tensors.begin(), unit.tensors.end(),
                                  [](const auto& t) { return t.name.ends_with("q_proj.weight"); });
      ASSERT_NE(q, unit.tensors.end());
      EXPECT_EQ(q->shape, (std::vector<std::int64_t>{512, 2880}));  // 4096 rows over tp 8
    }
  }
  EXPECT_TRUE(saw_experts);
  EXPECT_EQ(volume, report.total.allgather_elems);
}

TEST(CliTable, UnevenTensorParallelChunksAreReportedPerTpRankWithWhatTpMakesImpossible) {
  const TempDir dir;
  const std::string model =
      dir.write("model.json", modelWith(R"([{"name": "a.q_proj.weight", "shape": [96, 64], "dtype": "bf16"},
                                            {"name": "a.o_proj.weight", "shape": [64, 96], "dtype": "bf16"}])"));
  const ChildResult result = plan({"--model", model, "--devices", "4", "--tp", "5", "--granularity", "rows:16"});
  expectOk(result);
  // torch.chunk(96, 5): 20 rows for tp ranks 0-3, 16 for tp rank 4.
  EXPECT_NE(result.out.find("blk@tp0-3"), std::string::npos) << result.out;
  EXPECT_NE(result.out.find("blk@tp4"), std::string::npos) << result.out;
  EXPECT_NE(result.out.find("'rows:16' keeps bands of 16 rows, but tensor parallelism cuts dim 0 (96) over 5 ranks: "
                            "tp rank 0 holds 20 rows"),
            std::string::npos)
      << result.out;
}

TEST(CliUsage, ExpertParallelMustDivideTheRanksAndTheExperts) {
  expectBadInput(plan({"--model", kLlama, "--devices", "12", "--ep", "8"}), {"--ep 8 does not divide --devices 12"});
  expectBadInput(plan({"--model", kLlama, "--devices", "8", "--tp", "2", "--merge", "auto", "--unsharded-budget",
                       "1GiB"}),
                 {"--merge auto does not take --tp / --ep"});
  expectBadInput(plan({"--model", kModels + "/mixtral-8x7b.json", "--devices", "48", "--ep", "3"}),
                 {"mixtral-8x7b.json", "layers.0", "ep 3 does not divide its 8 experts"});
}

TEST(CliTable, MergeAutoShowsTheMergedUnitsAndWhatMergingCost) {
  std::vector<std::string> args = kMergedLlama;
  args.push_back("--summary");
  const ChildResult result = plan(args);
  expectOk(result);
  for (const char* needle : {"layers.0..final", "Merged with --merge auto under an unsharded budget of 16.00 GiB",
                             "N without merging (within 1.05 N: yes)", "peak unsharded buffer per rank: "}) {
    EXPECT_NE(result.out.find(needle), std::string::npos) << needle << "\n" << result.out;
  }
  // --unit takes a merged unit's name.
  args.insert(args.end(), {"--unit", "layers.0..final"});
  expectOk(plan(args));
}

bool looksLikeSvg(const std::string& text) {
  return text.starts_with("<svg") && text.ends_with("</svg>\n") &&
         text.find("xmlns=\"http://www.w3.org/2000/svg\"") != std::string::npos;
}

TEST(CliSvg, RankRowsAtFewRanks) {
  const ChildResult result = plan({"--model", kLlama, "--devices", "8", "--format", "svg", "--unit", "layers.0"});
  expectOk(result);
  EXPECT_TRUE(looksLikeSvg(result.out));
  EXPECT_NE(result.out.find("unit layers.0"), std::string::npos);
  EXPECT_NE(result.out.find("url(#pad)"), std::string::npos);
  EXPECT_EQ(result.out.find("bands of"), std::string::npos);
}

TEST(CliSvg, BandsAt1024RanksStaySmall) {
  const ChildResult result = plan({"--model", kModels + "/deepseek-v3.json", "--devices", "1024", "--granularity",
                                   "block:128x128", "--format", "svg"});
  expectOk(result);
  EXPECT_TRUE(looksLikeSvg(result.out));
  EXPECT_NE(result.out.find("bands of 16"), std::string::npos);
  EXPECT_LT(result.out.size(), 2u << 20);
}

TEST(CliOutputFile, WritesTheReportThere) {
  const TempDir dir;
  const std::string path = (dir.path() / "layers0.svg").string();
  const std::vector<std::string> args = {"--model", kLlama, "--devices", "8", "--format", "svg", "--unit", "layers.0"};
  std::vector<std::string> to_file = args;
  to_file.insert(to_file.end(), {"--output", path});
  const ChildResult written = plan(to_file);
  expectOk(written);
  EXPECT_EQ(written.out, "");
  const ChildResult printed = plan(args);
  expectOk(printed);
  EXPECT_EQ(readFile(path), printed.out);  // svg carries no timings: identical
}

}  // namespace
}  // namespace dbuf::testing
