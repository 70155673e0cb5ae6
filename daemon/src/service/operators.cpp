#include "operators.hpp"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <utility>

#include "dbuf/common/build_info.hpp"

namespace dbuf::daemon {

void OperatorDesk::answer(const std::shared_ptr<Session>& session, std::uint64_t request_id,
                          const ipc::AdminRequest& request, const LoopFigures& figures) {
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
  admin::DaemonView view = snapshot(figures);
  if (query->verb == admin::Verb::kPlan) view.plan_report = jobs_.planReport(query->job, query->group);
  if (query->verb == admin::Verb::kTrace) view.trace = jobs_.trace(query->job, figures.started);
  auto text = admin::answer(*query, *access, view);
  if (text) {
    session->send(ipc::AdminReply{std::move(*text)}, request_id);
  } else {
    session->sendError(text.error(), request_id);
  }
}

admin::DaemonView OperatorDesk::snapshot(const LoopFigures& figures) const {
  const auto now = SteadyClock::now();
  admin::DaemonView view;
  view.instance_id = instance_id_;
  view.pid = static_cast<std::int32_t>(::getpid());
  view.uid = daemon_uid_;
  view.socket = config_.socket_path;
  view.backend = std::string(toString(config_.backend));
  view.version = std::string(buildInfo().version);
  view.commit = std::string(buildInfo().commit);
  view.uptime_s = std::chrono::duration<double>(now - figures.started).count();
  view.started_unix_s = std::chrono::duration<double>(figures.started_wall.time_since_epoch()).count();
  view.loop_busy_s = std::chrono::duration<double>(figures.busy).count();
  view.metrics_url = figures.metrics_url;
  view.metrics_error = figures.metrics_error;
  view.memory_limit_bytes = config_.memory_limit_bytes;
  view.draining = jobs_.refusesNewJobs();
  jobs_.describe(view, now);
  for (const std::shared_ptr<Session>& session : listener_.open()) {  // by id
    admin::SessionView entry;
    entry.id = session->id();
    entry.peer = session->peer();
    entry.tenant = findTenant(config_.tenants, entry.peer.uid, entry.peer.gid);
    entry.kind = session->isOperator() ? "operator" : "handshake";
    entry.age_s = std::chrono::duration<double>(now - session->openedAt()).count();
    jobs_.describe(*session, entry);
    view.sessions.push_back(std::move(entry));
  }
  return view;
}

}  // namespace dbuf::daemon
