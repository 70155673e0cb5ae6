// The pure parts of jobs across nodes: store specs, which stores a daemon
// uses for whom, and the verdict every node draws from the op headers.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "cluster.hpp"
#include "dbuf/ipc/protocol.hpp"
#include "dbuf/ipc/ring.hpp"
#include "node_executor.hpp"
#include "support/temp_dir.hpp"

namespace dbuf::daemon {
namespace {

TEST(StoreSpec, FileAndRedisWithAndWithoutPrefix) {
  auto file = parseStoreSpec("file:/shared/rdzv#run-7.2");
  ASSERT_TRUE(file.ok()) << file.error().message;
  EXPECT_EQ(file->kind, StoreSpec::Kind::kFile);
  EXPECT_EQ(file->path, "/shared/rdzv");
  EXPECT_EQ(file->prefix, "run-7.2");
  auto redis = parseStoreSpec("redis:10.0.0.1:6379");
  ASSERT_TRUE(redis.ok()) << redis.error().message;
  EXPECT_EQ(redis->kind, StoreSpec::Kind::kRedis);
  EXPECT_EQ(redis->host, "10.0.0.1");
  EXPECT_EQ(redis->port, 6379);
  EXPECT_EQ(redis->prefix, "");
}

TEST(StoreSpec, BadSpecsSayWhatIsWrong) {
  for (const char* bad : {"", "tcp:host:1", "file:relative/dir", "file:/a/../b", "redis:host", "redis:host:0",
                          "redis:host:65536", "redis:host:12x", "file:/d#", "file:/d#a/b", "redis::6379"}) {
    auto spec = parseStoreSpec(bad);
    ASSERT_FALSE(spec.ok()) << bad;
    EXPECT_EQ(spec.error().code, ErrorCode::kInvalidArgument) << bad;
    EXPECT_NE(spec.error().message.find(std::string("store '") + bad + "'"), std::string::npos)
        << spec.error().message;
  }
}

TEST(StoreSpec, ADaemonUsesOnlyStoresTheJobsUserOwnsOrItsConfigLists) {
  dbuf::testing::TempDir dir("dbuf-store");
  Config config;
  config.cluster_store_hosts = {"10.0.0.1:6379"};
  const std::uint32_t me = ::geteuid();
  EXPECT_TRUE(checkStoreAllowed(*parseStoreSpec("file:" + dir.path().string()), config, me).ok());
  const auto other = checkStoreAllowed(*parseStoreSpec("file:" + dir.path().string()), config, me + 1);
  ASSERT_FALSE(other.ok());
  EXPECT_EQ(other.error().code, ErrorCode::kPermissionDenied);
  ASSERT_EQ(::chmod(dir.path().c_str(), 0770), 0);
  EXPECT_EQ(checkStoreAllowed(*parseStoreSpec("file:" + dir.path().string()), config, me).error().code,
            ErrorCode::kPermissionDenied);
  EXPECT_EQ(checkStoreAllowed(*parseStoreSpec("file:" + dir.path("missing")), config, me).error().code,
            ErrorCode::kNotFound);
  EXPECT_TRUE(checkStoreAllowed(*parseStoreSpec("redis:10.0.0.1:6379"), config, me).ok());
  EXPECT_EQ(checkStoreAllowed(*parseStoreSpec("redis:10.0.0.2:6379"), config, me).error().code,
            ErrorCode::kPermissionDenied);
}

NodeLayout twoByTwo() {
  NodeLayout layout;
  layout.first_ranks = {0, 2, 4};
  return layout;
}

OpHeader ready(std::uint64_t sequence, ipc::OpCode op, const char* text, std::uint64_t digest = 7) {
  OpHeader header;
  header.sequence = sequence;
  header.op = static_cast<std::uint8_t>(op);
  header.group_digest = digest;
  std::strncpy(header.text, text, OpHeader::kText - 1);
  return header;
}

TEST(OpHeaders, AgreeingNodesRun) {
  bool fatal = true;
  const std::vector<OpHeader> headers{ready(3, ipc::OpCode::kAllGather, "allGather(group 'g')"),
                                      ready(3, ipc::OpCode::kAllGather, "allGather(group 'g')")};
  EXPECT_TRUE(judgeHeaders(headers, twoByTwo(), fatal).ok());
  EXPECT_FALSE(fatal);
}

TEST(OpHeaders, ADifferentOpNamesEveryNodesOpAndTheDifferingRanks) {
  bool fatal = false;
  const std::vector<OpHeader> headers{ready(3, ipc::OpCode::kAllGather, "allGather(group 'g')"),
                                      ready(3, ipc::OpCode::kReduceScatter, "reduceScatter(group 'g', sum)")};
  auto verdict = judgeHeaders(headers, twoByTwo(), fatal);
  ASSERT_FALSE(verdict.ok());
  EXPECT_EQ(verdict.error().code, ErrorCode::kConflict);
  EXPECT_EQ(verdict.error().message,
            "collective #3 does not match across nodes: node 0 (ranks 0-1) allGather(group 'g'); node 1 (ranks 2-3) "
            "reduceScatter(group 'g', sum)");
  EXPECT_EQ(verdict.error().ranks, (std::vector<std::uint32_t>{2, 3}));
}

TEST(OpHeaders, AGroupPlannedDifferentlyIsNamed) {
  bool fatal = false;
  const std::vector<OpHeader> headers{ready(0, ipc::OpCode::kAllGather, "allGather(group 'g')", 1),
                                      ready(0, ipc::OpCode::kAllGather, "allGather(group 'g')", 2)};
  auto verdict = judgeHeaders(headers, twoByTwo(), fatal);
  ASSERT_FALSE(verdict.ok());
  EXPECT_NE(verdict.error().message.find("(its group was registered differently)"), std::string::npos)
      << verdict.error().message;
}

TEST(OpHeaders, TheFirstFailedNodesErrorWinsWithItsCodeAndRanks) {
  bool fatal = false;
  const std::vector<OpHeader> headers{
      ready(5, ipc::OpCode::kAllGather, "allGather(group 'g')"),
      failureHeader(5, Error{ErrorCode::kTimeout, "rank 3 of job j has not submitted it", {3}}, false)};
  auto verdict = judgeHeaders(headers, twoByTwo(), fatal);
  ASSERT_FALSE(verdict.ok());
  EXPECT_EQ(verdict.error().code, ErrorCode::kTimeout);
  EXPECT_EQ(verdict.error().message, "on node 1 (ranks 2-3): rank 3 of job j has not submitted it");
  EXPECT_EQ(verdict.error().ranks, (std::vector<std::uint32_t>{3}));
  EXPECT_FALSE(fatal);
}

TEST(OpHeaders, AFatalFailureSaysSoAndLongMessagesAreCut) {
  bool fatal = false;
  const std::string long_text(1000, 'x');
  const std::vector<OpHeader> headers{failureHeader(1, Error{ErrorCode::kConflict, long_text, {}}, true),
                                      ready(1, ipc::OpCode::kBarrier, "barrier")};
  auto verdict = judgeHeaders(headers, twoByTwo(), fatal);
  ASSERT_FALSE(verdict.ok());
  EXPECT_TRUE(fatal);
  EXPECT_EQ(verdict.error().message, "on node 0 (ranks 0-1): " + std::string(OpHeader::kText - 1, 'x'));
}

TEST(OpHeaders, ADaemonOfAnotherVersionIsNamedAndEndsTheJob) {
  bool fatal = false;
  std::vector<OpHeader> headers{ready(1, ipc::OpCode::kBarrier, "barrier"), ready(1, ipc::OpCode::kBarrier, "barrier")};
  headers[1].magic = 0x02484244;
  auto verdict = judgeHeaders(headers, twoByTwo(), fatal);
  ASSERT_FALSE(verdict.ok());
  EXPECT_TRUE(fatal);
  EXPECT_NE(verdict.error().message.find("node 1 (ranks 2-3)'s dbufd speaks another version"), std::string::npos)
      << verdict.error().message;
  EXPECT_EQ(verdict.error().ranks, (std::vector<std::uint32_t>{2, 3}));
}

}  // namespace
}  // namespace dbuf::daemon
