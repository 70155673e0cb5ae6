// The metrics endpoint's families (metrics.hpp) over a DaemonView made here:
// Prometheus's naming rules, bounded label sets, histograms as Prometheus
// reads them, and the text a scrape gets. A real daemon scraped by a real
// Prometheus: python/tests/test_metrics.py.
#include "metrics.hpp"

#include <gtest/gtest.h>
#include <prometheus/check_names.h>
#include <prometheus/text_serializer.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <string>
#include <vector>

namespace dbuf::daemon::metrics {
namespace {

using namespace std::chrono_literals;
using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

admin::DaemonView view() {
  admin::DaemonView made;
  made.backend = "host";
  made.version = "1.2.3";
  made.commit = "0123456789ab";
  made.loop_busy_s = 1.5;
  made.memory_limit_bytes = 1 << 30;
  made.memory_used_bytes = 4096;
  made.tenants = {{"research", 1 << 20, 4096, 4}, {"prod", 1 << 20, 0, 4}};
  admin::JobView job;
  job.id = "run-1";
  job.tenant = 0;
  job.memory_bytes = 4096;
  for (std::uint32_t r = 0; r < 3; ++r) {
    admin::RankView rank;
    rank.rank = r;
    rank.attached = r < 2;
    rank.gone = r == 2;
    rank.queued_ops = r == 0 ? 1 : 0;
    job.ranks.push_back(rank);
  }
  const ErrorCode timeout = ErrorCode::kTimeout;
  for (int i = 0; i < 5; ++i) job.op_stats.ended(ipc::OpCode::kAllGather, nullptr, 1000, 20us, 2ms);
  job.op_stats.ended(ipc::OpCode::kAllGather, &timeout, 1000, 30s, 0ns);
  job.op_stats.ended(ipc::OpCode::kBarrier, nullptr, 0, 5us, 0ns);
  job.op_stats.ranks_lost = 1;
  made.jobs.push_back(job);
  admin::SessionView session;
  session.kind = "rank";
  made.sessions = {session, session};
  return made;
}

const MetricFamily& find(const std::vector<MetricFamily>& families, const std::string& name) {
  const auto found =
      std::find_if(families.begin(), families.end(), [&](const MetricFamily& f) { return f.name == name; });
  if (found == families.end()) throw std::runtime_error("no family " + name);
  return *found;
}

std::string label(const ClientMetric& metric, const std::string& name) {
  for (const auto& l : metric.label) {
    if (l.name == name) return l.value;
  }
  return "";
}

TEST(Metrics, NamesAndLabelsFollowPrometheusConventions) {
  for (const MetricFamily& family : families(view())) {
    EXPECT_TRUE(prometheus::CheckMetricName(family.name)) << family.name;
    EXPECT_EQ(family.name.rfind("dbuf_", 0), 0u) << family.name;
    EXPECT_FALSE(family.help.empty()) << family.name;
    // Counters end in _total; base units (seconds, bytes) in the name.
    EXPECT_EQ(family.type == MetricType::Counter, family.name.ends_with("_total")) << family.name;
    if (family.type == MetricType::Histogram) {
      EXPECT_TRUE(family.name.ends_with("_seconds")) << family.name;
    }
    std::set<std::vector<ClientMetric::Label>> seen;
    for (const ClientMetric& metric : family.metric) {
      for (const auto& l : metric.label) {
        EXPECT_TRUE(prometheus::CheckLabelName(l.name)) << family.name << " " << l.name;
        // Prometheus gives every scraped series `job` and `instance` itself.
        EXPECT_NE(l.name, "job");
        EXPECT_NE(l.name, "instance");
      }
      EXPECT_TRUE(seen.insert(metric.label).second) << family.name << ": a label set twice";
    }
  }
}

TEST(Metrics, OpsAreCountedByOpAndResultListingOnlyWhatHappened) {
  const auto all = families(view());
  const MetricFamily& ops = find(all, "dbuf_ops_total");
  ASSERT_EQ(ops.metric.size(), 3u);  // allGather ok, allGather timeout, barrier ok: nothing else
  for (const ClientMetric& metric : ops.metric) {
    EXPECT_EQ(label(metric, "tenant"), "research");
    EXPECT_EQ(label(metric, "dbuf_job"), "run-1");
    const std::string op = label(metric, "op");
    const std::string result = label(metric, "result");
    const double expected = op == "allGather" && result == "ok" ? 5 : 1;
    EXPECT_EQ(metric.counter.value, expected) << op << " " << result;
    EXPECT_TRUE((op == "allGather" && (result == "ok" || result == "timeout")) || (op == "barrier" && result == "ok"));
  }
  // Bytes of the ops that succeeded; a barrier moves none and has no series.
  const MetricFamily& bytes = find(all, "dbuf_op_bytes_total");
  ASSERT_EQ(bytes.metric.size(), 1u);
  EXPECT_EQ(bytes.metric[0].counter.value, 5000);
  EXPECT_EQ(find(all, "dbuf_job_ranks_lost_total").metric[0].counter.value, 1);
}

TEST(Metrics, HistogramsAreCumulativeWithTheSampleCountAndSum) {
  const auto all = families(view());
  for (const char* name : {"dbuf_op_wait_seconds", "dbuf_op_run_seconds"}) {
    const MetricFamily& family = find(all, name);
    ASSERT_EQ(family.type, MetricType::Histogram);
    const auto gather = std::find_if(family.metric.begin(), family.metric.end(),
                                     [](const ClientMetric& m) { return label(m, "op") == "allGather"; });
    ASSERT_NE(gather, family.metric.end());
    const auto& histogram = gather->histogram;
    EXPECT_EQ(histogram.sample_count, 6u);
    ASSERT_EQ(histogram.bucket.size(), DurationHistogram::kBounds.size());
    for (std::size_t i = 1; i < histogram.bucket.size(); ++i) {
      EXPECT_LE(histogram.bucket[i - 1].cumulative_count, histogram.bucket[i].cumulative_count);
      EXPECT_LT(histogram.bucket[i - 1].upper_bound, histogram.bucket[i].upper_bound);
    }
    EXPECT_EQ(histogram.bucket.back().cumulative_count, 6u);
  }
  // wait: five at 20 us (<= 30 us), one at 30 s (<= 30 s); sum 30 s + 100 us.
  const auto& waits = find(all, "dbuf_op_wait_seconds").metric;
  ASSERT_EQ(waits.size(), 2u);  // barrier, allGather (in op code order)
  ASSERT_EQ(label(waits[1], "op"), "allGather");
  const auto& wait = waits[1].histogram;
  EXPECT_EQ(wait.bucket[0].cumulative_count, 0u);   // <= 10 us
  EXPECT_EQ(wait.bucket[1].cumulative_count, 5u);   // <= 30 us
  EXPECT_EQ(wait.bucket[12].cumulative_count, 5u);  // <= 10 s
  EXPECT_EQ(wait.bucket[13].cumulative_count, 6u);  // <= 30 s
  EXPECT_NEAR(wait.sample_sum, 30.0001, 1e-9);
}

TEST(Metrics, TheBoundsInNanosecondsAreTheBoundsInSeconds) {
  for (std::size_t i = 0; i < DurationHistogram::kBounds.size(); ++i) {
    EXPECT_EQ(static_cast<double>(DurationHistogram::kBoundsNs[i]) / 1e9, DurationHistogram::kBounds[i]) << i;
  }
}

TEST(Metrics, AnObservationAboveTheLastBoundCountsOnlyInInf) {
  DurationHistogram histogram;
  histogram.observe(std::chrono::seconds(1000));
  EXPECT_EQ(histogram.count, 1u);
  for (const std::uint64_t bucket : histogram.buckets) EXPECT_EQ(bucket, 0u);
}

TEST(Metrics, JobRanksTenantsAndSessionsAreGauges) {
  const auto all = families(view());
  const MetricFamily& ranks = find(all, "dbuf_job_ranks");
  ASSERT_EQ(ranks.metric.size(), 3u);
  for (const ClientMetric& metric : ranks.metric) {
    const std::string state = label(metric, "state");
    EXPECT_EQ(metric.gauge.value, state == "attached" ? 2 : state == "gone" ? 1 : 0) << state;
  }
  EXPECT_EQ(find(all, "dbuf_job_queued_ops").metric[0].gauge.value, 1);
  const MetricFamily& jobs = find(all, "dbuf_tenant_jobs");
  ASSERT_EQ(jobs.metric.size(), 2u);  // every tenant, with or without jobs
  EXPECT_EQ(jobs.metric[0].gauge.value + jobs.metric[1].gauge.value, 1);
  const MetricFamily& sessions = find(all, "dbuf_sessions");
  for (const ClientMetric& metric : sessions.metric) {
    EXPECT_EQ(metric.gauge.value, label(metric, "kind") == "rank" ? 2 : 0);
  }
  EXPECT_EQ(find(all, "dbuf_loop_busy_seconds_total").metric[0].counter.value, 1.5);
}

TEST(Metrics, BuildInfoNamesTheVersionCommitAndBackend) {
  const auto all = families(view());
  const MetricFamily& info = find(all, "dbuf_build_info");
  ASSERT_EQ(info.metric.size(), 1u);
  EXPECT_EQ(info.type, MetricType::Gauge);
  EXPECT_EQ(info.metric[0].gauge.value, 1);
  EXPECT_EQ(label(info.metric[0], "version"), "1.2.3");
  EXPECT_EQ(label(info.metric[0], "commit"), "0123456789ab");
  EXPECT_EQ(label(info.metric[0], "backend"), "host");
}

TEST(Metrics, TheTextFormatHasTypeLinesAndEscapedLabels) {
  admin::DaemonView made = view();
  made.jobs[0].id = "a\"b\\c";  // job ids are checked by the daemon, but the text must survive anything
  const std::string text = prometheus::TextSerializer().Serialize(families(made));
  EXPECT_NE(text.find("# TYPE dbuf_ops_total counter"), std::string::npos);
  EXPECT_NE(text.find("# TYPE dbuf_op_run_seconds histogram"), std::string::npos);
  EXPECT_NE(text.find(R"(dbuf_job="a\"b\\c")"), std::string::npos) << text;
  EXPECT_NE(text.find(R"(dbuf_op_run_seconds_bucket{tenant="research",dbuf_job="a\"b\\c",op="allGather",le="+Inf"} 6)"),
            std::string::npos)
      << text;
}

TEST(Metrics, AnEndpointOnATakenAddressIsAnIoErrorAndPortZeroPicksOne) {
  auto endpoint = Endpoint::start("127.0.0.1:0", [] { return std::optional<admin::DaemonView>(view()); });
  ASSERT_TRUE(endpoint) << endpoint.error().message;
  const std::string& url = (*endpoint)->url();
  EXPECT_EQ(url.rfind("http://127.0.0.1:", 0), 0u) << url;
  EXPECT_EQ(url.find(":0/"), std::string::npos) << url;
  const std::string address = url.substr(7, url.size() - 7 - std::string("/metrics").size());
  auto again = Endpoint::start(address, [] { return std::optional<admin::DaemonView>(); });
  ASSERT_FALSE(again);
  EXPECT_EQ(again.error().code, ErrorCode::kIo);
  EXPECT_NE(again.error().message.find("cannot serve metrics on " + address), std::string::npos)
      << again.error().message;
}

}  // namespace
}  // namespace dbuf::daemon::metrics
