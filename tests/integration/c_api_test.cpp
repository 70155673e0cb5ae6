// The C API (dbuf.h) against the embedded daemon: one full cycle (connect,
// attach, register, views, unshard, reshard, detach) on two ranks, and the
// error text of failures through dbuf_last_error.

#include <cstring>
#include <string>
#include <thread>

#include "dbuf/dbuf.h"
#include "harness.hpp"

namespace dbuf::integration {
namespace {

constexpr int64_t kTimeoutMs = 10000;

TEST(CApi, FullCycleOnTwoRanks) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  constexpr uint32_t kWorld = 2;
  std::vector<int64_t> shard_elems(kWorld, -1);
  std::vector<int64_t> held(kWorld, 0);
  onRanks(kWorld, [&](uint32_t rank) {
    dbuf_client* client = nullptr;
    ASSERT_EQ(dbuf_connect(daemon.socketPath().c_str(), kTimeoutMs, &client), DBUF_OK);
    ASSERT_NE(client, nullptr);
    ASSERT_EQ(dbuf_attach(client, "c-api", rank, kWorld, 0, 1, kTimeoutMs), DBUF_OK) << dbuf_last_error(client);

    const char* names[] = {"w", "b"};
    const uint32_t ranks[] = {2, 1};
    const int64_t shapes[] = {30, 16, 7};
    dbuf_group* group = nullptr;
    ASSERT_EQ(
        dbuf_register_group(client, "layer", 2, names, ranks, shapes, "rows:2", "fp32", "bf16", kTimeoutMs, &group),
        DBUF_OK)
        << dbuf_last_error(client);
    ASSERT_NE(group, nullptr);
    EXPECT_EQ(dbuf_group_tensor_count(group), 2U);
    shard_elems[rank] = dbuf_group_shard_elems(group);
    EXPECT_GE(dbuf_group_tensor_offset(group, 0), 0);
    EXPECT_GE(dbuf_group_tensor_offset(group, 1), 0);
    EXPECT_EQ(dbuf_group_tensor_offset(group, 2), -1);

    for (size_t t = 0; t < 2; ++t) {
      dbuf_tensor_view view{};
      ASSERT_EQ(dbuf_group_view(client, group, t, DBUF_REGION_SHARD, &view), DBUF_OK) << dbuf_last_error(client);
      EXPECT_STREQ(view.dtype, "fp32");
      held[rank] += view.end - view.begin;
      if (view.end > view.begin) {
        ASSERT_NE(view.data, nullptr);
        auto* data = static_cast<float*>(view.data);
        for (int64_t e = view.begin; e < view.end; ++e)
          data[e - view.begin] = static_cast<float>(int64_t{rank} * 1000 + e);
        for (int64_t e = view.begin; e < view.end; ++e) {
          EXPECT_EQ(data[e - view.begin], static_cast<float>(int64_t{rank} * 1000 + e));
        }
      }
      dbuf_tensor_view grad{};
      ASSERT_EQ(dbuf_group_view(client, group, t, DBUF_REGION_SHARD_GRAD, &grad), DBUF_OK);
      EXPECT_EQ(grad.begin, view.begin);
      EXPECT_EQ(grad.end, view.end);
    }

    // Unsharded views need a slot first; the failure says why.
    dbuf_tensor_view full{};
    EXPECT_EQ(dbuf_group_view(client, group, 0, DBUF_REGION_UNSHARDED, &full), DBUF_INVALID_ARGUMENT);
    EXPECT_NE(std::string(dbuf_last_error(client)).find("not unsharded"), std::string::npos) << dbuf_last_error(client);
    ASSERT_EQ(dbuf_group_unshard(client, group, kTimeoutMs), DBUF_OK) << dbuf_last_error(client);
    ASSERT_EQ(dbuf_group_view(client, group, 0, DBUF_REGION_UNSHARDED, &full), DBUF_OK);
    EXPECT_STREQ(full.dtype, "bf16");
    EXPECT_EQ(full.begin, 0);
    EXPECT_EQ(full.end, 30 * 16);
    ASSERT_NE(full.data, nullptr);
    std::memset(full.data, 0x5A, static_cast<size_t>(full.end) * 2);
    dbuf_tensor_view full_grad{};
    ASSERT_EQ(dbuf_group_view(client, group, 1, DBUF_REGION_UNSHARDED_GRAD, &full_grad), DBUF_OK);
    EXPECT_EQ(full_grad.end, 7);
    ASSERT_EQ(dbuf_group_reshard(client, group, kTimeoutMs), DBUF_OK) << dbuf_last_error(client);
    EXPECT_EQ(dbuf_group_view(client, group, 0, DBUF_REGION_UNSHARDED, &full), DBUF_INVALID_ARGUMENT);

    // Bad arguments are refused with a status and a message, never a crash.
    EXPECT_EQ(dbuf_group_view(client, group, 99, DBUF_REGION_SHARD, &full), DBUF_INVALID_ARGUMENT);
    EXPECT_STRNE(dbuf_last_error(client), "");

    dbuf_group_free(group);
    EXPECT_EQ(dbuf_detach(client, kTimeoutMs), DBUF_OK) << dbuf_last_error(client);
    dbuf_client_free(client);
  });
  EXPECT_EQ(shard_elems[0], shard_elems[1]);
  EXPECT_EQ(held[0] + held[1], 30 * 16 + 7) << "each element on exactly one rank";
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(CApi, FailuresCarryTheDaemonsMessage) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  dbuf_client* client = nullptr;
  ASSERT_EQ(dbuf_connect(daemon.socketPath().c_str(), kTimeoutMs, &client), DBUF_OK);
  // A rank outside the world size: the daemon refuses and closes the connection.
  EXPECT_EQ(dbuf_attach(client, "c-errors", 3, 2, 0, 1, kTimeoutMs), DBUF_INVALID_ARGUMENT);
  const std::string message = dbuf_last_error(client);
  EXPECT_NE(message.find("rank 3 of world size 2"), std::string::npos) << message;
  // The connection is gone: the next call says so instead of hanging.
  EXPECT_EQ(dbuf_attach(client, "c-errors", 0, 2, 0, 1, kTimeoutMs), DBUF_UNAVAILABLE);
  EXPECT_STRNE(dbuf_last_error(client), "");
  dbuf_client_free(client);

  // Registration errors: a bad granularity rule.
  ASSERT_EQ(dbuf_connect(daemon.socketPath().c_str(), kTimeoutMs, &client), DBUF_OK);
  ASSERT_EQ(dbuf_attach(client, "c-errors", 0, 1, 0, 1, kTimeoutMs), DBUF_OK) << dbuf_last_error(client);
  const char* names[] = {"w"};
  const uint32_t ranks[] = {2};
  const int64_t shapes[] = {8, 8};
  dbuf_group* group = nullptr;
  EXPECT_EQ(
      dbuf_register_group(client, "bad", 1, names, ranks, shapes, "rows:zero", "fp32", "bf16", kTimeoutMs, &group),
      DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(group, nullptr);
  EXPECT_NE(std::string(dbuf_last_error(client)).find("rows:zero"), std::string::npos) << dbuf_last_error(client);
  EXPECT_EQ(dbuf_register_group(client, "bad", 1, names, ranks, shapes, "element", "fp33", "bf16", kTimeoutMs, &group),
            DBUF_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dbuf_last_error(client)).find("dtype"), std::string::npos) << dbuf_last_error(client);
  // The same client goes on after errors.
  ASSERT_EQ(dbuf_register_group(client, "good", 1, names, ranks, shapes, "element", "fp32", "bf16", kTimeoutMs, &group),
            DBUF_OK)
      << dbuf_last_error(client);
  dbuf_group_free(group);
  EXPECT_EQ(dbuf_detach(client, kTimeoutMs), DBUF_OK);
  dbuf_client_free(client);

  // Argument checks that need no daemon.
  EXPECT_EQ(dbuf_connect(daemon.socketPath().c_str(), kTimeoutMs, nullptr), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_attach(nullptr, "x", 0, 1, 0, 1, kTimeoutMs), DBUF_INVALID_ARGUMENT);
  std::thread([] {
    EXPECT_STREQ(dbuf_last_error(nullptr), "no client") << "no dbuf_connect failed on this thread";
  }).join();
  EXPECT_TRUE(waitUntil([&] { return daemonIsEmpty(daemon.stats()); }));
}

TEST(CApi, ConnectWithoutADaemonFailsClearly) {
  TempDir dir;
  const std::string path = dir.path("nobody.sock");
  dbuf_client* client = nullptr;
  EXPECT_EQ(dbuf_connect(path.c_str(), kTimeoutMs, &client), DBUF_UNAVAILABLE);
  EXPECT_EQ(client, nullptr);
  // No client to ask: the reason is kept for this thread.
  const std::string message = dbuf_last_error(nullptr);
  EXPECT_NE(message.find("cannot reach dbufd at " + path), std::string::npos) << message;
}

}  // namespace
}  // namespace dbuf::integration
