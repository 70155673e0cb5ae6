// The C API (dbuf.h) against the embedded daemon: one full cycle (connect,
// attach, register, views, unshard = slot + all-gather, reshard, detach) on
// two ranks; a slot without a gather, ops through dbuf_submit / dbuf_wait /
// dbuf_run and a full ring (DBUF_WOULD_BLOCK); and the error text of failures
// through dbuf_last_error. Then what dbuf.h adds for FFI callers: versioned
// option structs (dbuf_attach_ex, dbuf_register_group_ex, dbuf_wait_result),
// the plan accessors (checked against the C++ API's plan for the same spec),
// reattached / instance id / in-flight, the whole last error (status, ranks),
// status names, the argument checks of each, and the header compiled as C89
// (c_header_test.c) driving a client of its own. Last, the interrupt check
// (dbuf_connect_ex: a cancelled dbuf_wait leaves its op in flight), pins
// that keep a view's range readable after its group and client are gone,
// and dbuf_memory_device.

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dbuf/dbuf.h"
#include "dbuf/kernels/convert.hpp"
#include "harness.hpp"

extern "C" int dbuf_c_header_client(const char* socket_path, char* why, size_t why_size);

namespace dbuf::integration {
namespace {

constexpr int64_t kTimeoutMs = 10000;

/// The group's plan read through the C accessors only (so that describe()
/// compares it with the C++ API's).
GroupPlan planOf(const dbuf_group* group) {
  GroupPlan plan;
  EXPECT_EQ(dbuf_group_id(group, &plan.group_id), DBUF_OK);
  EXPECT_EQ(dbuf_group_devices(group, &plan.devices), DBUF_OK);
  plan.shard_elems = dbuf_group_shard_elems(group);
  for (size_t t = 0; t < dbuf_group_tensor_count(group); ++t) {
    PlacedTensor tensor;
    const char* name = nullptr;
    EXPECT_EQ(dbuf_group_tensor_name(group, t, &name), DBUF_OK);
    tensor.name = name != nullptr ? name : "(null)";
    const int64_t* dims = nullptr;
    uint32_t ndim = 99;
    EXPECT_EQ(dbuf_group_tensor_shape(group, t, &dims, &ndim), DBUF_OK);
    uint32_t ndim_alone = 99;
    EXPECT_EQ(dbuf_group_tensor_ndim(group, t, &ndim_alone), DBUF_OK);
    EXPECT_EQ(ndim_alone, ndim);
    if (ndim > 0 && dims != nullptr) tensor.shape.assign(dims, dims + ndim);
    tensor.offset = dbuf_group_tensor_offset(group, t);
    EXPECT_EQ(dbuf_group_tensor_numel(group, t, &tensor.numel), DBUF_OK);
    EXPECT_EQ(dbuf_group_tensor_granularity(group, t, &tensor.granularity), DBUF_OK);
    plan.tensors.push_back(std::move(tensor));
  }
  return plan;
}

dbuf_client* connectC(const EmbeddedDaemon& daemon) {
  dbuf_client* client = nullptr;
  EXPECT_EQ(dbuf_connect(daemon.socketPath().c_str(), kTimeoutMs, &client), DBUF_OK) << dbuf_last_error(nullptr);
  return client;
}

dbuf_attach_options attachOptions(const char* job, uint32_t rank, uint32_t world) {
  dbuf_attach_options options;
  EXPECT_EQ(dbuf_attach_options_init(&options, sizeof options), DBUF_OK);
  options.job = job;
  options.rank = rank;
  options.world_size = world;
  return options;
}

/// A C client connected and attached with `options` (null, the failure
/// recorded, otherwise).
dbuf_client* attachedC(const EmbeddedDaemon& daemon, const dbuf_attach_options& options) {
  dbuf_client* client = connectC(daemon);
  if (client == nullptr) return nullptr;
  if (dbuf_attach_ex(client, &options, kTimeoutMs) != DBUF_OK) {
    ADD_FAILURE() << "attach: " << dbuf_last_error(client);
    dbuf_client_free(client);
    return nullptr;
  }
  return client;
}

dbuf_tensor_spec tensorSpec(const char* name, const std::vector<int64_t>& shape, const char* granularity = nullptr,
                            int32_t tp_dim = -1) {
  dbuf_tensor_spec spec;
  EXPECT_EQ(dbuf_tensor_spec_init(&spec, sizeof spec), DBUF_OK);
  spec.name = name;
  spec.shape = shape.empty() ? nullptr : shape.data();
  spec.ndim = static_cast<uint32_t>(shape.size());
  spec.granularity = granularity;
  spec.tp_dim = tp_dim;
  return spec;
}

std::string lastError(const dbuf_client* client) {
  return dbuf_last_error(client);
}

std::vector<uint32_t> lastErrorRanks(const dbuf_client* client) {
  const uint32_t* ranks = nullptr;
  size_t count = 99;
  EXPECT_EQ(dbuf_last_error_ranks(client, &ranks, &count), DBUF_OK);
  if (count == 0) {
    EXPECT_EQ(ranks, nullptr);
    return {};
  }
  return {ranks, ranks + count};
}

/// Whether `address` lies in a mapping of this process (/proc/self/maps);
/// `path` gets the mapping's file ("" for anonymous memory).
bool mapped(const void* address, std::string* path = nullptr) {
  const auto at = reinterpret_cast<std::uintptr_t>(address);
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    std::istringstream fields(line);
    std::string range;
    std::string skip;
    fields >> range >> skip >> skip >> skip >> skip;
    const auto dash = range.find('-');
    const std::uintptr_t start = std::stoull(range.substr(0, dash), nullptr, 16);
    const std::uintptr_t end = std::stoull(range.substr(dash + 1), nullptr, 16);
    if (at < start || at >= end) continue;
    std::string file;
    std::getline(fields >> std::ws, file);
    if (path != nullptr) *path = file;
    return true;
  }
  return false;
}

/// A C interrupt check: counts its calls, and fires (1) from call `fire_at` on.
struct InterruptCounter {
  int calls = 0;
  int fire_at = 0;  // 0: never
};
extern "C" int countingInterrupt(void* data) {
  auto* counter = static_cast<InterruptCounter*>(data);
  ++counter->calls;
  return counter->fire_at != 0 && counter->calls >= counter->fire_at ? 1 : 0;
}

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
    EXPECT_EQ(dbuf_group_unregister(client, nullptr, kTimeoutMs), DBUF_INVALID_ARGUMENT);

    // Done with it: unregistered, every later call on it refused; freed as before.
    ASSERT_EQ(dbuf_group_unregister(client, group, kTimeoutMs), DBUF_OK) << dbuf_last_error(client);
    EXPECT_EQ(dbuf_group_unshard(client, group, kTimeoutMs), DBUF_INVALID_ARGUMENT);
    EXPECT_NE(std::string(dbuf_last_error(client)).find("unregistered"), std::string::npos) << dbuf_last_error(client);
    EXPECT_EQ(dbuf_group_unregister(client, group, kTimeoutMs), DBUF_INVALID_ARGUMENT);
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
  // dbufd closed that connection; the client connects again for a corrected attach.
  ASSERT_EQ(dbuf_attach(client, "c-errors", 1, 2, 0, 1, kTimeoutMs), DBUF_OK) << dbuf_last_error(client);
  EXPECT_EQ(dbuf_detach(client, kTimeoutMs), DBUF_OK) << dbuf_last_error(client);
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

TEST(CApi, HeaderCompilesAsC89AndDrivesAClientOfItsOwn) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  char why[512] = "";
  EXPECT_EQ(dbuf_c_header_client(daemon.socketPath().c_str(), why, sizeof why), 0)
      << "c_header_test.c: the check on that line failed: " << why;
  EXPECT_TRUE(waitUntil([&] { return daemonIsEmpty(daemon.stats()); }));
}

TEST(CApi, AttachExPassesEveryOption) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  dbuf_client* client = connectC(daemon);
  ASSERT_NE(client, nullptr);
  uint64_t instance = 99;
  ASSERT_EQ(dbuf_daemon_instance_id(client, &instance), DBUF_OK);
  EXPECT_EQ(instance, 0U) << "no WELCOME yet";

  // Defaults as documented.
  dbuf_attach_options options;
  std::memset(&options, 0xAB, sizeof options);
  ASSERT_EQ(dbuf_attach_options_init(&options, sizeof options), DBUF_OK);
  EXPECT_EQ(options.struct_size, sizeof options);
  EXPECT_EQ(options.job, nullptr);
  EXPECT_EQ(options.rank, 0U);
  EXPECT_EQ(options.world_size, 1U);
  EXPECT_EQ(options.local_rank, 0U);
  EXPECT_EQ(options.device, -1);
  EXPECT_EQ(options.persistent, 0);
  EXPECT_EQ(options.prefetch_depth, 1U);

  // prefetch depth 2: three unsharded slots, so a fourth group cannot get one.
  options.job = "c-attach";
  options.local_rank = 0;
  options.device = -1;
  options.prefetch_depth = 2;
  ASSERT_EQ(dbuf_attach_ex(client, &options, kTimeoutMs), DBUF_OK) << lastError(client);
  int reattached = -1;
  ASSERT_EQ(dbuf_reattached(client, &reattached), DBUF_OK);
  EXPECT_EQ(reattached, 0);
  ASSERT_EQ(dbuf_daemon_instance_id(client, &instance), DBUF_OK);
  EXPECT_NE(instance, 0U);
  uint32_t in_flight = 99;
  ASSERT_EQ(dbuf_in_flight(client, &in_flight), DBUF_OK);
  EXPECT_EQ(in_flight, 0U);
  std::vector<dbuf_group*> groups(4, nullptr);
  const std::vector<int64_t> shape{8, 8};
  const dbuf_tensor_spec tensor = tensorSpec("w", shape);
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const std::string name = "g" + std::to_string(g);
    ASSERT_EQ(dbuf_register_group_ex(client, name.c_str(), 1, &tensor, nullptr, kTimeoutMs, &groups[g]), DBUF_OK)
        << lastError(client);
  }
  for (std::size_t g = 0; g < 3; ++g) {
    EXPECT_EQ(dbuf_group_acquire_slot(client, groups[g], kTimeoutMs), DBUF_OK) << g << ": " << lastError(client);
  }
  EXPECT_EQ(dbuf_group_acquire_slot(client, groups[3], kTimeoutMs), DBUF_CONFLICT) << "only 2 + 1 slots";
  EXPECT_EQ(dbuf_group_acquire_slot_growing(client, groups[3], kTimeoutMs), DBUF_OK)
      << "a slot beyond the pool: " << lastError(client);
  EXPECT_EQ(dbuf_group_acquire_slot_growing(client, nullptr, kTimeoutMs), DBUF_INVALID_ARGUMENT);
  for (dbuf_group* group : groups) dbuf_group_free(group);

  // Another job: a rank of a world of 4 with its local rank; the same daemon.
  dbuf_client* other = connectC(daemon);
  ASSERT_NE(other, nullptr);
  dbuf_attach_options local = attachOptions("c-attach-local", 2, 4);
  local.local_rank = 2;
  ASSERT_EQ(dbuf_attach_ex(other, &local, kTimeoutMs), DBUF_OK) << lastError(other);
  uint64_t other_instance = 0;
  ASSERT_EQ(dbuf_daemon_instance_id(other, &other_instance), DBUF_OK);
  EXPECT_EQ(other_instance, instance);
  EXPECT_EQ(dbuf_detach(other, kTimeoutMs), DBUF_OK);
  dbuf_client_free(other);

  // Argument checks; none reaches the daemon, so the fresh client stays usable.
  dbuf_client* fresh = connectC(daemon);
  ASSERT_NE(fresh, nullptr);
  dbuf_attach_options good = attachOptions("c-attach-args", 0, 1);
  EXPECT_EQ(dbuf_attach_ex(nullptr, &good, kTimeoutMs), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(nullptr).find("NULL client"), std::string::npos) << lastError(nullptr);
  EXPECT_EQ(dbuf_last_error_status(nullptr), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_attach_ex(fresh, nullptr, kTimeoutMs), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(fresh).find("NULL options"), std::string::npos) << lastError(fresh);
  EXPECT_EQ(dbuf_attach_ex(fresh, &good, 0), DBUF_INVALID_ARGUMENT);
  dbuf_attach_options bad = good;
  bad.struct_size = sizeof(size_t);
  EXPECT_EQ(dbuf_attach_ex(fresh, &bad, kTimeoutMs), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(fresh).find("below its first version"), std::string::npos) << lastError(fresh);
  bad.struct_size = 1U << 20;  // never initialised
  EXPECT_EQ(dbuf_attach_ex(fresh, &bad, kTimeoutMs), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(fresh).find("not initialised"), std::string::npos) << lastError(fresh);
  bad = good;
  bad.job = nullptr;
  EXPECT_EQ(dbuf_attach_ex(fresh, &bad, kTimeoutMs), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(fresh).find("job is NULL"), std::string::npos) << lastError(fresh);
  bad = good;
  bad.device = -2;
  EXPECT_EQ(dbuf_attach_ex(fresh, &bad, kTimeoutMs), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(fresh).find("device -2"), std::string::npos) << lastError(fresh);
  EXPECT_EQ(dbuf_attach_options_init(nullptr, sizeof good), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_attach_options_init(&bad, 3), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(nullptr).find("dbuf_attach_options"), std::string::npos) << lastError(nullptr);
  // A caller built against a newer header: a longer struct. Fields this
  // library does not know must be zero (the init zeroes them).
  struct Newer {
    dbuf_attach_options known;
    uint64_t unknown;
  } newer{};
  std::memset(&newer, 0xCD, sizeof newer);
  ASSERT_EQ(dbuf_attach_options_init(&newer.known, sizeof newer), DBUF_OK);
  EXPECT_EQ(newer.known.struct_size, sizeof newer);
  EXPECT_EQ(newer.unknown, 0U);
  newer.known.job = "c-attach-args";
  newer.unknown = 1;
  EXPECT_EQ(dbuf_attach_ex(fresh, &newer.known, kTimeoutMs), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(fresh).find("does not know"), std::string::npos) << lastError(fresh);
  newer.unknown = 0;
  EXPECT_EQ(dbuf_attach_ex(fresh, &newer.known, kTimeoutMs), DBUF_OK) << lastError(fresh);
  // The accessors.
  EXPECT_EQ(dbuf_reattached(nullptr, &reattached), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_reattached(fresh, nullptr), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(fresh).find("dbuf_reattached: NULL output"), std::string::npos) << lastError(fresh);
  EXPECT_EQ(dbuf_daemon_instance_id(nullptr, &instance), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_daemon_instance_id(fresh, nullptr), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_in_flight(nullptr, &in_flight), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_in_flight(fresh, nullptr), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(fresh).find("dbuf_in_flight"), std::string::npos) << lastError(fresh);
  EXPECT_EQ(dbuf_detach(fresh, kTimeoutMs), DBUF_OK);
  dbuf_client_free(fresh);

  EXPECT_EQ(dbuf_detach(client, kTimeoutMs), DBUF_OK) << lastError(client);
  dbuf_client_free(client);
  EXPECT_TRUE(waitUntil([&] { return daemonIsEmpty(daemon.stats()); }));
}

TEST(CApi, RegisterGroupExGivesTheCppApisPlan) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  constexpr uint32_t kWorld = 2;
  // w: its own granularity (4 rows of 16); b: a vector; q: a tp_dim, which
  // makes its blocks whole slices of 6 x 8 (the group's rows:2 would be 16).
  const std::vector<int64_t> w_shape{30, 16};
  const std::vector<int64_t> b_shape{7};
  const std::vector<int64_t> q_shape{4, 6, 8};
  GroupSpec spec;
  spec.name = "layer";
  spec.tensors = {{"w", w_shape, "rows:4", -1}, {"b", b_shape, "", -1}, {"q", q_shape, "", 1}};
  spec.granularity = "rows:2";
  spec.sharded_dtype = DType::kF32;
  spec.unsharded_dtype = DType::kBF16;
  spec.align_bytes = 64;
  onRanks(kWorld, [&](uint32_t rank) {
    dbuf_client* client = attachedC(daemon, attachOptions("c-plan", rank, kWorld));
    ASSERT_NE(client, nullptr);
    const dbuf_tensor_spec tensors[] = {tensorSpec("w", w_shape, "rows:4"), tensorSpec("b", b_shape),
                                        tensorSpec("q", q_shape, "", 1)};
    dbuf_group_options options;
    ASSERT_EQ(dbuf_group_options_init(&options, sizeof options), DBUF_OK);
    EXPECT_EQ(options.granularity, nullptr);
    EXPECT_EQ(options.align_bytes, 16U);
    EXPECT_EQ(options.reserved, 0U);
    options.granularity = "rows:2";
    options.sharded_dtype = "fp32";
    options.unsharded_dtype = "bf16";
    options.align_bytes = 64;
    dbuf_group* group = nullptr;
    ASSERT_EQ(dbuf_register_group_ex(client, "layer", 3, tensors, &options, kTimeoutMs, &group), DBUF_OK)
        << lastError(client);
    ASSERT_NE(group, nullptr);

    // The same spec through the C++ API, in a job of its own.
    auto cxx = daemon.attach(rankOf("cxx-plan", rank, kWorld));
    ASSERT_TRUE(cxx.ok()) << messageOf(cxx);
    auto cxx_group = cxx->registerGroup(spec);
    ASSERT_TRUE(cxx_group.ok()) << messageOf(cxx_group);
    const GroupPlan plan = planOf(group);
    EXPECT_EQ(describe(plan), describe(cxx_group->plan()));
    // Known values: blocks of 4 x 16, 1 and 6 x 8; bf16 offsets aligned to 64 bytes.
    ASSERT_EQ(plan.tensors.size(), 3U);
    EXPECT_EQ(plan.devices, kWorld);
    EXPECT_EQ(plan.tensors[0].granularity, 64);
    EXPECT_EQ(plan.tensors[1].granularity, 1);
    EXPECT_EQ(plan.tensors[2].granularity, 48);
    EXPECT_EQ(plan.tensors[2].numel, 4 * 6 * 8);
    EXPECT_EQ(plan.tensors[2].shape, q_shape);
    for (const PlacedTensor& tensor : plan.tensors) EXPECT_EQ(tensor.offset % 32, 0) << tensor.name;
    const char* name = nullptr;
    ASSERT_EQ(dbuf_group_name(group, &name), DBUF_OK);
    EXPECT_STREQ(name, "layer");
    uint32_t group_rank = 99;
    ASSERT_EQ(dbuf_group_rank(group, &group_rank), DBUF_OK);
    EXPECT_EQ(group_rank, rank);
    uint64_t shard_bytes = 0;
    ASSERT_EQ(dbuf_group_shard_bytes(group, &shard_bytes), DBUF_OK);
    EXPECT_EQ(shard_bytes, cxx_group->shardBytes());
    EXPECT_GE(shard_bytes, static_cast<uint64_t>(plan.shard_elems) * 4 * 2) << "fp32 shard + gradient";
    // The old entry point, same tensors but the group's rule and alignment:
    // coarser blocks for w, finer for q.
    const char* names[] = {"w", "b", "q"};
    const uint32_t ranks[] = {2, 1, 3};
    const int64_t shapes[] = {30, 16, 7, 4, 6, 8};
    dbuf_group* plain = nullptr;
    ASSERT_EQ(
        dbuf_register_group(client, "plain", 3, names, ranks, shapes, "rows:2", "fp32", "bf16", kTimeoutMs, &plain),
        DBUF_OK)
        << lastError(client);
    const GroupPlan plain_plan = planOf(plain);
    ASSERT_EQ(plain_plan.tensors.size(), 3U);
    EXPECT_EQ(plain_plan.tensors[0].granularity, 32);
    EXPECT_EQ(plain_plan.tensors[2].granularity, 16);

    // unsharded follows the slot.
    int unsharded = -1;
    ASSERT_EQ(dbuf_group_is_unsharded(group, &unsharded), DBUF_OK);
    EXPECT_EQ(unsharded, 0);
    ASSERT_EQ(dbuf_group_unshard(client, group, kTimeoutMs), DBUF_OK) << lastError(client);
    ASSERT_EQ(dbuf_group_is_unsharded(group, &unsharded), DBUF_OK);
    EXPECT_EQ(unsharded, 1);
    dbuf_tensor_view view{};
    ASSERT_EQ(dbuf_group_view(client, group, 2, DBUF_REGION_UNSHARDED, &view), DBUF_OK);
    EXPECT_EQ(view.end - view.begin, plan.tensors[2].numel);
    ASSERT_EQ(dbuf_group_reshard(client, group, kTimeoutMs), DBUF_OK) << lastError(client);
    ASSERT_EQ(dbuf_group_is_unsharded(group, &unsharded), DBUF_OK);
    EXPECT_EQ(unsharded, 0);

    dbuf_group_free(plain);
    dbuf_group_free(group);
    EXPECT_EQ(dbuf_detach(client, kTimeoutMs), DBUF_OK) << lastError(client);
    dbuf_client_free(client);
    EXPECT_TRUE(cxx->detach().ok());
  });
  EXPECT_TRUE(waitUntil([&] { return daemonIsEmpty(daemon.stats()); }));
}

TEST(CApi, RegisterGroupExAndThePlanAccessorsCheckTheirArguments) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  dbuf_client* client = attachedC(daemon, attachOptions("c-register-args", 0, 1));
  ASSERT_NE(client, nullptr);
  const std::vector<int64_t> shape{8, 8};
  const dbuf_tensor_spec good = tensorSpec("w", shape);
  const dbuf_tensor_spec second = tensorSpec("v", shape);
  dbuf_group* group = nullptr;

  // Each bad call: DBUF_INVALID_ARGUMENT, no group, and a message saying why.
  const auto refused = [&](const dbuf_tensor_spec* tensors, size_t count, const dbuf_group_options* options,
                           const std::string& expected) {
    dbuf_group* out = reinterpret_cast<dbuf_group*>(&group);  // not NULL: must be reset
    EXPECT_EQ(dbuf_register_group_ex(client, "bad", count, tensors, options, kTimeoutMs, &out), DBUF_INVALID_ARGUMENT)
        << expected;
    EXPECT_EQ(out, nullptr) << expected;
    EXPECT_NE(lastError(client).find(expected), std::string::npos) << lastError(client);
  };
  EXPECT_EQ(dbuf_register_group_ex(nullptr, "bad", 1, &good, nullptr, kTimeoutMs, &group), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(nullptr).find("NULL client"), std::string::npos);
  EXPECT_EQ(dbuf_register_group_ex(client, "bad", 1, &good, nullptr, kTimeoutMs, nullptr), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_register_group_ex(client, nullptr, 1, &good, nullptr, kTimeoutMs, &group), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_register_group_ex(client, "bad", 1, &good, nullptr, 0, &group), DBUF_INVALID_ARGUMENT);
  refused(nullptr, 1, nullptr, "tensors is NULL");
  refused(&good, 100000, nullptr, "tensor_count 100000");
  dbuf_tensor_spec two[] = {good, second};
  two[0].struct_size = 4;
  refused(two, 2, nullptr, "tensors[0].struct_size 4");
  two[0].struct_size = 5000;
  refused(two, 2, nullptr, "not initialised");
  two[0] = good;
  two[1].struct_size = sizeof good + 8;
  refused(two, 2, nullptr, "tensors[1].struct_size");
  two[1] = second;
  two[1].ndim = DBUF_MAX_NDIM + 1;
  refused(two, 2, nullptr, "9 dims");
  two[1] = second;
  two[1].shape = nullptr;
  refused(two, 2, nullptr, "shape is NULL");
  two[1] = second;
  two[1].name = nullptr;
  refused(two, 2, nullptr, "tensor name is NULL");
  two[1] = second;
  two[1].tp_dim = 5;  // refused on the way to the daemon: tp_dim does travel
  refused(two, 2, nullptr, "tp_dim");
  two[1] = second;
  two[1].granularity = "rows:zero";  // the tensor's own rule reaches the planner
  refused(two, 2, nullptr, "rows:zero");
  two[1] = good;  // a second 'w' could not be found by its name
  refused(two, 2, nullptr, "tensor 'w' is named twice");
  dbuf_group_options options;
  ASSERT_EQ(dbuf_group_options_init(&options, sizeof options), DBUF_OK);
  options.struct_size = 0;
  refused(&good, 1, &options, "dbuf_group_options.struct_size 0");
  ASSERT_EQ(dbuf_group_options_init(&options, sizeof options), DBUF_OK);
  options.reserved = 1;
  refused(&good, 1, &options, "reserved must be 0");
  options.reserved = 0;
  options.sharded_dtype = "fp33";
  refused(&good, 1, &options, "unknown sharded dtype 'fp33'");
  options.sharded_dtype = nullptr;
  options.unsharded_dtype = "int4";
  refused(&good, 1, &options, "unknown unsharded dtype 'int4'");
  options.unsharded_dtype = nullptr;
  options.align_bytes = 0;  // reaches the planner
  refused(&good, 1, &options, "alignment");
  EXPECT_EQ(dbuf_group_options_init(nullptr, sizeof options), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_tensor_spec_init(nullptr, sizeof good), DBUF_INVALID_ARGUMENT);
  dbuf_tensor_spec spec;
  EXPECT_EQ(dbuf_tensor_spec_init(&spec, 1), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(nullptr).find("dbuf_tensor_spec"), std::string::npos) << lastError(nullptr);
  ASSERT_EQ(dbuf_tensor_spec_init(&spec, sizeof spec), DBUF_OK);
  EXPECT_EQ(spec.tp_dim, -1);
  EXPECT_EQ(spec.granularity, nullptr);
  EXPECT_EQ(spec.ndim, 0U);

  // A newer caller's longer specs: the array's stride is their struct_size.
  struct Newer {
    dbuf_tensor_spec known;
    uint64_t unknown;
  };
  Newer newer[2];
  const std::vector<int64_t> bias{5};
  for (Newer& tensor : newer) ASSERT_EQ(dbuf_tensor_spec_init(&tensor.known, sizeof(Newer)), DBUF_OK);
  newer[0].known.name = "w";
  newer[0].known.shape = shape.data();
  newer[0].known.ndim = 2;
  newer[1].known.name = "b";
  newer[1].known.shape = bias.data();
  newer[1].known.ndim = 1;
  newer[1].unknown = 7;
  dbuf_group* out = nullptr;
  EXPECT_EQ(dbuf_register_group_ex(client, "newer", 2, &newer[0].known, nullptr, kTimeoutMs, &out),
            DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(client).find("tensors[1] sets fields past byte"), std::string::npos) << lastError(client);
  newer[1].unknown = 0;
  ASSERT_EQ(dbuf_register_group_ex(client, "newer", 2, &newer[0].known, nullptr, kTimeoutMs, &out), DBUF_OK)
      << lastError(client);
  const dbuf_tensor_spec same[] = {tensorSpec("w", shape), tensorSpec("b", bias)};
  ASSERT_EQ(dbuf_register_group_ex(client, "same", 2, same, nullptr, kTimeoutMs, &group), DBUF_OK) << lastError(client);
  GroupPlan newer_plan = planOf(out);
  GroupPlan same_plan = planOf(group);
  EXPECT_NE(newer_plan.group_id, same_plan.group_id);
  newer_plan.group_id = same_plan.group_id;
  EXPECT_EQ(describe(newer_plan), describe(same_plan));
  dbuf_group_free(out);

  // The plan accessors: a NULL group (the thread keeps the message), a NULL
  // output (the group's client keeps it), a tensor out of range.
  const char* text = nullptr;
  const int64_t* dims = nullptr;
  uint32_t u32 = 0;
  uint64_t u64 = 0;
  int64_t i64 = 0;
  int flag = 0;
  EXPECT_EQ(dbuf_group_name(nullptr, &text), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(nullptr).find("dbuf_group_name: NULL group"), std::string::npos) << lastError(nullptr);
  EXPECT_EQ(dbuf_group_name(group, nullptr), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(client).find("dbuf_group_name: NULL output"), std::string::npos) << lastError(client);
  EXPECT_EQ(dbuf_group_id(nullptr, &u32), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_group_id(group, nullptr), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_group_devices(nullptr, &u32), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_group_devices(group, nullptr), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_group_rank(nullptr, &u32), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_group_rank(group, nullptr), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_group_shard_bytes(nullptr, &u64), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_group_shard_bytes(group, nullptr), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_group_is_unsharded(nullptr, &flag), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_group_is_unsharded(group, nullptr), DBUF_INVALID_ARGUMENT);
  const auto tensor_refused = [&](dbuf_status status, const char* what) {
    EXPECT_EQ(status, DBUF_INVALID_ARGUMENT) << what;
    EXPECT_NE(lastError(client).find(std::string(what) + ": tensor 2 of a group of 2"), std::string::npos)
        << lastError(client);
  };
  tensor_refused(dbuf_group_tensor_name(group, 2, &text), "dbuf_group_tensor_name");
  tensor_refused(dbuf_group_tensor_ndim(group, 2, &u32), "dbuf_group_tensor_ndim");
  tensor_refused(dbuf_group_tensor_shape(group, 2, &dims, &u32), "dbuf_group_tensor_shape");
  tensor_refused(dbuf_group_tensor_numel(group, 2, &i64), "dbuf_group_tensor_numel");
  tensor_refused(dbuf_group_tensor_granularity(group, 2, &i64), "dbuf_group_tensor_granularity");
  EXPECT_EQ(dbuf_group_tensor_name(nullptr, 0, &text), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_group_tensor_name(group, 0, nullptr), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_group_tensor_ndim(nullptr, 0, &u32), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_group_tensor_ndim(group, 0, nullptr), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_group_tensor_shape(nullptr, 0, &dims, &u32), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_group_tensor_shape(group, 0, nullptr, &u32), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_group_tensor_shape(group, 0, &dims, nullptr), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_group_tensor_numel(nullptr, 0, &i64), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_group_tensor_numel(group, 0, nullptr), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_group_tensor_granularity(nullptr, 0, &i64), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_group_tensor_granularity(group, 0, nullptr), DBUF_INVALID_ARGUMENT);
  // And the good calls still answer.
  ASSERT_EQ(dbuf_group_tensor_shape(group, 1, &dims, &u32), DBUF_OK);
  ASSERT_EQ(u32, 1U);
  EXPECT_EQ(dims[0], 5);
  ASSERT_EQ(dbuf_group_tensor_numel(group, 0, &i64), DBUF_OK);
  EXPECT_EQ(i64, 64);

  dbuf_group_free(group);
  EXPECT_EQ(dbuf_detach(client, kTimeoutMs), DBUF_OK) << lastError(client);
  dbuf_client_free(client);
  EXPECT_TRUE(waitUntil([&] { return daemonIsEmpty(daemon.stats()); }));
}

TEST(CApi, WaitResultGivesIncreasingSequencesAndInFlightCounts) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  constexpr uint32_t kWorld = 2;
  constexpr std::size_t kOps = 3;
  std::vector<dbuf_client*> clients(kWorld, nullptr);
  for (uint32_t rank = 0; rank < kWorld; ++rank) {
    clients[rank] = connectC(daemon);
    ASSERT_NE(clients[rank], nullptr);
    const dbuf_attach_options attach = attachOptions("c-seq", rank, kWorld);
    ASSERT_EQ(dbuf_attach_ex(clients[rank], &attach, kTimeoutMs), DBUF_OK) << lastError(clients[rank]);
  }
  dbuf_client* const c0 = clients[0];
  dbuf_client* const c1 = clients[1];
  uint32_t in_flight = 99;

  // Rank 0 submits barriers rank 1 has not joined: they stay in flight.
  std::vector<dbuf_op> ops(kOps, 0);
  for (std::size_t i = 0; i < kOps; ++i) {
    ASSERT_EQ(dbuf_submit(c0, nullptr, DBUF_OP_BARRIER, nullptr, 0, 1, kTimeoutMs, &ops[i]), DBUF_OK) << lastError(c0);
    ASSERT_EQ(dbuf_in_flight(c0, &in_flight), DBUF_OK);
    EXPECT_EQ(in_flight, i + 1);
  }
  // Rank 1 joins them one by one; each completes with the next sequence number.
  std::vector<uint64_t> sequences;
  for (std::size_t i = 0; i < kOps; ++i) {
    dbuf_op op = 0;
    ASSERT_EQ(dbuf_submit(c1, nullptr, DBUF_OP_BARRIER, nullptr, 0, 1, kTimeoutMs, &op), DBUF_OK) << lastError(c1);
    ASSERT_EQ(dbuf_in_flight(c1, &in_flight), DBUF_OK);
    EXPECT_EQ(in_flight, 1U);
    dbuf_op_result result;
    ASSERT_EQ(dbuf_op_result_init(&result, sizeof result), DBUF_OK);
    ASSERT_EQ(dbuf_wait_result(c1, op, kTimeoutMs, &result), DBUF_OK) << lastError(c1);
    EXPECT_EQ(result.struct_size, sizeof result);
    EXPECT_GE(result.wait_ns, 0);
    EXPECT_GE(result.run_ns, 0);
    if (!sequences.empty()) {
      EXPECT_EQ(result.sequence, sequences.back() + 1);
    }
    sequences.push_back(result.sequence);
    ASSERT_EQ(dbuf_in_flight(c1, &in_flight), DBUF_OK);
    EXPECT_EQ(in_flight, 0U);
  }

  // Argument checks come before the wait: the op stays in flight.
  dbuf_op_result result;
  ASSERT_EQ(dbuf_op_result_init(&result, sizeof result), DBUF_OK);
  EXPECT_EQ(dbuf_wait_result(nullptr, ops[0], kTimeoutMs, &result), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_wait_result(c0, ops[0], kTimeoutMs, nullptr), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(c0).find("NULL result"), std::string::npos) << lastError(c0);
  EXPECT_EQ(dbuf_wait_result(c0, ops[0], 0, &result), DBUF_INVALID_ARGUMENT);
  dbuf_op_result small = result;
  small.struct_size = 8;
  EXPECT_EQ(dbuf_wait_result(c0, ops[0], kTimeoutMs, &small), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(c0).find("dbuf_op_result.struct_size 8"), std::string::npos) << lastError(c0);
  EXPECT_EQ(dbuf_op_result_init(nullptr, sizeof result), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_op_result_init(&small, 8), DBUF_INVALID_ARGUMENT);

  // Rank 0's ops: the same sequence numbers, in order; a newer caller's
  // longer result gets the fields past ours zeroed.
  struct Newer {
    dbuf_op_result known;
    uint64_t unknown;
  };
  for (std::size_t i = 0; i < kOps; ++i) {
    Newer newer{};
    ASSERT_EQ(dbuf_op_result_init(&newer.known, sizeof newer), DBUF_OK);
    newer.unknown = 0xFFFFFFFFFFFFFFFFULL;
    ASSERT_EQ(dbuf_wait_result(c0, ops[i], kTimeoutMs, &newer.known), DBUF_OK) << i << ": " << lastError(c0);
    EXPECT_EQ(newer.known.struct_size, sizeof newer);
    EXPECT_EQ(newer.known.sequence, sequences[i]);
    EXPECT_EQ(newer.unknown, 0U);
    ASSERT_EQ(dbuf_in_flight(c0, &in_flight), DBUF_OK);
    EXPECT_EQ(in_flight, 0U) << "all completions were collected by the first wait";
  }
  // An op waited for already: refused, *out untouched.
  result.sequence = 12345;
  EXPECT_EQ(dbuf_wait_result(c0, ops[0], kTimeoutMs, &result), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(result.sequence, 12345U);

  // A gather counts among the collectives too; dbuf_run / dbuf_wait go on working beside it.
  const std::vector<int64_t> shape{8, 8};
  const dbuf_tensor_spec tensor = tensorSpec("w", shape);
  std::vector<dbuf_group*> groups(kWorld, nullptr);
  onRanks(kWorld, [&](uint32_t rank) {
    ASSERT_EQ(dbuf_register_group_ex(clients[rank], "layer", 1, &tensor, nullptr, kTimeoutMs, &groups[rank]), DBUF_OK)
        << lastError(clients[rank]);
    ASSERT_EQ(dbuf_group_acquire_slot(clients[rank], groups[rank], kTimeoutMs), DBUF_OK);
    dbuf_op op = 0;
    ASSERT_EQ(dbuf_submit(clients[rank], groups[rank], DBUF_OP_ALL_GATHER, nullptr, 0, 1, kTimeoutMs, &op), DBUF_OK);
    dbuf_op_result gathered;
    ASSERT_EQ(dbuf_op_result_init(&gathered, sizeof gathered), DBUF_OK);
    ASSERT_EQ(dbuf_wait_result(clients[rank], op, kTimeoutMs, &gathered), DBUF_OK) << lastError(clients[rank]);
    EXPECT_EQ(gathered.sequence, sequences.back() + 1);
    EXPECT_EQ(dbuf_run(clients[rank], nullptr, DBUF_OP_BARRIER, nullptr, 0, kTimeoutMs), DBUF_OK);
    ASSERT_EQ(dbuf_group_reshard(clients[rank], groups[rank], kTimeoutMs), DBUF_OK);
  });
  for (uint32_t rank = 0; rank < kWorld; ++rank) {
    dbuf_group_free(groups[rank]);
    EXPECT_EQ(dbuf_detach(clients[rank], kTimeoutMs), DBUF_OK) << lastError(clients[rank]);
    dbuf_client_free(clients[rank]);
  }
  EXPECT_TRUE(waitUntil([&] { return daemonIsEmpty(daemon.stats()); }));
}

TEST(CApi, AReattachingRankOfAPersistentJobIsToldSo) {
  EmbeddedDaemon daemon;  // default grace: minutes, longer than this test
  ASSERT_TRUE(daemon.started());
  const std::vector<int64_t> shape{16, 8};
  const dbuf_tensor_spec tensor = tensorSpec("w", shape);
  uint64_t first_instance = 0;
  {
    dbuf_attach_options attach = attachOptions("c-keep", 0, 1);
    attach.persistent = 1;
    dbuf_client* client = attachedC(daemon, attach);
    ASSERT_NE(client, nullptr);
    int reattached = -1;
    ASSERT_EQ(dbuf_reattached(client, &reattached), DBUF_OK);
    EXPECT_EQ(reattached, 0) << "a new job";
    ASSERT_EQ(dbuf_daemon_instance_id(client, &first_instance), DBUF_OK);
    dbuf_group* group = nullptr;
    ASSERT_EQ(dbuf_register_group_ex(client, "weights", 1, &tensor, nullptr, kTimeoutMs, &group), DBUF_OK)
        << lastError(client);
    dbuf_tensor_view view{};
    ASSERT_EQ(dbuf_group_view(client, group, 0, DBUF_REGION_SHARD, &view), DBUF_OK);
    ASSERT_EQ(view.end - view.begin, 16 * 8);
    for (int64_t e = view.begin; e < view.end; ++e) static_cast<float*>(view.data)[e] = static_cast<float>(e) + 0.5F;
    dbuf_group_free(group);
    ASSERT_EQ(dbuf_detach(client, kTimeoutMs), DBUF_OK) << lastError(client);
    dbuf_client_free(client);
  }
  EXPECT_EQ(daemon.stats().jobs, 1U) << "the persistent job outlives its rank";
  {
    dbuf_attach_options attach = attachOptions("c-keep", 0, 1);
    attach.persistent = 1;
    dbuf_client* client = attachedC(daemon, attach);
    ASSERT_NE(client, nullptr);
    int reattached = -1;
    ASSERT_EQ(dbuf_reattached(client, &reattached), DBUF_OK);
    EXPECT_EQ(reattached, 1);
    uint64_t instance = 0;
    ASSERT_EQ(dbuf_daemon_instance_id(client, &instance), DBUF_OK);
    EXPECT_EQ(instance, first_instance);
    dbuf_group* group = nullptr;
    ASSERT_EQ(dbuf_register_group_ex(client, "weights", 1, &tensor, nullptr, kTimeoutMs, &group), DBUF_OK)
        << lastError(client);
    dbuf_tensor_view view{};
    ASSERT_EQ(dbuf_group_view(client, group, 0, DBUF_REGION_SHARD, &view), DBUF_OK);
    int64_t wrong = 0;
    for (int64_t e = view.begin; e < view.end; ++e) {
      wrong += static_cast<const float*>(view.data)[e] != static_cast<float>(e) + 0.5F ? 1 : 0;
    }
    EXPECT_EQ(wrong, 0) << "the shard as it was left";
    dbuf_group_free(group);
    ASSERT_EQ(dbuf_detach(client, kTimeoutMs), DBUF_OK) << lastError(client);
    dbuf_client_free(client);
  }
}

TEST(CApi, TheLastErrorKeepsItsStatusAndRanks) {
  // Status names: every value, and one that is none.
  const char* const names[] = {"DBUF_OK",         "DBUF_INVALID_ARGUMENT", "DBUF_NOT_FOUND",         "DBUF_IO",
                               "DBUF_INFEASIBLE", "DBUF_INTERNAL",         "DBUF_PERMISSION_DENIED", "DBUF_CONFLICT",
                               "DBUF_TIMEOUT",    "DBUF_UNAVAILABLE",      "DBUF_WOULD_BLOCK",       "DBUF_DEVICE",
                               "DBUF_CANCELLED"};
  for (int status = 0; status <= DBUF_CANCELLED; ++status) {
    EXPECT_STREQ(dbuf_status_name(static_cast<dbuf_status>(status)), names[status]);
  }
  EXPECT_STREQ(dbuf_status_name(static_cast<dbuf_status>(DBUF_CANCELLED + 1)), "DBUF_UNKNOWN_STATUS");
  dbuf_status negative = DBUF_OK;  // as a C caller may pass it
  static_assert(sizeof negative == sizeof(int));
  const int minus_one = -1;
  std::memcpy(&negative, &minus_one, sizeof minus_one);
  EXPECT_STREQ(dbuf_status_name(negative), "DBUF_UNKNOWN_STATUS");

  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  constexpr uint32_t kWorld = 2;
  std::vector<std::vector<uint32_t>> c_ranks(kWorld);
  std::vector<std::vector<uint32_t>> cxx_ranks(kWorld);
  onRanks(kWorld, [&](uint32_t rank) {
    dbuf_client* client = connectC(daemon);
    ASSERT_NE(client, nullptr);
    EXPECT_EQ(dbuf_last_error_status(client), DBUF_OK) << "nothing failed yet";
    EXPECT_STREQ(dbuf_last_error(client), "");
    EXPECT_TRUE(lastErrorRanks(client).empty());
    const dbuf_attach_options attach = attachOptions("c-mismatch", rank, kWorld);
    ASSERT_EQ(dbuf_attach_ex(client, &attach, kTimeoutMs), DBUF_OK) << lastError(client);

    // An argument error names no rank.
    dbuf_group* group = nullptr;
    EXPECT_EQ(dbuf_register_group_ex(client, "layer", 1, nullptr, nullptr, kTimeoutMs, &group), DBUF_INVALID_ARGUMENT);
    EXPECT_EQ(dbuf_last_error_status(client), DBUF_INVALID_ARGUMENT);
    EXPECT_TRUE(lastErrorRanks(client).empty());
    // A bad call of the getter itself leaves the error it reports.
    const std::string before = lastError(client);
    size_t count = 0;
    const uint32_t* ranks = nullptr;
    EXPECT_EQ(dbuf_last_error_ranks(client, nullptr, &count), DBUF_INVALID_ARGUMENT);
    EXPECT_EQ(dbuf_last_error_ranks(client, &ranks, nullptr), DBUF_INVALID_ARGUMENT);
    EXPECT_EQ(lastError(client), before);

    // The ranks disagree on the group: both fail, and the error is about both.
    const std::vector<int64_t> shape{8, rank == 0 ? int64_t{8} : int64_t{16}};
    const dbuf_tensor_spec tensor = tensorSpec("w", shape);
    EXPECT_EQ(dbuf_register_group_ex(client, "layer", 1, &tensor, nullptr, kTimeoutMs, &group), DBUF_CONFLICT);
    EXPECT_EQ(group, nullptr);
    EXPECT_EQ(dbuf_last_error_status(client), DBUF_CONFLICT);
    EXPECT_NE(lastError(client).find("disagree"), std::string::npos) << lastError(client);
    c_ranks[rank] = lastErrorRanks(client);
    // A later call that succeeds leaves it in place.
    uint32_t in_flight = 0;
    ASSERT_EQ(dbuf_in_flight(client, &in_flight), DBUF_OK);
    EXPECT_EQ(dbuf_last_error_status(client), DBUF_CONFLICT);
    EXPECT_EQ(lastErrorRanks(client), c_ranks[rank]);

    // The same disagreement through the C++ API: the C API hands on its ranks.
    auto cxx = daemon.attach(rankOf("cxx-mismatch", rank, kWorld));
    ASSERT_TRUE(cxx.ok()) << messageOf(cxx);
    GroupSpec spec;
    spec.name = "layer";
    spec.tensors = {{"w", shape, "", -1}};
    auto cxx_group = cxx->registerGroup(spec);
    EXPECT_FAILS_WITH(cxx_group, ErrorCode::kConflict);
    cxx_ranks[rank] = cxx_group.error().ranks;

    EXPECT_EQ(dbuf_detach(client, kTimeoutMs), DBUF_OK) << lastError(client);
    dbuf_client_free(client);
    EXPECT_TRUE(cxx->detach().ok());
  });
  for (uint32_t rank = 0; rank < kWorld; ++rank) {
    EXPECT_EQ(c_ranks[rank], cxx_ranks[rank]) << "rank " << rank;
    // dbufd names both ranks once it fills Error::ranks (empty before that).
    if (!c_ranks[rank].empty()) {
      EXPECT_EQ(c_ranks[rank], (std::vector<uint32_t>{0, 1})) << "rank " << rank;
    }
  }

  // A thread's own last error: none yet on a new thread; a failed connect's after.
  std::thread([] {
    EXPECT_EQ(dbuf_last_error_status(nullptr), DBUF_OK);
    EXPECT_STREQ(dbuf_last_error(nullptr), "no client");
    EXPECT_TRUE(lastErrorRanks(nullptr).empty());
    EXPECT_EQ(dbuf_connect("/nonexistent/dbuf.sock", kTimeoutMs, nullptr), DBUF_INVALID_ARGUMENT);
    EXPECT_EQ(dbuf_last_error_status(nullptr), DBUF_INVALID_ARGUMENT);
    dbuf_client* client = nullptr;
    EXPECT_EQ(dbuf_connect("/nonexistent/dbuf.sock", kTimeoutMs, &client), DBUF_UNAVAILABLE);
    EXPECT_EQ(dbuf_last_error_status(nullptr), DBUF_UNAVAILABLE);
    EXPECT_TRUE(lastErrorRanks(nullptr).empty());
  }).join();
  EXPECT_TRUE(waitUntil([&] { return daemonIsEmpty(daemon.stats()); }));
}

}  // namespace
}  // namespace dbuf::integration

namespace dbuf::integration {
namespace {

TEST(CApi, AnInterruptCheckCancelsAWaitAndTheOpCanBeWaitedAgain) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  InterruptCounter counter;
  dbuf_connect_options options;
  ASSERT_EQ(dbuf_connect_options_init(&options, sizeof options), DBUF_OK);
  options.socket_path = daemon.socketPath().c_str();
  options.interrupted = countingInterrupt;
  options.interrupt_data = &counter;
  dbuf_client* c0 = nullptr;
  ASSERT_EQ(dbuf_connect_ex(&options, &c0), DBUF_OK) << lastError(nullptr);
  dbuf_client* c1 = connectC(daemon);
  ASSERT_NE(c1, nullptr);
  const dbuf_attach_options a0 = attachOptions("c-interrupt", 0, 2);
  const dbuf_attach_options a1 = attachOptions("c-interrupt", 1, 2);
  ASSERT_EQ(dbuf_attach_ex(c0, &a0, kTimeoutMs), DBUF_OK) << lastError(c0);
  ASSERT_EQ(dbuf_attach_ex(c1, &a1, kTimeoutMs), DBUF_OK) << lastError(c1);

  // A barrier rank 1 has not joined: the wait asks the check until it fires.
  dbuf_op op = 0;
  ASSERT_EQ(dbuf_submit(c0, nullptr, DBUF_OP_BARRIER, nullptr, 0, 1, kTimeoutMs, &op), DBUF_OK) << lastError(c0);
  constexpr int kFireAt = 3;
  counter.calls = 0;
  counter.fire_at = kFireAt;
  const auto start = Clock::now();
  EXPECT_EQ(dbuf_wait(c0, op, kTimeoutMs), DBUF_CANCELLED);
  const auto elapsed = Clock::now() - start;
  EXPECT_EQ(counter.calls, kFireAt) << "the wait ends at the first non-zero answer";
  EXPECT_LT(elapsed, 2s) << "cancelled, not timed out";
  EXPECT_EQ(dbuf_last_error_status(c0), DBUF_CANCELLED);
  EXPECT_STRNE(dbuf_last_error(c0), "");
  uint32_t in_flight = 0;
  ASSERT_EQ(dbuf_in_flight(c0, &in_flight), DBUF_OK);
  EXPECT_EQ(in_flight, 1U) << "the op is still in flight";

  // Rank 1 joins: the same op, waited for again, completes.
  counter.fire_at = 0;
  ASSERT_EQ(dbuf_run(c1, nullptr, DBUF_OP_BARRIER, nullptr, 0, kTimeoutMs), DBUF_OK) << lastError(c1);
  EXPECT_EQ(dbuf_wait(c0, op, kTimeoutMs), DBUF_OK) << lastError(c0);
  ASSERT_EQ(dbuf_in_flight(c0, &in_flight), DBUF_OK);
  EXPECT_EQ(in_flight, 0U);
  // A check that does not fire changes nothing: the client goes on.
  EXPECT_EQ(dbuf_run(c0, nullptr, DBUF_OP_NOOP, nullptr, 0, kTimeoutMs), DBUF_OK) << lastError(c0);

  EXPECT_EQ(dbuf_detach(c0, kTimeoutMs), DBUF_OK) << lastError(c0);
  EXPECT_EQ(dbuf_detach(c1, kTimeoutMs), DBUF_OK) << lastError(c1);
  dbuf_client_free(c0);
  dbuf_client_free(c1);
  EXPECT_TRUE(waitUntil([&] { return daemonIsEmpty(daemon.stats()); }));
}

TEST(CApi, ConnectExPinsAndMemoryDeviceCheckTheirArguments) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());

  // dbuf_connect_options_init: the documented defaults.
  dbuf_connect_options options;
  std::memset(&options, 0xAB, sizeof options);
  ASSERT_EQ(dbuf_connect_options_init(&options, sizeof options), DBUF_OK);
  EXPECT_EQ(options.struct_size, sizeof options);
  EXPECT_EQ(options.socket_path, nullptr);
  EXPECT_EQ(options.timeout_ms, 10000);
  EXPECT_EQ(options.interrupted, nullptr);
  EXPECT_EQ(options.interrupt_data, nullptr);
  EXPECT_EQ(dbuf_connect_options_init(nullptr, sizeof options), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(dbuf_connect_options_init(&options, 3), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(nullptr).find("dbuf_connect_options"), std::string::npos) << lastError(nullptr);
  EXPECT_EQ(dbuf_connect_options_init(&options, 5000), DBUF_INVALID_ARGUMENT);

  // dbuf_connect_ex: failures go to the thread, and *out is NULL.
  dbuf_client* client = reinterpret_cast<dbuf_client*>(&options);  // not NULL: must be reset
  const auto refused = [&](const dbuf_connect_options* given, const std::string& expected) {
    client = reinterpret_cast<dbuf_client*>(&options);
    EXPECT_EQ(dbuf_connect_ex(given, &client), DBUF_INVALID_ARGUMENT) << expected;
    EXPECT_EQ(client, nullptr) << expected;
    EXPECT_NE(lastError(nullptr).find(expected), std::string::npos) << lastError(nullptr);
  };
  ASSERT_EQ(dbuf_connect_options_init(&options, sizeof options), DBUF_OK);
  options.socket_path = daemon.socketPath().c_str();
  EXPECT_EQ(dbuf_connect_ex(&options, nullptr), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(nullptr).find("dbuf_connect_ex: NULL output pointer"), std::string::npos) << lastError(nullptr);
  dbuf_connect_options bad = options;
  bad.timeout_ms = 0;
  refused(&bad, "dbuf_connect_ex: timeout_ms must be > 0");
  bad = options;
  bad.struct_size = sizeof(size_t);
  refused(&bad, "below its first version");
  bad.struct_size = 1U << 20;
  refused(&bad, "not initialised");
  EXPECT_EQ(dbuf_connect(daemon.socketPath().c_str(), 0, &client), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(nullptr).find("dbuf_connect: timeout_ms"), std::string::npos) << lastError(nullptr);
  // A newer caller's longer struct: fields this library does not know must be zero.
  struct Newer {
    dbuf_connect_options known;
    uint64_t unknown;
  } newer{};
  std::memset(&newer, 0xCD, sizeof newer);
  ASSERT_EQ(dbuf_connect_options_init(&newer.known, sizeof newer), DBUF_OK);
  EXPECT_EQ(newer.unknown, 0U);
  newer.known.socket_path = daemon.socketPath().c_str();
  newer.unknown = 1;
  refused(&newer.known, "does not know");
  newer.unknown = 0;
  ASSERT_EQ(dbuf_connect_ex(&newer.known, &client), DBUF_OK) << lastError(nullptr);
  ASSERT_NE(client, nullptr);
  dbuf_client_free(client);
  // NULL options: the defaults ($DBUF_SOCKET, else the default path).
  const char* env = std::getenv("DBUF_SOCKET");  // NOLINT(concurrency-mt-unsafe): nobody sets it here
  const std::string default_path = env != nullptr && *env != '\0' ? env : "/run/dbufd/dbufd.sock";
  client = nullptr;
  if (dbuf_connect_ex(nullptr, &client) == DBUF_OK) {
    dbuf_client_free(client);  // a real dbufd there
  } else {
    EXPECT_EQ(client, nullptr);
    EXPECT_NE(lastError(nullptr).find("cannot reach dbufd at " + default_path), std::string::npos)
        << lastError(nullptr);
  }

  // dbuf_memory_device: -1 before attach and for host memory.
  client = connectC(daemon);
  ASSERT_NE(client, nullptr);
  int32_t device = 99;
  ASSERT_EQ(dbuf_memory_device(client, &device), DBUF_OK);
  EXPECT_EQ(device, -1);
  const dbuf_attach_options attach = attachOptions("c-pin-args", 0, 1);
  ASSERT_EQ(dbuf_attach_ex(client, &attach, kTimeoutMs), DBUF_OK) << lastError(client);
  device = 99;
  ASSERT_EQ(dbuf_memory_device(client, &device), DBUF_OK);
  EXPECT_EQ(device, -1) << "the host backend";
  EXPECT_EQ(dbuf_memory_device(nullptr, &device), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(nullptr).find("dbuf_memory_device: NULL client"), std::string::npos) << lastError(nullptr);
  EXPECT_EQ(dbuf_memory_device(client, nullptr), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(client).find("dbuf_memory_device: NULL output"), std::string::npos) << lastError(client);

  // dbuf_group_pin.
  const std::vector<int64_t> shape{8, 8};
  const dbuf_tensor_spec tensor = tensorSpec("w", shape);
  dbuf_group* group = nullptr;
  ASSERT_EQ(dbuf_register_group_ex(client, "layer", 1, &tensor, nullptr, kTimeoutMs, &group), DBUF_OK)
      << lastError(client);
  dbuf_client* other = connectC(daemon);
  ASSERT_NE(other, nullptr);
  dbuf_pin* pin = reinterpret_cast<dbuf_pin*>(&options);  // not NULL: must be reset
  EXPECT_EQ(dbuf_group_pin(nullptr, group, DBUF_REGION_SHARD, &pin), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(nullptr).find("dbuf_group_pin: NULL client"), std::string::npos) << lastError(nullptr);
  EXPECT_EQ(dbuf_group_pin(client, group, DBUF_REGION_SHARD, nullptr), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(client).find("dbuf_group_pin: NULL output"), std::string::npos) << lastError(client);
  EXPECT_EQ(dbuf_group_pin(client, nullptr, DBUF_REGION_SHARD, &pin), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(pin, nullptr);
  EXPECT_NE(lastError(client).find("dbuf_group_pin: NULL group"), std::string::npos) << lastError(client);
  EXPECT_EQ(dbuf_group_pin(other, group, DBUF_REGION_SHARD, &pin), DBUF_INVALID_ARGUMENT);
  EXPECT_NE(lastError(other).find("another client"), std::string::npos) << lastError(other);
  dbuf_region seven = DBUF_REGION_SHARD;  // as a C caller may pass it
  const int raw_seven = 7;
  static_assert(sizeof seven == sizeof raw_seven);
  std::memcpy(&seven, &raw_seven, sizeof raw_seven);
  pin = reinterpret_cast<dbuf_pin*>(&options);
  EXPECT_EQ(dbuf_group_pin(client, group, seven, &pin), DBUF_INVALID_ARGUMENT);
  EXPECT_EQ(pin, nullptr);
  EXPECT_NE(lastError(client).find("unknown region 7"), std::string::npos) << lastError(client);
  // No slot before the first acquire: nothing to pin, and no error.
  pin = reinterpret_cast<dbuf_pin*>(&options);
  EXPECT_EQ(dbuf_group_pin(client, group, DBUF_REGION_UNSHARDED, &pin), DBUF_OK) << lastError(client);
  EXPECT_EQ(pin, nullptr);
  ASSERT_EQ(dbuf_group_pin(client, group, DBUF_REGION_SHARD_GRAD, &pin), DBUF_OK) << lastError(client);
  EXPECT_NE(pin, nullptr);
  dbuf_pin_free(pin);
  dbuf_pin_free(nullptr);  // a no-op
  ASSERT_EQ(dbuf_group_acquire_slot(client, group, kTimeoutMs), DBUF_OK) << lastError(client);
  pin = nullptr;
  ASSERT_EQ(dbuf_group_pin(client, group, DBUF_REGION_UNSHARDED_GRAD, &pin), DBUF_OK) << lastError(client);
  EXPECT_NE(pin, nullptr);
  dbuf_pin_free(pin);
  ASSERT_EQ(dbuf_group_reshard(client, group, kTimeoutMs), DBUF_OK) << lastError(client);
  // Once detached, no view points into the shard: nothing to pin.
  ASSERT_EQ(dbuf_detach(client, kTimeoutMs), DBUF_OK) << lastError(client);
  pin = reinterpret_cast<dbuf_pin*>(&options);
  EXPECT_EQ(dbuf_group_pin(client, group, DBUF_REGION_SHARD, &pin), DBUF_OK) << lastError(client);
  EXPECT_EQ(pin, nullptr);
  device = 99;
  ASSERT_EQ(dbuf_memory_device(client, &device), DBUF_OK);
  EXPECT_EQ(device, -1) << "after detach";
  dbuf_group_free(group);
  dbuf_client_free(client);
  dbuf_client_free(other);
  EXPECT_TRUE(waitUntil([&] { return daemonIsEmpty(daemon.stats()); }));
}

TEST(CApi, APinOutlivesItsGroupAndClientAndItsFreeReleasesTheRange) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  dbuf_client* client = attachedC(daemon, attachOptions("c-pins", 0, 1));
  ASSERT_NE(client, nullptr);
  const std::vector<int64_t> shape{16, 8};
  const dbuf_tensor_spec tensor = tensorSpec("w", shape);
  dbuf_group_options group_options;
  ASSERT_EQ(dbuf_group_options_init(&group_options, sizeof group_options), DBUF_OK);
  group_options.unsharded_dtype = "fp32";
  dbuf_group* group = nullptr;
  ASSERT_EQ(dbuf_register_group_ex(client, "layer", 1, &tensor, &group_options, kTimeoutMs, &group), DBUF_OK)
      << lastError(client);
  dbuf_tensor_view shard{};
  ASSERT_EQ(dbuf_group_view(client, group, 0, DBUF_REGION_SHARD, &shard), DBUF_OK) << lastError(client);
  ASSERT_EQ(shard.end - shard.begin, 16 * 8);
  auto* shard_data = static_cast<float*>(shard.data);
  for (int64_t e = 0; e < shard.end; ++e) shard_data[e] = static_cast<float>(e) + 1.0F;
  ASSERT_EQ(dbuf_group_unshard(client, group, kTimeoutMs), DBUF_OK) << lastError(client);
  dbuf_tensor_view full{};
  ASSERT_EQ(dbuf_group_view(client, group, 0, DBUF_REGION_UNSHARDED, &full), DBUF_OK) << lastError(client);
  auto* full_data = static_cast<float*>(full.data);
  for (int64_t e = 0; e < full.end; ++e) ASSERT_EQ(full_data[e], static_cast<float>(e) + 1.0F) << e;

  // Two pins of the shard range (either region), one of the slot's.
  dbuf_pin* shard_pin = nullptr;
  dbuf_pin* grad_pin = nullptr;
  dbuf_pin* slot_pin = nullptr;
  ASSERT_EQ(dbuf_group_pin(client, group, DBUF_REGION_SHARD, &shard_pin), DBUF_OK) << lastError(client);
  ASSERT_EQ(dbuf_group_pin(client, group, DBUF_REGION_SHARD_GRAD, &grad_pin), DBUF_OK) << lastError(client);
  ASSERT_EQ(dbuf_group_pin(client, group, DBUF_REGION_UNSHARDED, &slot_pin), DBUF_OK) << lastError(client);
  ASSERT_TRUE(shard_pin != nullptr && grad_pin != nullptr && slot_pin != nullptr);
  std::string path;
  ASSERT_TRUE(mapped(shard.data, &path));
  EXPECT_NE(path.find("memfd:dbuf:"), std::string::npos) << path;

  // The group goes (still unsharded), then the session, then the client.
  dbuf_group_free(group);
  ASSERT_EQ(dbuf_detach(client, kTimeoutMs), DBUF_OK) << lastError(client);
  dbuf_client_free(client);
  for (const void* data : {static_cast<const void*>(shard_data), static_cast<const void*>(full_data)}) {
    ASSERT_TRUE(mapped(data, &path)) << "the pins keep the range";
    EXPECT_EQ(path, "") << "zero pages, not the daemon's memory";
  }
  int64_t non_zero = 0;
  for (int64_t e = 0; e < shard.end; ++e) non_zero += shard_data[e] != 0.0F ? 1 : 0;
  for (int64_t e = 0; e < full.end; ++e) non_zero += full_data[e] != 0.0F ? 1 : 0;
  EXPECT_EQ(non_zero, 0) << "a stale view reads zeros";
  shard_data[0] = 5.0F;  // and its writes are harmless
  full_data[0] = 5.0F;

  // The range goes with its last pin.
  dbuf_pin_free(shard_pin);
  EXPECT_TRUE(mapped(shard_data)) << "grad_pin holds the same range";
  dbuf_pin_free(grad_pin);
  EXPECT_FALSE(mapped(shard_data)) << "the last pin released the shard range";
  EXPECT_TRUE(mapped(full_data)) << "the slot range has its own pin";
  dbuf_pin_free(slot_pin);
  EXPECT_FALSE(mapped(full_data)) << "the last pin released the slot range";
  EXPECT_TRUE(waitUntil([&] { return daemonIsEmpty(daemon.stats()); }));
}

}  // namespace
}  // namespace dbuf::integration
