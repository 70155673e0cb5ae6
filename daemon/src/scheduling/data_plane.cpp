#include "data_plane.hpp"

#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "dbuf/common/stream_counter_word.hpp"
#include "rank_text.hpp"

namespace dbuf::daemon {
namespace {

constexpr auto kOk = std::uint16_t{0};

/// How often the loop looks at a GPU while an op waits for one.
constexpr auto kGpuPollInterval = std::chrono::microseconds(50);

/// A failed op's completion status: its error's code on the wire.
std::uint16_t statusOf(const Error& error) {
  return static_cast<std::uint16_t>(ipc::toWire(error.code));
}

std::uint64_t nanosBetween(SteadyClock::time_point from, SteadyClock::time_point to) {
  return to > from ? static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(to - from).count())
                   : 0;
}

/// A scale as a person would write it ("0.5", "2", "1e-08").
std::string shortFloat(float value) {
  std::array<char, 32> text{};
  std::snprintf(text.data(), text.size(), "%g", static_cast<double>(value));
  return text.data();
}

bool streamOrdered(const ipc::Submission& submission) {
  return (submission.flags & ipc::kFlagStreamOrdered) != 0;
}

/// Whether the rank's next op waits for its CUDA stream to reach it. Read
/// on the host, never waited for on a GPU stream of the daemon's: the
/// counter is memory a client writes, and could hold that stream forever.
bool streamBehind(const RankSchedule& rank) {
  const ipc::Submission& op = rank.ops.front().submission;
  return streamOrdered(op) && counterValue(rank.plane->rings.streamCounters().ready) < op.ticket;
}

bool isGroupOp(ipc::OpCode op) {
  return op == ipc::OpCode::kAllGather || op == ipc::OpCode::kReduceScatter || op == ipc::OpCode::kAllReduce ||
         op == ipc::OpCode::kBroadcast;
}

/// The fields every rank must agree on, compared bit for bit (scales too:
/// ranks that disagree on a scale would silently diverge).
bool sameOp(const ipc::Submission& a, const ipc::Submission& b) {
  // Stream ordering is each rank's own business.
  constexpr auto kShared = static_cast<std::uint8_t>(~ipc::kFlagStreamOrdered);
  return a.op == b.op && a.group_id == b.group_id && a.reduce == b.reduce &&
         (a.flags & kShared) == (b.flags & kShared) && a.root == b.root &&
         std::memcmp(&a.pre_scale, &b.pre_scale, sizeof(float)) == 0 &&
         std::memcmp(&a.post_scale, &b.post_scale, sizeof(float)) == 0;
}

/// The ranks whose next op differs from rank 0's: those a mismatch names as
/// disagreeing (Error::ranks).
std::vector<std::uint32_t> ranksDifferingFromRankZero(const JobSchedule& job) {
  const ipc::Submission& first = job.ranks.front().ops.front().submission;
  std::vector<std::uint32_t> differing;
  for (std::uint32_t r = 1; r < job.localCount(); ++r) {
    if (!sameOp(job.ranks[r].ops.front().submission, first)) differing.push_back(job.globalRank(r));
  }
  return differing;
}

}  // namespace

DataPlane::DataPlane(asio::io_context& io, const Config& config)
    : io_(io), config_(config), timeout_timer_(io), gpu_poll_timer_(io) {}

SessionPlane::~SessionPlane() {
  // A stream may still wait for an op of the session that will never run
  // (its rank detached or died, the daemon is stopping): release it.
  if (last_ticket > 0) poisonCounter(rings.streamCounters().done);
  if (doorbell) {
    asio::error_code ignored;
    doorbell->close(ignored);
  }
}

void DataPlane::armDoorbell(const std::shared_ptr<asio::posix::stream_descriptor>& doorbell) {
  // The handler only drains the eventfd: waking the loop is its purpose. It
  // holds the descriptor, not the plane: a wake-up that completed before its
  // session ended may still run after the plane is freed, and then finds the
  // descriptor closed.
  doorbell->async_wait(asio::posix::stream_descriptor::wait_read, [doorbell](const asio::error_code& error) {
    if (error || !doorbell->is_open()) return;
    std::uint64_t count = 0;
    [[maybe_unused]] const auto drained = ::read(doorbell->native_handle(), &count, sizeof(count));
    armDoorbell(doorbell);
  });
}

Result<std::unique_ptr<SessionPlane>> DataPlane::openSession(const std::string& label) {
  auto plane = std::make_unique<SessionPlane>();
  const std::size_t bytes = ipc::segmentBytes(config_.ring_entries);
  auto fd = createMemfd(label, bytes);
  if (!fd) return std::move(fd).error();
  auto mapping = Mapping::map(fd->get(), bytes);
  if (!mapping) return std::move(mapping).error();
  auto rings = ipc::DaemonRings::format({mapping->data(), bytes}, config_.ring_entries);
  if (!rings) return std::move(rings).error();
  const int doorbell = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (doorbell < 0) return makeError(ErrorCode::kIo, "eventfd: " + std::string(std::strerror(errno)));
  plane->segment_fd = std::move(*fd);
  plane->segment = std::move(*mapping);
  plane->rings = *rings;
  plane->doorbell = std::make_shared<asio::posix::stream_descriptor>(io_, doorbell);
  armDoorbell(plane->doorbell);
  return plane;
}

// ----------------------------------------------------------------- submissions

std::size_t DataPlane::poll(std::span<JobSchedule* const> jobs, SteadyClock::time_point now,
                            std::optional<CorruptRing>& corrupt) {
  std::size_t work = 0;
  for (JobSchedule* job : jobs) {
    for (std::uint32_t rank = 0; rank < job->localCount(); ++rank) {
      if (!job->ranks[rank].plane) continue;
      auto taken = takeSubmissions(*job, rank, now);
      if (!taken) {
        corrupt = CorruptRing{job, rank, std::move(taken).error()};
        return work;
      }
      work += *taken;
    }
  }
  const std::size_t count = jobs.size();
  for (std::size_t i = 0; i < count; ++i) work += progress(*jobs[(next_job_turn_ + i) % count], now);
  if (count > 0) next_job_turn_ = (next_job_turn_ + 1) % count;
  return work;
}

Result<std::size_t> DataPlane::takeSubmissions(JobSchedule& job, std::uint32_t rank, SteadyClock::time_point now) {
  SessionPlane& plane = *job.ranks[rank].plane;
  std::size_t taken = 0;
  // Take only what can be answered: every op taken has a completion entry
  // reserved, so the daemon never has to hold a completion back.
  RankSchedule& state = job.ranks[rank];
  // A filling ends when the rank's rings have drained: either its ring is
  // found empty, or room has come back with none of its ops left here (its
  // next ops can only be taken from now on, so this pass sees it before any
  // next filling, however late the loop comes by).
  if (state.rings_full && state.ops.empty() && plane.rings.roomToAnswer()) state.rings_full = false;
  while (true) {
    if (!plane.rings.roomToAnswer()) {
      // As many of its ops outstanding as its rings hold: its next submit
      // waits (or fails with kWouldBlock). Counted once per filling.
      if (!state.rings_full) ++job.stats.ring_full;
      state.rings_full = true;
      break;
    }
    ipc::Submission submission;
    const ipc::TakeResult result = plane.rings.take(submission);
    if (result == ipc::TakeResult::kEmpty) {
      state.rings_full = false;
      break;
    }
    if (result == ipc::TakeResult::kCorrupt) {
      return makeError(ErrorCode::kInvalidArgument, "its submission ring indices are corrupt");
    }
    ++taken;
    enqueue(job, rank, submission, now);
  }
  return taken;
}

void DataPlane::enqueue(JobSchedule& job, std::uint32_t rank, const ipc::Submission& submission, SteadyClock::time_point now) {
  RankSchedule& state = job.ranks[rank];
  if (streamOrdered(submission)) {
    if (std::string why = streamOrderProblem(job, rank, submission); !why.empty()) {
      failOne(job, rank, submission, makeError(ErrorCode::kInvalidArgument, std::move(why)));
      return;
    }
    state.plane->last_ticket = submission.ticket;
  }
  if (submission.op == static_cast<std::uint8_t>(ipc::OpCode::kNoop)) {
    ipc::Completion completion;
    completion.handle = submission.handle;
    completeOne(job, rank, submission, completion, {});
    return;
  }
  if (!state.owed.empty()) {
    // This rank's k-th op already timed out without it.
    const Error timed_out = std::move(state.owed.front());
    state.owed.pop_front();
    failOne(job, rank, submission, timed_out);
    return;
  }
  if (const Error* unavailable = job.collectives.executor ? job.collectives.executor->unavailable() : nullptr) {
    failOne(job, rank, submission, *unavailable);
    return;
  }
  if (!job.gone.empty()) {
    std::vector<std::uint32_t> gone(job.gone.begin(), job.gone.end());
    std::string message = describe(job, submission) + " cannot run: " + goneRanksText(gone, job.id);
    failOne(job, rank, submission, Error{ErrorCode::kConflict, std::move(message), std::move(gone)});
    return;
  }
  // The queue holds as many ops as the ring, and roomToAnswer() bounds what was
  // taken: a full queue is a daemon bug, reported rather than losing the op.
  if (!state.ops.push({submission, now})) {
    failOne(job, rank, submission,
            makeError(ErrorCode::kInternal, "dbufd: a rank's op queue overflowed (a bug); the op was not run"));
  }
}

void DataPlane::failOne(JobSchedule& job, std::uint32_t rank, const ipc::Submission& submission, const Error& error) {
  ipc::Completion completion;
  completion.handle = submission.handle;
  completion.status = statusOf(error);
  ipc::setCompletionRanks(completion, error.ranks);
  completeOne(job, rank, submission, completion, error.message);
}

std::string DataPlane::streamOrderProblem(const JobSchedule& job, std::uint32_t rank, const ipc::Submission& submission) {
  const SessionPlane& plane = *job.ranks[rank].plane;
  ipc::OpCode op{};
  if (!ipc::opCodeFrom(submission.op, op) || !isGroupOp(op)) {
    return describe(job, submission) + ": only group collectives can be ordered on a CUDA stream";
  }
  if (plane.stream_order_over) {
    return describe(job, submission) +
           ": an earlier stream-ordered op of this session failed, which ended its stream ordering (detach and attach "
           "again)";
  }
  if (submission.ticket <= plane.last_ticket || isPoisoned(submission.ticket)) {
    return describe(job, submission) + ": stream ticket " + std::to_string(submission.ticket) +
           " does not follow the session's last one (" + std::to_string(plane.last_ticket) + ")";
  }
  if (job.placement == Placement::kHost) {
    return describe(job, submission) + ": ordering on a CUDA stream needs GPU memory, and job " + job.id +
           "'s is on the host (dbufd's host backend)";
  }
  return {};
}

void DataPlane::completeOne(JobSchedule& job, std::uint32_t rank, const ipc::Submission& submission,
                            const ipc::Completion& completion, std::string_view message) {
  SessionPlane* plane = job.ranks[rank].plane.get();
  if (plane == nullptr) return;  // the rank is gone; nobody to tell
  if (completion.status != kOk && streamOrdered(submission)) {
    // Its stream waits for done >= ticket, which the op will never write.
    poisonCounter(plane->rings.streamCounters().done);
    plane->stream_order_over = true;
  }
  plane->rings.complete(completion, message);
  plane->rings.wakeClient();
}

// ----------------------------------------------------------------- matching

std::size_t DataPlane::progress(JobSchedule& job, SteadyClock::time_point now) {
  JobCollectives& collectives = job.collectives;
  if (collectives.running) {
    collectives.executor->activate();  // jobs on other GPUs ran since this one's last turn
    if (!collectives.draining) {
      // One turn: steps until about kTurnBytes are written, so that a small op
      // (many tiny steps) is not charged a whole pass per step. (On a GPU a
      // step only queues its kernels.)
      Executor& executor = *collectives.executor;
      const std::uint64_t budget_end = executor.bytesWritten() + kTurnBytes;
      while (executor.bytesWritten() < budget_end) {
        if (executor.waiting()) return 0;  // another thread's turn; it wakes the loop
        auto stepped = executor.step();
        if (!stepped) return failRunning(job, stepped.error());
        if (*stepped) {
          if (auto queued = markQueued(job); !queued) return failRunning(job, queued.error());
          collectives.draining = true;
          break;
        }
      }
    }
    if (collectives.draining) {
      // Polled, never waited for: while a GPU runs the op, every pass looks
      // (and a sleeping loop wakes up for it, see prepareSleep).
      auto done = collectives.executor->done();
      if (!done) return failRunning(job, done.error());
      if (!*done) return 0;
      finish(job, nullptr, SteadyClock::now());
    }
    return 1;
  }
  if (!collectives.validated) {
    const bool all_arrived =
        std::all_of(job.ranks.begin(), job.ranks.end(), [](const RankSchedule& rank) { return !rank.ops.empty(); });
    if (!all_arrived) return checkTimeout(job, now) ? 1 : 0;
    if (!match(job, now)) return 1;
  }
  if (!streamsReady(job)) return checkStreamTimeout(job, now) ? 1 : 0;
  return start(job) ? 1 : 0;
}

std::size_t DataPlane::failRunning(JobSchedule& job, const Error& error) {
  job.collectives.executor->quiesce();  // nothing of the failed op may still be running
  // The executor's code goes on (kDevice for a failed NCCL call or kernel).
  const Error failed{
      error.code, describe(job, job.ranks.front().ops.front().submission) + " failed in the daemon: " + error.message,
      error.ranks};
  finish(job, &failed, SteadyClock::now());
  return 1;
}

bool DataPlane::match(JobSchedule& job, SteadyClock::time_point now) {
  if (auto valid = validateFronts(job); !valid) {
    spdlog::warn("job {}: {}", job.id, valid.error().message);
    failFronts(job, valid.error());
    return false;
  }
  JobCollectives& collectives = job.collectives;
  collectives.matched = now;
  const bool executor_runs_it =
      isGroupOp(collectives.args.op) || (collectives.executor && collectives.executor->runsBarriers());
  if (!executor_runs_it) {
    finish(job, nullptr, now);  // a barrier: everyone is here
    return false;
  }
  collectives.validated = true;
  return true;
}

bool DataPlane::streamsReady(const JobSchedule& job) {
  return std::none_of(job.ranks.begin(), job.ranks.end(), streamBehind);
}

bool DataPlane::checkStreamTimeout(JobSchedule& job, SteadyClock::time_point now) {
  if (now - job.collectives.matched < config_.collective_timeout) return false;
  std::vector<std::uint32_t> late;
  for (std::uint32_t r = 0; r < job.localCount(); ++r) {
    if (streamBehind(job.ranks[r])) late.push_back(job.globalRank(r));
  }
  const std::string message =
      timedOut(job, job.ranks.front().ops.front().submission,
               "the CUDA stream of " + ranksPhrase(late) + " of job " + job.id +
                   " did not reach it (the GPU work queued on it before the op has not finished)");
  spdlog::warn("job {}: {}", job.id, message);
  failFronts(job, Error{ErrorCode::kTimeout, message, std::move(late)});
  return true;
}

std::string DataPlane::timedOut(const JobSchedule& job, const ipc::Submission& op, const std::string& why) const {
  return "collective #" + std::to_string(job.collectives.next_sequence) + " " + describe(job, op) +
         " timed out after " + std::to_string(config_.collective_timeout.count()) + " ms: " + why;
}

bool DataPlane::executorTimeout(JobSchedule& job) {
  if (SteadyClock::now() - job.collectives.matched < config_.collective_timeout) return false;
  const std::string message =
      timedOut(job, job.ranks.front().ops.front().submission,
               job.acrossNodes() ? "the job's other nodes did not join it (their daemons have not met this one "
                                   "through the job's store yet, or are still in the previous op)"
                                 : "the daemon could not start it (the job's NCCL communicators are still being made)");
  spdlog::error("job {}: {}", job.id, message);
  failFronts(job, makeError(ErrorCode::kTimeout, message));
  return true;
}

bool DataPlane::start(JobSchedule& job) {
  JobCollectives& collectives = job.collectives;
  static const GroupGeometry kNoGroup;  // a barrier's (across nodes)
  const GroupGeometry* group = job.groupGeometry(collectives.group_id);
  const GroupGeometry& geometry = group != nullptr ? *group : kNoGroup;
  if (!collectives.executor) {  // every rank submitted, so every rank attached: a daemon bug
    failFronts(job, makeError(ErrorCode::kInternal, "dbufd: the job has no executor (a bug); the op was not run"));
    return true;
  }
  collectives.executor->activate();
  for (std::uint32_t r = 0; r < job.localCount(); ++r) {
    SessionPlane& plane = *job.ranks[r].plane;
    if (!streamOrdered(job.ranks[r].ops.front().submission) || plane.counters) continue;
    auto counters = collectives.executor->sessionCounters(r, plane.rings.streamCounters());
    if (!counters) {
      const std::string message = describe(job, job.ranks[r].ops.front().submission) + " cannot be ordered on rank " +
                                  std::to_string(job.globalRank(r)) + "'s CUDA stream: " + counters.error().message;
      spdlog::error("job {}: {}", job.id, message);
      failFronts(job, Error{counters.error().code, message, {}});
      return true;
    }
    plane.counters = std::move(*counters);
    collectives.executor->activate();  // registering made another GPU current
  }
  auto begun = collectives.executor->begin(collectives.args, geometry, collectives.buffers);
  if (!begun) {
    const std::string message =
        describe(job, job.ranks.front().ops.front().submission) + " cannot run in the daemon: " + begun.error().message;
    spdlog::error("job {}: {}", job.id, message);
    failFronts(job, Error{begun.error().code, message, {}});
    return true;
  }
  if (!*begun) return executorTimeout(job);  // not ready yet (NCCL set-up): the next pass asks again
  collectives.running = true;
  return true;
}

Result<void> DataPlane::validateFronts(JobSchedule& job) {
  const ipc::Submission& first = job.ranks.front().ops.front().submission;
  // Messages are built only on failure: the hot path allocates nothing.
  const auto refuse = [&](const std::string& why, ErrorCode code = ErrorCode::kConflict) {
    return makeError(code,
                     "collective #" + std::to_string(job.collectives.next_sequence) + " " + describe(job, first) + why);
  };
  const bool agree = std::all_of(job.ranks.begin(), job.ranks.end(),
                                 [&](const RankSchedule& rank) { return sameOp(rank.ops.front().submission, first); });
  if (!agree) return Error{ErrorCode::kConflict, mismatchMessage(job), ranksDifferingFromRankZero(job)};
  ipc::OpCode op{};
  if (!ipc::opCodeFrom(first.op, op)) return refuse(": not an op this daemon knows");
  if (first.reduce > static_cast<std::uint8_t>(ipc::ReduceMode::kAvg) ||
      (first.flags & ~(ipc::kFlagAccumulate | ipc::kFlagStreamOrdered)) != 0 || !std::isfinite(first.pre_scale) ||
      !std::isfinite(first.post_scale)) {
    return refuse(": bad reduce mode, flags or scales");
  }
  CollectiveArgs& args = job.collectives.args;
  args.sequence = job.collectives.next_sequence;
  args.op = op;
  args.reduce = static_cast<ipc::ReduceMode>(first.reduce);
  args.accumulate = (first.flags & ipc::kFlagAccumulate) != 0;
  args.root = first.root;
  args.pre_scale = first.pre_scale;
  args.post_scale = first.post_scale;
  args.description.clear();  // keeps its capacity: no allocation per op
  if (job.acrossNodes()) args.description = describe(job, first);
  job.collectives.group_id = first.group_id;
  if (op == ipc::OpCode::kBarrier) return {};
  const GroupGeometry* group = job.groupGeometry(first.group_id);
  if (group == nullptr) return refuse(": job " + job.id + " has no such group");
  if ((op == ipc::OpCode::kReduceScatter || op == ipc::OpCode::kAllReduce) && !group->reduces()) {
    return refuse(": the group holds " + std::string(toString(group->sharded)) +
                      ", which dbufd gathers as it is and does not reduce (reductions need fp32, bf16, fp16 or fp64)",
                  ErrorCode::kInvalidArgument);
  }
  if (op == ipc::OpCode::kBroadcast && first.root >= job.world_size) {
    return refuse(": root is not a rank of the job");
  }
  if (args.accumulate && (op != ipc::OpCode::kReduceScatter || group->sharded != group->accumulation())) {
    return refuse(": accumulate needs a reduce-scatter into an fp32 sharded gradient (fp64 in an fp64 group)");
  }
  if (auto bound = job.bindGroup(first.group_id); !bound) {
    Error error = std::move(bound).error();
    error.message = "collective #" + std::to_string(job.collectives.next_sequence) + " " + describe(job, first) +
                    ": " + error.message;
    return error;
  }
  return {};
}

Result<void> DataPlane::markQueued(JobSchedule& job) {
  for (RankSchedule& rank : job.ranks) {
    const ipc::Submission& op = rank.ops.front().submission;
    if (!streamOrdered(op)) continue;
    if (auto signalled = rank.plane->counters->signalDone(op.ticket); !signalled) return signalled;
  }
  return job.collectives.executor->queued();
}

void DataPlane::record(JobSchedule& job, const Error* error, SteadyClock::time_point now) {
  const auto with_op = std::find_if(job.ranks.begin(), job.ranks.end(), [](const RankSchedule& r) { return !r.ops.empty(); });
  if (with_op == job.ranks.end()) return;
  const ipc::Submission& op = with_op->ops.front().submission;
  OpRecord& entry = job.recorder.next();
  entry.submitted.resize(job.localCount());  // already so, but in a schedule a test made
  SteadyClock::time_point first_submitted = job.collectives.matched;
  for (std::uint32_t r = 0; r < job.localCount(); ++r) {
    const OpQueue& ops = job.ranks[r].ops;
    entry.submitted[r] = ops.empty() ? SteadyClock::time_point{} : ops.front().submitted;
    if (!ops.empty()) first_submitted = std::min(first_submitted, ops.front().submitted);
  }
  entry.sequence = job.collectives.next_sequence;
  if (!ipc::opCodeFrom(op.op, entry.op)) entry.op = ipc::OpCode::kNoop;  // (validated before it is queued)
  entry.group_id = op.group_id;
  const GroupGeometry* group = entry.op == ipc::OpCode::kBarrier ? nullptr : job.groupGeometry(op.group_id);
  entry.unsharded_bytes = group == nullptr ? 0
                                           : static_cast<std::uint64_t>(group->world) *
                                                 static_cast<std::uint64_t>(group->shard_elems) *
                                                 static_cast<std::uint64_t>(sizeBytes(group->unsharded));
  entry.started = job.collectives.matched;
  entry.ended = now;
  entry.ok = error == nullptr;
  if (error != nullptr) {
    entry.code = error->code;
    entry.error = error->message;
  } else {
    entry.error.clear();
  }
  // Waiting for the other ranks starts no earlier than the previous op's end
  // (before, the op was queued behind it; the timeout counts the same way).
  // An op failed before its match, as by a timeout, was "matched" as it failed (failFronts).
  first_submitted = std::min(std::max(first_submitted, job.collectives.finished), entry.started);
  job.stats.ended(entry.op, error != nullptr ? &error->code : nullptr, entry.unsharded_bytes,
                  std::chrono::nanoseconds(nanosBetween(first_submitted, entry.started)),
                  std::chrono::nanoseconds(nanosBetween(entry.started, now)));
}

void DataPlane::logRecent(const JobSchedule& job) {
  constexpr std::size_t kLogged = 8;
  const std::vector<const OpRecord*> records = job.recorder.records();
  if (records.empty()) return;
  const std::size_t first = records.size() > kLogged ? records.size() - kLogged : 0;
  std::string text;
  for (std::size_t i = first; i < records.size(); ++i) {
    const OpRecord& r = *records[i];
    const std::string* group = job.groupName(r.group_id);
    text += "\n  #" + std::to_string(r.sequence) + " " + std::string(ipc::toString(r.op)) +
            (group != nullptr && r.op != ipc::OpCode::kBarrier ? " of '" + *group + "'" : std::string()) + ": " +
            (r.ok ? std::string("ok") : std::string(toString(r.code)) + ": " + r.error) + "; ran " +
            std::to_string(nanosBetween(r.started, r.ended) / 1000) + " us; submitted";
    for (std::uint32_t local = 0; local < r.submitted.size(); ++local) {
      text += " " + std::to_string(job.globalRank(local)) + ":" +
              (r.submitted[local] == SteadyClock::time_point{}
                   ? std::string("never")
                   : std::to_string(nanosBetween(r.submitted[local], r.started) / 1000) + " us before");
    }
  }
  spdlog::warn("job {}: its last {} collective(s) (flight recorder; dbufctl trace {}):{}", job.id,
               records.size() - first, job.id, text);
}

void DataPlane::finish(JobSchedule& job, const Error* error, SteadyClock::time_point now) {
  record(job, error, now);
  JobCollectives& collectives = job.collectives;
  for (std::uint32_t r = 0; r < job.localCount(); ++r) {
    RankSchedule& rank = job.ranks[r];
    if (rank.ops.empty()) continue;
    const ipc::Submission submission = rank.ops.front().submission;
    ipc::Completion completion;
    completion.handle = submission.handle;
    completion.sequence = collectives.next_sequence;
    completion.wait_ns = nanosBetween(rank.ops.front().submitted, collectives.matched);
    completion.run_ns = nanosBetween(collectives.matched, now);
    if (error != nullptr) {
      completion.status = statusOf(*error);
      ipc::setCompletionRanks(completion, error->ranks);
    }
    rank.ops.pop();
    completeOne(job, r, submission, completion,
                error != nullptr ? std::string_view(error->message) : std::string_view());
    if (error == nullptr && streamOrdered(submission) && rank.plane && rank.plane->stream_order_over) {
      // A later op of the session failed while this one ran: its done write
      // (now landed) replaced that poison. Poison again.
      poisonCounter(rank.plane->rings.streamCounters().done);
    }
  }
  if (error != nullptr && collectives.executor) collectives.executor->opFailed(collectives.next_sequence, *error);
  collectives.validated = false;
  collectives.running = false;
  collectives.draining = false;
  collectives.finished = now;
  ++collectives.next_sequence;
  if (error == nullptr || !collectives.executor) return;
  if (const Error* unavailable = collectives.executor->unavailable()) {
    failQueued(job, Error(*unavailable));  // (this op's failure lost the job's link to its other nodes)
  }
}

void DataPlane::failQueued(JobSchedule& job, const Error& error) {
  for (std::uint32_t r = 0; r < job.localCount(); ++r) {
    RankSchedule& rank = job.ranks[r];
    while (!rank.ops.empty()) {
      const ipc::Submission submission = rank.ops.front().submission;
      rank.ops.pop();
      failOne(job, r, submission, error);
    }
  }
}

void DataPlane::failFronts(JobSchedule& job, const Error& error) {
  job.collectives.matched = SteadyClock::now();
  finish(job, &error, job.collectives.matched);
}

bool DataPlane::checkTimeout(JobSchedule& job, SteadyClock::time_point now) {
  SteadyClock::time_point oldest = SteadyClock::time_point::max();
  for (const RankSchedule& rank : job.ranks) {
    if (!rank.ops.empty()) oldest = std::min(oldest, rank.ops.front().submitted);
  }
  if (oldest == SteadyClock::time_point::max()) return false;
  // A rank cannot be late for an op while the daemon was still running the
  // job's previous one: count from whichever came last.
  if (now - std::max(oldest, job.collectives.finished) < config_.collective_timeout) return false;
  std::vector<std::uint32_t> missing;
  const ipc::Submission* example = nullptr;
  for (std::uint32_t r = 0; r < job.localCount(); ++r) {
    if (job.ranks[r].ops.empty()) {
      missing.push_back(r);  // local indices until the message
    } else if (example == nullptr) {
      example = &job.ranks[r].ops.front().submission;
    }
  }
  std::vector<std::uint32_t> missing_ranks;
  for (const std::uint32_t r : missing) missing_ranks.push_back(job.globalRank(r));
  std::string message = timedOut(job, *example,
                                 ranksPhrase(missing_ranks) + " of job " + job.id + " " + hasOrHave(missing_ranks) +
                                     " not submitted it");
  spdlog::warn("job {}: {}", job.id, message);
  const Error timed_out{ErrorCode::kTimeout, std::move(message), std::move(missing_ranks)};
  for (const std::uint32_t r : missing) job.ranks[r].owed.push_back(timed_out);
  failFronts(job, timed_out);
  logRecent(job);
  return true;
}

void DataPlane::rankGone(JobSchedule& job, std::uint32_t rank, RankEnd end) {
  RankSchedule& gone = job.ranks[rank];
  const bool had_op = !gone.ops.empty();
  const bool was_running = job.collectives.running;
  const bool ops_fail = was_running || std::any_of(job.ranks.begin(), job.ranks.end(),
                                                   [](const RankSchedule& r) { return !r.ops.empty(); });
  if (ops_fail) ++job.stats.ranks_lost;  // (a job's orderly end, rank by rank, loses nothing)
  // Queued GPU work may still touch the rank's memory, which goes next.
  if (job.collectives.executor) {
    job.collectives.executor->activate();
    job.collectives.executor->quiesce();
  }
  gone.ops.clear();
  gone.owed.clear();
  gone.plane.reset();
  job.collectives.validated = false;
  job.collectives.running = false;
  job.collectives.draining = false;
  const Error disconnected{
      ErrorCode::kConflict,
      "rank " + std::to_string(job.globalRank(rank)) + " of job " + job.id + " disconnected" +
          (was_running ? " while collective #" + std::to_string(job.collectives.next_sequence) + " was running"
                       : (had_op ? " with collectives pending" : "")),
      {job.globalRank(rank)}};
  // Every queued op of the others needs the dead rank: fail them all now
  // (and, across nodes, every op of the job from now on, on every node).
  if (job.collectives.executor) job.collectives.executor->abandon(job.collectives.next_sequence, disconnected);
  while (std::any_of(job.ranks.begin(), job.ranks.end(), [](const RankSchedule& r) { return !r.ops.empty(); })) {
    failFronts(job, disconnected);
  }
  if (ops_fail || end == RankEnd::kLost) logRecent(job);
}

// ----------------------------------------------------------------- sleeping

bool DataPlane::prepareSleep(std::span<JobSchedule* const> jobs) {
  SteadyClock::time_point deadline = SteadyClock::time_point::max();
  bool waiting_on_gpu = false;
  for (JobSchedule* job : jobs) {
    const JobCollectives& collectives = job->collectives;
    const bool polled = !collectives.executor || !collectives.executor->wakesTheLoop();
    waiting_on_gpu = waiting_on_gpu || (polled && (collectives.draining || (collectives.validated && !collectives.running)));
    // The next timeout: a matched op that has not started counts from its
    // match; a running one has none of the data plane's (its executor's own
    // bound it); else from the oldest submission.
    if (collectives.validated && !collectives.running) {
      deadline = std::min(deadline, collectives.matched + config_.collective_timeout);
    }
    for (RankSchedule& rank : job->ranks) {
      if (!rank.ops.empty() && !collectives.validated) {
        const auto since = std::max(rank.ops.front().submitted, job->collectives.finished);
        deadline = std::min(deadline, since + config_.collective_timeout);
      }
      if (!rank.plane) continue;
      SessionPlane& plane = *rank.plane;
      plane.rings.setSleeping(true);
      // A submission that cannot be taken yet (its client has not reaped its
      // completions) is no reason to stay awake: reaping needs no daemon.
      if (plane.rings.hasSubmission() && plane.rings.roomToAnswer()) return false;
    }
  }
  if (waiting_on_gpu && !gpu_poll_armed_) {
    gpu_poll_armed_ = true;
    gpu_poll_timer_.expires_after(kGpuPollInterval);
    gpu_poll_timer_.async_wait([this](const asio::error_code&) { gpu_poll_armed_ = false; });
  }
  if (deadline != SteadyClock::time_point::max() && deadline != armed_deadline_) {
    // Wake up for the earliest collective timeout; the loop's next poll
    // notices. Re-armed only when the deadline changes: re-arming cancels
    // the previous wait, whose handler would wake the loop for nothing.
    armed_deadline_ = deadline;
    timeout_timer_.expires_at(deadline);
    timeout_timer_.async_wait([this](const asio::error_code& error) {
      if (!error) armed_deadline_ = SteadyClock::time_point::max();
    });
  }
  return true;
}

void DataPlane::endSleep(std::span<JobSchedule* const> jobs) {
  for (JobSchedule* job : jobs) {
    for (RankSchedule& rank : job->ranks) {
      if (rank.plane) rank.plane->rings.setSleeping(false);
    }
  }
}

void DataPlane::stop() {
  gpu_poll_timer_.cancel();
  timeout_timer_.cancel();
  armed_deadline_ = SteadyClock::time_point::max();
}

// ----------------------------------------------------------------- messages

std::string DataPlane::mismatchMessage(const JobSchedule& job) {
  // Ranks that submitted the same op are listed together ("ranks 0-6
  // allGather(...); rank 7 barrier"), so the message names every op even for
  // large jobs within a completion's message slot.
  std::string text = "collective #" + std::to_string(job.collectives.next_sequence) + " does not match across ranks:";
  std::vector<bool> listed(job.localCount(), false);
  for (std::uint32_t r = 0; r < job.localCount(); ++r) {
    if (listed[r]) continue;
    const ipc::Submission& op = job.ranks[r].ops.front().submission;
    std::vector<std::uint32_t> same;
    for (std::uint32_t other = r; other < job.localCount(); ++other) {
      if (!listed[other] && sameOp(job.ranks[other].ops.front().submission, op)) {
        listed[other] = true;
        same.push_back(job.globalRank(other));
      }
    }
    text += std::string(same.size() > 1 ? " ranks " : " rank ") + rankRanges(same) + " " + describe(job, op) + ";";
  }
  text.pop_back();
  return text;
}

std::string DataPlane::describe(const JobSchedule& job, const ipc::Submission& submission) {
  ipc::OpCode op{};
  if (!ipc::opCodeFrom(submission.op, op)) return "an invalid op (code " + std::to_string(submission.op) + ")";
  std::string text(ipc::toString(op));
  if (op == ipc::OpCode::kBarrier) return text;
  const std::string* name = job.groupName(submission.group_id);
  text += "(group " + (name != nullptr ? "'" + *name + "'" : std::to_string(submission.group_id) + " (unknown)");
  if (op == ipc::OpCode::kReduceScatter || op == ipc::OpCode::kAllReduce) {
    text += submission.reduce == static_cast<std::uint8_t>(ipc::ReduceMode::kSum) ? ", sum"
            : submission.reduce == static_cast<std::uint8_t>(ipc::ReduceMode::kAvg)
                ? ", avg"
                : ", reduce mode " + std::to_string(submission.reduce);
    if (submission.pre_scale != 1.0F) text += ", pre " + shortFloat(submission.pre_scale);
    if (submission.post_scale != 1.0F) text += ", post " + shortFloat(submission.post_scale);
    if ((submission.flags & ipc::kFlagAccumulate) != 0) text += ", accumulate";
  }
  if (op == ipc::OpCode::kBroadcast) text += ", root " + std::to_string(submission.root);
  return text + ")";
}

}  // namespace dbuf::daemon
