#pragma once
// A job across nodes on GPUs (CUDA builds): its NCCL communicator over every
// node's ranks, made or found idle at each meeting of the nodes on the job's
// link thread (node_link.hpp), and left there for the nccl executor's loop.

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "cluster.hpp"
#include "dbuf/gpu/nccl.hpp"
#include "node_executor.hpp"
#include "node_link.hpp"

namespace dbuf::daemon {

/// A job across nodes' NCCL communicator, and what it is kept under
/// between jobs (IdleCommunicators).
struct MeetingComms {
  std::shared_ptr<gpu::LocalComms> comms;  ///< ends by ncclCommAbort (abortedWhenDropped)
  std::uint64_t id = 0;                    ///< agreed by every node's daemon
  std::string key;                         ///< the daemons, the job's layout, this node's GPUs
};

/// What an NcclExecutor of a job across nodes has besides its GPUs.
struct AcrossNodes {
  /// Where the link thread leaves each meeting's communicator for the loop.
  struct Made {
    std::mutex mutex;
    std::optional<MeetingComms> latest;
  };
  std::unique_ptr<NodeSync> sync;
  std::shared_ptr<Made> made = std::make_shared<Made>();
  std::shared_ptr<IdleCommunicators> idle;  ///< the daemon's
  std::chrono::milliseconds timeout{0};     ///< [timeouts] collective_ms
};

/// The job's after_meeting: the communicator over this set (the daemons,
/// the job's layout, this node's GPUs) that every node's daemon holds idle
/// is used again, with no NCCL set-up (a later job, a job whose rank came
/// back; idleOrNew). Else node 0's daemon puts a new NCCL unique id in the
/// meeting's keys, under the new communicator's id, and every daemon joins
/// its ranks (first_rank..) to it, within the collective timeout. Either is
/// left in `made` for the loop. A failure here, once every node has come,
/// spends the meeting: the nodes meet again, with a new id.
[[nodiscard]] NodeJob::AfterMeeting meetingCommunicator(const NodeJob& job, std::vector<int> devices,
                                                        const AcrossNodes& across);

}  // namespace dbuf::daemon
