// Jobs across nodes, end to end: several real dbufd processes ("nodes"), each
// with its own socket and [cluster] address, real rank processes attached to
// their node's daemon, and Gloo over real TCP between the daemons. Every
// node runs on loopback here (NodeNetwork::kLoopback); the NetworkNamespaces
// tests run the same jobs with each node in a network namespace of its own,
// joined by veth pairs and a bridge (skipped where namespaces cannot be
// made: not root, or no CAP_NET_ADMIN).
//
// - every op and dtype against the reference (coll-rank, which sums node by
//   node like the daemons) at 2 x 2, 3 x 2 and 4 x 1 ranks, and fp8;
// - communicators are the daemons': a second job over the same daemons
//   reuses the first one's, also while two jobs run at once;
// - a mismatch across nodes fails the op on every node, naming the ranks;
// - a rank missing on another node is named in the timeout error;
// - kill -9 of a rank, and of a node's dbufd, fail the job's ops on every
//   node within seconds (collective_ms is 30 s), while other jobs go on;
// - a Redis store (redis-server from Debian), and the stores a daemon
//   refuses.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iostream>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cf_rank_driver.hpp"
#include "harness.hpp"
#include "support/sanitizers.hpp"

#ifndef DBUF_COLL_RANK_EXE
#error "DBUF_COLL_RANK_EXE must name the coll-rank binary"
#endif

namespace dbuf::mp {
namespace {

using dbuf::testing::Child;
using dbuf::testing::TempDir;

/// Stops a hung job (longer under a sanitizer).
constexpr std::chrono::seconds kJobDeadline = dbuf::testing::sanitizerScaled(std::chrono::seconds(90));

/// How the nodes reach each other.
enum class NodeNetwork { kLoopback, kNamespaces };

/// Runs a command to its end; its exit status (-1 if it did not exit).
int runCommand(const std::vector<std::string>& argv, std::string* output = nullptr) {
  Child::Options options;
  options.pipe_stdout = true;
  options.pipe_stderr = true;
  Child child(argv.front(), {argv.begin() + 1, argv.end()}, options);
  std::string out;
  std::string err;
  static_cast<void>(child.readToEnd(out, err, Clock::now() + std::chrono::seconds(20)));
  const auto status = child.waitExit(std::chrono::seconds(5));
  if (output != nullptr) *output = out + err;
  return status && WIFEXITED(*status) ? WEXITSTATUS(*status) : -1;
}

/// Where iproute2's ip is (posix_spawn does not search PATH); empty: nowhere.
std::string ipCommand() {
  for (const char* path : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (::access(path, X_OK) == 0) return path;
  }
  return {};
}

/// Network namespaces for `nodes` nodes: ns<i> holds veth "eth0" with
/// 10.<net>.0.<i+1>/24, its peer enslaved to a bridge in a namespace of its
/// own, so no address or link is added outside namespaces this makes (and
/// removes).
class Namespaces {
 public:
  explicit Namespaces(std::uint32_t nodes) : prefix_("dbuf" + std::to_string(::getpid() % 100000)) {
    if (ipCommand().empty()) {
      why_ = "iproute2's ip is not installed";
      return;
    }
    if (::geteuid() != 0) {
      why_ = "making network namespaces needs root";
      return;
    }
    const std::string bridge = name("br");
    if (!ip({"netns", "add", bridge})) return;
    made_.push_back(bridge);
    if (!ip({"-n", bridge, "link", "add", "br0", "type", "bridge"}) ||
        !ip({"-n", bridge, "link", "set", "br0", "up"})) {
      return;
    }
    for (std::uint32_t n = 0; n < nodes; ++n) {
      const std::string ns = name("n" + std::to_string(n));
      const std::string peer = "v" + std::to_string(n);
      if (!ip({"netns", "add", ns})) return;
      made_.push_back(ns);
      if (!ip({"-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", peer, "netns", bridge}) ||
          !ip({"-n", ns, "addr", "add", address(n) + "/24", "dev", "eth0"}) ||
          !ip({"-n", ns, "link", "set", "eth0", "up"}) || !ip({"-n", ns, "link", "set", "lo", "up"}) ||
          !ip({"-n", bridge, "link", "set", peer, "master", "br0"}) ||
          !ip({"-n", bridge, "link", "set", peer, "up"})) {
        return;
      }
    }
    ready_ = true;
  }
  ~Namespaces() {
    for (auto it = made_.rbegin(); it != made_.rend(); ++it) static_cast<void>(ip({"netns", "del", *it}));
  }
  Namespaces(const Namespaces&) = delete;
  Namespaces& operator=(const Namespaces&) = delete;

  [[nodiscard]] bool ready() const noexcept { return ready_; }
  [[nodiscard]] const std::string& why() const noexcept { return why_; }
  [[nodiscard]] std::string node(std::uint32_t n) const { return name("n" + std::to_string(n)); }
  [[nodiscard]] static std::string address(std::uint32_t n) { return "10.231.0." + std::to_string(n + 1); }

 private:
  [[nodiscard]] std::string name(const std::string& what) const { return prefix_ + what; }
  bool ip(const std::vector<std::string>& args) {
    std::vector<std::string> argv{ipCommand()};
    argv.insert(argv.end(), args.begin(), args.end());
    std::string output;
    if (runCommand(argv, &output) == 0) return true;
    if (why_.empty()) why_ = "ip " + args.front() + " ... failed: " + output;
    return false;
  }
  std::string prefix_;
  std::vector<std::string> made_;
  std::string why_;
  bool ready_ = false;
};

/// `nodes` dbufd processes sharing a store directory.
class Cluster {
 public:
  Cluster(std::uint32_t nodes, NodeNetwork network, int collective_ms = 30000, std::string extra = "")
      : store_dir_(dir_.path("store")) {
    ::mkdir(store_dir_.c_str(), 0700);
    if (network == NodeNetwork::kNamespaces) namespaces_ = std::make_unique<Namespaces>(nodes);
    for (std::uint32_t n = 0; n < nodes; ++n) {
      const std::string node_dir = dir_.path("node" + std::to_string(n));
      ::mkdir(node_dir.c_str(), 0700);
      Daemon::Settings settings;
      settings.collective_ms = collective_ms;
      const bool in_namespace = namespaces_ && namespaces_->ready();
      settings.extra_config = "[cluster]\naddress = \"" +
                              (in_namespace ? Namespaces::address(n) : std::string("127.0.0.1")) + "\"\n" + extra;
      if (in_namespace) settings.launcher = {ipCommand(), "netns", "exec", namespaces_->node(n)};
      daemons_.push_back(std::make_unique<Daemon>(node_dir, settings));
    }
  }
  /// Empty when the cluster can run; else why not (namespaces).
  [[nodiscard]] std::string unavailable() const {
    return namespaces_ && !namespaces_->ready() ? namespaces_->why() : std::string();
  }
  void start() {
    for (auto& daemon : daemons_) daemon->start();
  }
  Daemon& node(std::uint32_t n) { return *daemons_.at(n); }
  [[nodiscard]] std::uint32_t nodes() const { return static_cast<std::uint32_t>(daemons_.size()); }
  [[nodiscard]] std::string fileStore(const std::string& prefix) const { return "file:" + store_dir_ + "#" + prefix; }
  [[nodiscard]] const TempDir& dir() const { return dir_; }
  /// Every daemon's log, for failure messages.
  [[nodiscard]] std::string logs() const {
    std::string text;
    for (std::size_t n = 0; n < daemons_.size(); ++n) text += "--- node " + std::to_string(n) + "\n" + daemons_[n]->log();
    return text;
  }

 private:
  TempDir dir_{"dbuf-multinode"};
  std::string store_dir_;
  std::unique_ptr<Namespaces> namespaces_;
  std::vector<std::unique_ptr<Daemon>> daemons_;
};

#define SKIP_UNLESS_AVAILABLE(cluster)                                           \
  do {                                                                           \
    if (const std::string why = (cluster).unavailable(); !why.empty()) {         \
      GTEST_SKIP() << "network namespaces are not available here: " << why;     \
    }                                                                            \
  } while (false)

/// A job of coll-rank processes: `per_node` ranks on each node.
class CollJob {
 public:
  CollJob(Cluster& cluster, const std::string& job, std::uint32_t per_node, const std::string& scenario,
          const std::string& shape, const std::string& store) {
    const std::uint32_t world = per_node * cluster.nodes();
    for (std::uint32_t rank = 0; rank < world; ++rank) {
      logs_.push_back(cluster.dir().path(job + "-" + std::to_string(rank) + ".log"));
      Child::Options options;
      options.stderr_path = logs_.back();
      ranks_.push_back(std::make_unique<Child>(
          DBUF_COLL_RANK_EXE,
          std::vector<std::string>{"--socket", cluster.node(rank / per_node).socket(), "--job", job, "--rank",
                                   std::to_string(rank), "--world", std::to_string(world), "--scenario", scenario,
                                   "--shape", shape, "--local-world", std::to_string(per_node), "--store", store},
          options));
    }
  }
  /// Every rank exited 0 (each rank's log is printed otherwise).
  ::testing::AssertionResult passed() {
    const auto deadline = Clock::now() + kJobDeadline;
    std::string failures;
    for (std::size_t r = 0; r < ranks_.size(); ++r) {
      const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
      auto status = ranks_[r]->waitExit(std::max(left, milliseconds(1)));
      if (!status) {
        ranks_[r]->killAndReap();
        failures += "rank " + std::to_string(r) + " did not finish in time\n";
      } else if (!WIFEXITED(*status) || WEXITSTATUS(*status) != 0) {
        failures += "rank " + std::to_string(r) + " failed\n";
      }
    }
    if (failures.empty()) return ::testing::AssertionSuccess();
    for (std::size_t r = 0; r < logs_.size(); ++r) {
      std::ifstream in(logs_[r]);
      std::stringstream text;
      text << in.rdbuf();
      failures += "--- rank " + std::to_string(r) + " log\n" + text.str();
    }
    return ::testing::AssertionFailure() << failures;
  }

 private:
  std::vector<std::string> logs_;
  std::vector<std::unique_ptr<Child>> ranks_;
};

/// How many jobs' links found a communicator in the cache ("(reused)") or
/// made one ("(new)"), as node n's log says.
/// How many times `pattern` matches in node n's log.
int logged(const Daemon& daemon, const std::string& pattern) {
  const std::string log = daemon.log();
  const std::regex line(pattern);
  return static_cast<int>(std::distance(std::sregex_iterator(log.begin(), log.end(), line), std::sregex_iterator()));
}

int linksLogged(const Daemon& daemon, const std::string& how) {
  return logged(daemon, "across nodes, reached at [^;]+; communicator [0-9a-f]+ \\(" + how + "\\)");
}

// ------------------------------------------------------------------ every op

struct Layout {
  std::uint32_t nodes;
  std::uint32_t per_node;
};

void everyOpAgainstTheReference(NodeNetwork network, Layout layout, const std::vector<std::string>& shapes) {
  Cluster cluster(layout.nodes, network);
  SKIP_UNLESS_AVAILABLE(cluster);
  cluster.start();
  int jobs = 0;
  for (const std::string& shape : shapes) {
    const std::string job = "ops-" + shape;
    CollJob ops(cluster, job, layout.per_node, "ops", shape, cluster.fileStore(job));
    EXPECT_TRUE(ops.passed()) << shape << "\n" << cluster.logs();
    ++jobs;
  }
  // Jobs after the first found the first one's communicator on every node.
  for (std::uint32_t n = 0; n < cluster.nodes(); ++n) {
    EXPECT_EQ(linksLogged(cluster.node(n), "new"), 1) << cluster.node(n).log();
    EXPECT_EQ(linksLogged(cluster.node(n), "reused"), jobs - 1) << cluster.node(n).log();
  }
}

TEST(MultiNode, EveryOpAndDtypeTwoNodesOfTwoRanks) {
  everyOpAgainstTheReference(NodeNetwork::kLoopback, {2, 2}, {"rows", "mixed", "block"});
}

TEST(MultiNode, EveryOpAndDtypeThreeNodesOfTwoRanks) {
  everyOpAgainstTheReference(NodeNetwork::kLoopback, {3, 2}, {"rows", "element"});
}

TEST(MultiNode, EveryOpAndDtypeFourNodesOfOneRank) {
  everyOpAgainstTheReference(NodeNetwork::kLoopback, {4, 1}, {"rows", "tiny"});
}

TEST(MultiNode, Fp8AllGatherAcrossNodes) {
  Cluster cluster(2, NodeNetwork::kLoopback);
  cluster.start();
  CollJob fp8(cluster, "fp8", 2, "fp8", "rows", cluster.fileStore("fp8"));
  EXPECT_TRUE(fp8.passed()) << cluster.logs();
}

TEST(MultiNode, GroupsLargerThanARoundRunInSeveralRounds) {
  // Shards of over 4 M elements at 2 ranks: each op is several rounds of
  // kRoundElements, two in flight (daemon/src/execution/node_executor.cpp).
  Cluster cluster(2, NodeNetwork::kLoopback);
  cluster.start();
  CollJob large(cluster, "large", 1, "large", "rows", cluster.fileStore("large"));
  EXPECT_TRUE(large.passed()) << cluster.logs();
}

TEST(MultiNode, TwoJobsAtOnceShareTheDaemonsCommunicator) {
  Cluster cluster(2, NodeNetwork::kLoopback);
  cluster.start();
  {
    CollJob first(cluster, "first", 2, "ops", "tiny", cluster.fileStore("first"));
    ASSERT_TRUE(first.passed()) << cluster.logs();
  }
  CollJob a(cluster, "a", 2, "ops", "rows", cluster.fileStore("a"));
  CollJob b(cluster, "b", 2, "ops", "mixed", cluster.fileStore("b"));
  EXPECT_TRUE(a.passed()) << cluster.logs();
  EXPECT_TRUE(b.passed()) << cluster.logs();
  for (std::uint32_t n = 0; n < 2; ++n) {
    EXPECT_EQ(linksLogged(cluster.node(n), "new"), 1) << cluster.node(n).log();
    EXPECT_EQ(linksLogged(cluster.node(n), "reused"), 2) << cluster.node(n).log();
  }
}

TEST(MultiNodeNamespaces, EveryOpAndDtypeTwoNodesOfTwoRanks) {
  everyOpAgainstTheReference(NodeNetwork::kNamespaces, {2, 2}, {"rows", "mixed"});
}

TEST(MultiNodeNamespaces, EveryOpAndDtypeThreeNodesOfTwoRanks) {
  everyOpAgainstTheReference(NodeNetwork::kNamespaces, {3, 2}, {"rows"});
}

TEST(MultiNodeNamespaces, EveryOpAndDtypeFourNodesOfOneRank) {
  everyOpAgainstTheReference(NodeNetwork::kNamespaces, {4, 1}, {"rows"});
}

// ------------------------------------------------------------------ failures

/// `per_node` cf-rank processes on each node of `cluster`, attached to `job`
/// (through the store of `run`, persistent if asked) with a group "g" of
/// 4096 fp32 elements registered and a slot acquired.
class FailureJob {
 public:
  FailureJob(Cluster& cluster, std::string job, std::uint32_t per_node, bool persistent = false,
             const std::string& run = "")
      : cluster_(cluster), job_(std::move(job)), per_node_(per_node), persistent_(persistent) {
    const std::uint32_t world = per_node * cluster.nodes();
    ranks_.resize(world);
    for (std::uint32_t r = 0; r < world; ++r) {
      ranks_[r] = std::make_unique<CfRank>(job_ + "-" + std::to_string(r));
      EXPECT_EQ(ranks_[r]->call("connect " + cluster.node(r / per_node).socket()), "ok connect");
      EXPECT_EQ(ranks_[r]->call(attachCommand(r, run)), "ok attach");
    }
    for (auto& rank : ranks_) rank->begin("register g 4096");
    for (auto& rank : ranks_) EXPECT_LINE(rank->result(), "ok register");
    for (auto& rank : ranks_) EXPECT_EQ(rank->call("acquire g"), "ok acquire");
  }
  /// A new process for rank r (its old one is gone), through the store of
  /// `run`: its daemon kept the job, so it reattaches, to the group as it was.
  void restart(std::uint32_t r, const std::string& run = "") {
    ranks_.at(r) = std::make_unique<CfRank>(job_ + "-" + std::to_string(r) + "-again");
    CfRank& rank = *ranks_[r];
    EXPECT_EQ(rank.call("connect " + cluster_.node(r / per_node_).socket()), "ok connect");
    // Until its daemon has seen the old process go.
    std::string answer;
    for (int tries = 0; tries < 100; ++tries) {
      answer = rank.call(attachCommand(r, run));
      if (answer.find("is already attached") == std::string::npos) break;
      std::this_thread::sleep_for(milliseconds(50));
    }
    EXPECT_EQ(answer, "ok attach reattached");
    EXPECT_LINE(rank.call("register g 4096"), "ok register");
    EXPECT_EQ(rank.call("acquire g"), "ok acquire");
  }
  CfRank& rank(std::uint32_t r) { return *ranks_.at(r); }
  [[nodiscard]] std::uint32_t world() const { return static_cast<std::uint32_t>(ranks_.size()); }
  /// Every rank runs `op`; their answers.
  std::vector<std::string> runAll(const std::string& op) {
    for (auto& rank : ranks_) rank->begin("run " + op + " g");
    std::vector<std::string> answers;
    for (auto& rank : ranks_) answers.push_back(rank->result());
    return answers;
  }
  /// An all-gather and a reduce-scatter with fresh values, checked on every rank.
  void keepsWorking(float base) {
    for (auto& rank : ranks_) EXPECT_EQ(rank->call("fill g " + std::to_string(base)), "ok fill");
    for (const std::string& answer : runAll("ag")) EXPECT_LINE(answer, "ok run");
    for (const std::string& answer : runAll("rs")) EXPECT_LINE(answer, "ok run");
    for (auto& rank : ranks_) {
      EXPECT_EQ(rank->call("checkag g " + std::to_string(base)), "ok checkag");
      EXPECT_EQ(rank->call("checkrs g " + std::to_string(base)), "ok checkrs");
    }
  }
  void finish() {
    for (auto& rank : ranks_) {
      if (rank) rank->call("detach");
    }
    for (auto& rank : ranks_) {
      if (rank) rank->exit();
    }
  }
  void forget(std::uint32_t r) { ranks_.at(r).reset(); }

 private:
  std::string attachCommand(std::uint32_t r, const std::string& run) const {
    return "attach " + job_ + " " + std::to_string(r) + " " + std::to_string(ranks_.size()) + " " +
           std::to_string(r % per_node_) + " " + std::to_string(per_node_) + " " +
           cluster_.fileStore(run.empty() ? job_ : run) + (persistent_ ? " persistent" : "");
  }

  Cluster& cluster_;
  std::string job_;
  std::uint32_t per_node_;
  bool persistent_;
  std::vector<std::unique_ptr<CfRank>> ranks_;
};

TEST(MultiNode, ResultsAreRightAndTheJobKeepsWorking) {
  Cluster cluster(2, NodeNetwork::kLoopback);
  cluster.start();
  FailureJob job(cluster, "right", 2);
  job.keepsWorking(1.5F);
  job.keepsWorking(-3.0F);
  job.finish();
}

TEST(MultiNode, AMismatchAcrossNodesFailsTheOpOnEveryNode) {
  Cluster cluster(2, NodeNetwork::kLoopback);
  cluster.start();
  FailureJob job(cluster, "mismatch", 2);
  // Node 0's ranks all-gather, node 1's reduce-scatter: each node agrees
  // within itself, so only the exchange between the nodes can tell.
  job.rank(0).begin("run ag g");
  job.rank(1).begin("run ag g");
  job.rank(2).begin("run rs g");
  job.rank(3).begin("run rs g");
  for (std::uint32_t r = 0; r < 4; ++r) {
    const std::string answer = job.rank(r).result();
    EXPECT_LINE(answer, "err run conflict");
    EXPECT_NE(answer.find("does not match across nodes"), std::string::npos) << answer;
    EXPECT_NE(answer.find("node 1 (ranks 2-3) reduceScatter"), std::string::npos) << answer;
  }
  job.keepsWorking(2.0F);  // the k-th op failed everywhere alike: the next ones match
  job.finish();
}

TEST(MultiNode, ARankMissingOnAnotherNodeIsNamedInTheTimeout) {
  Cluster cluster(2, NodeNetwork::kLoopback, /*collective_ms=*/1500);
  cluster.start();
  FailureJob job(cluster, "late", 2);
  for (std::uint32_t r = 0; r < 3; ++r) job.rank(r).begin("run ag g");
  for (std::uint32_t r = 0; r < 3; ++r) {
    const std::string answer = job.rank(r).result(milliseconds(10000));
    EXPECT_LINE(answer, "err run timeout");
    EXPECT_NE(answer.find("rank 3 of job late has not submitted it"), std::string::npos) << answer;
    if (r < 2) {
      EXPECT_NE(answer.find("on node 1 (ranks 2-3)"), std::string::npos) << answer;
    }
  }
  // Rank 3's first op is the one it missed: it fails at once, the next ones run.
  EXPECT_LINE(job.rank(3).call("run ag g"), "err run timeout");
  job.keepsWorking(4.0F);
  job.finish();
}

TEST(MultiNode, ANodeWhoseRanksAllStayAwayIsNamedWhenTheExchangeTimesOut) {
  Cluster cluster(2, NodeNetwork::kLoopback, /*collective_ms=*/500);
  cluster.start();
  FailureJob bystander(cluster, "bystander", 1);
  bystander.keepsWorking(1.0F);  // its link is made: the next job shares its communicator
  FailureJob job(cluster, "absent", 1);
  const std::string answer = job.rank(0).call("run ag g", milliseconds(10000));
  EXPECT_LINE(answer, "err run timeout");
  EXPECT_NE(answer.find("waiting for node 1 (rank 1)"), std::string::npos) << answer;
  EXPECT_LT(elapsedOf(answer), 5000) << answer;  // twice collective_ms, and some
  // The late node's daemon still sends its part when its rank comes: it
  // lands in what the timed-out exchange left, and fails there in turn.
  EXPECT_LINE(job.rank(1).call("run ag g", milliseconds(10000)), "err run");
  // The timeout was the job's, not the communicator's: the other job goes on.
  bystander.keepsWorking(3.0F);
  job.finish();
  bystander.finish();
  for (std::uint32_t n = 0; n < 2; ++n) EXPECT_EQ(linksLogged(cluster.node(n), "new"), 1) << cluster.node(n).log();
}

TEST(MultiNode, KillingARankFailsTheJobOnEveryNodeAndSparesOthers) {
  Cluster cluster(2, NodeNetwork::kLoopback);
  cluster.start();
  FailureJob other(cluster, "bystander", 1);
  FailureJob job(cluster, "victim", 2);
  job.keepsWorking(1.0F);
  for (std::uint32_t r = 0; r < 3; ++r) job.rank(r).begin("run rs g");
  job.rank(3).kill9();
  job.forget(3);
  for (std::uint32_t r = 0; r < 3; ++r) {
    const std::string answer = job.rank(r).result();
    EXPECT_LINE(answer, "err run conflict");
    EXPECT_NE(answer.find("rank 3 of job victim disconnected"), std::string::npos) << answer;
    EXPECT_LT(elapsedOf(answer), 10000) << answer;  // collective_ms is 30 s
  }
  // The job cannot go on across nodes; the error comes at once, on both nodes.
  for (std::uint32_t r : {0U, 2U}) {
    const std::string answer = job.rank(r).call("run ag g");
    EXPECT_LINE(answer, "err run");
    EXPECT_NE(answer.find("rank 3"), std::string::npos) << answer;
  }
  other.keepsWorking(7.0F);
  job.finish();
  other.finish();
}

TEST(MultiNode, KillingARankInTheMiddleOfAManyRoundOpFailsItOnTheOtherNode) {
  Cluster cluster(2, NodeNetwork::kLoopback);
  cluster.start();
  CfRank r0("big-0");
  CfRank r1("big-1");
  r0.attach(cluster.node(0).socket(), "big", 0, 2, " 0 1 " + cluster.fileStore("big"));
  r1.attach(cluster.node(1).socket(), "big", 1, 2, " 0 1 " + cluster.fileStore("big"));
  r0.begin("register big 16000000");  // 8 M elements a rank: four rounds
  r1.begin("register big 16000000");
  EXPECT_LINE(r0.result(), "ok register");
  EXPECT_LINE(r1.result(), "ok register");
  for (CfRank* rank : {&r0, &r1}) {
    EXPECT_EQ(rank->call("acquire big"), "ok acquire");
    EXPECT_EQ(rank->call("fill big 1"), "ok fill");
  }
  r0.begin("run ag big");
  EXPECT_LINE(r1.call("submit ag big"), "ok submit");
  EXPECT_LINE(r1.call("watch big", milliseconds(20000)), "ok watch");  // the daemon started it
  r1.kill9();
  const std::string answer = r0.result(milliseconds(20000));
  if (answer.rfind("ok run", 0) != 0) {  // else it was done before the kill
    EXPECT_LINE(answer, "err run");
    EXPECT_NE(answer.find("rank 1"), std::string::npos) << answer;
  }
  EXPECT_LINE(r0.call("run ag big"), "err run");  // at once: the job cannot go on
  r0.exit();
}

/// Every rank of `job` runs "rejoin" (barriers until one succeeds), as a
/// trainer does after a failure; each must succeed.
void rejoinAll(FailureJob& job) {
  for (std::uint32_t r = 0; r < job.world(); ++r) job.rank(r).begin("rejoin 100");
  for (std::uint32_t r = 0; r < job.world(); ++r) {
    const std::string answer = job.rank(r).result(milliseconds(30000));
    EXPECT_LINE(answer, "ok rejoin");
    // The nodes meet as soon as the last rank is back (3 s is collective_ms).
    EXPECT_LT(elapsedOf(answer), 3000) << answer;
    std::cout << "rank " << r << ": " << answer << "\n";
  }
}

/// How many times node n's log says the job's nodes met again.
int meetingsLogged(const Daemon& daemon, const std::string& job) {
  return logged(daemon, "job " + job + ": meeting its other nodes again");
}

TEST(MultiNode, AKilledRankReattachesAndTheJobGoesOnOnEveryNode) {
  Cluster cluster(2, NodeNetwork::kLoopback, /*collective_ms=*/3000);
  cluster.start();
  FailureJob other(cluster, "bystander", 1);
  other.keepsWorking(0.5F);  // its link is made: the next job shares its communicator
  FailureJob job(cluster, "phoenix", 2);
  job.keepsWorking(1.0F);  // every rank's shard now holds (rank + 1) * 1
  job.rank(1).kill9();
  // Node 0 fails the op at once; node 1 learns it from node 0's header.
  for (std::uint32_t r : {0U, 2U, 3U}) job.rank(r).begin("run ag g");
  for (std::uint32_t r : {0U, 2U, 3U}) {
    const std::string answer = job.rank(r).result();
    EXPECT_LINE(answer, "err run conflict");
    EXPECT_NE(answer.find("rank 1 of job phoenix disconnected"), std::string::npos) << answer;
  }
  // Until rank 1 is back, every op of the job fails at once, on both nodes,
  // saying so; the other job goes on.
  for (std::uint32_t r : {0U, 2U, 3U}) {
    const std::string answer = job.rank(r).call("run barrier g");
    EXPECT_LINE(answer, "err run conflict");
    EXPECT_NE(answer.find("meet again once each has all its ranks attached"), std::string::npos) << answer;
    EXPECT_LT(elapsedOf(answer), 1000) << answer;
  }
  other.keepsWorking(2.0F);
  job.restart(1);
  rejoinAll(job);
  // Rank 1's shard is as its first process left it, and the bytes cross.
  for (const std::string& answer : job.runAll("ag")) EXPECT_LINE(answer, "ok run");
  for (std::uint32_t r = 0; r < job.world(); ++r) EXPECT_EQ(job.rank(r).call("checkag g 1"), "ok checkag");
  job.keepsWorking(5.0F);
  other.keepsWorking(3.0F);
  job.finish();
  other.finish();
  for (std::uint32_t n = 0; n < 2; ++n) {
    EXPECT_EQ(meetingsLogged(cluster.node(n), "phoenix"), 1) << cluster.node(n).log();
    EXPECT_EQ(linksLogged(cluster.node(n), "new"), 1) << cluster.node(n).log();  // the meeting reused it
  }
}

TEST(MultiNode, ARankKilledOnEachNodeInTurnRejoinsEachTime) {
  Cluster cluster(2, NodeNetwork::kLoopback, /*collective_ms=*/3000);
  cluster.start();
  FailureJob job(cluster, "twice", 2);
  job.keepsWorking(1.0F);
  job.rank(3).kill9();  // node 1
  job.rank(0).kill9();  // node 0, before node 1's loss reached it
  job.restart(3);
  job.restart(0);
  rejoinAll(job);
  job.keepsWorking(2.0F);
  job.rank(2).kill9();
  job.restart(2);
  rejoinAll(job);
  job.keepsWorking(3.0F);
  job.finish();
  if (HasFailure()) ADD_FAILURE() << cluster.logs();
}

TEST(MultiNode, APersistentJobRestartedAsANewRunKeepsItsShards) {
  Cluster cluster(2, NodeNetwork::kLoopback, /*collective_ms=*/3000);
  cluster.start();
  FailureJob job(cluster, "kept", 2, /*persistent=*/true, "kept.run0");
  job.keepsWorking(1.0F);
  // Every rank dies (torchrun restarts them all), and comes back with the
  // next restart count's keys.
  for (std::uint32_t r = 0; r < job.world(); ++r) job.rank(r).kill9();
  for (std::uint32_t r = 0; r < job.world(); ++r) job.restart(r, "kept.run1");
  rejoinAll(job);
  for (const std::string& answer : job.runAll("ag")) EXPECT_LINE(answer, "ok run");
  for (std::uint32_t r = 0; r < job.world(); ++r) EXPECT_EQ(job.rank(r).call("checkag g 1"), "ok checkag");
  job.keepsWorking(4.0F);
  job.finish();
  for (std::uint32_t n = 0; n < 2; ++n) {
    EXPECT_NE(cluster.node(n).log().find("job kept: restarted with store"), std::string::npos) << cluster.node(n).log();
  }
}

TEST(MultiNode, KillingANodesDaemonFailsTheJobOnTheOtherNodes) {
  Cluster cluster(2, NodeNetwork::kLoopback);
  cluster.start();
  FailureJob job(cluster, "orphan", 1);
  job.keepsWorking(1.0F);
  EXPECT_TRUE(cluster.node(1).process().killAndReap());
  const std::string answer = job.rank(0).call("run ag g");
  EXPECT_LINE(answer, "err run");
  EXPECT_LT(elapsedOf(answer), 10000) << answer;
  // Node 0's daemon serves a job of its own as before.
  CfRank alone("alone");
  alone.attach(cluster.node(0).socket(), "alone", 0, 1);
  alone.begin("register g 1024");
  EXPECT_LINE(alone.result(), "ok register");
  EXPECT_EQ(alone.call("acquire g"), "ok acquire");
  EXPECT_LINE(alone.call("run ag g"), "ok run");
  alone.exit();
  job.rank(1).exit();  // its daemon is gone: it only has to end
  job.forget(1);
  job.finish();
  if (HasFailure()) ADD_FAILURE() << cluster.logs();
}

// ------------------------------------------------------------------ stores

TEST(MultiNode, StoresTheDaemonRefuses) {
  Cluster cluster(2, NodeNetwork::kLoopback);
  cluster.start();
  const std::string shared = cluster.dir().path("world-writable");
  ::mkdir(shared.c_str(), 0700);
  ::chmod(shared.c_str(), 0777);
  CfRank rank("refused");
  EXPECT_EQ(rank.call("connect " + cluster.node(0).socket()), "ok connect");
  const std::string writable = rank.call("attach j 0 2 0 1 file:" + shared);
  EXPECT_LINE(writable, "err attach permission_denied");
  EXPECT_NE(writable.find("writable by nobody else"), std::string::npos) << writable;
  EXPECT_EQ(rank.call("connect " + cluster.node(0).socket()), "ok connect");
  const std::string redis = rank.call("attach j 0 2 0 1 redis:127.0.0.1:6379");
  EXPECT_LINE(redis, "err attach permission_denied");
  EXPECT_NE(redis.find("store_hosts"), std::string::npos) << redis;
  EXPECT_EQ(rank.call("connect " + cluster.node(0).socket()), "ok connect");
  EXPECT_LINE(rank.call("attach j 0 2 0 1 ftp:somewhere"), "err attach invalid_argument");
  rank.exit();
}

/// A redis-server of the test's own on a free port, or nothing (not installed).
class RedisServer {
 public:
  explicit RedisServer(const TempDir& dir) {
    const char* candidates[] = {"/usr/bin/redis-server", "/usr/local/bin/redis-server"};
    for (const char* path : candidates) {
      if (::access(path, X_OK) == 0) executable_ = path;
    }
    if (executable_.empty()) return;
    port_ = 20000 + static_cast<int>(::getpid() % 20000);
    Child::Options options;
    options.stderr_path = dir.path("redis.log");
    server_ = std::make_unique<Child>(
        executable_,
        std::vector<std::string>{"--port", std::to_string(port_), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", dir.path(""), "--logfile", dir.path("redis.log")},
        options);
    std::string output;
    for (int attempt = 0; attempt < 100; ++attempt) {
      if (::access("/usr/bin/redis-cli", X_OK) == 0 &&
          runCommand({"/usr/bin/redis-cli", "-p", std::to_string(port_), "ping"}, &output) == 0 &&
          output.find("PONG") != std::string::npos) {
        return;
      }
      ::usleep(50000);
    }
    server_.reset();
  }
  [[nodiscard]] bool running() const { return server_ != nullptr; }
  [[nodiscard]] int port() const { return port_; }

 private:
  std::string executable_;
  int port_ = 0;
  std::unique_ptr<Child> server_;
};

TEST(MultiNode, EveryOpThroughARedisStore) {
  TempDir redis_dir("dbuf-redis");
  RedisServer redis(redis_dir);
  if (!redis.running()) GTEST_SKIP() << "redis-server is not installed (scripts/install-deps.sh installs it)";
  const std::string host = "127.0.0.1:" + std::to_string(redis.port());
  Cluster cluster(2, NodeNetwork::kLoopback, 30000, "store_hosts = [\"" + host + "\"]\n");
  cluster.start();
  CollJob ops(cluster, "redis-ops", 2, "ops", "rows", "redis:" + host + "#run1");
  EXPECT_TRUE(ops.passed()) << cluster.logs();
}

}  // namespace
}  // namespace dbuf::mp
