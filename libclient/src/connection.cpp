#include "connection.hpp"

#include <poll.h>

#include <algorithm>
#include <array>
#include <memory>
#include <mutex>
#include <vector>

namespace dbuf {

Result<void> Connection::send(const ipc::Message& request, std::uint64_t id, ipc::Clock::time_point deadline) {
  if (!lost_.empty()) return makeError(ErrorCode::kUnavailable, lost_);
  if (!socket_) return makeError(ErrorCode::kUnavailable, "not connected to dbufd");
  // Encode first: a request over a protocol limit (a tp_dim outside the shape,
  // a name too long...) is the caller's mistake and leaves the connection usable.
  auto encoded = ipc::encodeFrame(request, id);
  if (!encoded) return makeError(ErrorCode::kInvalidArgument, encoded.error().message);
  if (auto sent = ipc::sendAll(socket_.get(), *encoded, {}, deadline); !sent) {
    lost_ = "lost the connection to dbufd: " + sent.error().message;
    // A daemon that stopped said goodbye before closing (after any replies
    // still unread): pass on its reason.
    for (;;) {
      auto frame = ipc::receiveMessage(socket_.get(), ipc::Clock::now());
      if (!frame) break;
      if (const auto* shutdown = std::get_if<ipc::Shutdown>(&frame->message)) {
        lost_ = "dbufd is shutting down: " + shutdown->reason;
        break;
      }
    }
    dropSocket();
    return makeError(ErrorCode::kUnavailable, lost_);
  }
  return {};
}

Result<void> Connection::post(const ipc::Message& request) {
  const std::uint64_t id = next_request_++;
  if (auto sent = send(request, id, ipc::Clock::now() + timeout_); !sent) return sent;
  posted_.push_back(id);
  return {};
}

Result<void> Connection::settle(const ipc::ReceivedFrame& frame) {
  if (const auto* shutdown = std::get_if<ipc::Shutdown>(&frame.message)) {
    lost_ = "dbufd is shutting down: " + shutdown->reason;
    dropSocket();
    return makeError(ErrorCode::kUnavailable, lost_);
  }
  const auto posted = std::find(posted_.begin(), posted_.end(), frame.header.request_id);
  if (posted == posted_.end()) return {};  // stale reply of an abandoned call
  posted_.erase(posted);
  if (const auto* error = std::get_if<ipc::ErrorReply>(&frame.message)) {
    lost_ = "dbufd refused a request this client did not wait for (its state and dbufd's disagree); connection "
            "closed: " + error->message;
    dropSocket();
    return makeError(ErrorCode::kInternal, lost_);
  }
  return {};
}

Result<ipc::ReceivedFrame> Connection::call(const ipc::Message& request,
                                            std::optional<std::chrono::milliseconds> timeout) {
  const auto deadline = ipc::Clock::now() + timeout.value_or(timeout_);
  const std::uint64_t id = next_request_++;
  if (auto sent = send(request, id, deadline); !sent) return std::move(sent).error();
  for (;;) {
    // Waiting for the reply's first byte can be cancelled; a frame that has
    // begun is read whole (a partial one would desynchronise the stream).
    if (auto readable = awaitReadable(deadline); !readable) {
      // The daemon still acts on the request and a late reply could not be
      // told apart from the next call's: the connection is done either way.
      const bool cancelled = readable.error().code == ErrorCode::kCancelled;
      lost_ = cancelled ? "a call to dbufd was interrupted; connection closed"
                        : "dbufd did not answer in time; connection closed";
      dropSocket();
      return makeError(readable.error().code, lost_);
    }
    auto frame = ipc::receiveMessage(socket_.get(), deadline);
    if (!frame) {
      const bool timed_out = frame.error().code == ErrorCode::kTimeout;
      lost_ = timed_out ? "dbufd did not answer in time; connection closed"
                        : "lost the connection to dbufd: " + frame.error().message;
      dropSocket();
      return makeError(timed_out ? ErrorCode::kTimeout : ErrorCode::kUnavailable, lost_);
    }
    if (frame->header.request_id != id || std::holds_alternative<ipc::Shutdown>(frame->message)) {
      if (auto settled = settle(*frame); !settled) return std::move(settled).error();
      continue;
    }
    if (const auto* error = std::get_if<ipc::ErrorReply>(&frame->message)) {
      return Error{ipc::fromWire(error->code), "dbufd: " + error->message, error->ranks};
    }
    return std::move(*frame);
  }
}

Result<void> Connection::awaitReadable(ipc::Clock::time_point deadline) {
  for (;;) {
    const auto slice = std::min<ipc::Clock::duration>(kInterruptPeriod,
                                                      std::max<ipc::Clock::duration>(deadline - ipc::Clock::now(), {}));
    pollfd watch{socket_.get(), POLLIN, 0};
    const int ready = ::poll(&watch, 1, static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(slice).count()));
    if (ready > 0) return {};  // a frame, a hang-up or an error: receiveMessage says which
    if (auto stop = checkInterrupt(); !stop) return stop;
    if (ipc::Clock::now() >= deadline) return makeError(ErrorCode::kTimeout, "dbufd did not answer in time");
  }
}

Result<void> Connection::checkInterrupt() const {
  if (interrupted_ && interrupted_()) return makeError(ErrorCode::kCancelled, "interrupted while waiting for dbufd");
  return {};
}

}  // namespace dbuf

// ----------------------------------------------------------------- rings

namespace dbuf {
namespace {

// Also how often an interrupt check runs (kInterruptPeriod) while a wait sleeps.
constexpr auto kAliveCheckPeriod = kInterruptPeriod;

/// Keeps a closed session's stream counters registered and its segment
/// mapped until the process exits (one segment per session that ordered ops
/// on a stream, released by exit).
void retire(std::unique_ptr<StreamOrder> order, Mapping segment) {
  struct Retired {
    std::unique_ptr<StreamOrder> order;
    Mapping segment;
  };
  static std::mutex mutex;
  // Never destroyed: unregistering at exit could run after CUDA's own teardown.
  static auto* retired = new std::vector<Retired>();  // NOLINT(cppcoreguidelines-owning-memory)
  const std::lock_guard lock(mutex);
  retired->push_back({std::move(order), std::move(segment)});
}

}  // namespace

void Connection::dropSocket() noexcept {
  if (stream_order_) stream_order_->stop();  // its watcher polls the socket, and streams must not wait on a lost daemon
  hang_up_watch_.reset();                    // it polls the socket too, and wakes the rings
  socket_.reset();
}

bool Connection::open() const noexcept {
  if (!socket_ || !lost_.empty()) return false;
  pollfd watch{socket_.get(), POLLRDHUP, 0};
  if (::poll(&watch, 1, 0) <= 0) return true;
  return (watch.revents & (POLLRDHUP | POLLHUP | POLLERR)) == 0;
}

void Connection::close() noexcept {
  attached = false;  // what groups outlive the connection must not call on it
  dropSocket();
  if (stream_order_) {
    // The page stays registered and the segment mapped for the process's
    // life: a stream may not have reached a wait queued on them yet.
    retire(std::move(stream_order_), std::move(segment_));
  }
  rings_ = {};
  segment_.reset();
  doorbell_.reset();
  records_.clear();  // every op in flight is lost with the connection
  in_flight_ = 0;
}

Result<void> Connection::openRings(const ipc::Welcome& welcome, std::vector<UniqueFd>& fds) {
  if (fds.size() != 2) return makeError(ErrorCode::kInternal, "dbufd sent no session segment with its Welcome");
  auto size = fileSize(fds[0].get());
  if (!size) return std::move(size).error();
  if (*size < welcome.segment_bytes || welcome.segment_bytes != ipc::segmentBytes(welcome.ring_capacity)) {
    return makeError(ErrorCode::kInternal, "dbufd sent a session segment of the wrong size");
  }
  hang_up_watch_.reset();  // a watch of earlier rings must not touch the new ones
  auto mapping = Mapping::map(fds[0].get(), welcome.segment_bytes);
  if (!mapping) return std::move(mapping).error();
  auto rings = ipc::ClientRings::attach({mapping->data(), mapping->size()});
  if (!rings) return std::move(rings).error();
  segment_ = std::move(*mapping);
  rings_ = *rings;
  doorbell_ = std::move(fds[1]);
  busy_poll_ = std::chrono::microseconds(welcome.busy_poll_us);
  auto watch = DaemonWatch::start(
      [this] {
        hung_up_.store(true, std::memory_order_release);
        rings_.interruptWait();
      },
      socket_.get());
  if (!watch) return std::move(watch).error();
  hang_up_watch_ = std::move(*watch);
  // Room for a ring's worth of ops in flight plus as many completed ones
  // not waited for yet.
  records_.assign(2 * std::size_t{rings_.capacity()}, OpRecord{});
  return {};
}

Result<void> Connection::checkAlive() {
  if (!lost_.empty()) return makeError(ErrorCode::kUnavailable, lost_);
  if (!socket_ || !segment_.valid()) return makeError(ErrorCode::kUnavailable, "not attached to dbufd");
  // Between calls the daemon writes only the replies to posted requests,
  // and its goodbye.
  for (;;) {
    pollfd watch{socket_.get(), POLLIN | POLLRDHUP, 0};
    if (::poll(&watch, 1, 0) <= 0) return {};
    auto frame = ipc::receiveMessage(socket_.get(), ipc::Clock::now() + timeout_);
    if (!frame) break;  // closed
    if (auto settled = settle(*frame); !settled) return settled;
  }
  lost_ = "lost the connection to dbufd";
  return makeError(ErrorCode::kUnavailable, lost_);
}

void Connection::reap() {
  if (!segment_.valid()) return;  // closed: no rings
  ipc::Completion completion;
  std::array<char, ipc::kCompletionMessageBytes> message{};
  std::size_t message_bytes = 0;
  while (rings_.tryReap(completion, message, message_bytes)) {
    OpRecord& record = records_[completion.handle % records_.size()];
    if (record.handle != completion.handle || record.done) continue;  // not ours: ignore
    --in_flight_;
    if (record.abandoned) {
      record = OpRecord{};  // nobody waits for it: the record is free
      continue;
    }
    record.done = true;
    record.status = completion.status;
    if (completion.status != 0) {
      record.message.assign(message.data(), message_bytes);
      record.ranks = ipc::completionRanks(completion);
    }
    record.result = {completion.sequence, std::chrono::nanoseconds(completion.wait_ns),
                     std::chrono::nanoseconds(completion.run_ns)};
  }
}

void Connection::abandon(OpHandle handle) noexcept {
  if (records_.empty() || handle.id == 0) return;
  OpRecord& record = records_[handle.id % records_.size()];
  if (record.handle != handle.id) return;
  if (record.done) {
    record = OpRecord{};
  } else {
    record.abandoned = true;
  }
}

Result<bool> Connection::awaitCompletion(ipc::Clock::time_point deadline) {
  auto busy_poll = busy_poll_;
  for (;;) {
    const auto slice_end = std::min(deadline, ipc::Clock::now() + kAliveCheckPeriod);
    if (rings_.waitForCompletion(slice_end, busy_poll)) return true;
    busy_poll = {};  // spin once per wait only
    if (auto alive = checkAlive(); !alive) return std::move(alive).error();
    if (auto stop = checkInterrupt(); !stop) return std::move(stop).error();
    if (ipc::Clock::now() >= deadline) return false;
  }
}

Result<OpHandle> Connection::submit(ipc::Submission entry, const SubmitOptions& options) {
  if (hung_up_.load(std::memory_order_acquire)) {
    if (auto alive = checkAlive(); !alive) return std::move(alive).error();
  }
  if (!lost_.empty()) return makeError(ErrorCode::kUnavailable, lost_);
  if (!segment_.valid()) return makeError(ErrorCode::kUnavailable, "not attached to dbufd");
  const auto deadline = ipc::Clock::now() + options.timeout.value_or(timeout_);
  while (in_flight_ == rings_.capacity()) {
    // Back-pressure: room comes back as completions are reaped.
    reap();
    if (in_flight_ < rings_.capacity()) break;
    if (!options.wait_if_full) {
      return makeError(ErrorCode::kWouldBlock, std::to_string(in_flight_) + " ops in flight fill the ring");
    }
    auto arrived = awaitCompletion(deadline);
    if (!arrived) return std::move(arrived).error();
    if (!*arrived) return makeError(ErrorCode::kTimeout, "the ring stayed full: no op completed in time");
  }
  OpRecord& record = records_[next_handle_ % records_.size()];
  if (record.handle != 0) {
    // Its result would be lost: the caller must collect it first.
    return makeError(ErrorCode::kWouldBlock, "op " + std::to_string(record.handle) + " has not been waited for and " +
                                                 std::to_string(records_.size()) +
                                                 " ops were submitted since: wait() for it first");
  }
  if (options.stream) {
    if (entry.op == static_cast<std::uint8_t>(ipc::OpCode::kBarrier) ||
        entry.op == static_cast<std::uint8_t>(ipc::OpCode::kNoop)) {
      return makeError(ErrorCode::kInvalidArgument, "only group collectives can be ordered on a CUDA stream");
    }
    // Queued on the stream before the daemon can see the op (room is known).
    auto ticket = orderOnStream(*options.stream);
    if (!ticket) return std::move(ticket).error();
    entry.flags |= ipc::kFlagStreamOrdered;
    entry.ticket = *ticket;
  }
  entry.handle = next_handle_++;
  record = OpRecord{};
  record.handle = entry.handle;
  record.group_id = entry.group_id;
  // Cannot fail: at most capacity ops are in flight, and the daemon takes a
  // submission only once it has room to complete it.
  if (!rings_.trySubmit(entry)) {
    // A daemon bug. Dropping the connection also makes dbufd poison the
    // counters last, after any done write still in flight.
    lost_ = "dbufd's submission ring was full with room reported (a bug); connection closed";
    dropSocket();
    return makeError(ErrorCode::kInternal, lost_);
  }
  ++in_flight_;
  rings_.wakeDaemon(doorbell_.get());
  return OpHandle{entry.handle};
}

Result<void> Connection::finishReleases(bool wait) {
  Result<void> first_error;
  for (std::size_t i = 0; i < deferred_releases.size();) {
    auto finished = deferred_releases[i]->finishRelease(wait);
    if (finished && !*finished) {
      ++i;
      continue;
    }
    if (!finished && first_error) first_error = std::move(finished).error();
    deferred_releases.erase(deferred_releases.begin() + static_cast<std::ptrdiff_t>(i));
  }
  return first_error;
}

Result<std::uint64_t> Connection::orderOnStream(void* stream) {
  if (memory.kind != ipc::MemoryKind::kCuda) {
    return makeError(ErrorCode::kInvalidArgument,
                     "an op ordered on a CUDA stream needs GPU memory, and dbufd put this session's in host memory "
                     "(its host backend): submit without a stream");
  }
  if (!stream_order_) {
    auto opened = StreamOrder::open(rings_.streamCounters(), memory.device, socket_.get());
    if (!opened) return std::move(opened).error();
    stream_order_ = std::move(*opened);
  }
  return stream_order_->order(stream);
}

Result<OpResult> Connection::wait(OpHandle handle, std::optional<std::chrono::milliseconds> timeout) {
  if (records_.empty()) {
    return makeError(ErrorCode::kUnavailable, lost_.empty() ? "not attached to dbufd" : lost_);
  }
  OpRecord& record = records_[handle.id % records_.size()];
  if (handle.id == 0 || record.handle != handle.id || record.abandoned) {
    return makeError(ErrorCode::kInvalidArgument,
                     "op " + std::to_string(handle.id) + " is not in flight (already waited for, or unknown)");
  }
  const auto deadline = ipc::Clock::now() + timeout.value_or(timeout_);
  for (;;) {
    reap();
    if (record.done) break;
    auto arrived = awaitCompletion(deadline);
    if (!arrived) return std::move(arrived).error();
    if (!*arrived) {
      return makeError(ErrorCode::kTimeout, "op " + std::to_string(handle.id) + " did not complete in time");
    }
  }
  record.handle = 0;  // waited for: the record is free
  if (record.status != 0) {
    return Error{ipc::fromWire(static_cast<ipc::WireError>(record.status)), "dbufd: " + record.message,
                 std::move(record.ranks)};
  }
  return record.result;
}

Result<void> Connection::complete(Result<OpHandle> submitted, std::optional<std::chrono::milliseconds> timeout) {
  if (!submitted) return std::move(submitted).error();
  auto done = wait(*submitted, timeout);
  if (!done) {
    // A wait that timed out or was cancelled leaves the op in flight, and
    // the caller of a blocking form has no handle to wait again with: its
    // record must not stay taken (it would block every later submit).
    abandon(*submitted);
    return std::move(done).error();
  }
  return {};
}

Result<void> Connection::drain(std::uint32_t group_id, std::optional<std::chrono::milliseconds> timeout) {
  const auto deadline = ipc::Clock::now() + timeout.value_or(timeout_);
  const auto pending = [&] {
    return std::count_if(records_.begin(), records_.end(), [&](const OpRecord& record) {
      return record.handle != 0 && !record.done && record.group_id == group_id;
    });
  };
  for (;;) {
    reap();
    const auto left = pending();
    if (left == 0) return {};
    auto arrived = awaitCompletion(deadline);
    if (!arrived) return std::move(arrived).error();
    if (!*arrived) {
      return makeError(ErrorCode::kTimeout,
                       std::to_string(left) + " ops of group " + std::to_string(group_id) + " still in flight");
    }
  }
}

}  // namespace dbuf
