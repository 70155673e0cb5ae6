// The data plane's scheduling without a socket or a daemon: a job built by
// hand (no registry), each rank's rings made by DataPlane::openSession and driven from the
// client side (ipc::ClientRings), progress() called directly. Matching of
// the k-th op of every rank, a mismatch naming the ranks, a timeout naming
// the missing ranks (global rank numbers when the job's node holds only some
// of them), the barrier of a one-node job finishing at the match, and ops
// failing at once while the executor is unavailable (a job across nodes
// whose link was lost).
#include <gtest/gtest.h>

#include <asio.hpp>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data_plane.hpp"
#include "dbuf/ipc/ring.hpp"

namespace dbuf::daemon {
namespace {

/// A job with no groups (what the registry would answer for them).
struct GrouplessJob final : JobSchedule {
  const GroupGeometry* groupGeometry(std::uint32_t /*id*/) const override { return nullptr; }
  const std::string* groupName(std::uint32_t /*id*/) const override { return nullptr; }
  Result<void> bindGroup(std::uint32_t /*id*/) override { return makeError(ErrorCode::kInternal, "no groups"); }
};

/// A job of `ranks` local ranks (global ranks first_rank..) of a world of
/// `world`, with client ends of their rings.
class Scheduled {
 public:
  Scheduled(std::uint32_t ranks, std::uint32_t world, std::uint32_t first_rank) : plane_(io_, config()) {
    job_.id = "unit";
    job_.world_size = world;
    job_.first_rank = first_rank;
    job_.ranks.resize(ranks);
    job_.collectives.buffers.resize(ranks);
    scratch_.resize(LocalCollective::kStepElements);
    job_.collectives.executor = hostExecutor(scratch_);
    for (RankSchedule& rank : job_.ranks) {
      rank.ops.reset(config_.ring_entries);
      auto opened = plane_.openSession("dbuf:unit");
      EXPECT_TRUE(opened.ok());
      rank.plane = std::move(*opened);
      auto client = ipc::ClientRings::attach({rank.plane->segment.data(), rank.plane->segment.size()});
      EXPECT_TRUE(client.ok());
      clients_.push_back(*client);
    }
  }

  void submit(std::uint32_t local, ipc::OpCode op, std::uint32_t group = 0) {
    ipc::Submission entry;
    entry.handle = ++handles_;
    entry.op = static_cast<std::uint8_t>(op);
    entry.group_id = group;
    ASSERT_TRUE(clients_[local].trySubmit(entry));
  }
  /// Takes every rank's submissions and progresses the job, at `now`.
  void run(SteadyClock::time_point now = SteadyClock::now()) {
    JobSchedule* jobs[] = {&job_};
    std::optional<CorruptRing> corrupt;
    while (plane_.poll(jobs, now, corrupt) > 0) ASSERT_FALSE(corrupt);
    ASSERT_FALSE(corrupt);
  }
  /// The next completion of a rank, with its message; nullopt if none.
  std::optional<std::pair<ipc::Completion, std::string>> reap(std::uint32_t local) {
    ipc::Completion completion;
    std::vector<char> message(ipc::kCompletionMessageBytes);
    std::size_t bytes = 0;
    if (!clients_[local].tryReap(completion, message, bytes)) return std::nullopt;
    return std::pair{completion, std::string(message.data(), bytes)};
  }
  const Config& configuration() const { return config_; }
  void useExecutor(std::unique_ptr<Executor> executor) { job_.collectives.executor = std::move(executor); }

 private:
  const Config& config() {
    config_.ring_entries = 16;
    config_.collective_timeout = std::chrono::milliseconds(1000);
    return config_;
  }
  asio::io_context io_;
  Config config_;
  DataPlane plane_;
  GrouplessJob job_;
  std::vector<float> scratch_;
  std::vector<ipc::ClientRings> clients_;
  std::uint64_t handles_ = 0;
};

TEST(DataPlane, TheKthOpOfEveryRankMatchesAndABarrierEndsThere) {
  Scheduled job(3, 3, 0);
  job.submit(0, ipc::OpCode::kBarrier);
  job.submit(1, ipc::OpCode::kBarrier);
  job.run();
  EXPECT_FALSE(job.reap(0));  // rank 2 has not come yet
  job.submit(2, ipc::OpCode::kBarrier);
  job.run();
  for (std::uint32_t r = 0; r < 3; ++r) {
    auto done = job.reap(r);
    ASSERT_TRUE(done) << r;
    EXPECT_EQ(done->first.status, 0) << done->second;
    EXPECT_EQ(done->first.sequence, 0U);
  }
}

TEST(DataPlane, AMismatchFailsEveryRankNamingThoseThatDiffer) {
  Scheduled job(3, 3, 0);
  job.submit(0, ipc::OpCode::kBarrier);
  job.submit(1, ipc::OpCode::kBarrier);
  job.submit(2, ipc::OpCode::kAllGather, 1);
  job.run();
  for (std::uint32_t r = 0; r < 3; ++r) {
    auto done = job.reap(r);
    ASSERT_TRUE(done) << r;
    EXPECT_EQ(done->first.status, static_cast<std::uint16_t>(ipc::WireError::kConflict));
    EXPECT_NE(done->second.find("does not match across ranks: ranks 0-1 barrier; rank 2 allGather"),
              std::string::npos)
        << done->second;
    EXPECT_EQ(done->first.rank_count, 1);
    EXPECT_EQ(done->first.ranks[0], 2U);
  }
}

TEST(DataPlane, ATimeoutNamesTheMissingRanksByTheirGlobalNumbers) {
  // This node holds ranks 4-6 of a job of 8 (a job across nodes).
  Scheduled job(3, 8, 4);
  const auto start = SteadyClock::now();
  job.submit(0, ipc::OpCode::kBarrier);
  job.run(start);
  job.run(start + job.configuration().collective_timeout / 2);
  EXPECT_FALSE(job.reap(0));
  job.run(start + job.configuration().collective_timeout + std::chrono::milliseconds(1));
  auto done = job.reap(0);
  ASSERT_TRUE(done);
  EXPECT_EQ(done->first.status, static_cast<std::uint16_t>(ipc::WireError::kTimeout));
  EXPECT_NE(done->second.find("ranks 5, 6 of job unit have not submitted it"), std::string::npos) << done->second;
  EXPECT_EQ(done->first.rank_count, 2);
  EXPECT_EQ(done->first.ranks[0], 5U);
  // Ranks 5 and 6 owe it: their first ops fail at once with the same error.
  job.submit(1, ipc::OpCode::kBarrier);
  job.run();
  auto owed = job.reap(1);
  ASSERT_TRUE(owed);
  EXPECT_EQ(owed->first.status, static_cast<std::uint16_t>(ipc::WireError::kTimeout));
}

/// Runs barriers (as across nodes), each at once, except that the first op
/// it begins fails and leaves it unavailable (as a lost link leaves a job
/// across nodes) until back().
class LosingExecutor final : public Executor {
 public:
  Result<bool> begin(const CollectiveArgs& args, const GroupGeometry& /*geometry*/,
                     std::span<const RankBuffers> /*ranks*/) override {
    begun_.push_back(args.sequence);
    if (begun_.size() > 1) return true;
    lost_ = Error{ErrorCode::kUnavailable, "the link is lost", {7}};
    return *lost_;
  }
  Result<bool> step() override { return true; }
  std::uint64_t bytesWritten() const noexcept override { return 0; }
  Result<void> queued() override { return {}; }
  Result<bool> done() override { return true; }
  void quiesce() noexcept override {}
  bool runsBarriers() const noexcept override { return true; }
  const Error* unavailable() override { return lost_ ? &*lost_ : nullptr; }
  void back() { lost_.reset(); }
  const std::vector<std::uint64_t>& begun() const { return begun_; }

 private:
  std::optional<Error> lost_;
  std::vector<std::uint64_t> begun_;
};

TEST(DataPlane, WhileTheExecutorIsUnavailableQueuedAndNewOpsFailAtOnceAndTakeNoSequence) {
  Scheduled job(2, 2, 0);
  auto owned = std::make_unique<LosingExecutor>();
  LosingExecutor& executor = *owned;
  job.useExecutor(std::move(owned));
  job.submit(0, ipc::OpCode::kBarrier);
  job.submit(0, ipc::OpCode::kBarrier);  // queued behind the one that fails
  job.submit(1, ipc::OpCode::kBarrier);
  job.run();
  for (std::uint32_t r = 0; r < 2; ++r) {
    auto failed = job.reap(r);
    ASSERT_TRUE(failed) << r;
    EXPECT_EQ(failed->first.status, static_cast<std::uint16_t>(ipc::toWire(ErrorCode::kUnavailable))) << failed->second;
    EXPECT_EQ(failed->first.sequence, 0U);
  }
  auto queued = job.reap(0);
  ASSERT_TRUE(queued) << "the queued op must fail with the op that lost the executor";
  EXPECT_EQ(queued->first.status, static_cast<std::uint16_t>(ipc::toWire(ErrorCode::kUnavailable)));
  EXPECT_EQ(queued->second, "the link is lost");
  EXPECT_EQ(queued->first.rank_count, 1);
  EXPECT_EQ(queued->first.ranks[0], 7U);
  job.submit(1, ipc::OpCode::kBarrier);  // arrives while unavailable: fails as it comes
  job.run();
  auto refused = job.reap(1);
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->second, "the link is lost");
  executor.back();
  job.submit(0, ipc::OpCode::kBarrier);
  job.submit(1, ipc::OpCode::kBarrier);
  job.run();
  for (std::uint32_t r = 0; r < 2; ++r) {
    auto done = job.reap(r);
    ASSERT_TRUE(done) << r;
    EXPECT_EQ(done->first.status, 0) << done->second;
    EXPECT_EQ(done->first.sequence, 1U);  // the refused ops took none
  }
  EXPECT_EQ(executor.begun(), (std::vector<std::uint64_t>{0, 1}));
}

}  // namespace
}  // namespace dbuf::daemon
