// attach / register / map / write / read / unshard (the collective: slot +
// all-gather) / detach with 1, 2, 4 and 8 ranks, each rank a real client on
// its own thread; the embedded daemon's counters before and after. Also: a
// non-persistent job is freed when its last rank goes (by detach or by
// dropping the connection), two jobs side by side.
//
// The daemon runs in this process: /proc/self/maps and the fd table hold its
// mappings and files as well as the clients'. Since the data plane (protocol
// 2) the daemon maps every shard file, slot file and session segment itself,
// and each attached session has one session segment memfd (counted in
// ServerStats::memfds) and one eventfd.

#include <algorithm>
#include <array>
#include <barrier>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>

#include "dbuf/kernels/convert.hpp"
#include "harness.hpp"

namespace dbuf::integration {
namespace {

/// The rank whose shard holds element `element` of tensor `tensor`: rank r
/// holds [r * S, (r + 1) * S) of the global buffer.
std::uint32_t ownerOf(const GroupPlan& plan, std::size_t tensor, std::int64_t element) {
  return static_cast<std::uint32_t>((plan.tensors[tensor].offset + element) / plan.shard_elems);
}

/// A decoder-layer-like group: 2D weights under the group's rule (rows:2),
/// one with its own rule, 1D tensors (element granularity), odd sizes.
GroupSpec layerGroup() {
  GroupSpec spec;
  spec.name = "decoder.layers.0";
  spec.granularity = "rows:2";
  spec.tensors = {
      {"embed", {40, 24}, "", -1},           {"attn.qkv", {72, 24}, "", -1},     {"attn.norm", {24}, "", -1},
      {"attn.out", {24, 24}, "element", -1}, {"mlp.up", {33, 16}, "rows:3", -1}, {"mlp.bias", {13}, "", -1},
  };
  return spec;
}

/// Pattern values: exact in fp32 (all below 2^24) and different per rank,
/// tensor, element and region.
float shardValue(std::uint32_t rank, std::size_t tensor, std::int64_t element) {
  return static_cast<float>(std::size_t{rank} * 1'000'000 + tensor * 10'000 + static_cast<std::size_t>(element));
}
float gradValue(std::uint32_t rank, std::size_t tensor, std::int64_t element) {
  return -1.0F - shardValue(rank, tensor, element);
}
std::uint16_t slotValue(std::uint32_t rank, std::size_t tensor, std::int64_t element, bool grad) {
  return static_cast<std::uint16_t>(
      (std::size_t{rank} * 4099 + tensor * 257 + static_cast<std::size_t>(element) * 3 + (grad ? 1 : 0)) & 0xFFFF);
}

struct ViewRecord {
  std::uint32_t rank = 0;
  std::int64_t begin = 0;
  std::int64_t end = 0;
};

class LifecycleTest : public ::testing::TestWithParam<std::uint32_t> {};

TEST_P(LifecycleTest, AttachRegisterMapWriteReadDetach) {
  const std::uint32_t world = GetParam();
  const std::size_t fds_before = openFdCount();
  std::optional<EmbeddedDaemon> holder(std::in_place);
  EmbeddedDaemon& daemon = *holder;
  ASSERT_TRUE(daemon.started());
  const GroupSpec spec = layerGroup();
  const std::size_t tensors = spec.tensors.size();

  std::vector<std::string> plans(world);
  std::vector<std::vector<ViewRecord>> views(tensors);  // per tensor, from every rank
  std::mutex views_mutex;
  std::vector<std::size_t> shard_bytes(world, 0);
  std::barrier written(static_cast<std::ptrdiff_t>(world));
  std::barrier registered(static_cast<std::ptrdiff_t>(world) + 1);
  std::barrier checked(static_cast<std::ptrdiff_t>(world) + 1);
  std::barrier unsharded(static_cast<std::ptrdiff_t>(world) + 1);
  std::barrier counted(static_cast<std::ptrdiff_t>(world) + 1);

  std::thread main_checks([&] {
    Phases phases({&registered, &checked, &unsharded, &counted});
    phases.next();
    // Every rank holds its shard file and its session segment; no slot yet.
    const daemon::ServerStats stats = daemon.stats();
    EXPECT_EQ(stats.sessions, world);
    EXPECT_EQ(stats.jobs, 1U);
    EXPECT_EQ(stats.memfds, 2U * world) << "one shard file and one session segment per rank";
    std::uint64_t shards = 0;
    for (const std::size_t bytes : shard_bytes) shards += bytes;
    EXPECT_EQ(stats.bytes_in_use, shards);
    phases.next();
    phases.next();
    EXPECT_EQ(daemon.stats().memfds, 3U * world) << "shard file, session segment and slot file per rank";
    EXPECT_GT(daemon.stats().bytes_in_use, shards);
    phases.next();
  });

  onRanks(world, [&](std::uint32_t rank) {
    Phases phases({&registered, &written, &checked, &unsharded, &counted});
    auto client = daemon.attach(rankOf("job-" + std::to_string(world), rank, world));
    ASSERT_TRUE(client.ok()) << messageOf(client);
    EXPECT_FALSE(client->reattached());
    auto group = client->registerGroup(spec);
    ASSERT_TRUE(group.ok()) << "rank " << rank << ": " << messageOf(group);
    const GroupPlan& plan = group->plan();
    plans[rank] = describe(plan);
    shard_bytes[rank] = group->shardBytes();
    EXPECT_EQ(group->rank(), rank);
    EXPECT_EQ(group->name(), spec.name);
    EXPECT_EQ(plan.devices, world);
    EXPECT_EQ(plan.tensors.size(), tensors);
    EXPECT_FALSE(group->unsharded());
    phases.next();  // registered

    // Views: consistent with the plan, aligned, cut on block edges; write a
    // rank-specific pattern into both sharded regions.
    const std::int64_t rank_begin = static_cast<std::int64_t>(rank) * plan.shard_elems;
    std::optional<std::ptrdiff_t> grad_distance;
    const std::byte* first_base = nullptr;
    std::int64_t first_position = 0;
    for (std::size_t t = 0; t < tensors; ++t) {
      const PlacedTensor& placed = plan.tensors[t];
      EXPECT_EQ(placed.name, spec.tensors[t].name);
      EXPECT_EQ(placed.shape, spec.tensors[t].shape);
      const TensorView view = group->shardView(t);
      const TensorView grad = group->shardGradView(t);
      EXPECT_EQ(view.name, placed.name);
      EXPECT_EQ(view.shape, placed.shape);
      EXPECT_EQ(view.dtype, DType::kF32);
      EXPECT_EQ(grad.dtype, DType::kF32);
      EXPECT_EQ(grad.begin, view.begin);
      EXPECT_EQ(grad.end, view.end);
      {
        const std::lock_guard lock(views_mutex);
        views[t].push_back({rank, view.begin, view.end});
      }
      if (view.numel() == 0) {
        EXPECT_EQ(view.local_units, 0);
        continue;
      }
      ASSERT_NE(view.base, nullptr);
      ASSERT_NE(grad.base, nullptr);
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(view.base) % 16, 0U) << placed.name;
      const std::int64_t position = placed.offset + view.begin;  // in the global buffer
      EXPECT_GE(position, rank_begin);
      EXPECT_LE(placed.offset + view.end, rank_begin + plan.shard_elems);
      if (first_base == nullptr) {
        first_base = view.base;
        first_position = position;
      } else {
        EXPECT_EQ(view.base - first_base, (position - first_position) * 4) << placed.name;
      }
      const std::ptrdiff_t distance = grad.base - view.base;
      if (!grad_distance) grad_distance = distance;
      EXPECT_EQ(distance, *grad_distance) << "the gradient region is one block";
      EXPECT_GE(distance, plan.shard_elems * 4) << "gradient region overlaps the shard";
      // A cut inside a tensor falls on a block edge (RaggedShard).
      if (view.begin > 0) {
        EXPECT_EQ(view.begin % placed.granularity, 0) << placed.name;
      }
      if (view.end < placed.numel) {
        EXPECT_EQ(view.end % placed.granularity, 0) << placed.name;
      }
      const std::int64_t units = (view.end - 1) / placed.granularity - view.begin / placed.granularity + 1;
      EXPECT_EQ(view.local_units, units) << placed.name;
      for (std::int64_t e = view.begin; e < view.end; ++e) {
        view.data<float>()[e - view.begin] = shardValue(rank, t, e);
        grad.data<float>()[e - view.begin] = gradValue(rank, t, e);
      }
    }
    phases.next();  // written
    // Read back after every rank wrote: nothing overlapped, nothing was shared.
    for (std::size_t t = 0; t < tensors; ++t) {
      const TensorView view = group->shardView(t);
      const TensorView grad = group->shardGradView(t);
      std::int64_t wrong = 0;
      for (std::int64_t e = view.begin; e < view.end; ++e) {
        wrong += view.data<float>()[e - view.begin] != shardValue(rank, t, e) ? 1 : 0;
        wrong += grad.data<float>()[e - view.begin] != gradValue(rank, t, e) ? 1 : 0;
      }
      EXPECT_EQ(wrong, 0) << "rank " << rank << " tensor " << spec.tensors[t].name;
    }
    phases.next();  // checked

    // unshard (every rank): a slot whose views cover whole tensors, in the
    // unsharded dtype, holding every rank's shard cast to bf16.
    EXPECT_FAILS_WITH(group->unshardedView(0), ErrorCode::kInvalidArgument);
    auto mapped = group->unshard();
    ASSERT_TRUE(mapped.ok()) << messageOf(mapped);
    EXPECT_TRUE(group->unsharded());
    // What the all-gather wrote: params only (the fresh slot's gradients are
    // still zeros).
    const auto expect_gathered = [&](const char* when) {
      for (std::size_t t = 0; t < tensors; ++t) {
        auto full = group->unshardedView(t);
        auto full_grad = group->unshardedGradView(t);
        ASSERT_TRUE(full.ok() && full_grad.ok()) << messageOf(full) << messageOf(full_grad);
        std::int64_t wrong = 0;
        std::int64_t first_wrong = -1;
        for (std::int64_t e = 0; e < plan.tensors[t].numel; ++e) {
          const std::uint16_t expected = kernels::floatToBf16(shardValue(ownerOf(plan, t, e), t, e));
          const bool bad = full->data<std::uint16_t>()[e] != expected || full_grad->data<std::uint16_t>()[e] != 0;
          if (bad && first_wrong < 0) first_wrong = e;
          wrong += bad ? 1 : 0;
        }
        EXPECT_EQ(wrong, 0) << when << ": rank " << rank << " tensor " << spec.tensors[t].name << ", first at element "
                            << first_wrong;
      }
    };
    expect_gathered("first unshard");
    // A second unshard keeps the slot and gathers again (it is a collective:
    // every rank calls it): what this rank scribbled over its copy is gone.
    for (std::size_t t = 0; t < tensors; ++t) {
      auto full = group->unshardedView(t);
      ASSERT_TRUE(full.ok());
      std::fill_n(full->data<std::uint16_t>(), full->numel(), std::uint16_t{0xFFFF});
    }
    const std::byte* slot_before = group->unshardedView(0)->base;
    auto again = group->unshard();
    ASSERT_TRUE(again.ok()) << messageOf(again);
    EXPECT_EQ(group->unshardedView(0)->base, slot_before) << "a second unshard maps no new slot";
    expect_gathered("second unshard");
    for (std::size_t t = 0; t < tensors; ++t) {
      const PlacedTensor& placed = plan.tensors[t];
      auto full = group->unshardedView(t);
      auto full_grad = group->unshardedGradView(t);
      ASSERT_TRUE(full.ok()) << messageOf(full);
      ASSERT_TRUE(full_grad.ok()) << messageOf(full_grad);
      EXPECT_EQ(full->dtype, DType::kBF16);
      EXPECT_EQ(full->begin, 0);
      EXPECT_EQ(full->end, placed.numel);
      EXPECT_EQ(full->local_units, (placed.numel + placed.granularity - 1) / placed.granularity);
      ASSERT_NE(full->base, nullptr);
      EXPECT_GE(full_grad->base - full->base, static_cast<std::ptrdiff_t>(plan.devices) * plan.shard_elems * 2);
      auto first = group->unshardedView(0);
      EXPECT_EQ(full->base - first->base, (placed.offset - plan.tensors[0].offset) * 2);
      for (std::int64_t e = 0; e < placed.numel; ++e) {
        full->data<std::uint16_t>()[e] = slotValue(rank, t, e, false);
        full_grad->data<std::uint16_t>()[e] = slotValue(rank, t, e, true);
      }
    }
    for (std::size_t t = 0; t < tensors; ++t) {
      auto full = group->unshardedView(t);
      auto full_grad = group->unshardedGradView(t);
      std::int64_t wrong = 0;
      for (std::int64_t e = 0; e < plan.tensors[t].numel; ++e) {
        wrong += full->data<std::uint16_t>()[e] != slotValue(rank, t, e, false) ? 1 : 0;
        wrong += full_grad->data<std::uint16_t>()[e] != slotValue(rank, t, e, true) ? 1 : 0;
      }
      EXPECT_EQ(wrong, 0) << "rank " << rank << " unsharded tensor " << spec.tensors[t].name;
    }
    phases.next();  // unsharded
    phases.next();  // counted: the daemon's counters were read while every slot was mapped
    auto released = group->reshard();
    EXPECT_TRUE(released.ok()) << messageOf(released);
    EXPECT_FALSE(group->unsharded());
    EXPECT_FAILS_WITH(group->unshardedView(0), ErrorCode::kInvalidArgument);
    EXPECT_TRUE(group->reshard().ok()) << "a second reshard is a no-op";
    // The shard survived the round trip.
    const TensorView first = group->shardView(0);
    if (first.numel() > 0) {
      EXPECT_EQ(first.data<float>()[0], shardValue(rank, 0, first.begin));
    }

    auto detached = client->detach();
    EXPECT_TRUE(detached.ok()) << messageOf(detached);
  });
  main_checks.join();

  // One plan for everyone.
  for (std::uint32_t rank = 1; rank < world; ++rank) EXPECT_EQ(plans[rank], plans[0]) << "rank " << rank;
  // Every element of every tensor is held by exactly one rank.
  for (std::size_t t = 0; t < tensors; ++t) {
    std::vector<ViewRecord> held;
    std::copy_if(views[t].begin(), views[t].end(), std::back_inserter(held),
                 [](const ViewRecord& view) { return view.end > view.begin; });
    std::sort(held.begin(), held.end(), [](const ViewRecord& a, const ViewRecord& b) { return a.begin < b.begin; });
    std::int64_t next = 0;
    for (const ViewRecord& view : held) {
      EXPECT_EQ(view.begin, next) << spec.tensors[t].name << ": rank " << view.rank << " starts at " << view.begin;
      next = std::max(next, view.end);
    }
    std::int64_t numel = 1;
    for (const std::int64_t dim : spec.tensors[t].shape) numel *= dim;
    EXPECT_EQ(next, numel) << spec.tensors[t].name << " is not covered to its end";
    EXPECT_EQ(views[t].size(), world);
  }

  // Detached: nothing of the job is left in the daemon, nothing mapped here.
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
  EXPECT_EQ(dbufMappings(), 0U);
  holder.reset();
  EXPECT_EQ(openFdCount(), fds_before) << "an fd leaked (daemon and clients share this process)";
}

INSTANTIATE_TEST_SUITE_P(Ranks, LifecycleTest, ::testing::Values(1U, 2U, 4U, 8U),
                         [](const ::testing::TestParamInfo<std::uint32_t>& param) {
                           return std::to_string(param.param) + "ranks";
                         });

TEST(Lifecycle, MemoryIsUnmappedOnDetachAndOnDestruction) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  {
    auto client = daemon.attach(rankOf("unmap-detach", 0, 1));
    ASSERT_TRUE(client.ok()) << messageOf(client);
    auto group = client->registerGroup(smallGroup("g"));
    ASSERT_TRUE(group.ok()) << messageOf(group);
    ASSERT_TRUE(group->unshard().ok());
    // Each file twice: mapped by the client and by the daemon (same process).
    EXPECT_EQ(dbufMappings("unmap-detach:g:"), 2U) << "the group's shard file";
    EXPECT_EQ(dbufMappings("unmap-detach:slot:"), 2U) << "the unsharded slot";
    EXPECT_EQ(dbufMappings("unmap-detach:session:"), 2U) << "the session segment";
    EXPECT_EQ(dbufMappings("unmap-detach"), 6U) << "nothing else of the job is mapped";
    ASSERT_TRUE(client->detach().ok());
    // The Group object lives on, but its memory is gone with the session: the
    // client's three mappings at once, when detach returns; the daemon's three
    // just after (it frees the job once the Detached reply is out).
    EXPECT_LE(dbufMappings("unmap-detach"), 3U) << "detach leaves the group's memory mapped";
    EXPECT_TRUE(waitUntil([] { return dbufMappings("unmap-detach") == 0; }))
        << dbufMappings("unmap-detach") << " mappings left: the daemon did not unmap the freed job's files";
    EXPECT_FALSE(group->unsharded());
    EXPECT_EQ(group->shardView(0).base, nullptr);
    EXPECT_EQ(group->shardView(0).numel(), 0);
    EXPECT_FALSE(group->unshardedView(0).ok());
    EXPECT_FAILS_WITH(group->unshard(), ErrorCode::kUnavailable);
  }
  {
    auto client = daemon.attach(rankOf("unmap-destroy", 0, 1));
    ASSERT_TRUE(client.ok()) << messageOf(client);
    {
      auto group = client->registerGroup(smallGroup("g"));
      ASSERT_TRUE(group.ok()) << messageOf(group);
      ASSERT_TRUE(group->unshard().ok());
      EXPECT_EQ(dbufMappings("unmap-destroy"), 6U) << "shard file, slot and session segment, client and daemon";
    }
    // The client's mappings of the group are gone; the daemon keeps its own
    // (the shard file is the job's, the slot stays the group's until a
    // reshard or the detach) and the session segment is mapped on both sides.
    EXPECT_EQ(dbufMappings("unmap-destroy:g:"), 1U) << "a destroyed group leaves its shard mapped";
    EXPECT_EQ(dbufMappings("unmap-destroy:slot:"), 1U) << "a destroyed group leaves its slot mapped";
    EXPECT_EQ(dbufMappings("unmap-destroy:session:"), 2U);
    EXPECT_EQ(dbufMappings("unmap-destroy"), 4U);
    ASSERT_TRUE(client->detach().ok());
    EXPECT_LE(dbufMappings("unmap-destroy"), 3U) << "detach leaves the session segment mapped";
    EXPECT_TRUE(waitUntil([] { return dbufMappings("unmap-destroy") == 0; }))
        << dbufMappings("unmap-destroy") << " mappings left: the daemon did not unmap the freed job's files";
  }
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Lifecycle, ReshardKeepsTheSlotInThePoolAndDetachGivesItBack) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto client = daemon.attach(rankOf("pages", 0, 1));
  ASSERT_TRUE(client.ok()) << messageOf(client);
  auto group = client->registerGroup(smallGroup("g", 4, 256));  // 8 Ki elements
  ASSERT_TRUE(group.ok()) << messageOf(group);
  const std::size_t memfds = daemon.stats().memfds;
  std::uint64_t allocated = 0;
  for (int round = 0; round < 2; ++round) {
    // acquireSlot, not unshard: a gather would overwrite the params whatever
    // the pages held, and this checks what reshard left in them.
    ASSERT_TRUE(group->acquireSlot().ok());
    EXPECT_EQ(daemon.stats().memfds, memfds + 1) << "one slot file, reused in round " << round;
    for (std::size_t t = 0; t < 4; ++t) {
      auto full = group->unshardedView(t);
      auto grad = group->unshardedGradView(t);
      ASSERT_TRUE(full.ok() && grad.ok());
      // Round 0: a new slot file reads as zeros. Round 1: the same slot,
      // pages kept, holds what round 0 wrote.
      const std::uint16_t expected = round == 0 ? 0 : 0xFFFF;
      for (std::int64_t e = 0; e < full->numel(); ++e) {
        EXPECT_EQ(full->data<std::uint16_t>()[e], expected) << "round " << round;
        EXPECT_EQ(grad->data<std::uint16_t>()[e], expected) << "round " << round;
        full->data<std::uint16_t>()[e] = 0xFFFF;
        grad->data<std::uint16_t>()[e] = 0xFFFF;
      }
    }
    EXPECT_GE(dbufMemfdAllocatedBytes("pages:slot"), std::uint64_t{2} * 8192 * 2) << "params and grads written";
    ASSERT_TRUE(group->reshard().ok());
    const std::uint64_t kept = dbufMemfdAllocatedBytes("pages:slot");
    if (round == 0) allocated = kept;
    EXPECT_EQ(kept, allocated) << "the pool keeps the slot's pages, no more and no less, in round " << round;
  }
  ASSERT_TRUE(client->detach().ok());
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Lifecycle, PrefetchLoopKeepsUnshardedMemoryBounded) {
  // A forward pass over groups of different sizes with prefetch depth 1:
  // unshard the next group, then reshard the previous. Two slots per rank at
  // most, and the memory they hold is bounded by the two largest groups.
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  constexpr std::uint32_t kWorld = 2;
  const std::vector<std::int64_t> rows{64, 8, 200, 32, 128, 16};
  std::vector<std::uint64_t> slot_allocated_max(kWorld, 0);
  std::vector<std::uint64_t> slot_bound(kWorld, 0);
  onRanks(kWorld, [&](std::uint32_t rank) {
    auto client = daemon.attach(rankOf("prefetch", rank, kWorld, false, 1));
    ASSERT_TRUE(client.ok()) << messageOf(client);
    std::vector<Group> groups;
    std::vector<std::int64_t> slot_params;  // bf16 bytes of devices * S per group
    for (std::size_t i = 0; i < rows.size(); ++i) {
      auto group = client->registerGroup(smallGroup("layer" + std::to_string(i), 2, rows[i]));
      ASSERT_TRUE(group.ok()) << messageOf(group);
      slot_params.push_back(group->plan().devices * group->plan().shard_elems * 2);
      groups.push_back(std::move(*group));
    }
    // Two slots, each params + grads of the largest group it served, page-rounded.
    std::int64_t largest = 0;
    for (const std::int64_t bytes : slot_params) largest = std::max(largest, bytes);
    slot_bound[rank] = static_cast<std::uint64_t>(2 * (2 * largest + std::int64_t{2} * 4096));
    const std::string slot_prefix = "prefetch:slot:" + std::to_string(rank);
    for (int pass = 0; pass < 2; ++pass) {
      ASSERT_TRUE(groups[0].unshard().ok());
      for (std::size_t i = 1; i < groups.size(); ++i) {
        auto next = groups[i].unshard();
        ASSERT_TRUE(next.ok()) << "layer " << i << ": " << messageOf(next);
        // Touch every byte of the gathered copy, as a forward pass would.
        for (std::size_t t = 0; t < 2; ++t) {
          auto full = groups[i].unshardedView(t);
          ASSERT_TRUE(full.ok());
          std::fill_n(full->data<std::uint16_t>(), full->numel(), std::uint16_t{0x3F80});
        }
        slot_allocated_max[rank] = std::max(slot_allocated_max[rank], dbufMemfdAllocatedBytes(slot_prefix));
        ASSERT_TRUE(groups[i - 1].reshard().ok());
      }
      ASSERT_TRUE(groups.back().reshard().ok());
      // The pool keeps its pages between passes: still within the bound.
      EXPECT_LE(dbufMemfdAllocatedBytes(slot_prefix), slot_bound[rank]);
    }
    ASSERT_TRUE(client->detach().ok());
  });
  for (std::uint32_t rank = 0; rank < kWorld; ++rank) {
    EXPECT_GT(slot_allocated_max[rank], 0U);
    EXPECT_LE(slot_allocated_max[rank], slot_bound[rank]) << "rank " << rank;
  }
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Lifecycle, CallsOutOfOrderAreRefusedWithoutHarm) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto client = daemon.connect();
  ASSERT_TRUE(client.ok()) << messageOf(client);
  EXPECT_FAILS_WITH(client->registerGroup(smallGroup("early")), ErrorCode::kInvalidArgument);
  ASSERT_TRUE(client->attach(rankOf("ordered", 0, 1)).ok());
  EXPECT_FAILS_WITH(client->attach(rankOf("ordered", 0, 1)), ErrorCode::kInvalidArgument);
  auto group = client->registerGroup(smallGroup("g"));
  EXPECT_TRUE(group.ok()) << messageOf(group);
  ASSERT_TRUE(client->detach().ok());
  EXPECT_FALSE(client->detach().ok()) << "a second detach has no connection to use";
  EXPECT_FAILS_WITH(client->registerGroup(smallGroup("late")), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Lifecycle, OtherDtypesGiveViewsOfTheirOwnElementSize) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  constexpr std::uint32_t kWorld = 2;
  onRanks(kWorld, [&](std::uint32_t rank) {
    auto client = daemon.attach(rankOf("dtypes", rank, kWorld));
    ASSERT_TRUE(client.ok()) << messageOf(client);
    GroupSpec spec = smallGroup("half-master", 3, 10);
    spec.sharded_dtype = DType::kF16;
    spec.unsharded_dtype = DType::kF32;
    auto group = client->registerGroup(spec);
    ASSERT_TRUE(group.ok()) << messageOf(group);
    const GroupPlan& plan = group->plan();
    EXPECT_GE(group->shardBytes(), static_cast<std::size_t>(plan.shard_elems) * 2 * 2);
    std::vector<std::pair<const std::byte*, const std::byte*>> spans;  // 2-byte elements: no overlap
    for (std::size_t t = 0; t < 3; ++t) {
      const TensorView view = group->shardView(t);
      EXPECT_EQ(view.dtype, DType::kF16);
      if (view.numel() == 0) continue;
      spans.emplace_back(view.base, view.base + view.numel() * 2);
      // fp16 bit patterns rank + 1: subnormals, exact in fp32.
      std::fill_n(view.data<std::uint16_t>(), view.numel(), static_cast<std::uint16_t>(rank + 1));
    }
    std::sort(spans.begin(), spans.end());
    for (std::size_t i = 1; i < spans.size(); ++i) EXPECT_LE(spans[i - 1].second, spans[i].first);
    ASSERT_TRUE(group->unshard().ok());
    // The gather widened every rank's fp16 shard to fp32.
    for (std::size_t t = 0; t < 3; ++t) {
      auto gathered = group->unshardedView(t);
      ASSERT_TRUE(gathered.ok());
      std::int64_t wrong = 0;
      for (std::int64_t e = 0; e < gathered->numel(); ++e) {
        const auto owner = static_cast<std::uint16_t>(ownerOf(plan, t, e) + 1);
        wrong += gathered->data<float>()[e] != kernels::halfToFloat(owner) ? 1 : 0;
      }
      EXPECT_EQ(wrong, 0) << "rank " << rank << " tensor " << t;
    }
    auto full = group->unshardedView(2);
    ASSERT_TRUE(full.ok());
    EXPECT_EQ(full->dtype, DType::kF32);
    auto first = group->unshardedView(0);
    EXPECT_EQ(full->base - first->base, (plan.tensors[2].offset - plan.tensors[0].offset) * 4);
    std::fill_n(full->data<float>(), full->numel(), 1.5F);
    ASSERT_TRUE(group->reshard().ok());
    ASSERT_TRUE(client->detach().ok());
  });
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Lifecycle, Fp64GroupsReduceInFp64) {
  // fp64 parameters (trainable fp64 models, as FSDP2 trains them) are gathered as they are and their gradients
  // summed in fp64: the values differ from 1 below fp32's precision, so a sum through fp32 would lose them.
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  constexpr std::uint32_t kWorld = 3;
  const auto grad_value = [](std::uint32_t rank, std::size_t t, std::int64_t e) {
    return 1.0 + static_cast<double>((rank + 1) * 7 + t * 3 + static_cast<std::size_t>(e) % 11) * 0x1p-40;
  };
  // The sum in rank order, in fp64, times the factor: what every backend computes.
  const auto reduced = [&](std::size_t t, std::int64_t e, double factor) {
    double sum = 0.0;
    for (std::uint32_t r = 0; r < kWorld; ++r) sum += grad_value(r, t, e);
    return sum * factor;
  };
  onRanks(kWorld, [&](std::uint32_t rank) {
    auto client = daemon.attach(rankOf("fp64", rank, kWorld));
    ASSERT_TRUE(client.ok()) << messageOf(client);
    GroupSpec spec = smallGroup("fp64", 3, 10);
    spec.sharded_dtype = DType::kF64;
    spec.unsharded_dtype = DType::kF64;
    auto group = client->registerGroup(spec);
    ASSERT_TRUE(group.ok()) << messageOf(group);
    ASSERT_TRUE(group->unshard().ok());
    const auto write_grads = [&] {
      for (std::size_t t = 0; t < 3; ++t) {
        auto grad = group->unshardedGradView(t);
        ASSERT_TRUE(grad.ok());
        ASSERT_EQ(grad->dtype, DType::kF64);
        for (std::int64_t e = 0; e < grad->numel(); ++e) grad->data<double>()[e] = grad_value(rank, t, e);
      }
    };
    const auto expect_shard_grads = [&](const auto& want, const char* what) {
      for (std::size_t t = 0; t < 3; ++t) {
        const TensorView shard = group->shardGradView(t);
        ASSERT_EQ(shard.dtype, DType::kF64);
        std::int64_t wrong = 0;
        for (std::int64_t e = shard.begin; e < shard.end; ++e) {
          wrong += shard.data<double>()[e - shard.begin] != want(t, e) ? 1 : 0;
        }
        EXPECT_EQ(wrong, 0) << what << ", rank " << rank << " tensor " << t;
      }
    };
    write_grads();
    ASSERT_TRUE(group->reduceScatter({.mode = ReduceMode::kAvg}).ok());
    const double third = 1.0 / 3.0;  // avg's factor is computed in fp64 too
    expect_shard_grads([&](std::size_t t, std::int64_t e) { return reduced(t, e, third); }, "avg");
    // Gradient accumulation: summed again, added in fp64 to the sharded gradient.
    ASSERT_TRUE(group->reduceScatter({.mode = ReduceMode::kSum, .accumulate = true}).ok());
    expect_shard_grads([&](std::size_t t, std::int64_t e) { return reduced(t, e, third) + reduced(t, e, 1.0); },
                       "accumulated");
    write_grads();
    ASSERT_TRUE(group->allReduce({.mode = ReduceMode::kSum}).ok());
    for (std::size_t t = 0; t < 3; ++t) {
      auto grad = group->unshardedGradView(t);
      ASSERT_TRUE(grad.ok());
      std::int64_t wrong = 0;
      for (std::int64_t e = 0; e < grad->numel(); ++e) wrong += grad->data<double>()[e] != reduced(t, e, 1.0) ? 1 : 0;
      EXPECT_EQ(wrong, 0) << "all-reduce, rank " << rank << " tensor " << t;
    }
    ASSERT_TRUE(group->reshard().ok());
    ASSERT_TRUE(client->detach().ok());
  });
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Lifecycle, GatherOnlyGroupsCopyAnyDtypeAndRefuseReductions) {
  // Frozen parameters of dtypes dbufd does not compute in (fp8, integers) are held and gathered as they are;
  // their groups have gradient regions of their own dtype and no reductions. (fp64 is gathered the same way
  // and reduced in fp64: Fp64GroupsReduceInFp64.)
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  constexpr std::uint32_t kWorld = 2;
  onRanks(kWorld, [&](std::uint32_t rank) {
    auto client = daemon.attach(rankOf("bits", rank, kWorld));
    ASSERT_TRUE(client.ok()) << messageOf(client);
    for (const DType dtype : {DType::kF8E4M3, DType::kF8E5M2, DType::kI64, DType::kU8}) {
      const auto width = static_cast<std::size_t>(sizeBytes(dtype));
      GroupSpec spec = smallGroup("frozen-" + std::string(toString(dtype)), 3, 10);
      spec.sharded_dtype = dtype;
      spec.unsharded_dtype = dtype;
      auto group = client->registerGroup(spec);
      ASSERT_TRUE(group.ok()) << toString(dtype) << ": " << messageOf(group);
      const GroupPlan& plan = group->plan();
      // Every byte of a rank's elements is a pattern of the owner, the tensor and the element: any byte moved,
      // dropped or converted shows.
      const auto pattern = [&](std::uint32_t owner, std::size_t t, std::int64_t e, std::size_t byte) {
        return static_cast<std::byte>((owner * 71 + t * 13 + static_cast<std::size_t>(e) * 5 + byte) & 0xFF);
      };
      for (std::size_t t = 0; t < 3; ++t) {
        const TensorView view = group->shardView(t);
        EXPECT_EQ(view.dtype, dtype);
        for (std::int64_t i = 0; i < view.numel(); ++i) {
          for (std::size_t b = 0; b < width; ++b) {
            view.base[static_cast<std::size_t>(i) * width + b] = pattern(rank, t, view.begin + i, b);
          }
        }
      }
      ASSERT_TRUE(group->unshard().ok()) << toString(dtype);
      for (std::size_t t = 0; t < 3; ++t) {
        auto gathered = group->unshardedView(t);
        ASSERT_TRUE(gathered.ok());
        EXPECT_EQ(gathered->dtype, dtype);
        std::int64_t wrong = 0;
        for (std::int64_t e = 0; e < gathered->numel(); ++e) {
          for (std::size_t b = 0; b < width; ++b) {
            const std::byte expected = pattern(ownerOf(plan, t, e), t, e, b);
            wrong += gathered->base[static_cast<std::size_t>(e) * width + b] != expected ? 1 : 0;
          }
        }
        EXPECT_EQ(wrong, 0) << toString(dtype) << " rank " << rank << " tensor " << t;
        auto grad = group->unshardedGradView(t);
        ASSERT_TRUE(grad.ok());
        EXPECT_EQ(grad->dtype, dtype) << "no bf16 gradients beside a gather-only fp8 group";
      }
      auto reduced = group->reduceScatter();
      EXPECT_FAILS_WITH(reduced, ErrorCode::kInvalidArgument);
      EXPECT_NE(messageOf(reduced).find("does not reduce"), std::string::npos) << messageOf(reduced);
      EXPECT_FAILS_WITH(group->allReduce(), ErrorCode::kInvalidArgument);
      ASSERT_TRUE(group->reshard().ok()) << "the refused reductions left the group usable";
      ASSERT_TRUE(group->unshard().ok());
      ASSERT_TRUE(group->reshard().ok());
    }
    GroupSpec widened = smallGroup("fp64-to-fp32", 3, 10);
    widened.sharded_dtype = DType::kF64;
    widened.unsharded_dtype = DType::kF32;
    auto refused = client->registerGroup(widened);
    EXPECT_FAILS_WITH(refused, ErrorCode::kInvalidArgument);
    EXPECT_NE(messageOf(refused).find("fp64 -> fp32"), std::string::npos) << messageOf(refused);
    ASSERT_TRUE(client->detach().ok());
  });
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Lifecycle, AGroupEveryRankUnregisteredGivesItsMemoryBackAndItsNameMayBeRegisteredAgain) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  constexpr std::uint32_t kWorld = 2;
  std::vector<std::optional<Client>> clients(kWorld);
  std::vector<std::optional<Group>> groups(kWorld);
  onRanks(kWorld, [&](std::uint32_t rank) {
    auto client = daemon.attach(rankOf("regroup", rank, kWorld));
    ASSERT_TRUE(client.ok()) << messageOf(client);
    auto group = client->registerGroup(smallGroup("g", 3, 10));
    ASSERT_TRUE(group.ok()) << messageOf(group);
    ASSERT_TRUE(group->unshard().ok());
    clients[rank].emplace(std::move(*client));
    groups[rank].emplace(std::move(*group));
  });
  ASSERT_TRUE(groups[0] && groups[1]);
  const daemon::ServerStats with_group = daemon.stats();
  // Rank 0 is done with it (its slot given back on the way); rank 1 is not: the memory stays.
  ASSERT_TRUE(groups[0]->unregister().ok());
  EXPECT_FALSE(groups[0]->registered());
  EXPECT_EQ(groups[0]->shardView(0).base, nullptr);
  EXPECT_FAILS_WITH(groups[0]->unshard(), ErrorCode::kInvalidArgument);
  EXPECT_FAILS_WITH(groups[0]->submitReduceScatter(), ErrorCode::kInvalidArgument);
  EXPECT_FAILS_WITH(groups[0]->unregister(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(daemon.stats().memfds, with_group.memfds);
  EXPECT_TRUE(groups[1]->unsharded());
  ASSERT_TRUE(groups[1]->unregister().ok());
  // Both shard files (and rank 1's slot, which went back to its pool, keeps its pages) are what is freed.
  EXPECT_TRUE(waitUntil([&] { return daemon.stats().memfds == with_group.memfds - kWorld; }))
      << daemon.stats().memfds << " memfds, " << with_group.memfds << " with the group";
  EXPECT_LT(daemon.stats().bytes_in_use, with_group.bytes_in_use);
  onRanks(kWorld, [&](std::uint32_t rank) {
    auto again = clients[rank]->registerGroup(smallGroup("g", 4, 12));  // another spec under the same name
    ASSERT_TRUE(again.ok()) << messageOf(again);
    EXPECT_EQ(again->plan().tensors.size(), 4U);
    ASSERT_TRUE(again->unshard().ok());
    ASSERT_TRUE(again->reshard().ok());
    ASSERT_TRUE(clients[rank]->detach().ok());
  });
  groups.clear();
  clients.clear();
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Lifecycle, AJobIdTheProtocolRefusesLeavesTheClientUsable) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto client = daemon.connect();
  ASSERT_TRUE(client.ok()) << messageOf(client);
  auto refused = client->attach(rankOf("not a valid id!", 0, 1));
  EXPECT_FAILS_WITH(refused, ErrorCode::kInvalidArgument);
  EXPECT_NE(refused.error().message.find("job"), std::string::npos) << refused.error().message;
  auto attached = client->attach(rankOf("a-valid.id_1", 0, 1));
  ASSERT_TRUE(attached.ok()) << "the refused attach broke the client: " << messageOf(attached);
  GroupSpec spec = smallGroup("g");
  spec.tensors[0].name = std::string(600, 'n');  // over the protocol's string limit
  EXPECT_FAILS_WITH(client->registerGroup(spec), ErrorCode::kInvalidArgument);
  auto group = client->registerGroup(smallGroup("g"));
  EXPECT_TRUE(group.ok()) << messageOf(group);
  ASSERT_TRUE(client->detach().ok());
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Lifecycle, NonPersistentJobIsFreedWhenItsLastRankDetaches) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  std::vector<std::optional<Client>> clients(2);
  std::vector<std::optional<Group>> groups(2);
  onRanks(2, [&](std::uint32_t rank) {
    auto client = daemon.attach(rankOf("short-lived", rank, 2));
    ASSERT_TRUE(client.ok()) << messageOf(client);
    auto group = client->registerGroup(smallGroup("g", 2));
    ASSERT_TRUE(group.ok()) << messageOf(group);
    clients[rank].emplace(std::move(*client));
    groups[rank].emplace(std::move(*group));
  });
  ASSERT_TRUE(clients[0] && clients[1]);
  // Rank 0 alone takes a slot: acquireSlot (unshard is a collective).
  ASSERT_TRUE(groups[0]->acquireSlot().ok());
  const daemon::ServerStats full = daemon.stats();
  EXPECT_EQ(full.sessions, 2U);
  EXPECT_EQ(full.memfds, 5U);  // two shard files, two session segments, one slot

  // Detach replies only after the daemon let the rank go: no waiting needed.
  ASSERT_TRUE(clients[0]->detach().ok());
  daemon::ServerStats one_left = daemon.stats();
  EXPECT_EQ(one_left.sessions, 1U);
  EXPECT_EQ(one_left.jobs, 1U);
  // The job keeps both shard files; rank 0's slot and session segment go at
  // once, rank 1's session segment stays.
  EXPECT_EQ(one_left.memfds, 3U) << "rank 0's slot and session segment are given back at once";
  EXPECT_EQ(one_left.bytes_in_use, 2 * groups[1]->shardBytes());

  ASSERT_TRUE(clients[1]->detach().ok());
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Lifecycle, DroppingTheConnectionReclaimsTheSessionAndTheJob) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  {
    auto client = daemon.attach(rankOf("dropped", 0, 1));
    ASSERT_TRUE(client.ok()) << messageOf(client);
    auto group = client->registerGroup(smallGroup("g"));
    ASSERT_TRUE(group.ok()) << messageOf(group);
    ASSERT_TRUE(group->unshard().ok());
    EXPECT_EQ(daemon.stats().sessions, 1U);
  }  // no detach: the connection just closes
  EXPECT_TRUE(waitUntil([&] { return daemon.stats().sessions == 0 && daemon.stats().jobs == 0; }));
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Lifecycle, TwoJobsSideBySideKeepTheirOwnMemory) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  auto a = daemon.attach(rankOf("job-a", 0, 1));
  auto b = daemon.attach(rankOf("job-b", 0, 1));
  ASSERT_TRUE(a.ok()) << messageOf(a);
  ASSERT_TRUE(b.ok()) << messageOf(b);
  auto group_a = a->registerGroup(smallGroup("same-name"));
  auto group_b = b->registerGroup(smallGroup("same-name"));
  ASSERT_TRUE(group_a.ok()) << messageOf(group_a);
  ASSERT_TRUE(group_b.ok()) << messageOf(group_b);
  const TensorView view_a = group_a->shardView(0);
  const TensorView view_b = group_b->shardView(0);
  ASSERT_EQ(view_a.numel(), view_b.numel());
  std::fill_n(view_a.data<float>(), view_a.numel(), 1.0F);
  std::fill_n(view_b.data<float>(), view_b.numel(), 2.0F);
  EXPECT_EQ(view_a.data<float>()[0], 1.0F);
  EXPECT_EQ(view_a.data<float>()[view_a.numel() - 1], 1.0F);
  EXPECT_EQ(daemon.stats().jobs, 2U);
  ASSERT_TRUE(a->detach().ok());
  EXPECT_EQ(daemon.stats().jobs, 1U);
  EXPECT_EQ(view_b.data<float>()[0], 2.0F) << "job b's memory survives job a";
  ASSERT_TRUE(b->detach().ok());
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

TEST(Lifecycle, LongestJobAndGroupNamesWork) {
  EmbeddedDaemon daemon;
  ASSERT_TRUE(daemon.started());
  const std::string job(128, 'j');   // the longest job id the protocol allows
  const std::string name(128, 'g');  // the longest group name the daemon allows
  auto client = daemon.attach(rankOf(job, 0, 1));
  ASSERT_TRUE(client.ok()) << messageOf(client);
  auto group = client->registerGroup(smallGroup(name));
  ASSERT_TRUE(group.ok()) << messageOf(group);
  ASSERT_TRUE(group->unshard().ok());
  ASSERT_TRUE(client->detach().ok());
  EXPECT_TRUE(daemonIsEmpty(daemon.stats()));
}

}  // namespace
}  // namespace dbuf::integration
