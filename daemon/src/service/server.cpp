#include "dbuf/daemon/server.hpp"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <asio.hpp>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <random>

#include "abandoned_thread.hpp"
#include "admin.hpp"
#include "backend.hpp"
#include "dbuf/daemon/lock_file.hpp"
#include "dbuf/daemon/logging.hpp"
#include "jobs.hpp"
#include "listener.hpp"
#include "metrics.hpp"
#include "operators.hpp"
#include "reload.hpp"
#include "session.hpp"

namespace dbuf::daemon {

class Server::Impl final : public SessionHandler {
 public:
  Impl(Config config, LockFile lock, std::uint64_t instance_id)
      : config_(std::move(config)),
        lock_(std::move(lock)),
        instance_id_(instance_id),
        listener_(io_, *this),
        signals_(io_),
        heartbeat_(io_),
        shutdown_deadline_(io_),
        jobs_(io_, config_, instance_id),
        desk_(config_, instance_id, daemon_uid_, jobs_, listener_) {}

  Result<void> bind() { return listener_.bind(config_.socket_path); }

  void run(bool handle_signals) {
    if (handle_signals) {
      signals_.add(SIGTERM);
      signals_.add(SIGINT);
      signals_.add(SIGHUP);
      waitForSignal();
    }
    listener_.start(config_.handshake_timeout);
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
  /// While anything happened in the last jobs_.spin(), it spins (rings are
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
      if (Clock::now() - last_work < jobs_.spin()) continue;
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
      desk_.answer(session, header.request_id, *request, figures());
      finishDrainIfDone();
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
    listener_.forget(session->id());
    if (!stopping_) {
      jobs_.onClosed(session);
      finishDrainIfDone();
    } else if (listener_.empty()) {
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
    applyReload(config_, *fresh, jobs_, daemon_uid_);
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
      asio::post(io_, [this, promise] { promise->set_value(desk_.snapshot(figures())); });
    }
    if (future.wait_for(std::chrono::seconds(1)) != std::future_status::ready) return std::nullopt;
    return future.get();
  }

  /// Draining, once no job has a rank attached: stops (persistent jobs
  /// without ranks end with the daemon).
  void finishDrainIfDone() {
    if (!jobs_.refusesNewJobs() || stopping_ || jobs_.jobsWithRanks() > 0) return;
    spdlog::info("drained: no job has a rank attached; shutting down");
    beginShutdown();
  }

  void beginShutdown() {
    if (stopping_) return;
    stopping_ = true;
    keep_serving_.reset();  // serve() returns once the goodbyes are out
    listener_.stop();
    asio::error_code ignored;
    signals_.cancel(ignored);
    // Tell every client, free every job, then let the loop drain the
    // goodbyes; it returns once nothing is pending.
    for (const auto& session : listener_.open()) {
      session->send(ipc::Shutdown{"dbufd is shutting down"}, 0);
      session->closeAfterSending();
    }
    jobs_.clear();
    heartbeat_.cancel();
    if (listener_.empty()) return;
    // A client that does not read its goodbye must not keep the daemon up.
    shutdown_deadline_.expires_after(std::chrono::seconds(2));
    shutdown_deadline_.async_wait([this](const asio::error_code& error) {
      if (error) return;
      for (const auto& session : listener_.open()) session->close();
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

  LoopFigures figures() const {
    return LoopFigures{started_, started_wall_, busy_, metrics_ ? metrics_->url() : std::string(), metrics_error_};
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
  std::uint32_t daemon_uid_ = static_cast<std::uint32_t>(::getuid());
  Listener listener_;
  asio::signal_set signals_;
  asio::steady_timer heartbeat_;
  asio::steady_timer shutdown_deadline_;
  std::chrono::milliseconds heartbeat_period_{0};
  std::function<void()> on_heartbeat_;
  JobTable jobs_;
  OperatorDesk desk_;
  bool stopping_ = false;
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
