#pragma once
// Drives a dbuf-cf-rank process (cf_rank.cpp) from a test: one command line
// in, one answer line out. Shared by the collective-failure and multi-node
// process tests.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <string>

#include "harness.hpp"

#ifndef DBUF_CF_RANK_EXE
#error "DBUF_CF_RANK_EXE must name the dbuf-cf-rank binary"
#endif

namespace dbuf::mp {

inline ::testing::AssertionResult lineStartsWith(const std::string& line, const std::string& prefix) {
  if (startsWith(line, prefix)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected a line starting with '" << prefix << "', got '" << line << "'";
}

/// A dbuf-cf-rank process (see cf_rank.cpp for its commands).
class CfRank {
 public:
  explicit CfRank(std::string name) : name_(std::move(name)), child_(DBUF_CF_RANK_EXE, {}, options()) {}

  std::string call(const std::string& command, milliseconds timeout = kReplyTimeout) {
    child_.send(command);
    return result(timeout);
  }
  /// Sends a command that blocks on other ranks and waits for its "begin" line.
  void begin(const std::string& command) {
    child_.send(command);
    const auto line = child_.readLine(kReplyTimeout);
    const std::string verb = command.substr(0, command.find(' '));
    EXPECT_TRUE(line && *line == "begin " + verb) << name_ << ": " << command << " -> " << line.value_or("<none>");
  }
  std::string result(milliseconds timeout = kReplyTimeout) {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      const auto line = child_.readLine(std::chrono::ceil<milliseconds>(deadline - Clock::now()));
      if (!line) {
        if (!child_.running() || Clock::now() < deadline) return "<eof>";
        child_.killAndReap();  // out of step from here on: fail fast
        return "<timeout>";
      }
      if (startsWith(*line, "begin ")) continue;
      return *line;
    }
  }
  /// Connects and attaches; `node` (\" LOCAL_RANK LOCAL_WORLD STORE\") for a
  /// job across nodes.
  void attach(const std::string& socket, const std::string& job, std::uint32_t rank, std::uint32_t world,
              const std::string& node = "") {
    EXPECT_EQ(call("connect " + socket), "ok connect") << name_;
    // ("ok attach reattached" for a rank coming back to a job that kept it.)
    EXPECT_TRUE(lineStartsWith(call("attach " + job + " " + std::to_string(rank) + " " + std::to_string(world) + node),
                               "ok attach"))
        << name_;
  }
  void kill9() { EXPECT_TRUE(child_.killAndReap()) << name_ << " did not die of SIGKILL"; }
  void exit() {
    child_.send("exit");
    const auto status = child_.waitExit(kReplyTimeout);
    EXPECT_TRUE(status && WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << name_ << " did not exit cleanly";
  }

 private:
  static Child::Options options() {
    Child::Options options;
    options.pipe_stdin = true;
    options.pipe_stdout = true;
    return options;
  }
  std::string name_;
  Child child_;
};

#define EXPECT_LINE(line, prefix) EXPECT_TRUE(lineStartsWith((line), (prefix)))

/// The elapsed_ms=N of a rank's answer, or -1.
inline long elapsedOf(const std::string& line) {
  const auto at = line.find("elapsed_ms=");
  if (at == std::string::npos) return -1;
  return std::stol(line.substr(at + 11));
}

}  // namespace dbuf::mp
