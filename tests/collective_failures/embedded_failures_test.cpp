// How the data plane fails (issue 4), with dbufd embedded in the test process
// and ranks on threads: mismatched ops, timeouts naming the missing ranks, a
// rank whose connection ends, jobs that must not wait for each other, a full
// ring, a corrupt ring, requests the daemon must refuse, reshard with ops in
// flight and a shutdown while a rank waits. Kill -9 of real rank processes is
// in process_failures_test.cpp.
//
// No sleeps: ranks meet at std::barriers (Phases), and what is asynchronous to
// the test is polled against a deadline (waitUntil). Timing bounds are loose
// (an error "at once" must come well before the configured timeout).
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <barrier>
#include <limits>
#include <optional>
#include <ostream>
#include <string>
#include <type_traits>
#include <vector>

#include "dbuf/common/stream_counter_word.hpp"
#include "harness.hpp"
#include "raw.hpp"
#include "raw_ring.hpp"
#include "support/sanitizers.hpp"
#include "support/text.hpp"

namespace dbuf::integration {
namespace {

using dbuf::testing::contains;
using std::chrono::milliseconds;
using Ranks = std::vector<std::uint32_t>;

daemon::Config failureConfig(milliseconds collective_timeout, std::uint32_t ring_entries = 1024) {
  daemon::Config config;
  config.collective_timeout = collective_timeout;
  config.ring_entries = ring_entries;
  return config;
}

/// One tensor of `elements` elements, element granularity, fp32 unsharded.
GroupSpec oneTensor(const std::string& name, std::int64_t elements, DType sharded = DType::kF32) {
  GroupSpec spec;
  spec.name = name;
  spec.tensors = {{"w", {elements}, "", -1}};
  spec.granularity = "element";
  spec.sharded_dtype = sharded;
  spec.unsharded_dtype = DType::kF32;
  return spec;
}

std::int64_t msSince(Clock::time_point start) {
  return std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
}

/// What one call returned, kept for checks after the rank threads joined.
struct Outcome {
  bool ok = false;
  ErrorCode code = ErrorCode::kInternal;
  std::string message;
  Ranks ranks;  ///< Error::ranks
  std::int64_t elapsed_ms = -1;
  std::uint64_t sequence = 0;
  std::int64_t run_ms = -1;  ///< the daemon's execution time (OpResult::run)
};

template <typename T>
Outcome outcomeOf(const Result<T>& result, Clock::time_point start) {
  Outcome outcome;
  outcome.ok = result.ok();
  outcome.elapsed_ms = msSince(start);
  if (!result.ok()) {
    outcome.code = result.error().code;
    outcome.message = result.error().message;
    outcome.ranks = result.error().ranks;
  } else if constexpr (std::is_same_v<T, OpResult>) {
    outcome.sequence = result->sequence;
    outcome.run_ms = std::chrono::duration_cast<milliseconds>(result->run).count();
  }
  return outcome;
}

std::ostream& operator<<(std::ostream& out, const Outcome& outcome) {
  if (outcome.ok) {
    return out << "ok (sequence " << outcome.sequence << ", " << outcome.elapsed_ms << " ms, run " << outcome.run_ms
               << " ms)";
  }
  return out << toString(outcome.code) << " after " << outcome.elapsed_ms << " ms: " << outcome.message;
}

/// Submits through `submit` and waits; the Outcome carries the sequence.
template <typename Submit>
Outcome submitAndWait(Client& client, Submit&& submit, std::optional<milliseconds> timeout = std::nullopt) {
  const auto start = Clock::now();
  auto handle = submit();
  if (!handle) return outcomeOf(handle, start);
  return outcomeOf(client.wait(*handle, timeout), start);
}

::testing::AssertionResult failedWith(const Outcome& outcome, ErrorCode code, const std::vector<std::string>& parts) {
  if (outcome.ok) return ::testing::AssertionFailure() << "succeeded: " << outcome;
  if (outcome.code != code) {
    return ::testing::AssertionFailure() << "expected " << toString(code) << ", got " << outcome;
  }
  for (const std::string& part : parts) {
    if (outcome.message.find(part) == std::string::npos) {
      return ::testing::AssertionFailure() << "message lacks '" << part << "': " << outcome;
    }
  }
  return ::testing::AssertionSuccess();
}

void fill(const TensorView& view, float value) {
  for (std::int64_t i = 0; i < view.numel(); ++i) view.data<float>()[i] = value;
}

void fillShard(const Group& group, float value) {
  for (std::size_t t = 0; t < group.plan().tensors.size(); ++t) fill(group.shardView(t), value);
}

/// Every element of the unsharded params equals (owner rank + 1) * base,
/// where the owner of global element i is i / shard_elems.
/// `stride` > 1 checks every stride-th element and the last one (large groups).
::testing::AssertionResult gatheredFrom(const Group& group, float base, std::int64_t stride = 1) {
  auto view = group.unshardedView(0);
  if (!view) return ::testing::AssertionFailure() << view.error().message;
  const std::int64_t shard = group.plan().shard_elems;
  for (std::int64_t i = 0; i < view->numel();
       i = (i + stride < view->numel() || i == view->numel() - 1) ? i + stride : view->numel() - 1) {
    const auto expected = static_cast<float>(i / shard + 1) * base;
    if (view->data<float>()[i] != expected) {
      return ::testing::AssertionFailure()
             << "element " << i << " is " << view->data<float>()[i] << ", expected " << expected;
    }
  }
  return ::testing::AssertionSuccess();
}

/// The clients' default wait: only stops a hung test (longer under a sanitizer).
constexpr auto kClientTimeout = dbuf::testing::sanitizerScaled(std::chrono::seconds(8));

// ----------------------------------------------------------------- mismatch

TEST(CollectiveFailures, MismatchFailsOnEveryRankNamingEachRanksOpAndTheJobGoesOn) {
  EmbeddedDaemon daemon(failureConfig(milliseconds(20000)));
  ASSERT_TRUE(daemon.started());
  constexpr std::uint32_t kWorld = 3;
  constexpr std::size_t kSteps = 6;
  std::array<std::array<Outcome, kSteps>, kWorld> outcomes{};
  std::array<bool, kWorld> gathered{};
  onRanks(kWorld, [&](std::uint32_t rank) {
    auto client = daemon.attach(rankOf("mm", rank, kWorld), kClientTimeout);
    ASSERT_TRUE(client.ok()) << messageOf(client);
    auto group = client->registerGroup(oneTensor("g", 96));
    ASSERT_TRUE(group.ok()) << messageOf(group);
    ASSERT_TRUE(group->acquireSlot().ok());
    fillShard(*group, static_cast<float>(rank + 1) * 10.0F);
    auto& mine = outcomes[rank];
    // #0: three different ops.
    mine[0] = submitAndWait(*client, [&] {
      if (rank == 0) return group->submitAllGather();
      if (rank == 1) return group->submitReduceScatter({ReduceMode::kSum});
      return group->submitAllReduce({ReduceMode::kAvg, 0.5F, 1.0F, false});
    });
    // #1: the same op, different roots.
    mine[1] = submitAndWait(*client, [&] { return group->submitBroadcast(rank % 2); });
    // #2: the same reduction, one rank with another post scale.
    mine[2] = submitAndWait(*client, [&] {
      return group->submitAllReduce({ReduceMode::kSum, 1.0F, rank == 2 ? 2.0F : 1.0F, false});
    });
    // #3: one rank accumulates, the others overwrite.
    mine[3] = submitAndWait(*client, [&] {
      return group->submitReduceScatter({ReduceMode::kSum, 1.0F, 1.0F, rank == 1});
    });
    // #4: a barrier against a group op.
    mine[4] = submitAndWait(*client, [&] { return rank == 0 ? client->submitBarrier() : group->submitAllGather(); });
    // #5: the sequences stayed aligned: a matching op runs.
    mine[5] = submitAndWait(*client, [&] { return group->submitAllGather(); });
    gathered[rank] = mine[5].ok && gatheredFrom(*group, 10.0F);
    ASSERT_TRUE(client->detach().ok());
  });

  const std::string j = "dbufd: ";
  const std::array<std::string, 5> expected{
      // Ranks that agree are listed together (ranks 0, 2 / ranks 0-1).
      j + "collective #0 does not match across ranks: rank 0 allGather(group 'g'); rank 1 reduceScatter(group 'g', "
          "sum); rank 2 allReduce(group 'g', avg, pre 0.5)",
      j + "collective #1 does not match across ranks: ranks 0, 2 broadcast(group 'g', root 0); rank 1 "
          "broadcast(group 'g', root 1)",
      j + "collective #2 does not match across ranks: ranks 0-1 allReduce(group 'g', sum); rank 2 allReduce(group "
          "'g', sum, post 2)",
      j + "collective #3 does not match across ranks: ranks 0, 2 reduceScatter(group 'g', sum); rank 1 "
          "reduceScatter(group 'g', sum, accumulate)",
      j + "collective #4 does not match across ranks: rank 0 barrier; ranks 1-2 allGather(group 'g')",
  };
  // The ranks whose op differs from rank 0's, as data.
  const std::array<Ranks, 5> disagreeing{Ranks{1, 2}, Ranks{1}, Ranks{2}, Ranks{1}, Ranks{1, 2}};
  for (std::uint32_t rank = 0; rank < kWorld; ++rank) {
    for (std::size_t step = 0; step < expected.size(); ++step) {
      EXPECT_TRUE(failedWith(outcomes[rank][step], ErrorCode::kConflict, {expected[step]}))
          << "rank " << rank << ", collective #" << step;
      EXPECT_EQ(outcomes[rank][step].message, expected[step]) << "rank " << rank;
      EXPECT_EQ(outcomes[rank][step].ranks, disagreeing[step]) << "rank " << rank << ", collective #" << step;
    }
    EXPECT_TRUE(outcomes[rank][5].ok) << "rank " << rank << ": " << outcomes[rank][5];
    EXPECT_EQ(outcomes[rank][5].sequence, 5U) << "rank " << rank;
    EXPECT_TRUE(gathered[rank]) << "rank " << rank;
  }
}

// A node's usual job (8 ranks) with a realistic group name: the message must
// still name every rank's op, the odd one out included.
TEST(CollectiveFailures, MismatchMessageOfAnEightRankJobNamesTheOddRankOut) {
  EmbeddedDaemon daemon(failureConfig(milliseconds(20000)));
  ASSERT_TRUE(daemon.started());
  constexpr std::uint32_t kWorld = 8;
  const std::string name = "decoder.layers.17.self_attention.qkv_proj";
  std::array<Outcome, kWorld> outcomes{};
  onRanks(kWorld, [&](std::uint32_t rank) {
    auto client = daemon.attach(rankOf("eight", rank, kWorld), kClientTimeout);
    ASSERT_TRUE(client.ok()) << messageOf(client);
    auto group = client->registerGroup(oneTensor(name, 64));
    ASSERT_TRUE(group.ok()) << messageOf(group);
    ASSERT_TRUE(group->acquireSlot().ok());
    outcomes[rank] = submitAndWait(
        *client, [&] { return rank == kWorld - 1 ? group->submitReduceScatter() : group->submitAllGather(); });
  });
  EXPECT_TRUE(failedWith(outcomes[0], ErrorCode::kConflict,
                         {"collective #0 does not match across ranks", "ranks 0-6 allGather(group '" + name + "')",
                          "rank 7 reduceScatter(group '" + name + "', sum)"}))
      << "(" << outcomes[0].message.size() << " bytes)";
  for (std::uint32_t rank = 0; rank < kWorld; ++rank) {
    EXPECT_FALSE(outcomes[rank].ok) << "rank " << rank;
    EXPECT_EQ(outcomes[rank].message, outcomes[0].message) << "rank " << rank;
    EXPECT_EQ(outcomes[rank].ranks, Ranks{7}) << "rank " << rank << ": the odd rank out, as data";
  }
}

// ----------------------------------------------------------------- timeouts

TEST(CollectiveFailures, TimeoutNamesTheMissingRanksAndLateRanksFailAtOnceWithTheSameMessage) {
  EmbeddedDaemon daemon(failureConfig(milliseconds(300)));
  ASSERT_TRUE(daemon.started());
  constexpr std::uint32_t kWorld = 3;
  std::barrier<> ready(kWorld);
  std::barrier<> first_timed_out(kWorld);
  std::barrier<> first_told(kWorld);
  std::barrier<> second_timed_out(kWorld);
  std::array<Outcome, kWorld> first{};
  std::array<Outcome, kWorld> after_first{};
  std::array<Outcome, kWorld> second{};
  std::array<Outcome, kWorld> after_second{};
  std::array<bool, kWorld> reduced{};
  onRanks(kWorld, [&](std::uint32_t rank) {
    Phases phases({&ready, &first_timed_out, &first_told, &second_timed_out});
    auto client = daemon.attach(rankOf("slow", rank, kWorld), kClientTimeout);
    ASSERT_TRUE(client.ok()) << messageOf(client);
    auto group = client->registerGroup(oneTensor("g", 30));
    ASSERT_TRUE(group.ok()) << messageOf(group);
    ASSERT_TRUE(group->acquireSlot().ok());
    phases.next();  // ready
    // #0: rank 2 is late.
    if (rank != 2) first[rank] = submitAndWait(*client, [&] { return client->submitBarrier(); });
    phases.next();  // first_timed_out
    if (rank == 2) first[rank] = submitAndWait(*client, [&] { return client->submitBarrier(); });
    phases.next();  // first_told
    // #1: everyone: the job goes on, its sequence numbers aligned.
    fill(*group->unshardedGradView(0), static_cast<float>(rank + 1));
    after_first[rank] = submitAndWait(*client, [&] { return group->submitAllReduce({ReduceMode::kSum}); });
    const auto grads = group->unshardedGradView(0);
    reduced[rank] = grads.ok() && grads->data<float>()[0] == 6.0F && grads->data<float>()[29] == 6.0F;
    // #2: ranks 1 and 2 are late.
    if (rank == 0) second[rank] = submitAndWait(*client, [&] { return group->submitAllGather(); });
    phases.next();  // second_timed_out
    if (rank != 0) second[rank] = submitAndWait(*client, [&] { return group->submitAllGather(); });
    // #3
    after_second[rank] = submitAndWait(*client, [&] { return client->submitBarrier(); });
    ASSERT_TRUE(client->detach().ok());
  });

  const std::string one_missing =
      "dbufd: collective #0 barrier timed out after 300 ms: rank 2 of job slow has not submitted it";
  const std::string two_missing =
      "dbufd: collective #2 allGather(group 'g') timed out after 300 ms: ranks 1, 2 of job slow have not submitted it";
  for (std::uint32_t rank = 0; rank < kWorld; ++rank) {
    const bool waited_first = rank != 2;
    EXPECT_TRUE(failedWith(first[rank], ErrorCode::kTimeout, {one_missing})) << "rank " << rank;
    EXPECT_EQ(first[rank].message, one_missing);
    EXPECT_EQ(first[rank].ranks, Ranks{2}) << "rank " << rank;
    if (waited_first) {
      EXPECT_GE(first[rank].elapsed_ms, 280) << "rank " << rank << " timed out before collective_ms";
      EXPECT_LT(first[rank].elapsed_ms, 800) << "rank " << rank << " must hear soon after collective_ms";
    } else {
      EXPECT_LT(first[rank].elapsed_ms, 250) << "the late rank must fail at once, not wait";
    }
    EXPECT_TRUE(after_first[rank].ok) << "rank " << rank << ": " << after_first[rank];
    EXPECT_EQ(after_first[rank].sequence, 1U) << "rank " << rank;
    EXPECT_TRUE(reduced[rank]) << "rank " << rank;

    EXPECT_TRUE(failedWith(second[rank], ErrorCode::kTimeout, {two_missing})) << "rank " << rank;
    EXPECT_EQ(second[rank].message, two_missing);
    EXPECT_EQ(second[rank].ranks, (Ranks{1, 2})) << "rank " << rank;
    if (rank == 0) {
      EXPECT_GE(second[rank].elapsed_ms, 280);
    } else {
      EXPECT_LT(second[rank].elapsed_ms, 250) << "rank " << rank << " must fail at once";
    }
    EXPECT_TRUE(after_second[rank].ok) << "rank " << rank << ": " << after_second[rank];
    EXPECT_EQ(after_second[rank].sequence, 3U) << "rank " << rank;
  }
}

// A rank that queues ahead (prefetch) must not make the next collective time
// out while the daemon itself is still running the previous one: the other
// rank submits it about a millisecond after the previous op completed, so
// nobody was missing for anything like collective_ms. (Today the daemon
// counts from the queued op's submission and fails it at once.)
TEST(CollectiveFailures, TimeoutDoesNotCountTheTimeTheDaemonSpentRunningEarlierOps) {
  // Under a sanitizer the other rank's look at the data takes longer, and
  // the all-gather still far longer than the scaled timeout.
  constexpr auto kTimeout = dbuf::testing::sanitizerScaled(milliseconds(50));
  EmbeddedDaemon daemon(failureConfig(kTimeout));
  ASSERT_TRUE(daemon.started());
  // 2 x 16 Mi fp32 elements: an all-gather of 16 steps of 4 Mi elements, longer than kTimeout.
  // Twice that under a sanitizer: the timeout is scaled by the whole
  // slowdown, the all-gather's copies are slowed less (ASan: 138 ms against
  // a 150 ms timeout once on 2 cores).
  constexpr std::int64_t kElements = std::int64_t{dbuf::testing::kSanitizerSlowdown > 1 ? 64 : 32} << 20;
  std::barrier<> ready(2);
  std::array<Outcome, 2> gather{};
  std::array<Outcome, 2> barrier{};
  onRanks(2, [&](std::uint32_t rank) {
    Phases phases({&ready});
    auto client = daemon.attach(rankOf("ahead", rank, 2), kClientTimeout);
    ASSERT_TRUE(client.ok()) << messageOf(client);
    auto group = client->registerGroup(oneTensor("g", kElements));
    ASSERT_TRUE(group.ok()) << messageOf(group);
    ASSERT_TRUE(group->acquireSlot().ok());
    fillShard(*group, static_cast<float>(rank + 1));
    phases.next();  // ready
    if (rank == 0) {
      // Both ops at once, then wait for both.
      const auto start = Clock::now();
      auto first = group->submitAllGather();
      auto second = client->submitBarrier();
      ASSERT_TRUE(first.ok() && second.ok());
      gather[rank] = outcomeOf(client->wait(*first), start);
      barrier[rank] = outcomeOf(client->wait(*second), start);
    } else {
      // One at a time, with a look at the data in between (about a
      // millisecond: far less than kTimeout).
      gather[rank] = submitAndWait(*client, [&] { return group->submitAllGather(); });
      EXPECT_TRUE(gatheredFrom(*group, 1.0F, 4099));
      barrier[rank] = submitAndWait(*client, [&] { return client->submitBarrier(); });
    }
    ASSERT_TRUE(client->detach().ok());
  });
  ASSERT_TRUE(gather[0].ok && gather[1].ok) << gather[0] << " / " << gather[1];
  ASSERT_GT(gather[1].run_ms, kTimeout.count())
      << "the all-gather ran too fast to show anything on this machine: " << gather[1];
  EXPECT_TRUE(barrier[0].ok) << "rank 0: " << barrier[0];
  EXPECT_TRUE(barrier[1].ok) << "rank 1: " << barrier[1];
}

TEST(CollectiveFailures, WaitTimeoutOfTheClientLeavesTheOpInFlight) {
  EmbeddedDaemon daemon(failureConfig(milliseconds(20000)));
  ASSERT_TRUE(daemon.started());
  std::barrier<> waited(2);
  std::array<Outcome, 2> short_wait{};
  std::array<Outcome, 2> full_wait{};
  onRanks(2, [&](std::uint32_t rank) {
    Phases phases({&waited});
    auto client = daemon.attach(rankOf("patient", rank, 2), kClientTimeout);
    ASSERT_TRUE(client.ok()) << messageOf(client);
    if (rank == 0) {
      auto handle = client->submitBarrier();
      ASSERT_TRUE(handle.ok());
      short_wait[rank] = outcomeOf(client->wait(*handle, milliseconds(30)), Clock::now());
      phases.next();
      full_wait[rank] = outcomeOf(client->wait(*handle), Clock::now());
    } else {
      phases.next();
      full_wait[rank] = submitAndWait(*client, [&] { return client->submitBarrier(); });
    }
  });
  EXPECT_TRUE(failedWith(short_wait[0], ErrorCode::kTimeout, {"did not complete in time"}));
  EXPECT_TRUE(full_wait[0].ok) << full_wait[0];
  EXPECT_TRUE(full_wait[1].ok) << full_wait[1];
}

// The ranks an op timeout names reach every rank as data (Error::ranks), not
// only in the message: here ranks 1 and 3 of 4 never submit.
TEST(CollectiveFailures, TimeoutGivesTheRanksThatDidNotSubmitAsData) {
  EmbeddedDaemon daemon(failureConfig(milliseconds(300)));
  ASSERT_TRUE(daemon.started());
  constexpr std::uint32_t kWorld = 4;
  std::vector<Client> clients;
  for (std::uint32_t rank = 0; rank < kWorld; ++rank) {
    auto client = daemon.attach(rankOf("holes", rank, kWorld), kClientTimeout);
    ASSERT_TRUE(client.ok()) << messageOf(client);
    clients.push_back(std::move(*client));
  }
  const auto start = Clock::now();
  auto from0 = clients[0].submitBarrier();
  auto from2 = clients[2].submitBarrier();
  ASSERT_TRUE(from0.ok() && from2.ok());
  const Outcome waited0 = outcomeOf(clients[0].wait(*from0), start);
  const Outcome waited2 = outcomeOf(clients[2].wait(*from2), start);
  const std::string message =
      "dbufd: collective #0 barrier timed out after 300 ms: ranks 1, 3 of job holes have not submitted it";
  for (const Outcome* waited : {&waited0, &waited2}) {
    EXPECT_TRUE(failedWith(*waited, ErrorCode::kTimeout, {message})) << *waited;
    EXPECT_EQ(waited->message, message) << "the message is unchanged";
    EXPECT_EQ(waited->ranks, (Ranks{1, 3}));
  }
  // The late ranks' op #0 fails at once with the same error, ranks included.
  for (const std::uint32_t late : {1U, 3U}) {
    const Outcome outcome = submitAndWait(clients[late], [&] { return clients[late].submitBarrier(); });
    EXPECT_TRUE(failedWith(outcome, ErrorCode::kTimeout, {message})) << "rank " << late << ": " << outcome;
    EXPECT_EQ(outcome.ranks, (Ranks{1, 3})) << "rank " << late;
  }
  // The job goes on: a barrier of everyone is collective #1, and succeeds.
  std::vector<OpHandle> handles;
  for (Client& client : clients) {
    auto handle = client.submitBarrier();
    ASSERT_TRUE(handle.ok()) << messageOf(handle);
    handles.push_back(*handle);
  }
  for (std::uint32_t rank = 0; rank < kWorld; ++rank) {
    const Outcome done = outcomeOf(clients[rank].wait(handles[rank]), Clock::now());
    EXPECT_TRUE(done.ok) << "rank " << rank << ": " << done;
    EXPECT_TRUE(done.ranks.empty());
    EXPECT_EQ(done.sequence, 1U);
  }
  for (Client& client : clients) EXPECT_TRUE(client.detach().ok());
}

// A completion holds kCompletionRanks (6) ranks inline: an 8-rank job whose
// ranks 1-7 never submit times out with all seven in the message and the
// count, and the first six as data.
TEST(CollectiveFailures, TimeoutNamingMoreRanksThanACompletionHoldsKeepsTheFirstSixAndTheCount) {
  EmbeddedDaemon daemon(failureConfig(milliseconds(300)));
  ASSERT_TRUE(daemon.started());
  constexpr std::uint32_t kWorld = 8;
  auto rank0 = daemon.attach(rankOf("seven-late", 0, kWorld), kClientTimeout);
  ASSERT_TRUE(rank0.ok()) << messageOf(rank0);
  std::vector<std::unique_ptr<RawRingClient>> late;
  for (std::uint32_t rank = 1; rank < kWorld; ++rank) {
    late.push_back(RawRingClient::attach(daemon, "seven-late", rank, kWorld));
    ASSERT_NE(late.back(), nullptr);
  }
  const Outcome waited = submitAndWait(*rank0, [&] { return rank0->submitBarrier(); });
  const std::string message =
      "dbufd: collective #0 barrier timed out after 300 ms: ranks 1, 2, 3, 4, 5, 6, 7 of job seven-late have not "
      "submitted it";
  EXPECT_TRUE(failedWith(waited, ErrorCode::kTimeout, {message})) << waited;
  EXPECT_EQ(waited.message, message) << "the message still names every rank";
  EXPECT_EQ(waited.ranks, (Ranks{1, 2, 3, 4, 5, 6})) << "libdbuf gives the first kCompletionRanks";
  // On the ring (rank 1's owed op #0): the count says seven.
  ASSERT_TRUE(late[0]->submit(rawOp(ipc::OpCode::kBarrier)));
  const auto owed = late[0]->nextCompletion();
  ASSERT_TRUE(owed.has_value());
  EXPECT_EQ(owed->entry.status, static_cast<std::uint16_t>(ipc::WireError::kTimeout)) << owed->message;
  EXPECT_EQ(owed->entry.rank_count, 7U);
  EXPECT_EQ(ipc::completionRanks(owed->entry), (Ranks{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ("dbufd: " + owed->message, message);
  EXPECT_TRUE(rank0->detach().ok());
}

// ----------------------------------------------------------------- a rank gone

TEST(CollectiveFailures, ClosedConnectionFailsTheOthersAtOnceUntilTheRankAttachesAgain) {
  EmbeddedDaemon daemon(failureConfig(milliseconds(20000)));  // an error within seconds is not the timeout
  ASSERT_TRUE(daemon.started());
  constexpr std::uint32_t kWorld = 3;
  std::barrier<> ready(kWorld);
  std::barrier<> submitted(kWorld);
  std::barrier<> told(kWorld);
  std::barrier<> back(kWorld);
  std::array<Outcome, kWorld> pending{};
  std::array<Outcome, kWorld> refused{};
  std::array<Outcome, kWorld> after{};
  std::array<bool, kWorld> reduced{};
  onRanks(kWorld, [&](std::uint32_t rank) {
    Phases phases({&ready, &submitted, &told, &back});
    std::optional<Client> client;
    std::optional<Group> group;
    const auto join = [&] {
      auto attached = daemon.attach(rankOf("gone", rank, kWorld), kClientTimeout);
      ASSERT_TRUE(attached.ok()) << messageOf(attached);
      client.emplace(std::move(*attached));
      auto registered = client->registerGroup(oneTensor("g", 48));
      ASSERT_TRUE(registered.ok()) << messageOf(registered);
      group.emplace(std::move(*registered));
      ASSERT_TRUE(group->acquireSlot().ok());
      fill(*group->unshardedGradView(0), static_cast<float>(rank + 1));
    };
    ASSERT_NO_FATAL_FAILURE(join());
    phases.next();  // ready
    if (rank == 2) {
      phases.next();  // submitted: ranks 0 and 1 wait in a reduce-scatter
      group.reset();
      client.reset();  // no Detach: the connection just ends
      phases.next();   // told
      ASSERT_NO_FATAL_FAILURE(join());
    } else {
      auto handle = group->submitReduceScatter({ReduceMode::kSum});
      ASSERT_TRUE(handle.ok()) << messageOf(handle);
      phases.next();  // submitted
      const auto start = Clock::now();
      pending[rank] = outcomeOf(client->wait(*handle), start);
      refused[rank] = submitAndWait(*client, [&] { return client->submitBarrier(); });
      phases.next();  // told
    }
    phases.next();  // back: rank 2 attached again
    after[rank] = submitAndWait(*client, [&] { return group->submitReduceScatter({ReduceMode::kSum}); });
    const TensorView grad = group->shardGradView(0);
    reduced[rank] = grad.numel() > 0 && grad.data<float>()[0] == 6.0F;
    ASSERT_TRUE(client->detach().ok());
  });

  for (std::uint32_t rank = 0; rank < 2; ++rank) {
    EXPECT_TRUE(failedWith(pending[rank], ErrorCode::kConflict, {"rank 2 of job gone disconnected"})) << rank;
    EXPECT_EQ(pending[rank].ranks, Ranks{2}) << "rank " << rank << ": the rank that died, as data";
    EXPECT_LT(pending[rank].elapsed_ms, 3000) << "rank " << rank << " must hear at once, not after the timeout";
    EXPECT_TRUE(failedWith(refused[rank], ErrorCode::kConflict,
                           {"dbufd: barrier cannot run: rank 2 of job gone disconnected and has not attached again"}))
        << rank;
    EXPECT_EQ(refused[rank].ranks, Ranks{2}) << "rank " << rank;
    EXPECT_LT(refused[rank].elapsed_ms, 1000) << "rank " << rank;
  }
  for (std::uint32_t rank = 0; rank < kWorld; ++rank) {
    EXPECT_TRUE(after[rank].ok) << "rank " << rank << ": " << after[rank];
    EXPECT_TRUE(reduced[rank]) << "rank " << rank << ": 1 + 2 + 3 expected in its sharded gradient";
  }
  EXPECT_TRUE(waitUntil([&] { return daemonIsEmpty(daemon.stats()); })) << daemonIsEmpty(daemon.stats());
}

// ----------------------------------------------------------------- several jobs

TEST(CollectiveFailures, StalledOrDeadRankOfOneJobNeverDelaysAnotherJob) {
  EmbeddedDaemon daemon(failureConfig(milliseconds(20000)));
  ASSERT_TRUE(daemon.started());
  // Threads 0, 1: job "stalled" (rank 1 never submits, then dies);
  // threads 2, 3: job "busy", which must not notice.
  std::barrier<> ready(4);
  std::barrier<> stalled_submitted(4);
  std::barrier<> busy_done(4);
  std::barrier<> checked(4);
  std::barrier<> stalled_rank_died(4);
  constexpr int kRounds = 20;
  Outcome stalled_op;
  Outcome still_pending;
  std::array<Outcome, 2> busy_after_death{};
  std::array<std::vector<Outcome>, 2> busy{};
  onRanks(4, [&](std::uint32_t thread) {
    Phases phases({&ready, &stalled_submitted, &busy_done, &checked, &stalled_rank_died});
    const bool stalled_job = thread < 2;
    const std::uint32_t rank = thread % 2;
    std::optional<Client> client;
    {
      auto attached = daemon.attach(rankOf(stalled_job ? "stalled" : "busy", rank, 2), kClientTimeout);
      ASSERT_TRUE(attached.ok()) << messageOf(attached);
      client.emplace(std::move(*attached));
    }
    std::optional<Group> group;
    {
      auto registered = client->registerGroup(oneTensor("g", 64));
      ASSERT_TRUE(registered.ok()) << messageOf(registered);
      group.emplace(std::move(*registered));
    }
    ASSERT_TRUE(group->acquireSlot().ok());
    fillShard(*group, static_cast<float>(rank + 1));
    phases.next();  // ready
    if (stalled_job && rank == 0) {
      auto handle = client->submitBarrier();
      ASSERT_TRUE(handle.ok());
      phases.next();  // stalled_submitted
      phases.next();  // busy_done
      still_pending = outcomeOf(client->wait(*handle, milliseconds(0)), Clock::now());
      phases.next();  // checked
      phases.next();  // stalled_rank_died
      stalled_op = outcomeOf(client->wait(*handle), Clock::now());
    } else if (stalled_job) {
      phases.next();  // stalled_submitted
      phases.next();  // busy_done
      phases.next();  // checked
      group.reset();
      client.reset();  // rank 1 of the stalled job dies
      phases.next();   // stalled_rank_died
    } else {
      phases.next();  // stalled_submitted: the stalled job has an op waiting
      for (int round = 0; round < kRounds; ++round) {
        busy[rank].push_back(submitAndWait(*client, [&] { return group->submitAllGather(); }));
        busy[rank].push_back(submitAndWait(*client, [&] { return client->submitBarrier(); }));
      }
      EXPECT_TRUE(gatheredFrom(*group, 1.0F)) << "rank " << rank;
      phases.next();  // busy_done
      phases.next();  // checked
      phases.next();  // stalled_rank_died
      busy_after_death[rank] = submitAndWait(*client, [&] { return group->submitAllGather(); });
      ASSERT_TRUE(client->detach().ok());
    }
  });

  for (std::uint32_t rank = 0; rank < 2; ++rank) {
    ASSERT_EQ(busy[rank].size(), static_cast<std::size_t>(2 * kRounds));
    for (std::size_t i = 0; i < busy[rank].size(); ++i) {
      const Outcome& op = busy[rank][i];
      EXPECT_TRUE(op.ok) << "busy rank " << rank << " op " << i << ": " << op;
      EXPECT_EQ(op.sequence, i) << "job busy has its own sequence numbers";
      EXPECT_LT(op.elapsed_ms, 1000) << "busy rank " << rank << " op " << i << " was held up";
    }
    EXPECT_TRUE(busy_after_death[rank].ok) << busy_after_death[rank];
    EXPECT_EQ(busy_after_death[rank].sequence, static_cast<std::uint64_t>(2 * kRounds));
  }
  EXPECT_TRUE(failedWith(still_pending, ErrorCode::kTimeout, {"did not complete in time"}))
      << "the stalled job's op must still be waiting for its rank 1";
  EXPECT_TRUE(failedWith(stalled_op, ErrorCode::kConflict, {"rank 1 of job stalled disconnected"}));
  EXPECT_EQ(stalled_op.ranks, Ranks{1});
  EXPECT_LT(stalled_op.elapsed_ms, 3000);
}

TEST(CollectiveFailures, AnotherJobsOpsRunWhileAHugeOpIsRunning) {
  EmbeddedDaemon daemon(failureConfig(milliseconds(20000)));
  ASSERT_TRUE(daemon.started());
  // 2 x 16 Mi fp32 elements: the all-gather moves 256 MiB in 16 steps of 4 Mi elements;
  // the small job's all-gather and barrier need 5.
  constexpr std::int64_t kHugeElements = std::int64_t{32} << 20;
  constexpr float kSentinel = -1.0F;
  std::barrier<> ready(4);
  std::barrier<> huge_running(4);
  std::barrier<> small_done(4);
  Outcome huge_still_running;
  std::array<Outcome, 2> huge{};
  std::array<bool, 2> huge_gathered{};
  std::array<std::vector<Outcome>, 2> small{};
  std::atomic<bool> saw_it_start{false};
  onRanks(4, [&](std::uint32_t thread) {
    Phases phases({&ready, &huge_running, &small_done});
    const bool huge_job = thread < 2;
    const std::uint32_t rank = thread % 2;
    auto client = daemon.attach(rankOf(huge_job ? "huge" : "small", rank, 2), kClientTimeout);
    ASSERT_TRUE(client.ok()) << messageOf(client);
    auto group = client->registerGroup(oneTensor("g", huge_job ? kHugeElements : 64));
    ASSERT_TRUE(group.ok()) << messageOf(group);
    ASSERT_TRUE(group->acquireSlot().ok());
    fillShard(*group, static_cast<float>(rank + 1));
    group->unshardedView(0)->data<float>()[0] = kSentinel;
    phases.next();  // ready
    if (huge_job) {
      auto handle = group->submitAllGather();
      ASSERT_TRUE(handle.ok());
      if (rank == 0) {
        // The daemon writes element 0 (rank 0's own part) in the op's first step.
        const std::atomic_ref<float> first(*group->unshardedView(0)->data<float>());
        saw_it_start = waitUntil([&] { return first.load(std::memory_order_relaxed) != kSentinel; });
      }
      phases.next();  // huge_running
      phases.next();  // small_done
      if (rank == 0) huge_still_running = outcomeOf(client->wait(*handle, milliseconds(0)), Clock::now());
      huge[rank] = outcomeOf(client->wait(*handle), Clock::now());
      huge_gathered[rank] = gatheredFrom(*group, 1.0F, 4099);
    } else {
      phases.next();  // huge_running
      small[rank].push_back(submitAndWait(*client, [&] { return group->submitAllGather(); }));
      small[rank].push_back(submitAndWait(*client, [&] { return client->submitBarrier(); }));
      phases.next();  // small_done
    }
    ASSERT_TRUE(client->detach().ok());
  });

  ASSERT_TRUE(saw_it_start) << "the huge all-gather never started";
  for (std::uint32_t rank = 0; rank < 2; ++rank) {
    for (const Outcome& op : small[rank]) EXPECT_TRUE(op.ok) << op;
    EXPECT_TRUE(huge[rank].ok) << huge[rank];
    EXPECT_TRUE(huge_gathered[rank]);
  }
  EXPECT_TRUE(failedWith(huge_still_running, ErrorCode::kTimeout, {"did not complete in time"}))
      << "the small job's two ops must complete while the huge op runs (jobs take turns, one step each)";
}

// ----------------------------------------------------------------- a full ring

TEST(CollectiveFailures, FullRingRefusesOrWaitsAndLosesNothing) {
  constexpr std::uint32_t kCapacity = 16;
  EmbeddedDaemon daemon(failureConfig(milliseconds(20000), kCapacity));
  ASSERT_TRUE(daemon.started());
  std::barrier<> ready(2);
  std::barrier<> filled(2);
  Outcome would_block;
  Outcome stayed_full;
  std::uint32_t in_flight_when_full = 0;
  Outcome waited_for_room;
  std::vector<Outcome> ahead;     // rank 0: kCapacity + 1 ops, waited for at the end
  std::vector<Outcome> catch_up;  // rank 1: the same ops, one at a time
  bool gathered = false;
  onRanks(2, [&](std::uint32_t rank) {
    Phases phases({&ready, &filled});
    auto client = daemon.attach(rankOf("full", rank, 2), kClientTimeout);
    ASSERT_TRUE(client.ok()) << messageOf(client);
    auto group = client->registerGroup(oneTensor("g", 32));
    ASSERT_TRUE(group.ok()) << messageOf(group);
    ASSERT_TRUE(group->acquireSlot().ok());
    fillShard(*group, static_cast<float>(rank + 1) * 3.0F);
    phases.next();  // ready
    // Ops 0 .. kCapacity - 2: barriers, op kCapacity - 1: an all-gather, op kCapacity: a barrier.
    const auto op = [&](std::uint32_t index, const SubmitOptions& options) {
      return index == kCapacity - 1 ? group->submitAllGather(options) : client->submitBarrier(options);
    };
    if (rank == 0) {
      std::vector<OpHandle> handles;
      for (std::uint32_t i = 0; i < kCapacity; ++i) {
        auto handle = op(i, {.wait_if_full = false, .timeout = std::nullopt, .stream = {}});
        ASSERT_TRUE(handle.ok()) << "op " << i << ": " << messageOf(handle);
        handles.push_back(*handle);
      }
      in_flight_when_full = client->inFlight();
      auto start = Clock::now();
      would_block = outcomeOf(op(kCapacity, {.wait_if_full = false, .timeout = std::nullopt, .stream = {}}), start);
      start = Clock::now();
      stayed_full = outcomeOf(op(kCapacity, {.wait_if_full = true, .timeout = milliseconds(100), .stream = {}}), start);
      phases.next();  // filled: rank 1 starts catching up
      start = Clock::now();
      auto handle = op(kCapacity, {.wait_if_full = true, .timeout = std::nullopt, .stream = {}});
      waited_for_room = outcomeOf(handle, start);
      ASSERT_TRUE(handle.ok());
      handles.push_back(*handle);
      for (const OpHandle h : handles) ahead.push_back(outcomeOf(client->wait(h), Clock::now()));
      gathered = gatheredFrom(*group, 3.0F);
    } else {
      phases.next();  // filled
      for (std::uint32_t i = 0; i <= kCapacity; ++i) {
        catch_up.push_back(submitAndWait(*client, [&] { return op(i, {}); }));
      }
    }
    ASSERT_TRUE(client->detach().ok());
  });

  EXPECT_EQ(in_flight_when_full, kCapacity);
  EXPECT_TRUE(failedWith(would_block, ErrorCode::kWouldBlock, {"16 ops in flight fill the ring"}));
  EXPECT_LT(would_block.elapsed_ms, 50) << "kWouldBlock must come at once";
  EXPECT_TRUE(failedWith(stayed_full, ErrorCode::kTimeout, {"ring stayed full"}));
  EXPECT_GE(stayed_full.elapsed_ms, 95);
  EXPECT_TRUE(waited_for_room.ok) << waited_for_room;
  ASSERT_EQ(ahead.size(), kCapacity + 1);
  ASSERT_EQ(catch_up.size(), kCapacity + 1);
  for (std::uint32_t i = 0; i <= kCapacity; ++i) {
    EXPECT_TRUE(ahead[i].ok) << "rank 0 op " << i << ": " << ahead[i];
    EXPECT_TRUE(catch_up[i].ok) << "rank 1 op " << i << ": " << catch_up[i];
    EXPECT_EQ(ahead[i].sequence, i) << "in order";
    EXPECT_EQ(catch_up[i].sequence, i) << "in order";
  }
  EXPECT_TRUE(gathered) << "the all-gather queued behind 15 barriers ran on the right data";
}

// Ops that completed but were not waited for yet are no longer in flight, so
// the ring has room for more; their results must still be there for wait().
TEST(CollectiveFailures, ResultsOfCompletedOpsSurviveMoreSubmissionsThanTheRingHolds) {
  constexpr std::uint32_t kCapacity = 16;
  EmbeddedDaemon daemon(failureConfig(milliseconds(20000), kCapacity));
  ASSERT_TRUE(daemon.started());
  auto client = daemon.attach(rankOf("many", 0, 1), kClientTimeout);
  ASSERT_TRUE(client.ok()) << messageOf(client);
  std::vector<OpHandle> handles;
  for (std::uint32_t i = 0; i <= kCapacity; ++i) {
    auto handle = client->submitBarrier();
    ASSERT_TRUE(handle.ok()) << "op " << i << ": " << messageOf(handle);
    handles.push_back(*handle);
  }
  for (std::size_t i = 0; i < handles.size(); ++i) {
    const Outcome done = outcomeOf(client->wait(handles[i]), Clock::now());
    EXPECT_TRUE(done.ok) << "op " << i << " (handle " << handles[i].id << "): " << done;
    EXPECT_EQ(done.sequence, i);
  }
}

// ----------------------------------------------------------------- a corrupt ring

enum class Scribble { kAheadBeyondCapacity, kBehindTheTail };

class CorruptRing : public ::testing::TestWithParam<Scribble> {};

TEST_P(CorruptRing, ClosesThatSessionOnlyAndTheDaemonKeepsServing) {
  EmbeddedDaemon daemon(failureConfig(milliseconds(20000)));
  ASSERT_TRUE(daemon.started());
  auto good = daemon.attach(rankOf("good", 0, 1), kClientTimeout);
  ASSERT_TRUE(good.ok()) << messageOf(good);
  auto good_group = good->registerGroup(oneTensor("g", 40));
  ASSERT_TRUE(good_group.ok()) << messageOf(good_group);
  ASSERT_TRUE(good_group->unshard().ok());

  // Job "bad": rank 0 a libdbuf client waiting in a barrier, rank 1 raw.
  auto mate = daemon.attach(rankOf("bad", 0, 2), kClientTimeout);
  ASSERT_TRUE(mate.ok()) << messageOf(mate);
  auto raw = RawRingClient::attach(daemon, "bad", 1, 2);
  ASSERT_NE(raw, nullptr);
  // A valid op first, so that the tail has moved: "behind" then means behind it.
  auto mate_noop = mate->submitNoop();
  ASSERT_TRUE(mate_noop.ok());
  ASSERT_TRUE(mate->wait(*mate_noop).ok());
  ASSERT_TRUE(raw->submit(rawOp(ipc::OpCode::kNoop)));
  const auto noop = raw->nextCompletion();
  ASSERT_TRUE(noop.has_value());
  EXPECT_EQ(noop->entry.status, 0);
  ASSERT_EQ(raw->submitTail(), 1U);
  auto barrier = mate->submitBarrier();
  ASSERT_TRUE(barrier.ok());
  ASSERT_EQ(daemon.stats().sessions, 3U);

  const std::uint64_t capacity = raw->welcome().ring_capacity;
  raw->scribbleSubmitHead(GetParam() == Scribble::kAheadBeyondCapacity ? 1 + capacity + 1 : 0);
  EXPECT_TRUE(closedByDaemon(raw->socket())) << "the daemon must close the session of a corrupt ring";
  EXPECT_TRUE(waitUntil([&] { return daemon.stats().sessions == 2; })) << daemon.stats().sessions;

  const auto start = Clock::now();
  EXPECT_TRUE(
      failedWith(outcomeOf(mate->wait(*barrier), start), ErrorCode::kConflict, {"rank 1 of job bad disconnected"}));
  // The other job is served as before, and so is the surviving rank's next op (refused, but answered).
  fillShard(*good_group, 2.0F);
  const auto gathered = good_group->allGather();
  EXPECT_TRUE(gathered.ok()) << messageOf(gathered);
  EXPECT_TRUE(gatheredFrom(*good_group, 2.0F));
  EXPECT_TRUE(failedWith(submitAndWait(*mate, [&] { return mate->submitBarrier(); }), ErrorCode::kConflict,
                         {"has not attached again"}));
  EXPECT_TRUE(good->detach().ok());
  EXPECT_TRUE(mate->detach().ok());
  EXPECT_TRUE(waitUntil([&] { return daemonIsEmpty(daemon.stats()); })) << daemonIsEmpty(daemon.stats());
}

INSTANTIATE_TEST_SUITE_P(Indices, CorruptRing,
                         ::testing::Values(Scribble::kAheadBeyondCapacity, Scribble::kBehindTheTail),
                         [](const ::testing::TestParamInfo<Scribble>& scribble) {
                           return scribble.param == Scribble::kAheadBeyondCapacity ? "HeadAheadBeyondCapacity"
                                                                                   : "HeadBehindTheTail";
                         });

// ----------------------------------------------------------------- bad requests

/// Both raw ranks submit `entry`; returns both completions (nullopt: none came).
std::array<std::optional<RawCompletion>, 2> onBoth(RawRingClient& r0, RawRingClient& r1, const ipc::Submission& entry) {
  EXPECT_TRUE(r0.submit(entry));
  EXPECT_TRUE(r1.submit(entry));
  return {r0.nextCompletion(), r1.nextCompletion()};
}

::testing::AssertionResult rawFailed(const std::optional<RawCompletion>& completion, ipc::WireError code,
                                     std::initializer_list<std::string> parts) {
  if (!completion) return ::testing::AssertionFailure() << "no completion";
  if (completion->entry.status != static_cast<std::uint16_t>(code)) {
    return ::testing::AssertionFailure() << "status " << completion->entry.status << ": " << completion->message;
  }
  for (const std::string& part : parts) {
    if (completion->message.find(part) == std::string::npos) {
      return ::testing::AssertionFailure() << "message lacks '" << part << "': " << completion->message;
    }
  }
  return ::testing::AssertionSuccess();
}

TEST(CollectiveFailures, RawBadRequestsFailOnEveryRankAndTheJobGoesOn) {
  EmbeddedDaemon daemon(failureConfig(milliseconds(20000)));
  ASSERT_TRUE(daemon.started());
  auto r0 = RawRingClient::attach(daemon, "raw", 0, 2);
  auto r1 = RawRingClient::attach(daemon, "raw", 1, 2);
  ASSERT_NE(r0, nullptr);
  ASSERT_NE(r1, nullptr);
  const auto conflict = ipc::WireError::kConflict;

  auto unknown = onBoth(*r0, *r1, rawOp(ipc::OpCode::kAllGather, 9));
  for (const auto& completion : unknown) {
    EXPECT_TRUE(
        rawFailed(completion, conflict, {"collective #0 allGather(group 9 (unknown))", "job raw has no such group"}));
  }

  ipc::Submission invalid = rawOp(ipc::OpCode::kBarrier);
  invalid.op = 42;
  for (const auto& completion : onBoth(*r0, *r1, invalid)) {
    EXPECT_TRUE(rawFailed(completion, conflict, {"collective #1 ", "invalid op (code 42)"}));
  }

  ipc::Submission bad_mode = rawOp(ipc::OpCode::kAllReduce, 1);
  bad_mode.reduce = 7;
  for (const auto& completion : onBoth(*r0, *r1, bad_mode)) {
    EXPECT_TRUE(rawFailed(completion, conflict, {"collective #2 allReduce(group 1 (unknown)", "bad reduce mode"}));
  }

  // A registered group, a slot for rank 0 only, and an all-gather.
  r0->send(rawGroup("g", 64));
  r1->send(rawGroup("g", 64));
  for (RawRingClient* raw : {r0.get(), r1.get()}) {
    auto reply = raw->receive();
    ASSERT_TRUE(reply.ok()) << messageOf(reply);
    const auto* ready = std::get_if<ipc::GroupReady>(&reply->message);
    ASSERT_NE(ready, nullptr);
    ASSERT_EQ(ready->group_id, 1U);
  }
  r0->send(ipc::AcquireSlot{1});
  {
    auto reply = r0->receive();
    ASSERT_TRUE(reply.ok()) << messageOf(reply);
    ASSERT_NE(std::get_if<ipc::SlotGranted>(&reply->message), nullptr);
  }
  for (const auto& completion : onBoth(*r0, *r1, rawOp(ipc::OpCode::kAllGather, 1))) {
    EXPECT_TRUE(rawFailed(completion, conflict,
                          {"collective #3 allGather(group 'g')", "rank 1 ", "no unsharded slot for the group"}));
    ASSERT_TRUE(completion.has_value());
    EXPECT_EQ(completion->entry.rank_count, 1U);
    EXPECT_EQ(ipc::completionRanks(completion->entry), Ranks{1}) << "the rank without a slot, as data";
  }
  for (const auto& completion : onBoth(*r0, *r1, rawOp(ipc::OpCode::kBroadcast, 1, 2))) {
    EXPECT_TRUE(rawFailed(completion, conflict,
                          {"collective #4 broadcast(group 'g', root 2)", "root is not a rank of the job"}));
  }
  // The job goes on: a barrier matches as collective #5.
  for (const auto& completion : onBoth(*r0, *r1, rawOp(ipc::OpCode::kBarrier))) {
    ASSERT_TRUE(completion.has_value());
    EXPECT_EQ(completion->entry.status, 0) << completion->message;
    EXPECT_EQ(completion->entry.sequence, 5U);
  }
  // The daemon side of reshard: a slot with an op queued on it is not given back.
  // (Once the daemon has taken the op from the ring: a raw client that sends
  // ReleaseSlot right after submitting races the daemon's next poll.)
  const std::uint64_t taken = r0->submitTail() + 1;
  ASSERT_TRUE(r0->submit(rawOp(ipc::OpCode::kAllGather, 1)));
  ASSERT_TRUE(waitUntil([&] { return r0->submitTail() == taken; }));
  r1->send(ipc::AcquireSlot{1});
  ASSERT_TRUE(r1->receive().ok());
  r0->send(ipc::ReleaseSlot{1});
  EXPECT_TRUE(contains(expectErrorReply(r0->socket(), ipc::WireError::kConflict), "collectives of group 1 in flight"));
  ASSERT_TRUE(r1->submit(rawOp(ipc::OpCode::kAllGather, 1)));
  for (RawRingClient* raw : {r0.get(), r1.get()}) {
    const auto gathered = raw->nextCompletion();
    ASSERT_TRUE(gathered.has_value());
    EXPECT_EQ(gathered->entry.status, 0) << gathered->message;
    EXPECT_EQ(gathered->entry.sequence, 6U);
  }
  r0->send(ipc::ReleaseSlot{1});
  {
    auto reply = r0->receive();
    ASSERT_TRUE(reply.ok()) << messageOf(reply);
    EXPECT_NE(std::get_if<ipc::SlotReleased>(&reply->message), nullptr);
  }
  EXPECT_EQ(daemon.stats().sessions, 2U) << "nobody was disconnected";
}

// Ordering on a CUDA stream is for GPU memory; whatever a client asks, a
// stream-ordered op that cannot run fails at once and releases the client's
// stream (done poisoned), and its session's stream ordering is over.
TEST(CollectiveFailures, StreamOrderedOpsTheDaemonCannotRunFailAtOnceAndReleaseTheStream) {
  EmbeddedDaemon daemon(failureConfig(milliseconds(20000)));
  ASSERT_TRUE(daemon.started());
  const auto bad = ipc::WireError::kBadRequest;
  const auto ordered = [](ipc::OpCode op, std::uint32_t group, std::uint64_t ticket) {
    ipc::Submission entry = rawOp(op, group);
    entry.flags |= ipc::kFlagStreamOrdered;
    entry.ticket = ticket;
    return entry;
  };

  auto host = RawRingClient::attach(daemon, "host-memory", 0, 1);
  ASSERT_NE(host, nullptr);
  ipc::StreamCounters& counters = host->streamCounters();
  publishCounter(counters.done, 0);
  ASSERT_TRUE(host->submit(ordered(ipc::OpCode::kAllGather, 1, 1)));
  EXPECT_TRUE(rawFailed(host->nextCompletion(), bad,
                        {"allGather(group 1 (unknown))", "ordering on a CUDA stream needs GPU memory",
                         "job host-memory's is on the host"}));
  EXPECT_TRUE(isPoisoned(counterValue(counters.done))) << "the client's stream would wait forever";
  ASSERT_TRUE(host->submit(ordered(ipc::OpCode::kAllGather, 1, 2)));
  EXPECT_TRUE(rawFailed(host->nextCompletion(), bad, {"ended its stream ordering"}));
  // Host-ordered ops of the session go on.
  ASSERT_TRUE(host->submit(rawOp(ipc::OpCode::kBarrier)));
  const auto barrier = host->nextCompletion();
  ASSERT_TRUE(barrier.has_value());
  EXPECT_EQ(barrier->entry.status, 0) << barrier->message;

  auto barrier_on_stream = RawRingClient::attach(daemon, "stream-barrier", 0, 1);
  ASSERT_NE(barrier_on_stream, nullptr);
  ASSERT_TRUE(barrier_on_stream->submit(ordered(ipc::OpCode::kBarrier, 0, 1)));
  EXPECT_TRUE(rawFailed(barrier_on_stream->nextCompletion(), bad, {"only group collectives"}));

  auto stale = RawRingClient::attach(daemon, "stale-ticket", 0, 1);
  ASSERT_NE(stale, nullptr);
  ASSERT_TRUE(stale->submit(ordered(ipc::OpCode::kAllGather, 1, 0)));
  EXPECT_TRUE(rawFailed(stale->nextCompletion(), bad, {"stream ticket 0 does not follow the session's last one (0)"}));
  EXPECT_TRUE(isPoisoned(counterValue(stale->streamCounters().done)));
  EXPECT_EQ(daemon.stats().sessions, 3U) << "nobody was disconnected";
}

TEST(CollectiveFailures, LibdbufRefusesToOrderAnOpOnAStreamOverHostMemory) {
  EmbeddedDaemon daemon(failureConfig(milliseconds(20000)));
  ASSERT_TRUE(daemon.started());
  auto client = daemon.attach(rankOf("streams", 0, 1), kClientTimeout);
  ASSERT_TRUE(client.ok()) << messageOf(client);
  auto group = client->registerGroup(oneTensor("g", 40));
  ASSERT_TRUE(group.ok()) << messageOf(group);
  ASSERT_TRUE(group->acquireSlot().ok());
  SubmitOptions on_stream;
  on_stream.stream = nullptr;  // the default stream
  const auto refused = group->submitAllGather(on_stream);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(refused.error().message.find("needs GPU memory"), std::string::npos) << refused.error().message;
  const auto barrier = client->submitBarrier(on_stream);
  ASSERT_FALSE(barrier.ok());
  EXPECT_EQ(barrier.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(barrier.error().message.find("only group collectives"), std::string::npos) << barrier.error().message;
  const auto reshard_refused = group->reshardOnStream(nullptr);
  ASSERT_FALSE(reshard_refused.ok());
  EXPECT_EQ(reshard_refused.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(reshard_refused.error().message.find("needs GPU memory"), std::string::npos)
      << reshard_refused.error().message;
  EXPECT_TRUE(group->unsharded()) << "a refused reshard left the slot with the group";
  EXPECT_TRUE(group->allGather().ok()) << "the session goes on";
  EXPECT_TRUE(group->reshard().ok());
  EXPECT_FALSE(group->unsharded());
  EXPECT_TRUE(group->reshardOnStream(nullptr).ok()) << "nothing to give back: nothing to refuse";
  EXPECT_TRUE(client->detach().ok());
}

TEST(CollectiveFailures, BadRequestsThroughLibdbufFailOnEveryRankWithAClearMessage) {
  EmbeddedDaemon daemon(failureConfig(milliseconds(20000)));
  ASSERT_TRUE(daemon.started());
  constexpr std::size_t kSteps = 6;
  std::array<std::array<Outcome, kSteps>, 2> outcomes{};
  std::array<bool, 2> broadcasted{};
  onRanks(2, [&](std::uint32_t rank) {
    auto client = daemon.attach(rankOf("lib", rank, 2), kClientTimeout);
    ASSERT_TRUE(client.ok()) << messageOf(client);
    auto g = client->registerGroup(oneTensor("g", 50));
    ASSERT_TRUE(g.ok()) << messageOf(g);
    auto h = client->registerGroup(oneTensor("h", 50, DType::kBF16));
    ASSERT_TRUE(h.ok()) << messageOf(h);
    auto& mine = outcomes[rank];
    if (rank == 0) {
      ASSERT_TRUE(g->acquireSlot().ok());
    }
    // #0: a reduce-scatter where rank 1 holds no slot (libdbuf lets it submit).
    mine[0] = submitAndWait(*client, [&] { return g->submitReduceScatter(); });
    if (rank == 1) {
      ASSERT_TRUE(g->acquireSlot().ok());
    }
    // #1: a root outside the world.
    mine[1] = submitAndWait(*client, [&] { return g->submitBroadcast(2); });
    // #2: accumulate into a bf16 sharded gradient.
    ASSERT_TRUE(h->acquireSlot().ok());
    mine[2] = submitAndWait(*client, [&] { return h->submitReduceScatter({ReduceMode::kSum, 1.0F, 1.0F, true}); });
    // #3: accumulate on an all-reduce.
    mine[3] = submitAndWait(*client, [&] { return g->submitAllReduce({ReduceMode::kSum, 1.0F, 1.0F, true}); });
    // #4: a scale that is not finite.
    mine[4] = submitAndWait(*client, [&] {
      return g->submitAllReduce({ReduceMode::kSum, std::numeric_limits<float>::infinity(), 1.0F, false});
    });
    // #5: the job goes on.
    fill(*g->unshardedView(0), static_cast<float>(rank + 1));
    mine[5] = submitAndWait(*client, [&] { return g->submitBroadcast(1); });
    const auto params = g->unshardedView(0);
    broadcasted[rank] = params.ok() && params->data<float>()[0] == 2.0F && params->data<float>()[49] == 2.0F;
    ASSERT_TRUE(client->detach().ok());
  });
  const std::array<std::vector<std::string>, 5> expected{{
      {"dbufd: collective #0 reduceScatter(group 'g', sum)", "rank 1 ", "no unsharded slot for the group"},
      {"dbufd: collective #1 broadcast(group 'g', root 2)", "root is not a rank of the job"},
      {"dbufd: collective #2 reduceScatter(group 'h', sum, accumulate)", "accumulate needs", "fp32 sharded gradient"},
      {"dbufd: collective #3 allReduce(group 'g', sum, accumulate)", "accumulate needs a reduce-scatter"},
      {"dbufd: collective #4 allReduce(group 'g', sum, pre inf)", "bad reduce mode, flags or scales"},
  }};
  for (std::uint32_t rank = 0; rank < 2; ++rank) {
    for (std::size_t step = 0; step < expected.size(); ++step) {
      EXPECT_TRUE(failedWith(outcomes[rank][step], ErrorCode::kConflict, expected[step]))
          << "rank " << rank << " #" << step;
      EXPECT_EQ(outcomes[rank][step].message, outcomes[0][step].message) << "every rank hears the same";
      // Only #0 is about particular ranks (rank 1 holds no slot).
      EXPECT_EQ(outcomes[rank][step].ranks, step == 0 ? Ranks{1} : Ranks{}) << "rank " << rank << " #" << step;
    }
    EXPECT_TRUE(outcomes[rank][5].ok) << outcomes[rank][5];
    EXPECT_EQ(outcomes[rank][5].sequence, 5U);
    EXPECT_TRUE(broadcasted[rank]) << "rank " << rank;
  }
}

// ----------------------------------------------------------------- reshard

TEST(CollectiveFailures, ReshardWaitsForTheRanksOpsInFlight) {
  EmbeddedDaemon daemon(failureConfig(milliseconds(20000)));
  ASSERT_TRUE(daemon.started());
  std::barrier<> ready(2);
  std::barrier<> tried(2);
  Outcome early_reshard;
  bool kept_slot = false;
  Outcome reshard;
  Outcome gather_of_rank0;
  Outcome gather_of_rank1;
  bool gathered = false;
  onRanks(2, [&](std::uint32_t rank) {
    Phases phases({&ready, &tried});
    auto client = daemon.attach(rankOf("resh", rank, 2), kClientTimeout);
    ASSERT_TRUE(client.ok()) << messageOf(client);
    auto group = client->registerGroup(oneTensor("g", 64));
    ASSERT_TRUE(group.ok()) << messageOf(group);
    fillShard(*group, static_cast<float>(rank + 1) * 5.0F);
    phases.next();  // ready
    if (rank == 0) {
      ASSERT_TRUE(group->acquireSlot().ok());
      auto handle = group->submitAllGather();
      ASSERT_TRUE(handle.ok());
      // Rank 1 has not submitted: the op cannot complete, so neither can reshard.
      auto start = Clock::now();
      early_reshard = outcomeOf(group->reshard(milliseconds(50)), start);
      kept_slot = group->unsharded();
      phases.next();  // tried
      start = Clock::now();
      reshard = outcomeOf(group->reshard(), start);
      // Waited for, not failed: the daemon ran it before the slot went back.
      gather_of_rank0 = outcomeOf(client->wait(*handle), Clock::now());
    } else {
      phases.next();  // tried
      const auto start = Clock::now();
      gather_of_rank1 = outcomeOf(group->unshard(), start);
      gathered = gatheredFrom(*group, 5.0F);
    }
    ASSERT_TRUE(client->detach().ok());
  });
  EXPECT_TRUE(failedWith(early_reshard, ErrorCode::kTimeout, {"1 ops of group 1 still in flight"}));
  EXPECT_TRUE(kept_slot) << "a reshard that timed out must keep the slot";
  EXPECT_TRUE(reshard.ok) << reshard;
  EXPECT_TRUE(gather_of_rank0.ok) << gather_of_rank0;
  EXPECT_TRUE(gather_of_rank1.ok) << gather_of_rank1;
  EXPECT_TRUE(gathered);
}

// ----------------------------------------------------------------- shutdown

TEST(CollectiveFailures, ShutdownWhileARankWaitsGivesItUnavailablePromptly) {
  EmbeddedDaemon daemon(failureConfig(milliseconds(20000)));
  ASSERT_TRUE(daemon.started());
  std::barrier<> ready(3);
  std::barrier<> stopped(3);  // rank 1 stays attached until the daemon is gone
  std::atomic<bool> submitted{false};
  Outcome waiter;
  Clock::time_point told{};
  Clock::time_point stop_began{};
  Clock::time_point stop_ended{};
  onRanks(3, [&](std::uint32_t thread) {
    Phases phases({&ready, &stopped});
    if (thread == 2) {  // the operator
      phases.next();
      ASSERT_TRUE(waitUntil([&] { return submitted.load(); }));
      stop_began = Clock::now();
      daemon.stop();
      stop_ended = Clock::now();
      phases.next();  // stopped
      return;
    }
    auto client = daemon.attach(rankOf("down", thread, 2), kClientTimeout);
    ASSERT_TRUE(client.ok()) << messageOf(client);
    phases.next();
    if (thread == 0) {
      auto handle = client->submitBarrier();
      ASSERT_TRUE(handle.ok());
      submitted = true;
      waiter = outcomeOf(client->wait(*handle), Clock::now());
      told = Clock::now();
    }
    phases.next();  // stopped
  });
  EXPECT_TRUE(failedWith(waiter, ErrorCode::kUnavailable, {"shutting down"}));
  const auto stop_ms = std::chrono::duration_cast<milliseconds>(stop_ended - stop_began).count();
  const auto told_ms = std::chrono::duration_cast<milliseconds>(told - stop_began).count();
  EXPECT_LT(told_ms, stop_ms + 150) << "the waiter heard " << told_ms << " ms after the stop began; the stop took "
                                    << stop_ms << " ms";
}

// Prefetch: the next unit's all-gather is in flight (rank 1 has not
// submitted it yet) while rank 0 reshards the current unit. The reshard
// waits for the current unit's ops only, so it returns at once, and the
// prefetched gather completes afterwards.
TEST(CollectiveFailures, ReshardDoesNotWaitForAnotherGroupsPrefetch) {
  EmbeddedDaemon daemon(failureConfig(milliseconds(20000)));
  ASSERT_TRUE(daemon.started());
  std::barrier<> resharded(2);
  Outcome reshard_of_current;
  Outcome prefetch;
  onRanks(2, [&](std::uint32_t rank) {
    Phases phases({&resharded});
    auto client = daemon.attach(rankOf("prefetch", rank, 2), kClientTimeout);
    ASSERT_TRUE(client.ok()) << messageOf(client);
    auto current = client->registerGroup(oneTensor("current", 64));
    auto next = client->registerGroup(oneTensor("next", 64));
    ASSERT_TRUE(current.ok() && next.ok());
    fillShard(*next, static_cast<float>(rank + 1) * 5.0F);
    ASSERT_TRUE(current->unshard().ok());
    if (rank == 0) {
      ASSERT_TRUE(next->acquireSlot().ok());
      auto handle = next->submitAllGather();
      ASSERT_TRUE(handle.ok());
      const auto start = Clock::now();
      reshard_of_current = outcomeOf(current->reshard(milliseconds(2000)), start);
      phases.next();  // resharded: only now does rank 1 submit its part of the prefetch
      prefetch = outcomeOf(client->wait(*handle), Clock::now());
      EXPECT_TRUE(gatheredFrom(*next, 5.0F));
    } else {
      phases.next();
      ASSERT_TRUE(next->unshard().ok());
      ASSERT_TRUE(current->reshard().ok());
    }
    ASSERT_TRUE(client->detach().ok());
  });
  EXPECT_TRUE(reshard_of_current.ok) << reshard_of_current;
  EXPECT_LT(reshard_of_current.elapsed_ms, 1000) << "the reshard waited for the other group's gather";
  EXPECT_TRUE(prefetch.ok) << prefetch;
}

}  // namespace
}  // namespace dbuf::integration
