#include "dbuf/daemon/server.hpp"

#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <asio.hpp>
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <random>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "abandoned_thread.hpp"
#include "admin.hpp"
#include "backend.hpp"
#include "dbuf/daemon/lock_file.hpp"
#include "dbuf/daemon/logging.hpp"
#include "jobs.hpp"
#include "metrics.hpp"
#include "session.hpp"

namespace dbuf::daemon {

class Server::Impl final : public SessionHandler {
 public:
  static constexpr std::size_t kMaxSessions = 4096;  // connections, attached or not

  Impl(Config config, LockFile lock, std::uint64_t instance_id)
      : config_(std::move(config)),
        lock_(std::move(lock)),
        instance_id_(instance_id),
        acceptor_(io_),
        signals_(io_),
        heartbeat_(io_),
        shutdown_deadline_(io_),
        jobs_(io_, config_, instance_id) {}

  Result<void> bind() {
    // Bound and listening under a name of its own first, then renamed into
    // place: the socket path appears only once connecting to it works (a
    // client that sees the file is never refused). Binding in place where
    // that name would be too long for a Unix socket.
    const std::string& path = config_.socket_path;
    const std::string staged = stagedSocketPath(path);
    const std::string& bound = staged.empty() ? path : staged;
    // One left by a daemon that crashed with this pid (the lock file beside
    // the socket says no live daemon uses this directory).
    if (!staged.empty()) ::unlink(staged.c_str());
    asio::error_code error;
    const asio::local::stream_protocol::endpoint endpoint(bound);
    acceptor_.open(endpoint.protocol(), error);
    if (!error) acceptor_.bind(endpoint, error);
    if (!error) acceptor_.listen(asio::socket_base::max_listen_connections, error);
    if (error) {
      if (!staged.empty()) ::unlink(staged.c_str());
      return makeError(ErrorCode::kIo, "cannot listen on " + path + ": " + error.message());
    }
    // Anyone may connect; who may do what is decided per peer (SO_PEERCRED)
    // against the tenant table.
    ::chmod(bound.c_str(), 0666);
    if (!staged.empty() && ::rename(staged.c_str(), path.c_str()) != 0) {
      const int saved = errno;
      ::unlink(staged.c_str());
      return makeError(ErrorCode::kIo, "cannot listen on " + path + ": rename: " + std::strerror(saved));
    }
    return {};
  }

  /// A name beside `path` to bind under before renaming into place, or
  /// empty when it would not fit a Unix socket address.
  static std::string stagedSocketPath(const std::string& path) {
    const auto slash = path.rfind('/');
    const std::string dir = slash == std::string::npos ? std::string() : path.substr(0, slash + 1);
    std::string staged = dir + ".dbufd-" + std::to_string(::getpid()) + ".sock";
    return staged.size() < sizeof(sockaddr_un::sun_path) ? staged : std::string();
  }

  void run(bool handle_signals) {
    if (handle_signals) {
      signals_.add(SIGTERM);
      signals_.add(SIGINT);
      signals_.add(SIGHUP);
      waitForSignal();
    }
    accept();
    if (on_heartbeat_) beat();
    {
      const std::lock_guard lock(stats_mutex_);
      running_ = true;
    }
    spdlog::info("dbufd {:016x} listening on {}", instance_id_, config_.socket_path);
    startMetrics();
    serve();
    {
      const std::lock_guard lock(stats_mutex_);
      running_ = false;  // later stats() calls read the state directly; scrapes get nothing
    }
    // Answer the stats() requests and scrapes posted while run() was returning.
    io_.restart();
    io_.poll();
    metrics_.reset();  // (joins its threads: none waits for the loop any more)
    const std::lock_guard lock(stats_mutex_);
    finishShutdown();
  }

  void requestStop() {
    asio::post(io_, [this] { beginShutdown(); });
  }

  void setConfigSource(std::function<Result<Config>()> source) { config_source_ = std::move(source); }

  /// The loop: control-plane events and data-plane polling interleaved.
  /// While anything happened in the last busy_poll, it spins (rings are
  /// answered within a poll pass); then it flags every ring "sleeping" and
  /// blocks in Asio until a socket, a timer or a ring's doorbell (eventfd)
  /// wakes it. Ends once shutdown has released the work guard and nothing
  /// is left to do.
  void serve() {
    using Clock = std::chrono::steady_clock;
    // While spinning, the control plane is polled at most this often: an
    // idle io_.poll() is an epoll_wait system call (~150 ns), which would
    // otherwise sit on every ring round trip's path.
    constexpr auto kControlPollInterval = std::chrono::microseconds(10);
    auto last_work = Clock::now();
    auto last_control_poll = Clock::time_point{};
    while (!io_.stopped()) {
      std::size_t work = 0;
      const auto began = Clock::now();
      if (began - last_control_poll >= kControlPollInterval || stopping_) {
        work += io_.poll();
        last_control_poll = began;
      }
      if (!stopping_) work += jobs_.pollDataPlane();
      if (work > 0) {
        last_work = Clock::now();
        busy_ += last_work - began;  // (a pass that found nothing to do, or a sleep, is not work)
        continue;
      }
      if (Clock::now() - last_work < config_.busy_poll) continue;
      if (!stopping_ && !jobs_.prepareSleep()) {
        jobs_.endSleep();
        continue;
      }
      io_.run_one();
      if (!stopping_) jobs_.endSleep();
      last_work = Clock::now();
    }
  }

  static ServerStats statsOf(const JobTable::Counts& counts) {
    return ServerStats{counts.sessions, counts.jobs, counts.memfds, counts.bytes_in_use};
  }

  ServerStats stats() {
    std::promise<ServerStats> promise;
    auto future = promise.get_future();
    {
      // Not serving (before run() or after its loop ended): nothing else
      // touches the state but run()'s epilogue, which holds the mutex.
      // Serving: ask the loop; run() answers whatever was posted before its
      // loop ended, so a request posted under the mutex is never lost.
      const std::lock_guard lock(stats_mutex_);
      if (!running_) return statsOf(jobs_.counts());
      asio::post(io_, [this, &promise] { promise.set_value(statsOf(jobs_.counts())); });
    }
    return future.get();
  }

  void onMessage(const std::shared_ptr<Session>& session, const ipc::FrameHeader& header,
                 ipc::Message message) override {
    if (stopping_) {
      session->sendError(ipc::WireError::kShuttingDown, "dbufd is shutting down", header.request_id);
      return;
    }
    if (const auto* request = std::get_if<ipc::AdminRequest>(&message)) {
      handleAdmin(session, header.request_id, *request);
      return;
    }
    if (session->isOperator()) {
      session->sendError(ipc::WireError::kBadRequest,
                         "an operator's connection cannot attach a rank: open a connection of its own",
                         header.request_id);
      return;
    }
    jobs_.onMessage(session, header, std::move(message));
  }

  void onClosed(const std::shared_ptr<Session>& session) override {
    sessions_.erase(session->id());
    if (!stopping_) {
      jobs_.onClosed(session);
      finishDrainIfDone();
    } else if (sessions_.empty()) {
      shutdown_deadline_.cancel();  // every goodbye went out
    }
  }

  void setHeartbeat(std::chrono::milliseconds period, std::function<void()> beat) {
    heartbeat_period_ = period;
    on_heartbeat_ = std::move(beat);
  }

  const Config& config() const { return config_; }
  std::uint64_t instanceId() const { return instance_id_; }

 private:
  /// SIGTERM, SIGINT: shut down; SIGHUP: reload, and wait for the next.
  void waitForSignal() {
    signals_.async_wait([this](const asio::error_code& error, int signal) {
      if (error) return;
      if (signal == SIGHUP) {
        reload();
        waitForSignal();
        return;
      }
      spdlog::info("signal {}: shutting down", signal);
      beginShutdown();
    });
  }

  /// SIGHUP: the tenants, [admin] and the log level from the configuration
  /// as it is now; nothing when it has errors.
  void reload() {
    if (!config_source_) {
      spdlog::warn("SIGHUP: no configuration source to re-read; nothing changed");
      return;
    }
    auto fresh = config_source_();
    if (!fresh) {
      spdlog::error("SIGHUP: the configuration has errors; nothing changed:\n{}", fresh.error().message);
      return;
    }
    for (const std::string_view key : keysNeedingRestart(*fresh)) {
      spdlog::warn("SIGHUP: {} changed; it takes effect when dbufd restarts", key);
    }
    config_.tenants = jobs_.retenant(effectiveTenants(*fresh, daemon_uid_));
    config_.admin_uids = fresh->admin_uids;
    config_.admin_gids = fresh->admin_gids;
    config_.log_level = fresh->log_level;
    spdlog::default_logger()->set_level(toSpdlogLevel(config_.log_level));
    std::string tenants;
    for (const Tenant& tenant : config_.tenants) {
      tenants += (tenants.empty() ? "" : ", ") + tenant.name + " (quota " + std::to_string(tenant.memory_quota_bytes) +
                 " bytes, at most " + std::to_string(tenant.max_jobs) + " jobs)";
    }
    spdlog::info("SIGHUP: configuration reloaded: tenants {}; log level {}", tenants, toString(config_.log_level));
  }

  /// The keys of `fresh` that differ from what the daemon runs with and that
  /// only a restart applies.
  std::vector<std::string_view> keysNeedingRestart(const Config& fresh) const {
    std::vector<std::string_view> keys;
    const auto note = [&](bool changed, std::string_view key) {
      if (changed) keys.push_back(key);
    };
    note(fresh.socket_path != config_.socket_path, "daemon.socket");
    // config_.backend is resolved ("auto" became host or cuda).
    note(fresh.backend != Backend::kAuto && fresh.backend != config_.backend, "daemon.backend");
    note(fresh.virtual_ranks != config_.virtual_ranks, "daemon.virtual_ranks");
    note(fresh.memory_limit_bytes != config_.memory_limit_bytes, "daemon.memory_limit");
    note(fresh.ring_entries != config_.ring_entries, "rings.entries");
    note(fresh.busy_poll != config_.busy_poll, "rings.busy_poll_us");
    note(fresh.handshake_timeout != config_.handshake_timeout, "timeouts.handshake_ms");
    note(fresh.register_timeout != config_.register_timeout, "timeouts.register_ms");
    note(fresh.collective_timeout != config_.collective_timeout, "timeouts.collective_ms");
    note(fresh.persistence_grace != config_.persistence_grace, "persistence.grace_period_s");
    note(fresh.cluster_address != config_.cluster_address, "cluster.address");
    note(fresh.cluster_store_hosts != config_.cluster_store_hosts, "cluster.store_hosts");
    note(fresh.metrics_listen != config_.metrics_listen, "metrics.listen");
    return keys;
  }

  /// An operator's request (admin.hpp): who asks decides what it sees.
  void handleAdmin(const std::shared_ptr<Session>& session, std::uint64_t request_id,
                   const ipc::AdminRequest& request) {
    if (session->attached()) {
      session->sendError(ipc::WireError::kBadRequest,
                         "a rank's connection cannot ask as an operator: open a connection of its own", request_id);
      return;
    }
    auto groups = session->peerGroups();
    auto access = groups ? admin::authorize(config_, daemon_uid_, session->peer(), *groups)
                         : Result<admin::Access>(std::move(groups).error());
    if (!access) {
      spdlog::warn("operator request '{}' refused (pid {}, uid {}): {}", request.verb, session->peer().pid,
                   session->peer().uid, access.error().message);
      session->sendError(access.error(), request_id);
      session->closeAfterSending();
      return;
    }
    session->markOperator();
    auto query = admin::parseRequest(request);
    if (!query) {
      session->sendError(query.error(), request_id);
      return;
    }
    if (query->verb == admin::Verb::kDrain && access->everything && !jobs_.refusesNewJobs()) {
      jobs_.refuseNewJobs();
      spdlog::info("drain requested (pid {}, uid {}): no new jobs; stopping once {} job(s) with ranks end",
                   session->peer().pid, session->peer().uid, jobs_.jobsWithRanks());
    }
    admin::DaemonView view = snapshot();
    if (query->verb == admin::Verb::kPlan) view.plan_report = jobs_.planReport(query->job, query->group);
    if (query->verb == admin::Verb::kTrace) view.trace = jobs_.trace(query->job, started_);
    auto text = admin::answer(*query, *access, view);
    if (text) {
      session->send(ipc::AdminReply{std::move(*text)}, request_id);
    } else {
      session->sendError(text.error(), request_id);
    }
    finishDrainIfDone();
  }

  /// The Prometheus endpoint, when [metrics] listen names an address; a
  /// failure to listen is logged, and dbufd serves on without it.
  void startMetrics() {
    if (config_.metrics_listen.empty()) return;
    auto endpoint = metrics::Endpoint::start(config_.metrics_listen, [this] { return snapshotForScrape(); });
    if (!endpoint) {
      metrics_error_ = endpoint.error().message;
      spdlog::error("{}; serving without metrics", metrics_error_);
      return;
    }
    metrics_ = std::move(*endpoint);
    spdlog::info("metrics on {}", metrics_->url());
  }

  /// A snapshot for a scrape, taken on the loop (called on the endpoint's
  /// thread); nullopt when the loop does not answer within a second, or no
  /// longer serves.
  std::optional<admin::DaemonView> snapshotForScrape() {
    auto promise = std::make_shared<std::promise<admin::DaemonView>>();
    auto future = promise->get_future();
    {
      const std::lock_guard lock(stats_mutex_);  // (as in stats(): run() answers what was posted before it ended)
      if (!running_) return std::nullopt;
      asio::post(io_, [this, promise] { promise->set_value(snapshot()); });
    }
    if (future.wait_for(std::chrono::seconds(1)) != std::future_status::ready) return std::nullopt;
    return future.get();
  }

  /// What the daemon holds now, for an operator.
  admin::DaemonView snapshot() const {
    const auto now = SteadyClock::now();
    admin::DaemonView view;
    view.instance_id = instance_id_;
    view.pid = static_cast<std::int32_t>(::getpid());
    view.uid = daemon_uid_;
    view.socket = config_.socket_path;
    view.backend = std::string(toString(config_.backend));
    view.uptime_s = std::chrono::duration<double>(now - started_).count();
    view.started_unix_s = std::chrono::duration<double>(started_wall_.time_since_epoch()).count();
    view.loop_busy_s = std::chrono::duration<double>(busy_).count();
    if (metrics_) view.metrics_url = metrics_->url();
    view.metrics_error = metrics_error_;
    view.memory_limit_bytes = config_.memory_limit_bytes;
    view.draining = jobs_.refusesNewJobs();
    jobs_.describe(view, now);
    for (const auto& [id, weak] : sessions_) {
      const auto session = weak.lock();
      if (!session) continue;
      admin::SessionView entry;
      entry.id = id;
      entry.peer = session->peer();
      entry.tenant = findTenant(config_.tenants, entry.peer.uid, entry.peer.gid);
      entry.kind = session->isOperator() ? "operator" : "handshake";
      entry.age_s = std::chrono::duration<double>(now - session->openedAt()).count();
      jobs_.describe(*session, entry);
      view.sessions.push_back(std::move(entry));
    }
    std::sort(view.sessions.begin(), view.sessions.end(),
              [](const admin::SessionView& a, const admin::SessionView& b) { return a.id < b.id; });
    return view;
  }

  /// Draining, once no job has a rank attached: stops (persistent jobs
  /// without ranks end with the daemon).
  void finishDrainIfDone() {
    if (!jobs_.refusesNewJobs() || stopping_ || jobs_.jobsWithRanks() > 0) return;
    spdlog::info("drained: no job has a rank attached; shutting down");
    beginShutdown();
  }

  void accept() {
    acceptor_.async_accept([this](const asio::error_code& error, asio::local::stream_protocol::socket socket) {
      if (error) {
        if (error != asio::error::operation_aborted) spdlog::warn("accept: {}", error.message());
        if (!stopping_ && error != asio::error::operation_aborted) accept();
        return;
      }
      auto peer = ipc::peerCredentials(socket.native_handle());
      if (sessions_.size() >= kMaxSessions) {
        spdlog::warn("refusing a connection: {} sessions open", sessions_.size());
      } else if (peer) {
        auto session = std::make_shared<Session>(std::move(socket), *this, next_session_id_++, *peer);
        sessions_.emplace(session->id(), session);
        session->start(config_.handshake_timeout);
      } else {
        spdlog::warn("dropping a connection: {}", peer.error().message);
      }
      if (!stopping_) accept();
    });
  }

  void beginShutdown() {
    if (stopping_) return;
    stopping_ = true;
    keep_serving_.reset();  // serve() returns once the goodbyes are out
    asio::error_code ignored;
    acceptor_.close(ignored);
    signals_.cancel(ignored);
    // Tell every client, free every job, then let the loop drain the
    // goodbyes; it returns once nothing is pending.
    std::vector<std::shared_ptr<Session>> open;
    for (auto& [id, weak] : sessions_) {
      if (auto session = weak.lock()) open.push_back(std::move(session));
    }
    for (const auto& session : open) {
      session->send(ipc::Shutdown{"dbufd is shutting down"}, 0);
      session->closeAfterSending();
    }
    jobs_.clear();
    heartbeat_.cancel();
    if (sessions_.empty()) return;
    // A client that does not read its goodbye must not keep the daemon up.
    shutdown_deadline_.expires_after(std::chrono::seconds(2));
    shutdown_deadline_.async_wait([this](const asio::error_code& error) {
      if (error) return;
      std::vector<std::shared_ptr<Session>> stuck;
      for (auto& [id, weak] : sessions_) {
        if (auto session = weak.lock()) stuck.push_back(std::move(session));
      }
      for (const auto& session : stuck) session->close();
    });
  }

  void beat() {
    heartbeat_.expires_after(heartbeat_period_);
    heartbeat_.async_wait([this](const asio::error_code& error) {
      if (error || stopping_) return;
      on_heartbeat_();
      beat();
    });
  }

  void finishShutdown() {
    jobs_.clear();
    ::unlink(config_.socket_path.c_str());
    spdlog::info("dbufd stopped");
  }

  Config config_;
  LockFile lock_;
  std::uint64_t instance_id_;
  asio::io_context io_;
  asio::local::stream_protocol::acceptor acceptor_;
  asio::signal_set signals_;
  asio::steady_timer heartbeat_;
  asio::steady_timer shutdown_deadline_;
  std::chrono::milliseconds heartbeat_period_{0};
  std::function<void()> on_heartbeat_;
  JobTable jobs_;
  std::unordered_map<std::uint64_t, std::weak_ptr<Session>> sessions_;
  std::uint64_t next_session_id_ = 1;
  bool stopping_ = false;
  std::uint32_t daemon_uid_ = static_cast<std::uint32_t>(::getuid());
  std::function<Result<Config>()> config_source_;  // SIGHUP re-reads it
  SteadyClock::time_point started_ = SteadyClock::now();
  std::chrono::system_clock::time_point started_wall_ = std::chrono::system_clock::now();
  SteadyClock::duration busy_{0};  // the loop's time working (serve())
  std::unique_ptr<metrics::Endpoint> metrics_;
  std::string metrics_error_;  // why there is no endpoint, when [metrics] listen names one
  asio::executor_work_guard<asio::io_context::executor_type> keep_serving_ = asio::make_work_guard(io_);
  std::mutex stats_mutex_;  // guards running_ against stats() from other threads
  bool running_ = false;
};

Result<std::unique_ptr<Server>> Server::create(Config config) {
  config.tenants = effectiveTenants(config, static_cast<std::uint32_t>(::getuid()));
  auto backend = resolveBackend(config);
  if (!backend) return std::move(backend).error();
  config.backend = *backend;
  spdlog::info("backend: {}{}", toString(config.backend),
               config.backend == Backend::kCuda
                   ? " (virtual ranks per GPU: " + std::to_string(config.virtual_ranks) + ")"
                   : std::string());
  auto lock = LockFile::acquire(config.socket_path);
  if (!lock) return std::move(lock).error();
  if (auto stale = removeStaleSocket(config.socket_path); !stale) return std::move(stale).error();
  std::random_device entropy;
  const std::uint64_t instance_id = (std::uint64_t{entropy()} << 32) | entropy();
  auto impl = std::make_unique<Impl>(std::move(config), std::move(*lock), instance_id);
  if (auto bound = impl->bind(); !bound) return std::move(bound).error();
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Server::~Server() = default;

void Server::run(bool handle_signals) {
  impl_->run(handle_signals);
}
void Server::requestStop() {
  impl_->requestStop();
}
void Server::setConfigSource(std::function<Result<Config>()> source) {
  impl_->setConfigSource(std::move(source));
}
void Server::setHeartbeat(std::chrono::milliseconds period, std::function<void()> beat) {
  impl_->setHeartbeat(period, std::move(beat));
}
ServerStats Server::stats() {
  return impl_->stats();
}
const std::string& Server::socketPath() const noexcept {
  return impl_->config().socket_path;
}
std::uint64_t Server::instanceId() const noexcept {
  return impl_->instanceId();
}

int abandonedThreads() noexcept {
  return AbandonedThread::live();
}

}  // namespace dbuf::daemon
