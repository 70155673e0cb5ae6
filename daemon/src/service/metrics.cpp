#include "metrics.hpp"

#include <prometheus/collectable.h>
#include <prometheus/exposer.h>

#include <algorithm>
#include <exception>
#include <utility>

#include "dbuf/ipc/ring.hpp"

namespace dbuf::daemon::metrics {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;
using Labels = std::vector<ClientMetric::Label>;

MetricFamily family(std::string name, std::string help, MetricType type) {
  return MetricFamily{std::move(name), std::move(help), type, {}};
}

ClientMetric gauge(Labels labels, double value) {
  ClientMetric metric;
  metric.label = std::move(labels);
  metric.gauge.value = value;
  return metric;
}

ClientMetric counter(Labels labels, double value) {
  ClientMetric metric;
  metric.label = std::move(labels);
  metric.counter.value = value;
  return metric;
}

ClientMetric histogram(Labels labels, const DurationHistogram& observed) {
  ClientMetric metric;
  metric.label = std::move(labels);
  metric.histogram.sample_count = observed.count;
  metric.histogram.sample_sum = observed.sumSeconds();
  std::uint64_t cumulative = 0;
  for (std::size_t i = 0; i < DurationHistogram::kBounds.size(); ++i) {
    cumulative += observed.buckets[i];
    metric.histogram.bucket.push_back({cumulative, DurationHistogram::kBounds[i]});
  }
  // (The serializer writes the +Inf bucket from sample_count.)
  return metric;
}

/// The result label: "ok", or the error's code as dbufctl trace spells it.
std::string resultLabel(std::size_t index) {
  return index == 0 ? std::string("ok") : std::string(toString(static_cast<ErrorCode>(index - 1)));
}

void addDaemon(const admin::DaemonView& view, std::vector<MetricFamily>& out) {
  MetricFamily info =
      family("dbuf_build_info", "dbufd's version, the git commit it was built from, and its backend (always 1)",
             MetricType::Gauge);
  info.metric.push_back(gauge({{"version", view.version}, {"commit", view.commit}, {"backend", view.backend}}, 1));
  out.push_back(std::move(info));
  MetricFamily started =
      family("dbuf_start_time_seconds", "When dbufd started, since the Unix epoch", MetricType::Gauge);
  started.metric.push_back(gauge({}, view.started_unix_s));
  out.push_back(std::move(started));
  MetricFamily busy =
      family("dbuf_loop_busy_seconds_total",
             "Time dbufd's loop spent working rather than waiting (rate(): its busy fraction)", MetricType::Counter);
  busy.metric.push_back(counter({}, view.loop_busy_s));
  out.push_back(std::move(busy));
  MetricFamily draining = family("dbuf_draining", "1 while dbufd refuses new jobs (dbufctl drain)", MetricType::Gauge);
  draining.metric.push_back(gauge({}, view.draining ? 1 : 0));
  out.push_back(std::move(draining));
  MetricFamily limit = family("dbuf_memory_limit_bytes", "Memory all tenants together may use", MetricType::Gauge);
  limit.metric.push_back(gauge({}, static_cast<double>(view.memory_limit_bytes)));
  out.push_back(std::move(limit));
  MetricFamily used = family("dbuf_memory_used_bytes", "Memory charged to tenants", MetricType::Gauge);
  used.metric.push_back(gauge({}, static_cast<double>(view.memory_used_bytes)));
  out.push_back(std::move(used));

  MetricFamily sessions = family("dbuf_sessions", "Open connections, by kind", MetricType::Gauge);
  for (const char* kind : {"rank", "operator", "handshake"}) {
    const auto count = std::count_if(view.sessions.begin(), view.sessions.end(),
                                     [kind](const admin::SessionView& session) { return session.kind == kind; });
    sessions.metric.push_back(gauge({{"kind", kind}}, static_cast<double>(count)));
  }
  out.push_back(std::move(sessions));
}

void addTenants(const admin::DaemonView& view, std::vector<MetricFamily>& out) {
  MetricFamily quota = family("dbuf_tenant_memory_quota_bytes", "A tenant's memory quota", MetricType::Gauge);
  MetricFamily used = family("dbuf_tenant_memory_used_bytes", "Memory charged to a tenant", MetricType::Gauge);
  MetricFamily jobs = family("dbuf_tenant_jobs", "A tenant's jobs (live or persisting)", MetricType::Gauge);
  for (std::size_t t = 0; t < view.tenants.size(); ++t) {
    const admin::TenantView& tenant = view.tenants[t];
    const auto count =
        std::count_if(view.jobs.begin(), view.jobs.end(), [t](const admin::JobView& job) { return job.tenant == t; });
    quota.metric.push_back(gauge({{"tenant", tenant.name}}, static_cast<double>(tenant.memory_quota_bytes)));
    used.metric.push_back(gauge({{"tenant", tenant.name}}, static_cast<double>(tenant.memory_used_bytes)));
    jobs.metric.push_back(gauge({{"tenant", tenant.name}}, static_cast<double>(count)));
  }
  out.push_back(std::move(quota));
  out.push_back(std::move(used));
  out.push_back(std::move(jobs));
}

/// The job's state and its collectives. The label is dbuf_job, not job:
/// Prometheus gives every scraped series a `job` label of its own (the
/// scrape job's name).
struct JobFamilies {
  MetricFamily memory = family("dbuf_job_memory_bytes", "Memory charged for a job", MetricType::Gauge);
  MetricFamily ranks =
      family("dbuf_job_ranks", "A job's ranks on this node: attached; gone (lost while others stayed); detached",
             MetricType::Gauge);
  MetricFamily queued =
      family("dbuf_job_queued_ops", "Collectives its ranks submitted that wait for the others", MetricType::Gauge);
  MetricFamily ring_full = family(
      "dbuf_job_ring_full_total",
      "Times a rank's rings filled: as many ops outstanding as they hold (its next submit waits)", MetricType::Counter);
  MetricFamily ranks_lost =
      family("dbuf_job_ranks_lost_total",
             "Ranks whose connection ended while the job's collectives were queued or running", MetricType::Counter);
  MetricFamily ops = family("dbuf_ops_total",
                            "Collectives that ended, by op and result (ok, or the error: timeout, conflict for a "
                            "mismatch, ...)",
                            MetricType::Counter);
  MetricFamily bytes =
      family("dbuf_op_bytes_total",
             "Bytes of the collectives that succeeded: a rank's unsharded copy of the group each", MetricType::Counter);
  MetricFamily wait =
      family("dbuf_op_wait_seconds",
             "From the first of this node's ranks submitting a collective (or the previous one's end) to the last",
             MetricType::Histogram);
  MetricFamily run = family("dbuf_op_run_seconds", "From a collective's match (every rank submitted) to its end",
                            MetricType::Histogram);

  void add(const admin::DaemonView& view, const admin::JobView& job) {
    const Labels labels{{"tenant", view.tenants.at(job.tenant).name}, {"dbuf_job", job.id}};
    const auto with = [&labels](std::initializer_list<ClientMetric::Label> more) {
      Labels all = labels;
      all.insert(all.end(), more);
      return all;
    };
    memory.metric.push_back(gauge(labels, static_cast<double>(job.memory_bytes)));
    std::size_t attached = 0;
    std::size_t gone = 0;
    std::uint64_t queued_ops = 0;
    for (const admin::RankView& rank : job.ranks) {
      if (rank.attached) ++attached;
      if (!rank.attached && rank.gone) ++gone;
      queued_ops += rank.queued_ops;
    }
    ranks.metric.push_back(gauge(with({{"state", "attached"}}), static_cast<double>(attached)));
    ranks.metric.push_back(gauge(with({{"state", "gone"}}), static_cast<double>(gone)));
    ranks.metric.push_back(
        gauge(with({{"state", "detached"}}), static_cast<double>(job.ranks.size() - attached - gone)));
    queued.metric.push_back(gauge(labels, static_cast<double>(queued_ops)));
    ring_full.metric.push_back(counter(labels, static_cast<double>(job.op_stats.ring_full)));
    ranks_lost.metric.push_back(counter(labels, static_cast<double>(job.op_stats.ranks_lost)));
    for (std::size_t code = 0; code < OpStats::kOpCodes; ++code) {
      const OpStats::PerOp& per_op = job.op_stats.ops[code];
      if (per_op.wait.count == 0) continue;  // never ran (or no such op)
      const std::string op(ipc::toString(static_cast<ipc::OpCode>(code)));
      for (std::size_t result = 0; result < OpStats::kResults; ++result) {
        if (per_op.ended[result] == 0) continue;
        ops.metric.push_back(
            counter(with({{"op", op}, {"result", resultLabel(result)}}), static_cast<double>(per_op.ended[result])));
      }
      if (code != static_cast<std::size_t>(ipc::OpCode::kBarrier)) {  // (a barrier moves no bytes)
        bytes.metric.push_back(counter(with({{"op", op}}), static_cast<double>(per_op.bytes)));
      }
      wait.metric.push_back(histogram(with({{"op", op}}), per_op.wait));
      run.metric.push_back(histogram(with({{"op", op}}), per_op.run));
    }
  }

  void moveInto(std::vector<MetricFamily>& out) {
    for (MetricFamily* each : {&memory, &ranks, &queued, &ring_full, &ranks_lost, &ops, &bytes, &wait, &run}) {
      out.push_back(std::move(*each));
    }
  }
};

/// The collectable the Exposer asks at every scrape (on its own threads).
class DaemonCollectable final : public prometheus::Collectable {
 public:
  explicit DaemonCollectable(Endpoint::Snapshot snapshot) : snapshot_(std::move(snapshot)) {}
  std::vector<MetricFamily> Collect() const override {
    const std::optional<admin::DaemonView> view = snapshot_();
    return view ? families(*view) : std::vector<MetricFamily>{};
  }

 private:
  Endpoint::Snapshot snapshot_;
};

}  // namespace

std::vector<MetricFamily> families(const admin::DaemonView& view) {
  std::vector<MetricFamily> out;
  addDaemon(view, out);
  addTenants(view, out);
  JobFamilies jobs;
  for (const admin::JobView& job : view.jobs) jobs.add(view, job);
  jobs.moveInto(out);
  return out;
}

struct Endpoint::Impl {
  std::shared_ptr<DaemonCollectable> collectable;
  std::unique_ptr<prometheus::Exposer> exposer;  // (stops, joining its threads, before the collectable goes)
};

Result<std::unique_ptr<Endpoint>> Endpoint::start(const std::string& listen, Snapshot snapshot) {
  auto impl = std::make_unique<Impl>();
  try {
    // One thread: scrapes come every few seconds, and each waits for the loop.
    impl->exposer = std::make_unique<prometheus::Exposer>(listen, 1);
  } catch (const std::exception& error) {
    return makeError(ErrorCode::kIo, "cannot serve metrics on " + listen + ": " + error.what());
  }
  impl->collectable = std::make_shared<DaemonCollectable>(std::move(snapshot));
  impl->exposer->RegisterCollectable(impl->collectable, "/metrics");
  const std::vector<int> ports = impl->exposer->GetListeningPorts();
  const auto colon = listen.rfind(':');
  const std::string url = "http://" + listen.substr(0, colon) + ":" +
                          (ports.empty() ? listen.substr(colon + 1) : std::to_string(ports.front())) + "/metrics";
  return std::unique_ptr<Endpoint>(new Endpoint(std::move(impl), url));
}

Endpoint::Endpoint(std::unique_ptr<Impl> impl, std::string url) : impl_(std::move(impl)), url_(std::move(url)) {}
Endpoint::~Endpoint() = default;

}  // namespace dbuf::daemon::metrics
