// The C API (dbuf.h) against the embedded daemon: one full cycle (connect,
// attach, register, views, unshard = slot + all-gather, reshard, detach) on
// two ranks; a slot without a gather, ops through dbuf_submit / dbuf_wait /
// dbuf_run and a full ring (DBUF_WOULD_BLOCK); and the error text of failures
// through dbuf_last_error.

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "dbuf/dbuf.h"
#include "dbuf/kernels/convert.hpp"
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
    // A collective: both ranks call it, and both get every rank's shard, in bf16.
    ASSERT_EQ(dbuf_group_unshard(client, group, kTimeoutMs), DBUF_OK) << dbuf_last_error(client);
    for (size_t t = 0; t < 2; ++t) {
      dbuf_tensor_view gathered{};
      ASSERT_EQ(dbuf_group_view(client, group, t, DBUF_REGION_UNSHARDED, &gathered), DBUF_OK);
      ASSERT_NE(gathered.data, nullptr);
      const int64_t offset = dbuf_group_tensor_offset(group, t);
      const auto* bits = static_cast<const uint16_t*>(gathered.data);
      int64_t wrong = 0;
      for (int64_t e = gathered.begin; e < gathered.end; ++e) {
        const int64_t owner = (offset + e) / shard_elems[rank];
        wrong += bits[e] != kernels::floatToBf16(static_cast<float>(owner * 1000 + e)) ? 1 : 0;
      }
      EXPECT_EQ(wrong, 0) << "rank " << rank << " tensor " << t;
    }
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

TEST(CApi, AcquireSlotThenOpsThroughSubmitWaitAndRun) {
  daemon::Config config;
  config.ring_entries = 16;  // the smallest ring: easy to fill
  EmbeddedDaemon daemon(config);
  ASSERT_TRUE(daemon.started());
  constexpr uint32_t kWorld = 2;
  constexpr std::size_t kRing = 16;
  std::vector<dbuf_client*> clients(kWorld, nullptr);
  std::vector<dbuf_group*> groups(kWorld, nullptr);
  onRanks(kWorld, [&](uint32_t rank) {
    ASSERT_EQ(dbuf_connect(daemon.socketPath().c_str(), kTimeoutMs, &clients[rank]), DBUF_OK);
    ASSERT_EQ(dbuf_attach(clients[rank], "c-ops", rank, kWorld, 0, 1, kTimeoutMs), DBUF_OK)
        << dbuf_last_error(clients[rank]);
    const char* names[] = {"w"};
    const uint32_t ranks[] = {2};
    const int64_t shapes[] = {8, 8};
    ASSERT_EQ(dbuf_register_group(clients[rank], "layer", 1, names, ranks, shapes, "rows:2", "fp32", "fp32", kTimeoutMs,
                                  &groups[rank]),
              DBUF_OK)
        << dbuf_last_error(clients[rank]);
    dbuf_tensor_view shard{};
    ASSERT_EQ(dbuf_group_view(clients[rank], groups[rank], 0, DBUF_REGION_SHARD, &shard), DBUF_OK);
    for (int64_t e = shard.begin; e < shard.end; ++e) {
      static_cast<float*>(shard.data)[e - shard.begin] = 7.0F + static_cast<float>(rank);
    }
  });
  for (uint32_t rank = 0; rank < kWorld; ++rank) ASSERT_NE(groups[rank], nullptr);
  dbuf_client* const c0 = clients[0];
  dbuf_client* const c1 = clients[1];

  // acquire_slot is not a collective and gathers nothing: rank 0 alone gets a
  // slot of zeros.
  ASSERT_EQ(dbuf_group_acquire_slot(c0, groups[0], kTimeoutMs), DBUF_OK) << dbuf_last_error(c0);
  dbuf_tensor_view full{};
  ASSERT_EQ(dbuf_group_view(c0, groups[0], 0, DBUF_REGION_UNSHARDED, &full), DBUF_OK);
  ASSERT_EQ(full.end, 64);
  for (int64_t e = 0; e < full.end; ++e) ASSERT_EQ(static_cast<const float*>(full.data)[e], 0.0F) << e;
  ASSERT_EQ(dbuf_group_acquire_slot(c1, groups[1], kTimeoutMs), DBUF_OK) << dbuf_last_error(c1);

  // An all-gather submitted on both ranks, waited for on both.
  dbuf_op ops[kWorld] = {0, 0};
  ASSERT_EQ(dbuf_submit(c0, groups[0], DBUF_OP_ALL_GATHER, nullptr, 0, 1, kTimeoutMs, &ops[0]), DBUF_OK)
      << dbuf_last_error(c0);
  ASSERT_EQ(dbuf_submit(c1, groups[1], DBUF_OP_ALL_GATHER, nullptr, 0, 1, kTimeoutMs, &ops[1]), DBUF_OK)
      << dbuf_last_error(c1);
  EXPECT_NE(ops[0], 0U);
  EXPECT_EQ(dbuf_wait(c0, ops[0], kTimeoutMs), DBUF_OK) << dbuf_last_error(c0);
  EXPECT_EQ(dbuf_wait(c1, ops[1], kTimeoutMs), DBUF_OK) << dbuf_last_error(c1);
  const int64_t shard_elems = dbuf_group_shard_elems(groups[0]);
  for (int64_t e = 0; e < full.end; ++e) {
    const int64_t owner = (dbuf_group_tensor_offset(groups[0], 0) + e) / shard_elems;
    ASSERT_EQ(static_cast<const float*>(full.data)[e], 7.0F + static_cast<float>(owner)) << e;
  }
  // Ordering on a CUDA stream needs GPU memory (this daemon's is host memory),
  // and applies to group ops only.
  dbuf_op on_stream = 0;
  EXPECT_EQ(dbuf_submit_on_stream(c0, groups[0], DBUF_OP_ALL_GATHER, nullptr, 0, nullptr, kTimeoutMs, &on_stream),
            DBUF_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dbuf_last_error(c0)).find("needs GPU memory"), std::string::npos) << dbuf_last_error(c0);
  EXPECT_EQ(dbuf_submit_on_stream(c0, nullptr, DBUF_OP_BARRIER, nullptr, 0, nullptr, kTimeoutMs, &on_stream),
            DBUF_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dbuf_last_error(c0)).find("only group ops"), std::string::npos) << dbuf_last_error(c0);
  EXPECT_EQ(dbuf_group_reshard_on_stream(c0, groups[0], nullptr), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dbuf_last_error(c0)).find("needs GPU memory"), std::string::npos) << dbuf_last_error(c0);
  EXPECT_EQ(dbuf_group_reshard_on_stream(c0, nullptr, nullptr), DBUF_INVALID_ARGUMENT);
  // Waiting twice for one op, or for one never submitted, is an argument error.
  EXPECT_EQ(dbuf_wait(c0, ops[0], kTimeoutMs), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dbuf_last_error(c0)).find("not in flight"), std::string::npos) << dbuf_last_error(c0);
  EXPECT_EQ(dbuf_wait(c0, 0, kTimeoutMs), DBUF_INVALID_ARGUMENT);

  // dbuf_run: submit and wait. A barrier needs no group; a no-op is not a
  // collective (rank 0 alone).
  EXPECT_EQ(dbuf_run(c0, nullptr, DBUF_OP_NOOP, nullptr, 0, kTimeoutMs), DBUF_OK) << dbuf_last_error(c0);
  std::thread peer([&] { EXPECT_EQ(dbuf_run(c1, nullptr, DBUF_OP_BARRIER, nullptr, 0, kTimeoutMs), DBUF_OK); });
  EXPECT_EQ(dbuf_run(c0, nullptr, DBUF_OP_BARRIER, nullptr, 0, kTimeoutMs), DBUF_OK) << dbuf_last_error(c0);
  peer.join();

  // A full ring: rank 0 submits barriers rank 1 has not joined yet. Past the
  // ring's capacity, a submit that may not wait fails at once.
  std::vector<dbuf_op> barriers(kRing, 0);
  for (std::size_t i = 0; i < kRing; ++i) {
    ASSERT_EQ(dbuf_submit(c0, nullptr, DBUF_OP_BARRIER, nullptr, 0, 0, kTimeoutMs, &barriers[i]), DBUF_OK)
        << i << ": " << dbuf_last_error(c0);
  }
  dbuf_op refused = 0;
  EXPECT_EQ(dbuf_submit(c0, nullptr, DBUF_OP_BARRIER, nullptr, 0, 0, kTimeoutMs, &refused), DBUF_WOULD_BLOCK);
  EXPECT_NE(std::string(dbuf_last_error(c0)).find("16 ops in flight"), std::string::npos) << dbuf_last_error(c0);
  // One that may wait gives up after its timeout, still full.
  EXPECT_EQ(dbuf_submit(c0, nullptr, DBUF_OP_BARRIER, nullptr, 0, 1, 50, &refused), DBUF_TIMEOUT);
  // Rank 1 joins the barriers; rank 0's complete, in order.
  for (std::size_t i = 0; i < kRing; ++i) {
    ASSERT_EQ(dbuf_run(c1, nullptr, DBUF_OP_BARRIER, nullptr, 0, kTimeoutMs), DBUF_OK) << dbuf_last_error(c1);
  }
  for (std::size_t i = 0; i < kRing; ++i) {
    EXPECT_EQ(dbuf_wait(c0, barriers[i], kTimeoutMs), DBUF_OK) << dbuf_last_error(c0);
  }
  EXPECT_EQ(dbuf_submit(c0, nullptr, DBUF_OP_NOOP, nullptr, 0, 0, kTimeoutMs, &refused), DBUF_OK)
      << "room again once the ops completed";
  EXPECT_EQ(dbuf_wait(c0, refused, kTimeoutMs), DBUF_OK);

  // Bad arguments: a status and a message, never a crash.
  dbuf_op op = 0;
  EXPECT_EQ(dbuf_submit(c0, nullptr, DBUF_OP_ALL_GATHER, nullptr, 0, 1, kTimeoutMs, &op), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dbuf_last_error(c0)).find("needs a group"), std::string::npos) << dbuf_last_error(c0);
  // Out-of-range enum values, as a C caller may pass them.
  EXPECT_EQ(dbuf_submit(c0, groups[0], static_cast<dbuf_op_kind>(7), nullptr, 0, 1, kTimeoutMs, &op),
            DBUF_INVALID_ARGUMENT);
  dbuf_reduce_options bad_mode{DBUF_REDUCE_SUM, 1.0F, 1.0F, 0};
  static_assert(sizeof(bad_mode.mode) == sizeof(int));
  const int seven = 7;
  std::memcpy(&bad_mode.mode, &seven, sizeof seven);
  EXPECT_EQ(dbuf_submit(c0, groups[0], DBUF_OP_ALL_REDUCE, &bad_mode, 0, 1, kTimeoutMs, &op), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_submit(c0, groups[0], DBUF_OP_ALL_GATHER, nullptr, 0, 1, kTimeoutMs, nullptr), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_submit(c0, groups[0], DBUF_OP_ALL_GATHER, nullptr, 0, 1, 0, &op), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_group_acquire_slot(c0, nullptr, kTimeoutMs), DBUF_INVALID_ARGUMENT);

  for (uint32_t rank = 0; rank < kWorld; ++rank) {
    EXPECT_EQ(dbuf_group_reshard(clients[rank], groups[rank], kTimeoutMs), DBUF_OK) << dbuf_last_error(clients[rank]);
    dbuf_group_free(groups[rank]);
    EXPECT_EQ(dbuf_detach(clients[rank], kTimeoutMs), DBUF_OK) << dbuf_last_error(clients[rank]);
    dbuf_client_free(clients[rank]);
  }
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
