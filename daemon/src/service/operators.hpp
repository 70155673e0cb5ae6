#pragma once
// Operators' requests (dbufctl; control/admin.hpp answers them) and the
// snapshot of the daemon that they and Prometheus scrapes read.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "admin.hpp"
#include "dbuf/daemon/config.hpp"
#include "jobs.hpp"
#include "listener.hpp"

namespace dbuf::daemon {

/// What the daemon's loop knows of itself.
struct LoopFigures {
  SteadyClock::time_point started;
  std::chrono::system_clock::time_point started_wall;
  SteadyClock::duration busy{0};  ///< the loop's time working
  std::string metrics_url;        ///< empty without an endpoint
  std::string metrics_error;      ///< why there is none, when [metrics] listen names one
};

class OperatorDesk {
 public:
  OperatorDesk(const Config& config, std::uint64_t instance_id, std::uint32_t daemon_uid, JobTable& jobs,
               const Listener& listener)
      : config_(config), instance_id_(instance_id), daemon_uid_(daemon_uid), jobs_(jobs), listener_(listener) {}

  /// Answers `request`: who asks decides what it sees. A refused operator's
  /// connection is closed; an administrator's drain starts refusing new jobs.
  void answer(const std::shared_ptr<Session>& session, std::uint64_t request_id, const ipc::AdminRequest& request,
              const LoopFigures& figures);
  /// What the daemon holds now.
  [[nodiscard]] admin::DaemonView snapshot(const LoopFigures& figures) const;

 private:
  const Config& config_;  // the daemon's, as SIGHUP leaves it
  std::uint64_t instance_id_;
  std::uint32_t daemon_uid_;
  JobTable& jobs_;
  const Listener& listener_;
};

}  // namespace dbuf::daemon
