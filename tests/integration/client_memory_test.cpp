// The C++ client's memory and interrupt features against the embedded daemon
// (host backend).
//
// Memory: a group keeps one address range per DBuffer for its life, so its
// views keep their address across reshard / unshard, also when the slot it
// gets served a larger group first; an unmapped range holds private zero
// pages (views read zeros after reshard, detach, the group's end; writes go
// nowhere); a view's pin keeps its range reserved after the Group is gone,
// and the last pin unmaps it (/proc/self/maps says so). memoryDevice() is
// nullopt for host memory. With keep_slot_mappings, a slot stays mapped after
// reshard (no page faults when its group gets it back), never past dbufd
// replacing its file or for a slot beyond the pool.
//
// Interrupts (ClientOptions::interrupted): a wait for an op that cannot
// complete ends with kCancelled soon after the check says so, the op still in
// flight; a submit into a full ring submits nothing; a request to the daemon
// (registerGroup) closes the connection and the daemon reclaims the session;
// a check that never fires changes nothing.

#include <sys/resource.h>

#include <atomic>
#include <barrier>
#include <cstdint>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "harness.hpp"
#include "support/text.hpp"

namespace dbuf::integration {
namespace {

/// The line of /proc/self/maps whose range holds `address`.
struct MapsEntry {
  std::uintptr_t start = 0;
  std::uintptr_t end = 0;
  std::string path;  ///< empty for anonymous memory
};

std::optional<MapsEntry> mappingAt(const void* address) {
  const auto at = reinterpret_cast<std::uintptr_t>(address);
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    std::istringstream fields(line);
    std::string range;
    std::string perms;
    std::string offset;
    std::string dev;
    std::string inode;
    fields >> range >> perms >> offset >> dev >> inode;
    const auto dash = range.find('-');
    MapsEntry entry;
    entry.start = std::stoull(range.substr(0, dash), nullptr, 16);
    entry.end = std::stoull(range.substr(dash + 1), nullptr, 16);
    if (at < entry.start || at >= entry.end) continue;
    std::getline(fields >> std::ws, entry.path);
    return entry;
  }
  return std::nullopt;
}

/// `address` lies in a mapping of a dbuf memfd (the daemon's memory).
::testing::AssertionResult mapsDaemonMemory(const void* address) {
  const auto entry = mappingAt(address);
  if (!entry) return ::testing::AssertionFailure() << address << " is not mapped";
  if (entry->path.find("memfd:dbuf:") == std::string::npos) {
    return ::testing::AssertionFailure() << address << " is mapped to '" << entry->path << "', not a dbuf memfd";
  }
  return ::testing::AssertionSuccess();
}

/// `address` lies in anonymous memory (the zero pages of a reserved range).
::testing::AssertionResult mapsZeroPages(const void* address) {
  const auto entry = mappingAt(address);
  if (!entry) return ::testing::AssertionFailure() << address << " is not mapped";
  if (!entry->path.empty()) return ::testing::AssertionFailure() << address << " is mapped to '" << entry->path << "'";
  return ::testing::AssertionSuccess();
}

/// fp32 elements [0, count) of `base` that are not `expected(e)`.
template <typename Expected>
std::int64_t wrongFloats(const std::byte* base, std::int64_t count, Expected expected) {
  const auto* data = reinterpret_cast<const float*>(base);
  std::int64_t wrong = 0;
  for (std::int64_t e = 0; e < count; ++e) wrong += data[e] != expected(e) ? 1 : 0;
  return wrong;
}

std::int64_t nonZeroFloats(const TensorView& view) {
  return wrongFloats(view.base, view.numel(), [](std::int64_t) { return 0.0F; });
}

void fill(const TensorView& view, float value) {
  for (std::int64_t e = 0; e < view.numel(); ++e) view.data<float>()[e] = value;
}

/// Distinct per tensor, element and round; exact in fp32.
float pattern(std::size_t tensor, std::int64_t element, int round) {
  return static_cast<float>(static_cast<std::int64_t>(tensor) * 100'000 + element + std::int64_t{round} * 10'000) +
         0.5F;
}

/// Writes this rank's part of every tensor of `group`'s shard.
void writeShards(const Group& group, int round) {
  for (std::size_t t = 0; t < group.plan().tensors.size(); ++t) {
    const TensorView view = group.shardView(t);
    for (std::int64_t e = view.begin; e < view.end; ++e) view.data<float>()[e - view.begin] = pattern(t, e, round);
  }
}

/// Every tensor's unsharded view holds what writeShards(round) wrote on every rank.
void expectGathered(const Group& group, int round) {
  for (std::size_t t = 0; t < group.plan().tensors.size(); ++t) {
    auto view = group.unshardedView(t);
    ASSERT_TRUE(view.ok()) << messageOf(view);
    EXPECT_EQ(wrongFloats(view->base, view->numel(), [&](std::int64_t e) { return pattern(t, e, round); }), 0)
        << "group " << group.name() << " tensor " << t << " round " << round;
  }
}

/// A group of fp32 tensors, gathered in fp32 (so the gather is a copy).
GroupSpec fp32Group(const std::string& name, std::size_t tensors, std::int64_t rows) {
  GroupSpec spec = smallGroup(name, tensors, rows);
  spec.sharded_dtype = DType::kF32;
  spec.unsharded_dtype = DType::kF32;
  return spec;
}

TEST(ClientMemory, UnshardedViewsKeepTheirAddressAndReadZerosWhileResharded) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto client = daemon.attach(rankOf("mem-stable", 0, 1));
  ASSERT_TRUE(client.ok()) << messageOf(client);
  auto group = client->registerGroup(fp32Group("layer", 2, 16));
  ASSERT_TRUE(group.ok()) << messageOf(group);
  EXPECT_EQ(group->slotPin(), nullptr) << "no slot before the first acquire";
  writeShards(*group, 1);

  ASSERT_TRUE(group->unshard().ok());
  expectGathered(*group, 1);
  auto params = group->unshardedView(0);
  auto grads = group->unshardedGradView(0);
  ASSERT_TRUE(params.ok() && grads.ok());
  ASSERT_NE(params->pin, nullptr);
  EXPECT_EQ(params->pin, group->slotPin()) << "a view pins its group's slot range";
  std::byte* const address = params->base;
  EXPECT_TRUE(mapsDaemonMemory(address));
  fill(*grads, 1.5F);

  ASSERT_TRUE(group->reshard().ok());
  EXPECT_FALSE(group->unshardedView(0).ok()) << "no views are handed out while resharded";
  // The old views: zero pages at the same address, and writes that go nowhere.
  ASSERT_TRUE(mapsZeroPages(address));
  EXPECT_EQ(nonZeroFloats(*params), 0);
  EXPECT_EQ(nonZeroFloats(*grads), 0);
  fill(*params, 9.0F);
  fill(*grads, 9.0F);
  EXPECT_EQ(params->data<float>()[0], 9.0F) << "private pages take the write";

  ASSERT_TRUE(group->unshard().ok());
  auto again = group->unshardedView(0);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->base, address) << "every unshard maps the slot at the same address";
  EXPECT_TRUE(mapsDaemonMemory(address));
  expectGathered(*group, 1);  // through the old view's address as well:
  EXPECT_EQ(wrongFloats(address, params->numel(), [](std::int64_t e) { return pattern(0, e, 1); }), 0);
  EXPECT_EQ(wrongFloats(grads->base, grads->numel(), [](std::int64_t) { return 1.5F; }), 0)
      << "the slot kept its gradients; the writes while resharded went nowhere";

  ASSERT_TRUE(group->reshard().ok());
  group = makeError(ErrorCode::kInternal, "destroyed");
  EXPECT_TRUE(client->detach().ok());
  EXPECT_TRUE(waitUntil([&] { return daemonIsEmpty(daemon.stats()); }));
}

TEST(ClientMemory, AGroupServedALargerGroupsSlotKeepsItsAddress) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  constexpr std::uint32_t kWorld = 2;
  onRanks(kWorld, [&](std::uint32_t rank) {
    // Prefetch depth 0: one slot per rank, which both groups take in turn.
    auto client = daemon.attach(rankOf("mem-shared-slot", rank, kWorld, false, 0));
    ASSERT_TRUE(client.ok()) << messageOf(client);
    auto small = client->registerGroup(fp32Group("small", 2, 16));
    ASSERT_TRUE(small.ok()) << messageOf(small);
    auto big = client->registerGroup(fp32Group("big", 3, 1024));
    ASSERT_TRUE(big.ok()) << messageOf(big);

    // The small group first: the slot is its size.
    writeShards(*small, 1);
    ASSERT_TRUE(small->unshard().ok());
    expectGathered(*small, 1);
    std::vector<std::byte*> params;
    std::vector<std::byte*> grads;
    for (std::size_t t = 0; t < 2; ++t) {
      params.push_back(small->unshardedView(t)->base);
      grads.push_back(small->unshardedGradView(t)->base);
    }
    ASSERT_TRUE(small->reshard().ok());
    ASSERT_TRUE(small->acquireSlot().ok());
    EXPECT_FAILS_WITH(big->acquireSlot(), ErrorCode::kConflict);  // prefetch depth 0: one slot
    ASSERT_TRUE(small->reshard().ok());

    // The big group grows the slot (a new, larger file), then gives it back.
    writeShards(*big, 2);
    ASSERT_TRUE(big->unshard().ok());
    expectGathered(*big, 2);
    ASSERT_TRUE(big->reshard().ok());

    // The small group is served the larger slot: same addresses, right views.
    writeShards(*small, 3);
    ASSERT_TRUE(small->unshard().ok());
    for (std::size_t t = 0; t < 2; ++t) {
      EXPECT_EQ(small->unshardedView(t)->base, params[t]) << "tensor " << t;
      EXPECT_EQ(small->unshardedGradView(t)->base, grads[t]) << "tensor " << t;
    }
    expectGathered(*small, 3);
    ASSERT_TRUE(small->reshard().ok());

    // And the big group again, then the small one: still the same addresses.
    ASSERT_TRUE(big->unshard().ok());
    expectGathered(*big, 2);
    ASSERT_TRUE(big->reshard().ok());
    writeShards(*small, 4);
    ASSERT_TRUE(small->unshard().ok());
    EXPECT_EQ(small->unshardedView(0)->base, params[0]);
    expectGathered(*small, 4);
    ASSERT_TRUE(small->reshard().ok());
    EXPECT_TRUE(client->detach().ok());
  });
  EXPECT_TRUE(waitUntil([&] { return daemonIsEmpty(daemon.stats()); }));
}

TEST(ClientMemory, PinsKeepViewsReadableAfterTheGroupIsGoneAndTheLastOneUnmaps) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto client = daemon.attach(rankOf("mem-pins", 0, 1));
  ASSERT_TRUE(client.ok()) << messageOf(client);
  std::optional<Group> group;
  {
    auto registered = client->registerGroup(fp32Group("layer", 1, 16));
    ASSERT_TRUE(registered.ok()) << messageOf(registered);
    group.emplace(std::move(*registered));
  }
  writeShards(*group, 1);
  ASSERT_TRUE(group->unshard().ok());
  TensorView shard = group->shardView(0);
  TensorView shard_grad = group->shardGradView(0);
  TensorView full;
  {
    auto unsharded = group->unshardedView(0);
    ASSERT_TRUE(unsharded.ok());
    full = *unsharded;  // the only copy of the view (of its pin) left after this block
  }
  ASSERT_NE(shard.pin, nullptr);
  EXPECT_EQ(shard.pin, shard_grad.pin) << "one range for the whole shard file";
  EXPECT_NE(shard.pin, full.pin);
  EXPECT_TRUE(mapsDaemonMemory(shard.base));
  EXPECT_TRUE(mapsDaemonMemory(full.base));
  EXPECT_EQ(wrongFloats(full.base, full.numel(), [](std::int64_t e) { return pattern(0, e, 1); }), 0);

  // The group goes while unsharded; the pins keep both ranges, as zero pages.
  group.reset();
  ASSERT_TRUE(mapsZeroPages(shard.base));
  ASSERT_TRUE(mapsZeroPages(full.base));
  EXPECT_EQ(nonZeroFloats(shard), 0);
  EXPECT_EQ(nonZeroFloats(shard_grad), 0);
  EXPECT_EQ(nonZeroFloats(full), 0);
  fill(shard, 3.0F);  // harmless
  fill(full, 3.0F);

  // The shard range goes with its last pin (two views hold it), not before.
  shard.pin.reset();
  EXPECT_TRUE(mapsZeroPages(shard.base)) << "shard_grad still pins the range";
  shard_grad.pin.reset();
  EXPECT_FALSE(mappingAt(shard.base).has_value()) << "the last pin unmapped the shard range";
  EXPECT_TRUE(mapsZeroPages(full.base)) << "the slot range has its own pin";
  full.pin.reset();
  EXPECT_FALSE(mappingAt(full.base).has_value()) << "the last pin unmapped the slot range";

  EXPECT_TRUE(client->detach().ok());
  EXPECT_TRUE(waitUntil([&] { return daemonIsEmpty(daemon.stats()); }));
}

TEST(ClientMemory, ViewsReadZerosAfterDetachAndHostMemoryHasNoDevice) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto client = daemon.connect();
  ASSERT_TRUE(client.ok()) << messageOf(client);
  EXPECT_EQ(client->memoryDevice(), std::nullopt) << "not attached";
  ASSERT_TRUE(client->attach(rankOf("mem-detach", 0, 1)).ok());
  EXPECT_EQ(client->memoryDevice(), std::nullopt) << "the host backend: host memory";
  auto group = client->registerGroup(fp32Group("layer", 2, 16));
  ASSERT_TRUE(group.ok()) << messageOf(group);
  writeShards(*group, 1);
  ASSERT_TRUE(group->unshard().ok());
  const TensorView shard = group->shardView(1);
  const TensorView shard_grad = group->shardGradView(1);
  const TensorView full = *group->unshardedView(1);
  fill(shard_grad, 2.0F);
  EXPECT_EQ(wrongFloats(shard.base, shard.numel(), [](std::int64_t e) { return pattern(1, e, 1); }), 0);
  EXPECT_EQ(wrongFloats(full.base, full.numel(), [](std::int64_t e) { return pattern(1, e, 1); }), 0);

  ASSERT_TRUE(client->detach().ok());
  EXPECT_EQ(client->memoryDevice(), std::nullopt);
  // The Group lives on: its ranges stay reserved, as zero pages.
  ASSERT_TRUE(mapsZeroPages(shard.base));
  ASSERT_TRUE(mapsZeroPages(full.base));
  EXPECT_EQ(nonZeroFloats(shard), 0);
  EXPECT_EQ(nonZeroFloats(shard_grad), 0);
  EXPECT_EQ(nonZeroFloats(full), 0);
  fill(shard, 1.0F);  // harmless
  EXPECT_EQ(group->shardView(0).base, nullptr) << "views taken after detach are empty";
  EXPECT_EQ(group->shardView(0).pin, nullptr);
  EXPECT_FALSE(group->unsharded());
  group = makeError(ErrorCode::kInternal, "destroyed");
  EXPECT_TRUE(mapsZeroPages(shard.base)) << "the views' pins outlive the group";
  EXPECT_TRUE(waitUntil([&] { return daemonIsEmpty(daemon.stats()); }));
}

// ----------------------------------------------------------------- interrupts

/// ClientOptions::interrupted for a test: true from a point in time on
/// (armed), counting how often it was asked. Shared with the client's copy.
struct Interrupter {
  std::atomic<std::int64_t> fire_at_ns{INT64_MAX};  // Clock time since epoch
  std::atomic<int> calls{0};

  void fireIn(Clock::duration delay) {
    fire_at_ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>((Clock::now() + delay).time_since_epoch()).count();
  }
  void disarm() { fire_at_ns = INT64_MAX; }
  bool check() {
    ++calls;
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count() >= fire_at_ns;
  }
};

Result<Client> interruptible(const EmbeddedDaemon& daemon, const std::shared_ptr<Interrupter>& interrupter,
                             const AttachOptions& attach) {
  ClientOptions options;
  options.socket_path = daemon.socketPath();
  options.timeout = 10s;
  options.interrupted = [interrupter] { return interrupter->check(); };
  auto client = Client::connect(options);
  if (!client) return client;
  if (auto attached = client->attach(attach); !attached) return std::move(attached).error();
  return client;
}

constexpr auto kFireAfter = 50ms;
/// kFireAfter + 2 x kInterruptPeriod, with slack for a loaded 2-core machine.
constexpr auto kCancelledWithin = 500ms;
static_assert(kFireAfter + 2 * kInterruptPeriod < kCancelledWithin);

TEST(ClientInterrupt, ACancelledWaitLeavesTheOpInFlight) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto interrupter = std::make_shared<Interrupter>();
  auto rank0 = interruptible(daemon, interrupter, rankOf("int-wait", 0, 2));
  ASSERT_TRUE(rank0.ok()) << messageOf(rank0);
  auto rank1 = daemon.attach(rankOf("int-wait", 1, 2));
  ASSERT_TRUE(rank1.ok()) << messageOf(rank1);

  // A barrier rank 1 has not joined cannot complete.
  auto op = rank0->submitBarrier();
  ASSERT_TRUE(op.ok()) << messageOf(op);
  interrupter->fireIn(kFireAfter);
  const auto start = Clock::now();
  auto waited = rank0->wait(*op, 10s);
  const auto elapsed = Clock::now() - start;
  EXPECT_FAILS_WITH(waited, ErrorCode::kCancelled);
  EXPECT_GE(elapsed, kFireAfter);
  EXPECT_LT(elapsed, kCancelledWithin) << "the check is asked every kInterruptPeriod while waiting";
  EXPECT_GE(interrupter->calls.load(), 2) << "asked while waiting, not only once";
  EXPECT_EQ(rank0->inFlight(), 1U) << "the op is still in flight";

  // Rank 1 joins the barrier: the same op, waited for again, completes.
  interrupter->disarm();
  EXPECT_TRUE(rank1->barrier().ok());
  auto done = rank0->wait(*op, 10s);
  EXPECT_TRUE(done.ok()) << messageOf(done);
  EXPECT_EQ(rank0->inFlight(), 0U);
  EXPECT_TRUE(rank0->detach().ok());
  EXPECT_TRUE(rank1->detach().ok());
  EXPECT_TRUE(waitUntil([&] { return daemonIsEmpty(daemon.stats()); }));
}

TEST(ClientInterrupt, ACancelledSubmitIntoAFullRingSubmitsNothing) {
  daemon::Config config;
  config.ring_entries = 16;  // the smallest ring: easy to fill
  EmbeddedDaemon daemon(config);
  ASSERT_TRUE(daemon.started());
  constexpr std::size_t kRing = 16;
  auto interrupter = std::make_shared<Interrupter>();
  auto rank0 = interruptible(daemon, interrupter, rankOf("int-ring", 0, 2));
  ASSERT_TRUE(rank0.ok()) << messageOf(rank0);
  auto rank1 = daemon.attach(rankOf("int-ring", 1, 2));
  ASSERT_TRUE(rank1.ok()) << messageOf(rank1);

  std::vector<OpHandle> ops;
  for (std::size_t i = 0; i < kRing; ++i) {
    auto op = rank0->submitBarrier({false, {}, {}});
    ASSERT_TRUE(op.ok()) << i << ": " << messageOf(op);
    ops.push_back(*op);
  }
  EXPECT_FAILS_WITH(rank0->submitBarrier({false, {}, {}}), ErrorCode::kWouldBlock);
  // A submit that waits for room: cancelled, having submitted nothing.
  interrupter->fireIn(kFireAfter);
  const auto start = Clock::now();
  auto refused = rank0->submitBarrier({true, 10s, {}});
  const auto elapsed = Clock::now() - start;
  EXPECT_FAILS_WITH(refused, ErrorCode::kCancelled);
  EXPECT_GE(elapsed, kFireAfter);
  EXPECT_LT(elapsed, kCancelledWithin);
  EXPECT_EQ(rank0->inFlight(), kRing);

  // Rank 1 joins the 16 barriers: rank 0's complete, and none is left over
  // (a 17th would stay in flight, waiting for a 17th of rank 1's).
  interrupter->disarm();
  for (std::size_t i = 0; i < kRing; ++i) ASSERT_TRUE(rank1->barrier().ok()) << i;
  for (std::size_t i = 0; i < kRing; ++i) EXPECT_TRUE(rank0->wait(ops[i]).ok()) << i;
  EXPECT_EQ(rank0->inFlight(), 0U) << "the cancelled submit left no op behind";
  // And the next barrier pairs up as the 17th of both.
  auto next = rank0->submitBarrier();
  ASSERT_TRUE(next.ok()) << messageOf(next);
  auto joined = rank1->submitBarrier();
  ASSERT_TRUE(joined.ok()) << messageOf(joined);
  auto ours = rank0->wait(*next);
  auto theirs = rank1->wait(*joined);
  ASSERT_TRUE(ours.ok() && theirs.ok()) << messageOf(ours) << " / " << messageOf(theirs);
  EXPECT_EQ(ours->sequence, theirs->sequence);
  EXPECT_TRUE(rank0->detach().ok());
  EXPECT_TRUE(rank1->detach().ok());
  EXPECT_TRUE(waitUntil([&] { return daemonIsEmpty(daemon.stats()); }));
}

TEST(ClientInterrupt, ACancelledRegistrationClosesTheConnection) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto interrupter = std::make_shared<Interrupter>();
  auto rank0 = interruptible(daemon, interrupter, rankOf("int-register", 0, 2));
  ASSERT_TRUE(rank0.ok()) << messageOf(rank0);
  auto rank1 = daemon.attach(rankOf("int-register", 1, 2));
  ASSERT_TRUE(rank1.ok()) << messageOf(rank1);
  ASSERT_EQ(daemon.stats().sessions, 2U);

  // Rank 1 does not register (yet): rank 0's registration waits, interrupted.
  interrupter->fireIn(kFireAfter);
  const auto start = Clock::now();
  auto group = rank0->registerGroup(smallGroup("layer"), 10s);
  const auto elapsed = Clock::now() - start;
  EXPECT_FAILS_WITH(group, ErrorCode::kCancelled);
  EXPECT_GE(elapsed, kFireAfter);
  EXPECT_LT(elapsed, kCancelledWithin);

  // The connection is closed: every later call says so at once.
  interrupter->disarm();
  EXPECT_FAILS_WITH(rank0->registerGroup(smallGroup("layer")), ErrorCode::kUnavailable);
  EXPECT_FAILS_WITH(rank0->submitBarrier(), ErrorCode::kUnavailable);
  // ... and dbufd reclaimed the session: rank 0 is gone from the job, so
  // rank 1's registration fails at once, naming it.
  EXPECT_TRUE(waitUntil([&] { return daemon.stats().sessions == 1; })) << daemon.stats().sessions;
  auto other = rank1->registerGroup(smallGroup("layer"), 10s);
  EXPECT_FAILS_WITH(other, ErrorCode::kConflict);
  EXPECT_EQ(other.error().ranks, (std::vector<std::uint32_t>{0})) << other.error().message;
  EXPECT_FAILS_WITH(rank0->detach(), ErrorCode::kUnavailable);
  EXPECT_TRUE(rank1->detach().ok());
  EXPECT_TRUE(waitUntil([&] { return daemonIsEmpty(daemon.stats()); }));
}

TEST(ClientInterrupt, ACheckThatNeverFiresChangesNothing) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  constexpr std::uint32_t kWorld = 2;
  std::vector<std::shared_ptr<Interrupter>> interrupters;
  for (std::uint32_t r = 0; r < kWorld; ++r) interrupters.push_back(std::make_shared<Interrupter>());
  std::barrier timed_out(kWorld);
  onRanks(kWorld, [&](std::uint32_t rank) {
    Phases phases({&timed_out});
    auto client = interruptible(daemon, interrupters[rank], rankOf("int-never", rank, kWorld));
    ASSERT_TRUE(client.ok()) << messageOf(client);
    auto group = client->registerGroup(fp32Group("layer", 2, 16));
    ASSERT_TRUE(group.ok()) << messageOf(group);
    writeShards(*group, 1);
    ASSERT_TRUE(group->unshard().ok());
    expectGathered(*group, 1);
    ASSERT_TRUE(group->reduceScatter().ok());
    ASSERT_TRUE(group->reshard().ok());
    ASSERT_TRUE(client->barrier().ok());
    if (rank == 0) {
      // An op that cannot complete yet times out as it would without a check.
      const int calls_before = interrupters[rank]->calls.load();
      auto op = client->submitBarrier();
      ASSERT_TRUE(op.ok()) << messageOf(op);
      EXPECT_FAILS_WITH(client->wait(*op, 200ms), ErrorCode::kTimeout);
      EXPECT_GE(interrupters[rank]->calls.load() - calls_before, 3) << "asked while the wait slept";
      phases.next();
      EXPECT_TRUE(client->wait(*op, 10s).ok()) << "kTimeout left it in flight";
    } else {
      phases.next();  // joins rank 0's barrier once rank 0's wait timed out
      ASSERT_TRUE(client->barrier(10s).ok());
    }
    EXPECT_TRUE(client->detach().ok());
  });
  EXPECT_TRUE(waitUntil([&] { return daemonIsEmpty(daemon.stats()); }));
}

// A blocking form whose wait times out has no handle to wait with again: its
// op must not keep a record taken, or once the handles wrap around (twice the
// ring capacity) every submit fails with kWouldBlock.
TEST(ClientInterrupt, BlockingFormsThatGiveUpDoNotWedgeTheClient) {
  daemon::Config config;
  config.ring_entries = 16;
  EmbeddedDaemon daemon(config);
  ASSERT_TRUE(daemon.started());
  auto rank0 = daemon.attach(rankOf("give-up", 0, 2));
  ASSERT_TRUE(rank0.ok()) << messageOf(rank0);
  auto rank1 = daemon.attach(rankOf("give-up", 1, 2));
  ASSERT_TRUE(rank1.ok()) << messageOf(rank1);
  constexpr int kGiveUps = 40;  // more than the 32 records of a 16-entry ring
  for (int i = 0; i < kGiveUps; ++i) {
    auto late = rank0->barrier(std::chrono::milliseconds(5));
    ASSERT_FALSE(late.ok()) << i;
    ASSERT_EQ(late.error().code, ErrorCode::kTimeout) << i << ": " << late.error().message;
    // Rank 1 completes that barrier: its result is dropped, the record freed.
    ASSERT_TRUE(rank1->barrier().ok()) << i;
  }
  auto noop = rank0->submitNoop();
  ASSERT_TRUE(noop.ok()) << messageOf(noop);
  EXPECT_TRUE(rank0->wait(*noop).ok());
  EXPECT_EQ(rank0->inFlight(), 0U);
  // An abandoned handle is no longer the caller's to wait for.
  auto dropped = rank0->submitNoop();
  ASSERT_TRUE(dropped.ok());
  rank0->abandon(*dropped);
  EXPECT_FAILS_WITH(rank0->wait(*dropped), ErrorCode::kInvalidArgument);
}

/// A group of one 64 x 64 tensor.
GroupSpec squareGroup(const std::string& name) {
  GroupSpec spec;
  spec.name = name;
  spec.tensors = {{"w", {64, 64}, "", -1}};
  return spec;
}

// A group destroyed while it holds its slot gives the slot back: with a pool
// of one, the next group can take it.
TEST(ClientMemory, AGroupDestroyedWhileUnshardedGivesItsSlotBack) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto client = daemon.attach(rankOf("give-back", 0, 1, false, 0));  // prefetch depth 0: one slot
  ASSERT_TRUE(client.ok()) << messageOf(client);
  auto other = client->registerGroup(squareGroup("second"));
  ASSERT_TRUE(other.ok()) << messageOf(other);
  {
    auto group = client->registerGroup(squareGroup("first"));
    ASSERT_TRUE(group.ok()) << messageOf(group);
    ASSERT_TRUE(group->acquireSlot().ok());
    EXPECT_FAILS_WITH(other->acquireSlot(), ErrorCode::kConflict);  // the one slot is taken
  }
  EXPECT_TRUE(other->acquireSlot().ok()) << "the destroyed group kept its slot";
}

// A full pool: WhenPoolFull::kGrow takes a slot beyond it, which works as any
// slot does, is charged while held and gives its memory back at reshard; the
// pool's own slot keeps its pages.
TEST(ClientMemory, AGrowingAcquireTakesASlotBeyondThePoolUntilItsReshard) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto client = daemon.attach(rankOf("grow", 0, 1, false, 0));  // prefetch depth 0: a pool of one slot
  ASSERT_TRUE(client.ok()) << messageOf(client);
  auto first = client->registerGroup(fp32Group("first", 2, 16));
  ASSERT_TRUE(first.ok()) << messageOf(first);
  auto second = client->registerGroup(fp32Group("second", 3, 32));
  ASSERT_TRUE(second.ok()) << messageOf(second);
  writeShards(*first, 1);
  writeShards(*second, 2);
  ASSERT_TRUE(first->unshard().ok());
  const std::uint64_t pool_only = daemon.stats().bytes_in_use;

  EXPECT_FAILS_WITH(second->acquireSlot(std::nullopt, WhenPoolFull::kFail), ErrorCode::kConflict);
  ASSERT_TRUE(second->acquireSlot(std::nullopt, WhenPoolFull::kGrow).ok());
  ASSERT_TRUE(second->allGather().ok());
  expectGathered(*first, 1);
  expectGathered(*second, 2);
  EXPECT_GT(daemon.stats().bytes_in_use, pool_only) << "the slot beyond the pool is charged";

  // reshard() does not wait for dbufd to take the slot back: it does so in order with the session's requests.
  ASSERT_TRUE(second->reshard().ok());
  EXPECT_TRUE(waitUntil([&] { return daemon.stats().bytes_in_use == pool_only; }))
      << "the slot beyond the pool kept its memory: " << daemon.stats().bytes_in_use;
  ASSERT_TRUE(first->reshard().ok());
  EXPECT_EQ(daemon.stats().bytes_in_use, pool_only) << "the pool's slot keeps its pages";
  // With the pool free again, the plain acquire is served from it.
  ASSERT_TRUE(second->unshard().ok());
  expectGathered(*second, 2);
}

// Beyond the pool, the tenant's quota still holds: kInfeasible naming it, the
// pool untouched.
TEST(ClientMemory, AGrowingAcquireOverQuotaFailsAndLeavesThePool) {
  // Room for both shard files (big's: 128 KiB) and small's slot, not for a second 128 KiB.
  EmbeddedDaemon daemon(oneTenantWithQuota("bounded", std::uint64_t{192} << 10));
  ASSERT_TRUE(daemon.started());
  auto client = daemon.attach(rankOf("grow-quota", 0, 1, false, 0));
  ASSERT_TRUE(client.ok()) << messageOf(client);
  auto small = client->registerGroup(fp32Group("small", 1, 16));
  ASSERT_TRUE(small.ok()) << messageOf(small);
  auto big = client->registerGroup(fp32Group("big", 1, 2048));
  ASSERT_TRUE(big.ok()) << messageOf(big);
  ASSERT_TRUE(small->unshard().ok());
  const std::uint64_t before = daemon.stats().bytes_in_use;
  auto grown = big->acquireSlot(std::nullopt, WhenPoolFull::kGrow);
  EXPECT_FAILS_WITH(grown, ErrorCode::kInfeasible);
  EXPECT_TRUE(testing::contains(grown.error().message, "quota")) << grown.error().message;
  EXPECT_EQ(daemon.stats().bytes_in_use, before);
  EXPECT_TRUE(small->unsharded());
}

// A group that outlives its client (closed, rings unmapped) is destroyed
// without touching the connection's memory.
// ------------------------------------------------ AttachOptions::keep_slot_mappings

AttachOptions keepingSlots(const std::string& job, std::uint32_t prefetch_depth) {
  AttachOptions options = rankOf(job, 0, 1, false, prefetch_depth);
  options.keep_slot_mappings = true;
  return options;
}

/// Minor page faults of this process so far (the embedded daemon's threads included).
long minorFaults() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

/// Page faults taken by two groups' unshard, a read of every parameter and a
/// write of every gradient, each group getting back the slot it gave back.
long faultsOfARoundTrip(Client& client, const std::string& tag) {
  constexpr std::int64_t kRows = 8192;  // 256 KiB per region: 64 pages
  auto first = client.registerGroup(fp32Group(tag + "-first", 1, kRows));
  auto second = client.registerGroup(fp32Group(tag + "-second", 1, kRows));
  EXPECT_TRUE(first.ok() && second.ok());
  if (!first.ok() || !second.ok()) return -1;
  writeShards(*first, 1);
  writeShards(*second, 2);
  const auto use = [](Group& group, int round) {
    EXPECT_TRUE(group.unshard().ok());
    expectGathered(group, round);
    auto grads = group.unshardedGradView(0);
    EXPECT_TRUE(grads.ok());
    if (grads.ok()) fill(*grads, 0.0F);
  };
  use(*first, 1);
  use(*second, 2);
  EXPECT_TRUE(first->reshard().ok());
  EXPECT_TRUE(second->reshard().ok());
  // Given back in the other order than taken: with a pool of two free slots,
  // each group still gets the one it held (dbufd prefers it).
  const long before = minorFaults();
  use(*second, 2);
  use(*first, 1);
  const long faults = minorFaults() - before;
  EXPECT_TRUE(first->reshard().ok());
  EXPECT_TRUE(second->reshard().ok());
  return faults;
}

// The point of keeping slots mapped: an unshard that gets its slot back maps
// nothing and faults no page in; without it, every page of both regions is
// faulted in again (the check below can tell the two apart).
TEST(ClientMemory, AKeptSlotGivenBackToItsGroupTakesNoPageFaults) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto plain = daemon.attach(rankOf("unkept", 0, 1, false, 1));
  ASSERT_TRUE(plain.ok()) << messageOf(plain);
  const long remapped = faultsOfARoundTrip(*plain, "unkept");
  auto keeping = daemon.attach(keepingSlots("kept", 1));
  ASSERT_TRUE(keeping.ok()) << messageOf(keeping);
  const long kept = faultsOfARoundTrip(*keeping, "kept");
  // Two groups, params and grads, 64 pages each; a read fault maps the pages
  // around it too (the kernel's fault-around: 16 at most), a write fault one.
  // The count is the process's: a sanitizer's shadow memory adds faults to
  // both runs (measured under TSan: 44 kept, 2231 remapped), hence a ratio.
  constexpr long kPages = 2 * 2 * 64;
  EXPECT_GE(remapped, kPages / 4) << "each unshard maps its slot afresh";
  EXPECT_LT(kept * 8, remapped) << "the slots were still mapped: " << kept << " faults, " << remapped
                                << " when mapped afresh";
}

// A kept slot may serve another group in between: the old view then shows
// that group's data (the documented price), and the group's own next unshard
// gathers its own again.
TEST(ClientMemory, AKeptSlotThatServedAnotherGroupGathersItsOwnGroupsData) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto client = daemon.attach(keepingSlots("kept-shared", 0));  // a pool of one slot
  ASSERT_TRUE(client.ok()) << messageOf(client);
  auto first = client->registerGroup(fp32Group("first", 2, 16));
  auto second = client->registerGroup(fp32Group("second", 2, 16));
  ASSERT_TRUE(first.ok() && second.ok());
  writeShards(*first, 1);
  writeShards(*second, 2);
  ASSERT_TRUE(first->unshard().ok());
  auto old_view = first->unshardedView(0);
  ASSERT_TRUE(old_view.ok());
  ASSERT_TRUE(first->reshard().ok());
  EXPECT_TRUE(mapsDaemonMemory(old_view->base)) << "the slot stays mapped after reshard";
  EXPECT_FALSE(first->unshardedView(0).ok()) << "yet no views are handed out while resharded";

  ASSERT_TRUE(second->unshard().ok());
  expectGathered(*second, 2);
  EXPECT_EQ(wrongFloats(old_view->base, old_view->numel(), [](std::int64_t e) { return pattern(0, e, 2); }), 0)
      << "a view kept past reshard reads what the slot holds now";
  ASSERT_TRUE(second->reshard().ok());

  ASSERT_TRUE(first->unshard().ok());
  expectGathered(*first, 1);
  ASSERT_TRUE(first->reshard().ok());
}

// dbufd replaces a slot's file to grow it: a group that kept the old file
// mapped lets go of it (zero pages again), so nothing holds its memory.
TEST(ClientMemory, AKeptSlotWhoseMemoryDbufdReplacedIsUnmapped) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto client = daemon.attach(keepingSlots("kept-regrown", 0));
  ASSERT_TRUE(client.ok()) << messageOf(client);
  auto small = client->registerGroup(fp32Group("small", 1, 16));
  auto big = client->registerGroup(fp32Group("big", 1, 4096));
  ASSERT_TRUE(small.ok() && big.ok());
  writeShards(*small, 1);
  writeShards(*big, 2);
  ASSERT_TRUE(small->unshard().ok());
  auto small_view = small->unshardedView(0);
  ASSERT_TRUE(small_view.ok());
  ASSERT_TRUE(small->reshard().ok());
  ASSERT_TRUE(mapsDaemonMemory(small_view->base));

  ASSERT_TRUE(big->unshard().ok());  // the slot is regrown: a new file
  expectGathered(*big, 2);
  EXPECT_TRUE(mapsZeroPages(small_view->base)) << "the old file is no longer mapped";
  ASSERT_TRUE(big->reshard().ok());
  ASSERT_TRUE(small->unshard().ok());
  expectGathered(*small, 1);
}

// A slot beyond the pool goes back to the system at its release: never kept.
TEST(ClientMemory, ASlotBeyondThePoolIsNeverKept) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto client = daemon.attach(keepingSlots("kept-grow", 0));
  ASSERT_TRUE(client.ok()) << messageOf(client);
  auto first = client->registerGroup(fp32Group("first", 1, 16));
  auto second = client->registerGroup(fp32Group("second", 1, 16));
  ASSERT_TRUE(first.ok() && second.ok());
  ASSERT_TRUE(first->unshard().ok());
  const std::uint64_t pool_only = daemon.stats().bytes_in_use;
  ASSERT_TRUE(second->acquireSlot(std::nullopt, WhenPoolFull::kGrow).ok());
  auto grown = second->unshardedView(0);
  ASSERT_TRUE(grown.ok());
  ASSERT_TRUE(second->reshard().ok());
  EXPECT_TRUE(mapsZeroPages(grown->base));
  EXPECT_TRUE(waitUntil([&] { return daemon.stats().bytes_in_use == pool_only; }));
  ASSERT_TRUE(first->reshard().ok());
}

TEST(ClientMemory, AGroupOutlivingItsClientIsDestroyedSafely) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  std::optional<Group> group;
  {
    auto client = daemon.attach(rankOf("outlive", 0, 1));
    ASSERT_TRUE(client.ok()) << messageOf(client);
    auto registered = client->registerGroup(squareGroup("g"));
    ASSERT_TRUE(registered.ok()) << messageOf(registered);
    group.emplace(std::move(*registered));
    ASSERT_TRUE(group->acquireSlot().ok());
  }  // the client goes first
  EXPECT_FAILS_WITH(group->allGather(), ErrorCode::kUnavailable);
  group.reset();  // must not reap the unmapped rings
}

}  // namespace
}  // namespace dbuf::integration
