#pragma once
// The Prometheus endpoint ([metrics] listen; docs/operations.md, "Metrics"):
// the daemon's state and its jobs' collectives (OpStats) as Prometheus
// metric families, built from the same snapshot dbufctl's answers are
// (admin::DaemonView), and an HTTP endpoint (prometheus-cpp's Exposer) that
// serves them. A scrape asks the loop for a snapshot: nothing on the data
// plane's hot path is shared with the endpoint's threads.

#include <prometheus/metric_family.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "admin.hpp"
#include "dbuf/common/result.hpp"

namespace dbuf::daemon::metrics {

/// Every dbuf_ metric of `view` (its jobs' op_stats included). Label sets are
/// bounded: tenants and jobs are the configured ones, ops and results are
/// enums, and only combinations that occurred are listed.
[[nodiscard]] std::vector<prometheus::MetricFamily> families(const admin::DaemonView& view);

/// An HTTP server answering GET /metrics, on its own threads.
class Endpoint {
 public:
  /// A snapshot of the daemon, taken on its loop; nullopt when the loop did
  /// not answer in time or no longer runs (the scrape then gets no dbuf_
  /// metrics, and Prometheus sees the gap).
  using Snapshot = std::function<std::optional<admin::DaemonView>()>;

  /// Listens on `listen` ("HOST:PORT", "[IPV6]:PORT"; port 0: any free one).
  /// kIo when it cannot (the address is taken, say).
  [[nodiscard]] static Result<std::unique_ptr<Endpoint>> start(const std::string& listen, Snapshot snapshot);
  ~Endpoint();
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  /// "http://HOST:PORT/metrics", with the port it listens on.
  [[nodiscard]] const std::string& url() const noexcept { return url_; }

 private:
  struct Impl;
  explicit Endpoint(std::unique_ptr<Impl> impl, std::string url);
  std::unique_ptr<Impl> impl_;
  std::string url_;
};

}  // namespace dbuf::daemon::metrics
