// Logging: the two line formats, journal detection and the registered logger.
#include "dbuf/daemon/logging.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <spdlog/logger.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <memory>
#include <regex>
#include <sstream>
#include <string>

#include "dbuf/common/unique_fd.hpp"
#include "support/temp_dir.hpp"

namespace dbuf::daemon {
namespace {

using dbuf::testing::TempDir;

std::string logLines(LogLevel level, LogFormat format) {
  std::ostringstream out;
  auto logger = makeLogger(level, format, std::make_shared<spdlog::sinks::ostream_sink_st>(out));
  logger->debug("debug line");
  logger->info("listening on {}", "/run/dbufd/dbufd.sock");
  logger->warn("warn line");
  logger->error("error line");
  logger->critical("critical line");
  return out.str();
}

TEST(Logging, JournalLinesCarryPriorityAndNoTimestamp) {
  EXPECT_EQ(logLines(LogLevel::kInfo, LogFormat::kJournal),
            "<6>info: listening on /run/dbufd/dbufd.sock\n"
            "<4>warning: warn line\n"
            "<3>error: error line\n"
            "<2>critical: critical line\n");
  EXPECT_EQ(logLines(LogLevel::kError, LogFormat::kJournal).rfind("<3>error: error line\n", 0), 0U);
  EXPECT_EQ(logLines(LogLevel::kDebug, LogFormat::kJournal).rfind("<7>debug: debug line\n", 0), 0U);
  EXPECT_EQ(logLines(LogLevel::kOff, LogFormat::kJournal), "");
}

TEST(Logging, TerminalLinesCarryATimestamp) {
  const std::string lines = logLines(LogLevel::kWarn, LogFormat::kTerminal);
  const std::regex expected(R"(\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}\] \[dbufd\] \[warning\] warn line\n)"
                            R"(\[[-0-9 :.]+\] \[dbufd\] \[error\] error line\n)"
                            R"(\[[-0-9 :.]+\] \[dbufd\] \[critical\] critical line\n)");
  EXPECT_TRUE(std::regex_match(lines, expected)) << lines;
}

TEST(Logging, JournalStreamMustMatchTheDescriptor) {
  const TempDir dir;
  const std::string path = dir.write("stream", "");
  const UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));  // NOLINT
  ASSERT_TRUE(fd.valid());
  struct stat st {};
  ASSERT_EQ(::fstat(fd.get(), &st), 0);
  const std::string device = std::to_string(st.st_dev);
  const std::string inode = std::to_string(st.st_ino);
  EXPECT_TRUE(isJournalStream(device + ":" + inode, fd.get()));
  EXPECT_FALSE(isJournalStream(device + ":" + std::to_string(st.st_ino + 1), fd.get()));
  EXPECT_FALSE(isJournalStream(inode + ":" + device + "0", fd.get()));
  EXPECT_FALSE(isJournalStream("", fd.get()));
  EXPECT_FALSE(isJournalStream(device, fd.get()));
  EXPECT_FALSE(isJournalStream(device + ":" + inode + "x", fd.get()));
  EXPECT_FALSE(isJournalStream(device + ":" + inode, -1));
}

TEST(Logging, SetupRegistersTheDaemonLoggerAsDefault) {
  auto first = setupLogging(LogLevel::kError);
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(first->name(), "dbufd");
  EXPECT_EQ(spdlog::get("dbufd"), first);
  EXPECT_EQ(spdlog::default_logger(), first);
  EXPECT_EQ(first->level(), spdlog::level::err);

  auto second = setupLogging(LogLevel::kDebug);  // e.g. once the config file has been read
  EXPECT_NE(second, first);
  EXPECT_EQ(spdlog::get("dbufd"), second);
  EXPECT_EQ(spdlog::default_logger(), second);
  EXPECT_EQ(second->level(), spdlog::level::debug);
}

TEST(Logging, LevelsMapOneToOne) {
  EXPECT_EQ(toSpdlogLevel(LogLevel::kTrace), spdlog::level::trace);
  EXPECT_EQ(toSpdlogLevel(LogLevel::kDebug), spdlog::level::debug);
  EXPECT_EQ(toSpdlogLevel(LogLevel::kInfo), spdlog::level::info);
  EXPECT_EQ(toSpdlogLevel(LogLevel::kWarn), spdlog::level::warn);
  EXPECT_EQ(toSpdlogLevel(LogLevel::kError), spdlog::level::err);
  EXPECT_EQ(toSpdlogLevel(LogLevel::kOff), spdlog::level::off);
}

}  // namespace
}  // namespace dbuf::daemon
