// Every program of dbuf (dbufd, dbufctl, dbuf-plan, dbuf-soak, the
// benchmarks) run as a real process with the command-line conventions of
// cli/ (dbuf/cli/command_line.hpp): --version names the build, --help goes to
// stdout, and a bad command line is one line on stderr naming the option,
// with exit status 2.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "dbuf/common/build_info.hpp"
#include "support/child_process.hpp"

namespace dbuf::testing {
namespace {

/// DBUF_PROGRAMS: "NAME=PATH,NAME=PATH,..." of this build (tests/cli/CMakeLists.txt).
std::map<std::string, std::string> programs() {
  std::map<std::string, std::string> found;
  std::stringstream list(DBUF_PROGRAMS);
  for (std::string entry; std::getline(list, entry, ',');) {
    const auto equals = entry.find('=');
    found[entry.substr(0, equals)] = entry.substr(equals + 1);
  }
  return found;
}

/// An option of each program that takes a value, and a value it accepts (bench_planner has only a positional).
struct ValueOption {
  std::string option;
  std::string value;
};
const std::map<std::string, ValueOption> kValueOption{
    {"dbufd", {"--socket", "/tmp/x.sock"}},
    {"dbufctl", {"--socket", "/tmp/x.sock"}},
    {"dbuf-plan", {"--devices", "8"}},
    {"dbuf-soak", {"--jobs", "2"}},
    {"bench_kernels", {"--elements", "2000"}},
    {"bench_control", {"--iterations", "10"}},
    {"bench_collectives", {"--repeats", "2"}},
    {"bench_planner_families", {"--models", "2"}},
    {"bench_planner_merge", {"--devices", "8"}},
    {"bench_gpu_kernels", {"--reps", "2"}},
    {"bench_gpu_overlap", {"--seconds", "1"}},
    {"bench_gpu_allgather", {"--reps", "3"}},
};

std::vector<std::string> programNames() {
  std::vector<std::string> names;
  for (const auto& [name, path] : programs()) names.push_back(name);
  return names;
}

class CommandLine : public ::testing::TestWithParam<std::string> {
 protected:
  ChildResult run(const std::vector<std::string>& args) { return runChild(programs().at(GetParam()), args, 20000); }

  /// Exit status 2, nothing on stdout, one line on stderr: "PROGRAM: ... (see --help)" holding `words`.
  void expectUsageError(const ChildResult& result, const std::string& words) {
    const std::string& name = GetParam();
    EXPECT_EQ(result.signal, 0) << result.err;
    EXPECT_EQ(result.exit_code, 2) << result.err;
    EXPECT_EQ(result.out, "");
    EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << result.err;
    EXPECT_TRUE(result.err.starts_with(name + ": ")) << result.err;
    EXPECT_NE(result.err.find(words), std::string::npos) << "'" << words << "' not in: " << result.err;
    EXPECT_TRUE(result.err.ends_with(" (see --help)\n")) << result.err;
  }
};

TEST_P(CommandLine, VersionNamesTheProjectVersionAndCommit) {
  const ChildResult result = run({"--version"});
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_EQ(result.out, GetParam() + " " + std::string(buildInfo().version) + " (commit " +
                            std::string(buildInfo().commit) + ")\n");
  EXPECT_EQ(result.err, "");
}

TEST_P(CommandLine, HelpGoesToStdoutWithEveryOption) {
  const ChildResult result = run({"--help"});
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_NE(result.out.find("Usage: " + GetParam() + " [OPTIONS]"), std::string::npos) << result.out;
  EXPECT_NE(result.out.find("--version"), std::string::npos) << result.out;
  const auto value_option = kValueOption.find(GetParam());
  if (value_option != kValueOption.end()) {
    EXPECT_NE(result.out.find(value_option->second.option), std::string::npos) << result.out;
  }
  EXPECT_EQ(result.err, "");
}

TEST_P(CommandLine, AnUnknownOptionIsNamed) {
  expectUsageError(run({"--no-such-option"}), "unknown option '--no-such-option'");
}

TEST_P(CommandLine, AnOptionWithoutItsValueIsNamed) {
  const auto value_option = kValueOption.find(GetParam());
  if (value_option == kValueOption.end()) GTEST_SKIP() << GetParam() << " has no option that takes a value";
  const std::string& option = value_option->second.option;
  expectUsageError(run({option}), option + " needs a value");
  expectUsageError(run({option, "--help"}), option + " needs a value");
}

TEST_P(CommandLine, AnOptionGivenTwiceIsNamed) {
  const auto value_option = kValueOption.find(GetParam());
  if (value_option == kValueOption.end()) GTEST_SKIP() << GetParam() << " has no option that takes a value";
  const auto& [option, value] = value_option->second;
  expectUsageError(run({option, value, option, value}), option + " given more than once");
}

INSTANTIATE_TEST_SUITE_P(Programs, CommandLine, ::testing::ValuesIn(programNames()),
                         [](const ::testing::TestParamInfo<std::string>& param) {
                           std::string name = param.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

TEST(CommandLineErrors, ValuesOutOfRangeAndBadVerbsAreNamed) {
  const auto all = programs();
  const ChildResult verb = runChild(all.at("dbufctl"), {"frobnicate"});
  EXPECT_EQ(verb.exit_code, 2);
  EXPECT_EQ(verb.err, "dbufctl: unknown verb 'frobnicate' (see --help)\n");
  const ChildResult no_verb = runChild(all.at("dbufctl"), {});
  EXPECT_EQ(no_verb.exit_code, 2);
  EXPECT_EQ(no_verb.err, "dbufctl: no verb given (see --help)\n");
  const ChildResult two_verbs = runChild(all.at("dbufctl"), {"drain", "status"});
  EXPECT_EQ(two_verbs.exit_code, 2);
  EXPECT_EQ(two_verbs.err, "dbufctl: one verb at a time, got 'drain' and 'status' (see --help)\n");
  // A word starting with "--" is not taken as a value (it would have made a file named --typo).
  const ChildResult output = runChild(all.at("dbuf-plan"), {"--model", "m.json", "--devices", "8", "--output", "--typo"});
  EXPECT_EQ(output.exit_code, 2);
  EXPECT_EQ(output.err, "dbuf-plan: --output needs a value (see --help)\n");
  const ChildResult timeout = runChild(all.at("dbufctl"), {"--timeout", "0", "status"});
  EXPECT_EQ(timeout.exit_code, 2);
  EXPECT_EQ(timeout.err, "dbufctl: --timeout: takes seconds, more than 0 and at most 86400, not '0' (see --help)\n");
  const ChildResult operand = runChild(all.at("dbufctl"), {"job"});
  EXPECT_EQ(operand.exit_code, 2);
  EXPECT_EQ(operand.err, "dbufctl: JOB is required (see --help)\n");
  const ChildResult jobs = runChild(all.at("dbuf-soak"), {"--jobs", "0"});
  EXPECT_EQ(jobs.exit_code, 2);
  EXPECT_NE(jobs.err.find("--jobs: Value 0 not in range 1 to 65536"), std::string::npos) << jobs.err;
}

}  // namespace
}  // namespace dbuf::testing
