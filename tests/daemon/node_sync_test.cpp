// nodeSync() — what keeps a job's nodes in step when its data moves another
// way (the cuda backend's NCCL path) — between two "daemons" in one process,
// over real Gloo on loopback and a real FileStore: the k-th op of both nodes
// matches, ops that differ fail on both, the job's after_meeting runs at
// every meeting with what the store holds there, loseLink() on one node
// (its NCCL failed) fails the next op on both and makes them meet again,
// and idleOrNew() gives a later job the communicator every node holds idle
// (a stand-in for NCCL's: a later job then makes none).
#include <gloo/rendezvous/store.h>
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <array>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cluster.hpp"
#include "dbuf/daemon/config.hpp"
#include "group_layout.hpp"
#include "local_collective.hpp"
#include "node_executor.hpp"
#include "support/temp_dir.hpp"

namespace dbuf::daemon {
namespace {

using std::chrono::milliseconds;

/// What each node's after_meeting saw: (meeting, the value node 0 left
/// in the meeting's keys).
struct Meetings {
  std::mutex mutex;
  std::vector<std::pair<std::uint32_t, std::string>> seen;
};

/// One "daemon": its config and what its jobs across nodes share.
struct Daemon {
  explicit Daemon(std::uint64_t instance, milliseconds timeout = milliseconds(3000)) {
    // dbufd makes its logger before it starts a thread (main.cpp); here the
    // link threads would be the first to log. spdlog's registry is a
    // function-local static of libspdlog, made thread-safely, but that
    // library is not instrumented: ThreadSanitizer does not see its guard,
    // and took two link threads' first logs for a race. Made here, on the
    // test's thread, before any link thread starts.
    static_cast<void>(spdlog::default_logger_raw());
    config.cluster_address = "127.0.0.1";
    config.collective_timeout = timeout;
    cluster.config = &config;
    cluster.instance_id = instance;
  }
  Config config;
  ClusterContext cluster;
};

/// A job of two ranks, one per node: on `daemon`, rank first_rank.
NodeJob jobOfTwo(const std::string& id, const std::string& store_dir, std::uint32_t first_rank) {
  NodeJob job;
  job.job_id = id;
  job.store = *parseStoreSpec("file:" + store_dir + "#test");
  job.world_size = 2;
  job.first_rank = first_rank;
  job.local_count = 1;
  return job;
}

/// One node's part of job "sync", on a daemon of its own, whose
/// after_meeting records what it saw (and fails at meeting 0 if asked,
/// as an NCCL set-up that failed).
struct Node {
  Node(std::uint64_t instance, const std::string& store_dir, std::uint32_t first_rank,
       milliseconds timeout = milliseconds(3000), bool fail_first_meeting = false)
      : daemon(instance, timeout) {
    NodeJob job = jobOfTwo("sync", store_dir, first_rank);
    job.after_meeting = [meetings = meetings, fail_first_meeting](const NodeJob::Meeting& meeting) -> Result<void> {
      if (fail_first_meeting && meeting.number == 0) {
        return makeError(ErrorCode::kDevice, "set-up failed at meeting 0");
      }
      // As the NCCL path hands out its unique id: node 0 writes, the others read.
      const std::string key = "what";
      if (meeting.layout.node == 0) {
        const std::string value = "node 0's, meeting " + std::to_string(meeting.number);
        meeting.keys.set(key, std::vector<char>(value.begin(), value.end()));
      } else {
        meeting.keys.wait({key}, milliseconds(3000));
      }
      const std::vector<char> value = meeting.keys.get(key);
      const std::lock_guard lock(meetings->mutex);
      meetings->seen.emplace_back(meeting.number, std::string(value.begin(), value.end()));
      return {};
    };
    sync = nodeSync(job, daemon.cluster);
  }
  std::vector<std::pair<std::uint32_t, std::string>> seen() const {
    const std::lock_guard lock(meetings->mutex);
    return meetings->seen;
  }

  Daemon daemon;
  std::shared_ptr<Meetings> meetings = std::make_shared<Meetings>();
  std::unique_ptr<NodeSync> sync;
};

CollectiveArgs op(std::uint64_t sequence, ipc::OpCode code = ipc::OpCode::kAllGather) {
  CollectiveArgs args;
  args.sequence = sequence;
  args.op = code;
  args.description = code == ipc::OpCode::kAllGather ? "allGather(group 'g')" : "reduceScatter(group 'g')";
  return args;
}

/// Runs `args[n]` on node n, both at once, as the data plane would (begin
/// until it starts, step until it ends, opFailed on a failure): each node's
/// outcome.
std::array<Result<bool>, 2> runOnBoth(std::array<NodeSync*, 2> syncs, const std::array<CollectiveArgs, 2>& args) {
  const GroupGeometry geometry;
  std::array<Result<bool>, 2> outcome{Result<bool>(false), Result<bool>(false)};
  std::array<bool, 2> begun{false, false};
  std::array<bool, 2> over{false, false};
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!(over[0] && over[1]) && std::chrono::steady_clock::now() < deadline) {
    for (std::size_t n = 0; n < 2; ++n) {
      if (over[n]) continue;
      NodeSync& sync = *syncs[n];
      Result<bool> now = begun[n] ? sync.step() : sync.begin(args[n], geometry, {});
      if (!now) {
        sync.opFailed(args[n].sequence, now.error());
        outcome[n] = now;
        over[n] = true;
      } else if (begun[n] && *now) {
        outcome[n] = true;
        over[n] = true;
      } else {
        begun[n] = begun[n] || *now;
      }
    }
    std::this_thread::sleep_for(milliseconds(1));
  }
  return outcome;
}

std::array<Result<bool>, 2> runOnBoth(std::array<Node*, 2> nodes, const std::array<CollectiveArgs, 2>& args) {
  return runOnBoth(std::array<NodeSync*, 2>{nodes[0]->sync.get(), nodes[1]->sync.get()}, args);
}

/// Until neither node refuses ops (they have met again), or the deadline.
bool bothAvailable(std::array<Node*, 2> nodes) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < deadline) {
    const bool first = nodes[0]->sync->unavailable() == nullptr;
    const bool second = nodes[1]->sync->unavailable() == nullptr;
    if (first && second) return true;
    std::this_thread::sleep_for(milliseconds(5));
  }
  return false;
}

class NodeSyncTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(::mkdir(store_.c_str(), 0700), 0); }
  testing::TempDir dir_{"dbuf-node-sync"};
  std::string store_ = dir_.path("store");
};

TEST_F(NodeSyncTest, TheKthOpsMatchAndAfterMeetingRunsOnBothNodesWithNodeZerosValue) {
  Node a(101, store_, 0);
  Node b(202, store_, 1);
  for (std::uint64_t k = 0; k < 3; ++k) {
    for (const Result<bool>& outcome : runOnBoth({&a, &b}, {op(k), op(k)})) {
      EXPECT_TRUE(outcome.ok()) << outcome.error().message;
    }
  }
  const std::vector<std::pair<std::uint32_t, std::string>> once{{0, "node 0's, meeting 0"}};
  EXPECT_EQ(a.seen(), once);
  EXPECT_EQ(b.seen(), once);
}

TEST_F(NodeSyncTest, OpsThatDifferFailOnBothNodesAndTheNextOnesRun) {
  Node a(101, store_, 0);
  Node b(202, store_, 1);
  const auto outcomes = runOnBoth({&a, &b}, {op(0), op(0, ipc::OpCode::kReduceScatter)});
  for (const Result<bool>& outcome : outcomes) {
    ASSERT_FALSE(outcome.ok());
    EXPECT_EQ(outcome.error().code, ErrorCode::kConflict);
    EXPECT_NE(outcome.error().message.find("does not match across nodes"), std::string::npos)
        << outcome.error().message;
    EXPECT_NE(outcome.error().message.find("node 1 (rank 1) reduceScatter(group 'g')"), std::string::npos)
        << outcome.error().message;
  }
  for (const Result<bool>& outcome : runOnBoth({&a, &b}, {op(1), op(1)})) EXPECT_TRUE(outcome.ok());
}

TEST_F(NodeSyncTest, AMeetingThatFailsOnceEveryNodeCameIsSpentAndTheNodesMeetAtTheNext) {
  // Node 0 has met; node 1's after_meeting failed after both came, so it
  // does not try meeting 0 again (node 0 went on with its keys): its op
  // fails at once, node 0's times out waiting for it, and both meet at 1.
  Node a(101, store_, 0, milliseconds(1000));
  Node b(202, store_, 1, milliseconds(1000), /*fail_first_meeting=*/true);
  const std::array<Result<bool>, 2> first = runOnBoth({&a, &b}, {op(0), op(0)});
  ASSERT_FALSE(first[1].ok());
  EXPECT_NE(first[1].error().message.find("set-up failed at meeting 0"), std::string::npos) << first[1].error().message;
  ASSERT_FALSE(first[0].ok());
  EXPECT_EQ(first[0].error().code, ErrorCode::kTimeout) << first[0].error().message;
  ASSERT_TRUE(bothAvailable({&a, &b}));
  for (const Result<bool>& outcome : runOnBoth({&a, &b}, {op(1), op(1)})) {
    EXPECT_TRUE(outcome.ok()) << outcome.error().message;
  }
  EXPECT_EQ(a.seen(), (std::vector<std::pair<std::uint32_t, std::string>>{{0, "node 0's, meeting 0"},
                                                                          {1, "node 0's, meeting 1"}}));
  EXPECT_EQ(b.seen(), (std::vector<std::pair<std::uint32_t, std::string>>{{1, "node 0's, meeting 1"}}));
}

TEST_F(NodeSyncTest, ALinkLostOnOneNodeFailsTheNextOpOnBothAndTheyMeetAgain) {
  Node a(101, store_, 0);
  Node b(202, store_, 1);
  for (const Result<bool>& outcome : runOnBoth({&a, &b}, {op(0), op(0)})) EXPECT_TRUE(outcome.ok());
  // Node 1's NCCL failed: its next op (1) fails there and, through its
  // header, on node 0.
  b.sync->loseLink(1, Error{ErrorCode::kDevice, "NCCL failed on node 1", {1}});
  const Error* refused = b.sync->unavailable();
  ASSERT_NE(refused, nullptr);
  EXPECT_NE(refused->message.find("NCCL failed on node 1"), std::string::npos) << refused->message;
  const std::array<Result<bool>, 2> lost = runOnBoth({&a, &b}, {op(1), op(1)});
  for (const Result<bool>& outcome : lost) {
    ASSERT_FALSE(outcome.ok());
    EXPECT_NE(outcome.error().message.find("NCCL failed on node 1"), std::string::npos) << outcome.error().message;
  }
  EXPECT_EQ(lost[0].error().code, ErrorCode::kDevice);  // the code crosses the nodes
  EXPECT_NE(lost[0].error().message.find("on node 1 (rank 1)"), std::string::npos) << lost[0].error().message;
  ASSERT_TRUE(bothAvailable({&a, &b}));
  // Sequence 2 is the first op since the nodes met again, on both.
  for (const Result<bool>& outcome : runOnBoth({&a, &b}, {op(2), op(2)})) {
    EXPECT_TRUE(outcome.ok()) << outcome.error().message;
  }
  const std::vector<std::pair<std::uint32_t, std::string>> twice{{0, "node 0's, meeting 0"},
                                                                 {1, "node 0's, meeting 1"}};
  EXPECT_EQ(a.seen(), twice);
  EXPECT_EQ(b.seen(), twice);
}

}  // namespace
}  // namespace dbuf::daemon

namespace dbuf::daemon {
namespace {

/// One node's part of a job whose after_meeting takes its communicator
/// from idleOrNew: a stand-in (an int holding its id), counted when made.
struct CommunicatorJob {
  CommunicatorJob(Daemon& daemon, const std::string& id, const std::string& store_dir, std::uint32_t first_rank)
      : idle(daemon.cluster.idle_gpu_communicators) {
    NodeJob job = jobOfTwo(id, store_dir, first_rank);
    job.after_meeting = [this](const NodeJob::Meeting& meeting) -> Result<void> {
      key = meeting.daemons + "|test";
      const std::uint64_t proposal = 1000 + meeting.number;  // node 0's, the same each try
      auto entry = idleOrNew(meeting, "test", *idle, key, proposal, milliseconds(3000),
                             [this](std::uint64_t made_id) -> Result<std::shared_ptr<void>> {
                               ++made;
                               return std::shared_ptr<void>(std::make_shared<std::uint64_t>(made_id));
                             });
      if (!entry) return std::move(entry).error();
      held = std::move(*entry);
      return {};
    };
    sync = nodeSync(job, daemon.cluster);
  }
  /// The job ends: its communicator goes back to the daemon's idle ones.
  void park() { idle->put(key, std::move(held)); }

  std::shared_ptr<IdleCommunicators> idle;
  std::string key;
  IdleCommunicators::Entry held;
  int made = 0;
  std::unique_ptr<NodeSync> sync;
};

TEST_F(NodeSyncTest, ALaterJobUsesTheCommunicatorEveryNodeHoldsIdleAndMakesOneWhereTheyDiffer) {
  Daemon first(101);
  Daemon second(202);
  const auto run = [&](CommunicatorJob& a, CommunicatorJob& b) {
    for (const Result<bool>& outcome : runOnBoth({a.sync.get(), b.sync.get()}, {op(0), op(0)})) {
      ASSERT_TRUE(outcome.ok()) << outcome.error().message;
    }
  };
  {
    CommunicatorJob a(first, "one", store_, 0);
    CommunicatorJob b(second, "one", store_, 1);
    run(a, b);
    EXPECT_EQ(a.made + b.made, 2);  // a new one, node 0's proposal, on both
    EXPECT_EQ(a.held.id, 1000U);
    EXPECT_EQ(b.held.id, 1000U);
    a.park();
    b.park();
  }
  {
    CommunicatorJob a(first, "two", store_, 0);
    CommunicatorJob b(second, "two", store_, 1);
    run(a, b);
    EXPECT_EQ(a.made + b.made, 0);  // job one's, from both daemons' idle ones
    EXPECT_EQ(a.held.id, 1000U);
    EXPECT_EQ(*std::static_pointer_cast<std::uint64_t>(b.held.communicator), 1000U);
    a.park();  // node 1's is lost (say it failed): the nodes no longer hold the same
  }
  CommunicatorJob a(first, "three", store_, 0);
  CommunicatorJob b(second, "three", store_, 1);
  run(a, b);
  EXPECT_EQ(a.made + b.made, 2);
  // Node 0's idle one went back, for a later meeting that agrees on it.
  auto kept = first.cluster.idle_gpu_communicators->take(a.key);
  ASSERT_TRUE(kept.has_value());
  EXPECT_EQ(kept->id, 1000U);
}

}  // namespace
}  // namespace dbuf::daemon
