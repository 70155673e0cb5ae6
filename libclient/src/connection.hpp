#pragma once
// The one connection a Client and its Groups share: the socket (request /
// reply with request ids, daemon errors turned into dbuf::Error values) and
// the session's rings (submit, reap, wait). Not thread-safe.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dbuf/client.hpp"
#include "dbuf/common/result.hpp"
#include "dbuf/common/shared_memory.hpp"
#include "dbuf/common/unique_fd.hpp"
#include "dbuf/ipc/protocol.hpp"
#include "dbuf/ipc/ring.hpp"
#include "dbuf/ipc/socket.hpp"
#include "daemon_watch.hpp"
#include "dbuffer_mapping.hpp"
#include "stream_order.hpp"

namespace dbuf {

class Connection {
 public:
  Connection(UniqueFd socket, std::chrono::milliseconds timeout, std::function<bool()> interrupted = {})
      : socket_(std::move(socket)), timeout_(timeout), interrupted_(std::move(interrupted)) {}

  /// Sends `request` and waits for its reply (frames for other request ids are
  /// not expected: one request at a time). An ErrorReply becomes an Error
  /// (its code through ipc::fromWire, its ranks).
  [[nodiscard]] Result<ipc::ReceivedFrame> call(const ipc::Message& request,
                                                std::optional<std::chrono::milliseconds> timeout);
  /// Sends `request` without waiting for its reply, for a request that only
  /// a client's bug makes dbufd refuse (a slot release after the group's ops
  /// were drained). Its reply is read by a later call() or wait; if it is a
  /// refusal, the connection is lost with dbufd's reason (the client's state
  /// and dbufd's no longer agree), and the next call or wait says so.
  [[nodiscard]] Result<void> post(const ipc::Message& request);

  [[nodiscard]] std::chrono::milliseconds defaultTimeout() const noexcept { return timeout_; }
  void close() noexcept;
  /// Whether a request can still go out: not closed or lost here, and not
  /// hung up by dbufd (which closes a connection whose Hello it refused, or
  /// that said none within its handshake deadline).
  [[nodiscard]] bool open() const noexcept;

  /// How the connection was made (Client::attach makes another like it in
  /// place of one that is no longer open()).
  ClientOptions origin;

  /// Maps the session segment the daemon sent with its Welcome.
  [[nodiscard]] Result<void> openRings(const ipc::Welcome& welcome, std::vector<UniqueFd>& fds);
  /// Puts `entry` (its handle is filled in) on the submission ring.
  [[nodiscard]] Result<OpHandle> submit(ipc::Submission entry, const SubmitOptions& options);
  [[nodiscard]] Result<OpResult> wait(OpHandle handle, std::optional<std::chrono::milliseconds> timeout);
  /// Nobody will wait for `handle`: its result is dropped when it completes
  /// (a drain still waits for it). Unknown handles are ignored.
  void abandon(OpHandle handle) noexcept;
  /// The blocking form of every op: waits for what `submitted` returned, or
  /// passes on why it could not be submitted.
  [[nodiscard]] Result<void> complete(Result<OpHandle> submitted, std::optional<std::chrono::milliseconds> timeout);
  /// Waits until none of this client's ops on `group_id` is in flight.
  [[nodiscard]] Result<void> drain(std::uint32_t group_id, std::optional<std::chrono::milliseconds> timeout);
  [[nodiscard]] std::uint32_t inFlight() const noexcept { return in_flight_; }

  /// Called on detach, after the daemon was told: every group of this
  /// connection unmaps its memory (registered by the groups themselves).
  std::vector<std::function<void()>*> on_detach;

  /// A group's slot going back once a point on a CUDA stream is reached
  /// (Group::reshardOnStream).
  class DeferredRelease {
   public:
    virtual ~DeferredRelease() = default;
    /// Unmaps and gives the slot back if the stream has passed the point
    /// (with `wait`: once it has); false while it has not. Either way but
    /// false, the release is over (done, or failed with the error).
    [[nodiscard]] virtual Result<bool> finishRelease(bool wait) = 0;
  };
  /// Oldest first; a group adds and removes itself.
  std::vector<DeferredRelease*> deferred_releases;

  /// A slot of the rank's pool, as dbufd granted it: its index, and the file
  /// that holds its memory now (dbufd replaces it to grow the slot).
  struct SlotIdentity {
    std::uint32_t index = 0;
    FileIdentity file;
    friend bool operator==(const SlotIdentity&, const SlotIdentity&) = default;
  };
  /// A group that may keep a released slot mapped (keep_slot_mappings).
  class KeptSlot {
   public:
    virtual ~KeptSlot() = default;
    /// Unmaps the kept slot if it is `granted`'s index in another file: dbufd
    /// replaced that slot's memory, and no mapping may keep the old pages.
    virtual void forgetIfReplaced(const SlotIdentity& granted) noexcept = 0;
  };
  /// Groups add and remove themselves.
  std::vector<KeptSlot*> kept_slots;
  /// Finishes the deferred releases whose streams are past their points
  /// (every one, waiting for its stream, with `wait`); the first error.
  [[nodiscard]] Result<void> finishReleases(bool wait);

  // Filled by attach().
  std::uint32_t rank = 0;
  std::uint32_t pool_slots = 0;     ///< the rank's pool in dbufd (AcquireSlot::grow's slots come after)
  bool keep_slot_mappings = false;  ///< AttachOptions::keep_slot_mappings, on host memory
  std::uint64_t instance_id = 0;
  MemorySite memory;  ///< where the daemon puts this session's DBuffers
  bool attached = false;
  bool reattached = false;

 private:
  /// What became of a submitted op; slot handle % capacity.
  struct OpRecord {
    std::uint64_t handle = 0;
    std::uint32_t group_id = 0;
    bool done = false;
    bool abandoned = false;  // nobody will wait: freed when it completes
    std::uint16_t status = 0;
    std::string message;               // only for failed ops
    std::vector<std::uint32_t> ranks;  // only for failed ops: the first ipc::kCompletionRanks the error names
    OpResult result;
  };

  /// Moves every available completion into its record.
  void reap();
  /// Waits for a completion until `deadline`, sleeping in short slices to
  /// notice a daemon that went away (its socket says so). False on timeout.
  [[nodiscard]] Result<bool> awaitCompletion(ipc::Clock::time_point deadline);
  [[nodiscard]] Result<void> checkAlive();
  /// kCancelled when the client's interrupt check says so.
  [[nodiscard]] Result<void> checkInterrupt() const;
  /// Waits until the socket has something to read (kTimeout at `deadline`,
  /// kCancelled when interrupted), in slices of kInterruptPeriod.
  [[nodiscard]] Result<void> awaitReadable(ipc::Clock::time_point deadline);
  /// Closes the socket (stream ordering stopped and released first).
  void dropSocket() noexcept;
  /// Sends an encoded request; on failure the connection is lost (with the
  /// daemon's goodbye, if it said one).
  [[nodiscard]] Result<void> send(const ipc::Message& request, std::uint64_t id, ipc::Clock::time_point deadline);
  /// A frame that answers no call in progress: the reply to a posted request
  /// (taken off posted_; a refusal loses the connection), or a stale reply
  /// of an abandoned call (ignored). Any other frame loses the connection.
  [[nodiscard]] Result<void> settle(const ipc::ReceivedFrame& frame);
  /// Queues the next stream-ordered op's ready / done-wait on `stream`;
  /// its ticket.
  [[nodiscard]] Result<std::uint64_t> orderOnStream(void* stream);

  UniqueFd socket_;
  std::chrono::milliseconds timeout_;
  std::function<bool()> interrupted_;  // ClientOptions::interrupted
  std::uint64_t next_request_ = 1;
  std::string lost_;  // why the connection is unusable, once it is
  std::vector<std::uint64_t> posted_;  // ids of posted requests whose replies were not read yet

  Mapping segment_;
  UniqueFd doorbell_;  // the daemon's eventfd
  ipc::ClientRings rings_;
  // Set, and the rings' waits woken, by hang_up_watch_ once the daemon's end
  // of the socket closed: the next call learns it at once, not within a
  // kAliveCheckPeriod.
  std::atomic<bool> hung_up_{false};
  std::unique_ptr<DaemonWatch> hang_up_watch_;  // while the rings are open
  std::unique_ptr<StreamOrder> stream_order_;  // at the first stream-ordered op; its page is in segment_
  std::chrono::microseconds busy_poll_{0};
  std::vector<OpRecord> records_;
  std::uint64_t next_handle_ = 1;
  std::uint32_t in_flight_ = 0;
};

}  // namespace dbuf
