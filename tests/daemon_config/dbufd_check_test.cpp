// `dbufd --check` as an operator runs it (a real dbufd process): a valid
// configuration is described on stdout and exits 0 without serving; a bad one
// is one line on stderr and exits 2. And the shipped systemd unit passes
// `systemd-analyze verify`.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "support/child_process.hpp"
#include "support/temp_dir.hpp"
#include "support/text.hpp"

namespace dbuf::testing {
namespace {

const std::string kDbufd = DBUFD_EXE;
const std::string kConfigDir = DBUF_CONFIG_DIR;
const std::string kSystemdDir = DBUF_SYSTEMD_DIR;

void expectValid(const ChildResult& result) {
  ASSERT_FALSE(result.timed_out);
  ASSERT_EQ(result.signal, 0) << result.err;
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_EQ(result.err, "");
  EXPECT_TRUE(contains(result.out, "is valid")) << result.out;
}

/// Exit 2, nothing on stdout, one line on stderr holding `needle`.
void expectInvalid(const ChildResult& result, const std::string& needle) {
  ASSERT_FALSE(result.timed_out);
  ASSERT_EQ(result.signal, 0) << result.err;
  EXPECT_EQ(result.exit_code, 2) << result.err;
  EXPECT_EQ(result.out, "");
  EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << result.err;
  EXPECT_TRUE(contains(result.err, needle)) << "'" << needle << "' not in: " << result.err;
}

TEST(DbufdCheck, TheShippedConfigAndEveryExampleAreValid) {
  expectValid(runChild(kDbufd, {"--config", kConfigDir + "/dbufd.toml", "--check"}));
  for (const auto& entry : std::filesystem::directory_iterator(kConfigDir + "/examples")) {
    SCOPED_TRACE(entry.path().string());
    expectValid(runChild(kDbufd, {"--check", "--config", entry.path().string()}));
  }
}

TEST(DbufdCheck, SaysWhatTheConfigSetsAndServesNothing) {
  const TempDir dir("dbufd-check");
  const std::string socket = dir.path("d.sock");
  const std::string file = dir.write("d.toml",
                                     "[daemon]\nsocket = \"" + socket +
                                         "\"\nmemory_limit = \"3GiB\"\n"
                                         "[[tenant]]\nname = \"team\"\nuids = [4242]\nmemory_quota = \"512MiB\"\n"
                                         "max_jobs = 3\n");
  const ChildResult result = runChild(kDbufd, {"--config", file, "--check", "--log-level", "warn"});
  expectValid(result);
  for (const std::string& line : {"socket:             " + socket, std::string("memory limit:       3 GiB"),
                                  std::string("log level:          warn"),
                                  std::string("team: 1 uid(s), 0 gid(s), quota 512 MiB, at most 3 jobs")}) {
    EXPECT_TRUE(contains(result.out, line)) << "'" << line << "' not in:\n" << result.out;
  }
  struct stat status {};
  EXPECT_NE(::stat(socket.c_str(), &status), 0) << "--check made the socket";
  EXPECT_NE(::stat((socket + ".lock").c_str(), &status), 0) << "--check took the lock file";
}

TEST(DbufdCheck, ABadFileOrFlagIsOneLineAndExitTwo) {
  const TempDir dir("dbufd-check");
  expectInvalid(runChild(kDbufd, {"--config", dir.write("bad.toml", "[daemon]\nbogus = 1\n"), "--check"}), "bogus");
  const std::string quota = dir.write("q.toml", "[[tenant]]\nname = \"t\"\nuids = [1]\nmemory_quota = \"lots\"\n");
  expectInvalid(runChild(kDbufd, {"--config", quota, "--check"}), "memory_quota");
  expectInvalid(runChild(kDbufd, {"--config", dir.path("missing.toml"), "--check"}), "missing.toml");
  expectInvalid(runChild(kDbufd, {"--check", "--virtual-ranks", "many"}), "virtual");
}

/// The unit as installed, but starting the dbufd just built (verify checks
/// that ExecStart's program exists and is executable).
TEST(SystemdUnit, PassesSystemdAnalyzeVerify) {
  const std::string analyze = "/usr/bin/systemd-analyze";
  if (::access(analyze.c_str(), X_OK) != 0) GTEST_SKIP() << analyze << " is not installed";
  const TempDir dir("dbufd-unit");
  std::string unit = readFile(kSystemdDir + "/dbufd.service");
  ASSERT_FALSE(unit.empty());
  const std::string installed = "/usr/bin/dbufd";
  const auto at = unit.find(installed);
  ASSERT_NE(at, std::string::npos) << "ExecStart does not start " << installed;
  unit.replace(at, installed.size(), kDbufd);
  const ChildResult result = runChild(analyze, {"verify", dir.write("dbufd.service", unit)});
  ASSERT_FALSE(result.timed_out);
  EXPECT_EQ(result.exit_code, 0) << result.out << result.err;
  // verify reports problems on stderr even where its exit status stays 0.
  EXPECT_FALSE(contains(result.err, "dbufd.service:")) << result.err;
}

}  // namespace
}  // namespace dbuf::testing
