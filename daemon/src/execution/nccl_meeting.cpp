#include "nccl_meeting.hpp"

#include <gloo/rendezvous/store.h>
#include <spdlog/spdlog.h>

#include <condition_variable>
#include <cstring>
#include <random>
#include <system_error>
#include <thread>
#include <utility>

#include "abandoned_thread.hpp"

namespace dbuf::daemon {
namespace {

/// A communicator across nodes ends with ncclCommAbort, never
/// ncclCommDestroy: it is dropped when its peers may be gone, and destroy
/// could wait for them.
std::shared_ptr<gpu::LocalComms> abortedWhenDropped(gpu::LocalComms comms) {
  auto owned = std::make_unique<gpu::LocalComms>(std::move(comms));
  return {owned.release(), [](gpu::LocalComms* dropped) {
            dropped->fail(Error{ErrorCode::kUnavailable, "no longer used", {}});
            delete dropped;  // NOLINT(cppcoreguidelines-owning-memory): the shared_ptr's deleter
          }};
}

std::string numbersText(const auto& numbers) {
  std::string text;
  for (const auto n : numbers) text += (text.empty() ? "" : ",") + std::to_string(n);
  return text;
}

/// LocalComms::join on a thread of its own, for at most `timeout`: NCCL's
/// set-up blocks until every rank has joined, and a node whose daemon died
/// (or failed before joining) would hold the link's thread there for good.
/// A set-up that takes longer is left to its thread (counted by
/// AbandonedThread), which ends what it made if it ever returns.
Result<gpu::LocalComms> joinWithin(std::vector<int> devices, const ncclUniqueId& id, int world, int first_rank,
                                   std::chrono::milliseconds timeout) {
  struct Joining {
    std::mutex mutex;
    std::condition_variable done;
    std::optional<Result<gpu::LocalComms>> result;
    std::unique_ptr<AbandonedThread> abandoned;  // set when nobody waits any more
  };
  auto joining = std::make_shared<Joining>();
  try {
    std::thread([joining, devices = std::move(devices), id, world, first_rank] {
      Result<gpu::LocalComms> joined = gpu::LocalComms::join(devices, id, world, first_rank);
      const std::lock_guard lock(joining->mutex);
      if (joining->abandoned && joined) joined->fail(Error{ErrorCode::kTimeout, "set up too late", {}});
      joining->result = std::move(joined);
      joining->done.notify_all();
    }).detach();
  } catch (const std::system_error& error) {
    return makeError(ErrorCode::kUnavailable, std::string("no thread for NCCL's set-up: ") + error.what());
  }
  std::unique_lock lock(joining->mutex);
  if (!joining->done.wait_for(lock, timeout, [&] { return joining->result.has_value(); })) {
    joining->abandoned = std::make_unique<AbandonedThread>();
    return makeError(ErrorCode::kTimeout, "NCCL's set-up (ncclCommInitRank) did not end within " +
                                              std::to_string(timeout.count()) +
                                              " ms: another node's daemon did not join it");
  }
  return std::move(*joining->result);
}

}  // namespace

NodeJob::AfterMeeting meetingCommunicator(const NodeJob& job, std::vector<int> devices, const AcrossNodes& across) {
  return [=, job_id = job.job_id, world = job.world_size, first_rank = job.first_rank, made = across.made,
          idle = across.idle, timeout = across.timeout](const NodeJob::Meeting& meeting) -> Result<void> {
    const NodeLayout& layout = meeting.layout;
    const std::uint64_t proposal =
        layout.node == 0 ? (std::random_device{}() | (std::uint64_t{std::random_device{}()} << 32) | 1) : 0;
    bool joined_new = false;
    const auto join = [&](std::uint64_t id) -> Result<std::shared_ptr<void>> {
      const std::string key = "nccl-id-" + std::to_string(id);
      ncclUniqueId unique{};
      if (layout.node == 0) {
        if (auto r = gpu::ncclStatus((*gpu::nccl())->getUniqueId(&unique), "ncclGetUniqueId"); !r) return r.error();
        meeting.keys.set(key, std::vector<char>(unique.internal, unique.internal + sizeof unique.internal));
      } else {
        meeting.keys.wait({key}, timeout);
        const std::vector<char> value = meeting.keys.get(key);
        if (value.size() != sizeof unique.internal) {
          return makeError(ErrorCode::kConflict, "the store's NCCL id for the job is not one this version understands");
        }
        std::memcpy(unique.internal, value.data(), sizeof unique.internal);
      }
      auto joined = joinWithin(devices, unique, static_cast<int>(world), static_cast<int>(first_rank), timeout);
      if (!joined) return std::move(joined).error();
      joined_new = true;
      return std::shared_ptr<void>(abortedWhenDropped(std::move(*joined)));
    };
    MeetingComms chosen;
    chosen.key = meeting.daemons + "|" + numbersText(layout.first_ranks) + "|" + numbersText(devices);
    auto entry = idleOrNew(meeting, "nccl", *idle, chosen.key, proposal, timeout, join);
    if (!entry) return std::move(entry).error();
    chosen.comms = std::static_pointer_cast<gpu::LocalComms>(std::move(entry->communicator));
    chosen.id = entry->id;
    spdlog::info("job {}: NCCL communicator {:016x} for ranks {}-{} of {} ({})", job_id, chosen.id, first_rank,
                 first_rank + devices.size() - 1, world, joined_new ? "new" : "reused");
    std::optional<MeetingComms> unused;  // one the loop never took: it ends outside the lock
    const std::lock_guard lock(made->mutex);
    unused = std::exchange(made->latest, std::move(chosen));
    return {};
  };
}

}  // namespace dbuf::daemon
