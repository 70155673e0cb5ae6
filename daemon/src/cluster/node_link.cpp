#include "node_link.hpp"

#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <spdlog/spdlog.h>

#include <pthread.h>

#include <charconv>
#include <csignal>
#include <exception>
#include <optional>
#include <random>
#include <sstream>
#include <utility>

#include "abandoned_thread.hpp"
#include "rank_text.hpp"

namespace dbuf::daemon {
namespace {

/// A store key's value as this daemon writes it: words separated by spaces.
std::vector<char> encodeWords(const std::vector<std::string>& words) {
  std::string text;
  for (const std::string& word : words) text += (text.empty() ? "" : " ") + word;
  return {text.begin(), text.end()};
}

std::vector<std::string> decodeWords(const std::vector<char>& value) {
  std::istringstream in(std::string(value.begin(), value.end()));
  std::vector<std::string> words;
  for (std::string word; in >> word;) words.push_back(word);
  return words;
}

std::optional<std::uint64_t> number(const std::string& text) {
  std::uint64_t value = 0;
  const auto parsed = std::from_chars(text.data(), text.data() + text.size(), value);
  if (parsed.ec != std::errc{} || parsed.ptr != text.data() + text.size()) return std::nullopt;
  return value;
}

/// Gloo reports failures as exceptions: converted here, in one place. A
/// timeout is Gloo's IoException whose text says so (it has no type of its
/// own); everything else means the connection to a peer is gone.
Error glooError(const std::exception& error, const std::string& doing) {
  const std::string text = error.what();
  const bool timed_out = text.find("Timed out") != std::string::npos || text.find("timed out") != std::string::npos;
  return Error{timed_out ? ErrorCode::kTimeout : ErrorCode::kUnavailable, doing + ": " + text, {}};
}

}  // namespace

Result<IdleCommunicators::Entry> idleOrNew(
    const NodeJob::Meeting& meeting, const std::string& kind, IdleCommunicators& idle, const std::string& key,
    std::uint64_t proposal, std::chrono::milliseconds timeout,
    const std::function<Result<std::shared_ptr<void>>(std::uint64_t id)>& make) {
  const NodeLayout& layout = meeting.layout;
  // Ours until it is chosen; else back to the idle ones (also when the
  // store throws), for a later meeting that agrees on it.
  std::optional<IdleCommunicators::Entry> held = idle.take(key);
  struct PutBack {
    IdleCommunicators& idle;
    const std::string& key;
    std::optional<IdleCommunicators::Entry>& entry;
    ~PutBack() {
      if (entry) idle.put(key, std::move(*entry));
    }
  } put_back{idle, key, held};
  const std::uint64_t held_id = held ? held->id : 0;
  meeting.keys.set(kind + "-" + std::to_string(layout.node),
                   encodeWords({std::to_string(held_id), std::to_string(layout.node == 0 ? proposal : 0)}));
  bool same = held_id != 0;
  std::uint64_t proposed_id = 0;
  for (std::uint32_t n = 0; n < layout.nodes(); ++n) {
    const std::string entry = kind + "-" + std::to_string(n);
    meeting.keys.wait({entry}, timeout);
    const std::vector<std::string> words = decodeWords(meeting.keys.get(entry));
    const auto id = words.size() == 2 ? number(words[0]) : std::nullopt;
    const auto proposed = words.size() == 2 ? number(words[1]) : std::nullopt;
    if (!id || !proposed) {
      return makeError(ErrorCode::kConflict, "the store's " + kind + " entry of " + layout.describeNode(n) +
                                                 " is not one this version understands");
    }
    same = same && *id == held_id;
    if (n == 0) proposed_id = *proposed;
  }
  if (same) return std::exchange(held, std::nullopt).value();
  auto made = make(proposed_id);
  if (!made) return std::move(made).error();
  return IdleCommunicators::Entry{proposed_id, std::move(*made)};
}

std::string NodeLayout::describeNode(std::uint32_t n) const {
  return "node " + std::to_string(n) + " (" + rankSpan(firstRank(n), rankCount(n)) + ")";
}

std::vector<std::uint32_t> NodeLayout::ranksOf(std::uint32_t n) const {
  std::vector<std::uint32_t> ranks;
  for (std::uint32_t r = firstRank(n); r < first_ranks[n + 1]; ++r) ranks.push_back(r);
  return ranks;
}

Watchdog::Watchdog() : thread_([this] { run(); }) {}

Watchdog::~Watchdog() {
  {
    const std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

void Watchdog::arm(std::vector<gloo::transport::UnboundBuffer*> buffers,
                   std::chrono::steady_clock::time_point deadline) {
  {
    const std::lock_guard lock(mutex_);
    buffers_ = std::move(buffers);
    deadline_ = deadline;
    fired_ = false;
  }
  changed_.notify_all();
}

bool Watchdog::disarm() {
  const std::lock_guard lock(mutex_);
  buffers_.clear();
  deadline_ = std::chrono::steady_clock::time_point::max();
  return std::exchange(fired_, false);
}

void Watchdog::run() {
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    if (buffers_.empty()) {
      changed_.wait(lock);
      continue;
    }
    if (changed_.wait_until(lock, deadline_) == std::cv_status::timeout && !buffers_.empty() &&
        std::chrono::steady_clock::now() >= deadline_) {
      // Under the lock: disarm() cannot return (and the buffers go) meanwhile.
      for (gloo::transport::UnboundBuffer* buffer : buffers_) {
        buffer->abortWaitRecv();
        buffer->abortWaitSend();
      }
      fired_ = true;
      buffers_.clear();
    }
  }
}

struct NodeLink::State {
  NodeJob job;
  ClusterContext cluster;  // its config pointer is not used: the thread may outlive the daemon's Config
  std::string address;     // [cluster] address
  std::chrono::milliseconds wait_limit{0};  // [timeouts] collective_ms

  mutable std::mutex mutex;
  std::condition_variable wake_thread;
  struct Posted {
    Step step;
    std::shared_ptr<Ticket> ticket;
    std::optional<Error> breaks;  ///< a breakLink() marker instead of a step
  };
  std::deque<Posted> steps;
  std::size_t unfinished = 0;  // posted and not ended
  bool stopping = false;
  std::optional<Error> broken;

  std::atomic<bool> connected{false};
  NodeLayout layout;  // written once, before `connected`
  std::vector<std::string> identities;  // of each node's daemon
  std::shared_ptr<Communicator> communicator;
  std::uint32_t tag = 0;
  bool reused = false;
  /// Set when the NodeLink goes while a step still runs: counted by
  /// abandonedThreads() until the thread ends (and with it this state).
  std::unique_ptr<AbandonedThread> abandoned;
  Watchdog watchdog;

  [[nodiscard]] std::chrono::milliseconds timeout() const { return wait_limit; }
  [[nodiscard]] std::string identity() const { return address + "/" + std::to_string(cluster.instance_id); }

  void run();
  Result<void> runStep(const Step& step, const std::optional<Error>& broken_now);
  /// connect(); a later meeting tries until it succeeds or the link goes.
  Result<void> meet();
  /// One try at the meeting; `everyone_came` once every node's daemon has
  /// announced itself in the meeting's keys.
  Result<void> connect(bool& everyone_came);
  Result<void> findNodes(gloo::rendezvous::Store& store);
  Result<void> agreeOnCommunicator(gloo::rendezvous::Store& store, const std::string& key);
  Result<std::shared_ptr<Communicator>> makeCommunicator(gloo::rendezvous::Store& store, std::uint64_t id) const;
};

NodeLink::NodeLink(NodeJob job, ClusterContext cluster) : state_(std::make_shared<State>()) {
  state_->job = std::move(job);
  state_->address = cluster.config->cluster_address;
  state_->wait_limit = cluster.config->collective_timeout;
  state_->cluster = std::move(cluster);
  state_->cluster.config = nullptr;
  thread_ = std::thread([state = state_] { state->run(); });
}

NodeLink::~NodeLink() {
  bool busy = false;
  {
    const std::lock_guard lock(state_->mutex);
    state_->stopping = true;
    busy = state_->unfinished > 0;
  }
  state_->wake_thread.notify_all();
  if (!busy) {
    thread_.join();
    return;
  }
  // A step is in a Gloo call, which the watchdog bounds: it must not hold
  // the daemon's loop. The thread owns what it touches (the shared state).
  state_->abandoned = std::make_unique<AbandonedThread>();
  thread_.detach();
}

std::shared_ptr<NodeLink::Ticket> NodeLink::post(Step step) {
  auto ticket = std::make_shared<Ticket>();
  {
    const std::lock_guard lock(state_->mutex);
    state_->steps.push_back({std::move(step), ticket, std::nullopt});
    ++state_->unfinished;
  }
  state_->wake_thread.notify_all();
  return ticket;
}

bool NodeLink::idle() const {
  const std::lock_guard lock(state_->mutex);
  return state_->unfinished == 0;
}

bool NodeLink::connected() const noexcept {
  return state_->connected.load(std::memory_order_acquire);
}

std::optional<Error> NodeLink::broken() const {
  const std::lock_guard lock(state_->mutex);
  return state_->broken;
}

const NodeLayout& NodeLink::layout() const {
  return state_->layout;
}

void NodeLink::breakLink(const Error& why) {
  {
    const std::lock_guard lock(state_->mutex);
    state_->steps.push_back({nullptr, std::make_shared<Ticket>(), why});
    ++state_->unfinished;
  }
  state_->wake_thread.notify_all();
}

void NodeLink::State::run() {
  // Gloo writes to its sockets without MSG_NOSIGNAL: a write to a daemon
  // that died would raise SIGPIPE, whose default action ends dbufd. The
  // signal goes to the writing thread, which is this one or the Gloo device
  // thread it creates (which inherits this mask): blocked here, the write
  // fails with EPIPE instead, and Gloo reports it.
  sigset_t pipe;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
  for (;;) {
    Posted next;
    std::optional<Error> broken_now;
    {
      std::unique_lock lock(mutex);
      wake_thread.wait(lock, [&] { return stopping || !steps.empty(); });
      if (steps.empty()) return;  // stopping, nothing left
      next = std::move(steps.front());
      steps.pop_front();
      if (next.breaks && !broken) broken = next.breaks;
      broken_now = broken;
    }
    if (!next.breaks) next.ticket->result = runStep(next.step, broken_now);
    next.ticket->done.store(true, std::memory_order_release);
    {
      const std::lock_guard lock(mutex);
      --unfinished;
    }
    if (cluster.waker) cluster.waker->wake();
  }
}

Result<void> NodeLink::State::runStep(const Step& step, const std::optional<Error>& broken_now) {
  if (broken_now) return *broken_now;
  if (!connected.load(std::memory_order_acquire)) {
    if (auto made = meet(); !made) return made;
  }
  try {
    return step(LinkChannel{communicator->context, *communicator, tag, timeout(), layout, watchdog});
  } catch (const LinkTimeout& late) {
    // Not the communicator's fault: its other jobs go on. This job's tag may
    // still see a late message, so no later step of the job uses it.
    Error failed{ErrorCode::kTimeout, "job " + job.job_id + ": " + late.what(), {}};
    std::string others;
    for (std::uint32_t n = 0; n < layout.nodes(); ++n) {
      if (n == layout.node) continue;
      others += (others.empty() ? "" : ", ") + layout.describeNode(n);
      for (const std::uint32_t rank : layout.ranksOf(n)) failed.ranks.push_back(rank);
    }
    failed.message += " (waiting for " + others + ")";
    const std::lock_guard lock(mutex);
    if (!broken) broken = failed;
    return failed;
  } catch (const std::exception& error) {
    // A transport error (a peer's daemon died, a connection broke): no later
    // step of this job uses the connections, nor does a later job.
    Error failed = glooError(error, "job " + job.job_id + ": the exchange with the other nodes failed");
    communicator->failed.store(true);
    const std::lock_guard lock(mutex);
    if (!broken) broken = failed;
    return failed;
  }
}

Result<void> NodeLink::State::meet() {
  constexpr auto kPause = std::chrono::seconds(1);  // between tries that fail at once (a store not there yet)
  for (bool first_try = true;; first_try = false) {
    bool everyone_came = false;
    auto made = connect(everyone_came);
    if (!made && everyone_came) {
      // A node may have gone on with what this one did not finish (its
      // Gloo connections, its NCCL set-up): this meeting's keys are spent.
      // The link is lost, and the nodes meet again under the next one's.
      const std::lock_guard lock(mutex);
      if (!broken) broken = made.error();
      return made;
    }
    if (made || job.meeting == 0) return made;
    if (first_try) {
      spdlog::info("job {}: meeting {} of its nodes: {}; trying again until they come", job.job_id, job.meeting,
                   made.error().message);
    }
    std::unique_lock lock(mutex);
    if (wake_thread.wait_for(lock, kPause, [&] { return stopping; })) return made;
  }
}

Result<void> NodeLink::State::connect(bool& everyone_came) {
  const auto started = std::chrono::steady_clock::now();
  auto store = openStore(job.store);
  if (!store) return std::move(store).error().withContext("job " + job.job_id);
  // Keys are the job's, the run's when its ranks gave a prefix, and the
  // meeting's after the first.
  gloo::rendezvous::PrefixStore keys("dbuf/" + job.job_id + (job.store.prefix.empty() ? "" : "/" + job.store.prefix) +
                                         (job.meeting == 0 ? "" : "/meeting-" + std::to_string(job.meeting)),
                                     **store);
  try {
    if (auto found = findNodes(keys); !found) return found;
    everyone_came = true;
    std::string key;
    for (const std::string& identity : identities) key += (key.empty() ? "" : ",") + identity;
    if (auto agreed = agreeOnCommunicator(keys, key); !agreed) return agreed;
    if (job.after_meeting) {
      if (auto set_up = job.after_meeting(NodeJob::Meeting{keys, layout, key, job.meeting}); !set_up) {
        return std::move(set_up).error().withContext("job " + job.job_id + ", setting up its nodes");
      }
    }
  } catch (const std::exception& error) {
    return glooError(error, "job " + job.job_id + ": meeting the other nodes' daemons");
  }
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - started);
  spdlog::info("job {}: {} of {} across nodes, reached at {}; communicator {:016x} ({}) in {} ms{}", job.job_id,
               layout.describeNode(layout.node), layout.nodes(), address, communicator->id,
               reused ? "reused" : "new", took.count(),
               job.meeting == 0 ? "" : " (meeting " + std::to_string(job.meeting) + ")");
  connected.store(true, std::memory_order_release);
  return {};
}

Result<void> NodeLink::State::findNodes(gloo::rendezvous::Store& store) {
  // Each daemon announces its node under the node's first rank; the nodes
  // are then found in rank order from rank 0, each entry saying where the
  // next one starts. What another daemon wrote is checked like any input.
  const std::string mine = "node-at-" + std::to_string(job.first_rank);
  store.set(mine, encodeWords({std::to_string(job.local_count), identity()}));
  layout.first_ranks.clear();
  identities.clear();
  for (std::uint32_t first = 0; first < job.world_size;) {
    const std::string key = "node-at-" + std::to_string(first);
    store.wait({key}, timeout());
    const std::vector<std::string> words = decodeWords(store.get(key));
    const auto count = words.size() == 2 ? number(words[0]) : std::nullopt;
    if (!count || *count == 0 || *count > job.world_size - first) {
      return makeError(ErrorCode::kConflict, "job " + job.job_id + ": the store's entry for the node of rank " +
                                                 std::to_string(first) + " is not a node this version understands");
    }
    if (first == job.first_rank && (*count != job.local_count || words[1] != identity())) {
      // (What the entry holds is not repeated: the store is the user's, and
      // a file there could be a link to one only the daemon may read.)
      return makeError(ErrorCode::kConflict, "job " + job.job_id + ": another daemon announced the node of " +
                                                 rankSpan(first, job.local_count) +
                                                 " in the store (two nodes claim the same ranks, or the store holds "
                                                 "an earlier run's keys: give each run its own #PREFIX)");
    }
    if (first < job.first_rank && first + *count > job.first_rank) {
      return makeError(ErrorCode::kConflict, "job " + job.job_id + ": the node of rank " + std::to_string(first) +
                                                 " has " + std::to_string(*count) + " ranks, which overlap this node's " +
                                                 rankSpan(job.first_rank, job.local_count));
    }
    if (first == job.first_rank) layout.node = static_cast<std::uint32_t>(identities.size());
    layout.first_ranks.push_back(first);
    identities.push_back(words[1]);
    first += static_cast<std::uint32_t>(*count);
  }
  layout.first_ranks.push_back(job.world_size);
  return {};
}

Result<void> NodeLink::State::agreeOnCommunicator(gloo::rendezvous::Store& store, const std::string& key) {
  // Every daemon says which communicator over these daemons it has (0:
  // none). The same one everywhere: it is reused, with a tag that node 0's
  // daemon hands out (node 0 is in every job over this key, so its counter
  // keeps the jobs sharing the communicator apart). Otherwise a new one is
  // made, under the id node 0 proposes.
  const std::shared_ptr<Communicator> cached = cluster.communicators->find(key);
  // (Proposed once per meeting: a meeting that fails after every node came
  // is not tried again, see meet().)
  const std::uint64_t cached_id = cached ? cached->id : 0;
  std::uint64_t proposed_id = 0;
  std::uint32_t proposed_tag = 0;
  if (layout.node == 0) {
    proposed_id = std::random_device{}() | (std::uint64_t{std::random_device{}()} << 32) | 1;
    if (cached) proposed_tag = cached->next_channel.fetch_add(1);
  }
  store.set("communicator-" + std::to_string(layout.node),
            encodeWords({std::to_string(cached_id), std::to_string(proposed_id), std::to_string(proposed_tag)}));
  std::vector<std::uint64_t> ids;
  std::uint64_t new_id = 0;
  std::uint32_t tag_from_leader = 0;
  for (std::uint32_t n = 0; n < layout.nodes(); ++n) {
    const std::string entry = "communicator-" + std::to_string(n);
    store.wait({entry}, timeout());
    const std::vector<std::string> words = decodeWords(store.get(entry));
    const auto id = words.size() == 3 ? number(words[0]) : std::nullopt;
    const auto proposal = words.size() == 3 ? number(words[1]) : std::nullopt;
    const auto tag_word = words.size() == 3 ? number(words[2]) : std::nullopt;
    if (!id || !proposal || !tag_word || *tag_word > UINT32_MAX) {
      return makeError(ErrorCode::kConflict, "job " + job.job_id + ": the store's communicator entry of " +
                                                 layout.describeNode(n) + " is not one this version understands");
    }
    ids.push_back(*id);
    if (n == 0) {
      new_id = *proposal;
      tag_from_leader = static_cast<std::uint32_t>(*tag_word);
    }
  }
  const bool same = cached && std::all_of(ids.begin(), ids.end(), [&](std::uint64_t id) { return id == cached->id; });
  if (same && tag_from_leader != 0) {
    communicator = cached;
    tag = tag_from_leader;
    reused = true;
    cluster.communicators->countReuse();
    return {};
  }
  auto made = makeCommunicator(store, new_id);
  if (!made) return std::move(made).error();
  communicator = std::move(*made);
  tag = communicator->next_channel.fetch_add(1);
  cluster.communicators->insert(key, communicator);
  return {};
}

Result<std::shared_ptr<Communicator>> NodeLink::State::makeCommunicator(gloo::rendezvous::Store& store,
                                                                         std::uint64_t id) const {
  auto made = std::make_shared<Communicator>();
  made->id = id;
  gloo::transport::tcp::attr listen;
  listen.hostname = address;
  try {
    made->device = gloo::transport::tcp::CreateDevice(listen);
  } catch (const std::exception& error) {
    return makeError(ErrorCode::kUnavailable, "cannot listen on [cluster] address " + address + ": " + error.what());
  }
  auto context = std::make_shared<gloo::rendezvous::Context>(static_cast<int>(layout.node),
                                                             static_cast<int>(layout.nodes()));
  context->setTimeout(timeout());
  gloo::rendezvous::PrefixStore mesh("gloo-" + std::to_string(id), store);
  context->connectFullMesh(mesh, made->device);
  made->context = std::move(context);
  return made;
}

}  // namespace dbuf::daemon
