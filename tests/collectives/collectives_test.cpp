// Grouped collectives over shared-memory rings, end to end: a real dbufd
// (tests/multiprocess harness) and world_size real trainer processes
// (coll-rank), each checking every result element by element against the
// reference of reference.hpp. Label: collectives (host backend).
//
// Built a second time as gpu_collectives_test (DBUF_COLL_GPU; label gpu,
// skipped without a GPU): the same suite on GPU memory, dbufd running its
// cuda backend and the ranks attaching on GPU 0. One-rank jobs go through the
// NCCL path (dbufd without virtual ranks), larger ones are virtual ranks on
// the one GPU: a machine with one GPU can run nothing else, and both must
// equal the reference bit for bit like the host backend.
//
// One process launch per (world, shape) runs every op on one group per dtype
// pair; the fp8, training and large-shard tests have scenarios of their own.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "harness.hpp"
#include "support/sanitizers.hpp"
#include "reference.hpp"

#if defined(DBUF_COLL_GPU)
#include "gpu_test_support.hpp"
#define DBUF_SKIP_WITHOUT_A_GPU_IF_NEEDED() DBUF_SKIP_WITHOUT_GPU()
#else
#define DBUF_SKIP_WITHOUT_A_GPU_IF_NEEDED() static_cast<void>(0)
#endif

extern char** environ;  // NOLINT(readability-identifier-naming): POSIX name

namespace dbuf::coll {
namespace {

#ifndef DBUF_COLL_RANK_EXE
#error "DBUF_COLL_RANK_EXE must name the coll-rank binary"
#endif

using Clock = std::chrono::steady_clock;
using dbuf::mp::Daemon;
using dbuf::testing::Child;
using dbuf::testing::TempDir;

/// A whole job must finish within this (far more than it needs; a hang is
/// killed, not waited for). Longer under a sanitizer.
constexpr std::chrono::seconds kJobDeadline = dbuf::testing::sanitizerScaled(std::chrono::seconds(60));

struct JobSpec {
  std::string job;
  std::string scenario;
  std::string shape = "rows";
  std::uint32_t world = 1;
  std::uint64_t seed = 1;
  bool rank_outputs = false;  ///< pass --out <dir>/<job>-<rank>.bin
  bool gpu_per_rank = false;  ///< GPU suite: rank r attaches on GPU r (else every rank on GPU 0)
  /// A job across nodes: rank r attaches to node_sockets[r / local_world],
  /// the nodes meeting through `store` (empty: one node, the Job's daemon).
  std::vector<std::string> node_sockets{};
  std::uint32_t local_world = 0;
  std::string store{};
};

#if defined(DBUF_COLL_GPU)
constexpr bool kOnGpu = true;
#else
constexpr bool kOnGpu = false;
#endif

std::string collRankExecutable() {
  // The GPU bundle runs its copies from its bin/ (its run script exports DBUF_BIN_DIR).
  if (const char* dir = std::getenv("DBUF_BIN_DIR"); dir != nullptr) return std::string(dir) + "/coll-rank";  // NOLINT
  return DBUF_COLL_RANK_EXE;
}

/// The test's environment minus what would make a child behave differently.
std::vector<std::string> childEnvironment() {
  std::vector<std::string> environment;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string text(*entry);
    if (text.rfind("DBUF_SOCKET=", 0) == 0 || text.rfind("NOTIFY_SOCKET=", 0) == 0) continue;
    environment.push_back(text);
  }
  return environment;
}

/// One job: world_size coll-rank processes started at once, each logging to
/// <dir>/<job>-<rank>.log.
class Job {
 public:
  Job(const TempDir& dir, const Daemon& daemon, JobSpec spec) : spec_(std::move(spec)) {
    for (std::uint32_t rank = 0; rank < spec_.world; ++rank) {
      const std::string name = spec_.job + "-" + std::to_string(rank);
      logs_.push_back(dir.path(name + ".log"));
      outputs_.push_back(dir.path(name + ".bin"));
      const std::string socket = spec_.node_sockets.empty() ? daemon.socket()
                                                            : spec_.node_sockets.at(rank / spec_.local_world);
      std::vector<std::string> args = {"--socket",   socket,
                                       "--job",      spec_.job,
                                       "--rank",     std::to_string(rank),
                                       "--world",    std::to_string(spec_.world),
                                       "--scenario", spec_.scenario,
                                       "--shape",    spec_.shape,
                                       "--seed",     std::to_string(spec_.seed)};
      if (spec_.rank_outputs) args.insert(args.end(), {"--out", outputs_.back()});
      if (!spec_.node_sockets.empty()) {
        args.insert(args.end(), {"--local-world", std::to_string(spec_.local_world), "--store", spec_.store});
      }
      if (kOnGpu) args.insert(args.end(), {"--device", spec_.gpu_per_rank ? std::to_string(rank) : "0"});
      Child::Options options;
      options.stderr_path = logs_.back();
      options.environment = childEnvironment();
      ranks_.push_back(std::make_unique<Child>(collRankExecutable(), args, options));
    }
  }

  /// Waits for every rank (killing all that are left at the deadline) and
  /// expects each to have exited 0; on failure prints each rank's log.
  void expectAllPassed(const Daemon& daemon) {
    const auto deadline = Clock::now() + kJobDeadline;
    std::vector<std::optional<int>> status(ranks_.size());
    bool timed_out = false;
    for (std::size_t r = 0; r < ranks_.size(); ++r) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      status[r] = ranks_[r]->waitExit(std::max(left, std::chrono::milliseconds(0)));
      if (!status[r]) {
        timed_out = true;
        break;
      }
    }
    if (timed_out) {
      for (auto& rank : ranks_) {
        if (rank->running()) rank->killAndReap();
      }
    }
    for (std::size_t r = 0; r < ranks_.size(); ++r) {
      const std::string log = dbuf::testing::readFile(logs_[r]);
      const bool passed = status[r] && WIFEXITED(*status[r]) && WEXITSTATUS(*status[r]) == 0;
      if (passed) {
        std::cout << lastLine(log) << "\n";
        continue;
      }
      std::string how = "killed at the " + std::to_string(kJobDeadline.count()) + " s deadline";
      if (status[r] && WIFEXITED(*status[r])) how = "exit status " + std::to_string(WEXITSTATUS(*status[r]));
      if (status[r] && WIFSIGNALED(*status[r])) how = "signal " + std::to_string(WTERMSIG(*status[r]));
      ADD_FAILURE() << "job " << spec_.job << " (" << spec_.scenario << ", shape " << spec_.shape << ", world "
                    << spec_.world << ") rank " << r << ": " << how << "\n--- rank log\n"
                    << log << "--- dbufd log (tail)\n"
                    << tail(daemon.log(), 30);
    }
  }

  [[nodiscard]] const std::string& output(std::uint32_t rank) const { return outputs_.at(rank); }

 private:
  static std::string lastLine(const std::string& text) {
    const std::size_t end = text.find_last_not_of('\n');
    if (end == std::string::npos) return "";
    const std::size_t begin = text.rfind('\n', end);
    return text.substr(begin == std::string::npos ? 0 : begin + 1,
                       end + 1 - (begin == std::string::npos ? 0 : begin + 1));
  }
  static std::string tail(const std::string& text, int lines) {
    std::size_t at = text.size();
    for (int i = 0; i <= lines && at != std::string::npos && at > 0; ++i) at = text.rfind('\n', at - 1);
    return at == std::string::npos ? text : text.substr(at + 1);
  }

  JobSpec spec_;
  std::vector<std::string> logs_;
  std::vector<std::string> outputs_;
  std::vector<std::unique_ptr<Child>> ranks_;
};

/// dbufd's settings for jobs of `world` ranks: the host backend, or on GPU
/// the cuda backend with one-rank jobs (and `gpu_per_rank` ones) through
/// NCCL and other ones as virtual ranks on one GPU.
Daemon::Settings settingsFor(std::uint32_t world, bool gpu_per_rank) {
  Daemon::Settings settings;
  if (kOnGpu) {
    settings.extra_args = {"--backend", "cuda", "--virtual-ranks", world == 1 || gpu_per_rank ? "0" : "8"};
    settings.tenants_by_uid = false;  // the GPU bundle may run as any user
  }
  return settings;
}

/// A daemon in a fresh directory for one test, for jobs of up to 8 ranks
/// (`world` 1: one-rank jobs only).
struct Node {
  explicit Node(std::uint32_t world = 8, bool gpu_per_rank = false)
      : daemon(dir.path(), settingsFor(world, gpu_per_rank)) {}
  TempDir dir{"dbuf-coll"};
  Daemon daemon;
};

void runJob(Node& node, const JobSpec& spec) {
  Job job(node.dir, node.daemon, spec);
  job.expectAllPassed(node.daemon);
}

// ----------------------------------------------------------------- every op

using OpsParam = std::tuple<std::uint32_t, std::string>;

class CollectiveOps : public ::testing::TestWithParam<OpsParam> {};

TEST_P(CollectiveOps, EveryOpAndDtypePairMatchesTheReference) {
  DBUF_SKIP_WITHOUT_A_GPU_IF_NEEDED();
  const auto& [world, shape] = GetParam();
  Node node(world);
  ASSERT_NO_FATAL_FAILURE(node.daemon.start());
  runJob(node, {"ops-" + shape + "-" + std::to_string(world), "ops", shape, world,
                1000 + world * 10 + std::hash<std::string>{}(shape) % 10, false});
}

std::string opsName(const ::testing::TestParamInfo<OpsParam>& info) {
  return std::get<1>(info.param) + "_world" + std::to_string(std::get<0>(info.param));
}

#if defined(DBUF_COLL_GPU)
// 1 rank: the NCCL path; 2 and 4: virtual ranks on one GPU.
INSTANTIATE_TEST_SUITE_P(GpuRanks, CollectiveOps,
                         ::testing::Combine(::testing::Values(1U, 2U, 4U),
                                            ::testing::Values("element", "rows", "block", "mixed", "tiny", "medium")),
                         opsName);

// Two ranks on two GPUs through NCCL, where the machine has them. Bit for
// bit like the reference: NCCL sums in fp32 like the engine, and a sum of
// two is the same in either order (with more ranks the order is NCCL's;
// NaN payloads would differ, and the suite's gradients are finite).
class NcclCollectiveOps : public ::testing::TestWithParam<std::string> {};

TEST_P(NcclCollectiveOps, TwoRanksOnTwoGpusMatchTheReference) {
  DBUF_SKIP_WITHOUT_A_GPU_IF_NEEDED();
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 2) GTEST_SKIP() << "needs 2 GPUs, this machine has " << gpus;
  Node node(2, true);
  ASSERT_NO_FATAL_FAILURE(node.daemon.start());
  JobSpec spec{"nccl-" + GetParam(), "ops", GetParam(), 2, 2000 + std::hash<std::string>{}(GetParam()) % 10, false};
  spec.gpu_per_rank = true;
  runJob(node, spec);
}

INSTANTIATE_TEST_SUITE_P(TwoGpus, NcclCollectiveOps, ::testing::Values("rows", "block", "mixed"));

// A job across two "nodes" on one GPU: two dbufd, each with one rank of the
// job, told apart by NCCL as two hosts (NCCL_HOSTID; else it would refuse
// two ranks of one communicator on one GPU), so one NCCL communicator over
// both daemons' GPUs runs every op, each op's headers first going between
// the daemons over Gloo. Bit for bit like the node-order reference: a sum of
// two is the same in either order.
TEST(NcclAcrossNodes, TwoDaemonsOnOneGpuAsTwoHostsMatchTheReference) {
  DBUF_SKIP_WITHOUT_A_GPU_IF_NEEDED();
  TempDir dir{"dbuf-coll-nodes"};
  const std::string store = dir.path("store");
  ASSERT_EQ(::mkdir(store.c_str(), 0700), 0);
  std::vector<std::unique_ptr<Daemon>> nodes;
  std::vector<std::string> sockets;
  for (int n = 0; n < 2; ++n) {
    const std::string node_dir = dir.path("node" + std::to_string(n));
    ASSERT_EQ(::mkdir(node_dir.c_str(), 0700), 0);
    Daemon::Settings settings = settingsFor(1, true);
    settings.extra_config = "[cluster]\naddress = \"127.0.0.1\"\n";
    settings.launcher = {"/usr/bin/env", "NCCL_HOSTID=dbuf-node-" + std::to_string(n)};
    nodes.push_back(std::make_unique<Daemon>(node_dir, settings));
    ASSERT_NO_FATAL_FAILURE(nodes.back()->start());
    sockets.push_back(nodes.back()->socket());
  }
  for (const std::string shape : {"rows", "block", "mixed"}) {
    JobSpec spec{"nodes-" + shape, "ops", shape, 2, 3000 + std::hash<std::string>{}(shape) % 10, false};
    spec.node_sockets = sockets;
    spec.local_world = 1;
    spec.store = "file:" + store + "#nodes-" + shape;
    Job job(dir, *nodes[0], spec);
    job.expectAllPassed(*nodes[0]);
  }
  if (HasFailure()) ADD_FAILURE() << "--- node 1's dbufd log\n" << nodes[1]->log();
}

TEST(Fp8AllGather, OneRankThroughNcclEqualsFullTensorQuantizationBitwise) {
  DBUF_SKIP_WITHOUT_A_GPU_IF_NEEDED();
  Node node(1);
  ASSERT_NO_FATAL_FAILURE(node.daemon.start());
  runJob(node, {"fp8-1", "fp8", "", 1, 501, false});
}
#else
INSTANTIATE_TEST_SUITE_P(Ranks, CollectiveOps,
                         ::testing::Combine(::testing::Values(1U, 2U, 3U, 4U, 8U),
                                            ::testing::Values("element", "rows", "block", "mixed", "tiny")),
                         opsName);
INSTANTIATE_TEST_SUITE_P(OddRanks, CollectiveOps,
                         ::testing::Combine(::testing::Values(5U, 7U), ::testing::Values("mixed")), opsName);
INSTANTIATE_TEST_SUITE_P(MultiThreadedKernels, CollectiveOps,
                         ::testing::Combine(::testing::Values(3U), ::testing::Values("medium")), opsName);
#endif

TEST(CollectiveJobs, TwoJobsOnOneDaemonInterleave) {
  DBUF_SKIP_WITHOUT_A_GPU_IF_NEEDED();
  Node node;
  ASSERT_NO_FATAL_FAILURE(node.daemon.start());
  Job a(node.dir, node.daemon, {"interleave-a", "ops", "rows", 3, 71, false});
  Job b(node.dir, node.daemon, {"interleave-b", "ops", "block", 2, 72, false});
  a.expectAllPassed(node.daemon);
  b.expectAllPassed(node.daemon);
}

// ----------------------------------------------------------------- fp8

TEST(Fp8AllGather, ShardedBlockQuantizationEqualsFullTensorQuantizationBitwise) {
  DBUF_SKIP_WITHOUT_A_GPU_IF_NEEDED();
  Node node;
  ASSERT_NO_FATAL_FAILURE(node.daemon.start());
  for (const std::uint32_t world : {2U, 3U, 4U, 8U}) {
    SCOPED_TRACE("world " + std::to_string(world));
    runJob(node, {"fp8-" + std::to_string(world), "fp8", "", world, 500 + world, false});
  }
}

// ----------------------------------------------------------------- training

TEST(TrainingStep, FourRanksFiveSgdStepsMatchSingleProcessReference) {
  DBUF_SKIP_WITHOUT_A_GPU_IF_NEEDED();
  Node node;
  ASSERT_NO_FATAL_FAILURE(node.daemon.start());
  constexpr std::uint64_t kSeed = 4242;
  Job job(node.dir, node.daemon, {"train", "train", "", kTrainWorld, kSeed, true});
  job.expectAllPassed(node.daemon);
  if (HasFailure()) return;

  // Assemble the master weights from every rank's final shard.
  const std::vector<TrainTensor> tensors = trainTensors();
  std::vector<std::vector<float>> master(tensors.size());
  std::vector<std::vector<int>> covered(tensors.size());
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    master[t].assign(static_cast<std::size_t>(tensors[t].numel()), std::nanf(""));
    covered[t].assign(static_cast<std::size_t>(tensors[t].numel()), 0);
  }
  for (std::uint32_t rank = 0; rank < kTrainWorld; ++rank) {
    std::ifstream in(job.output(rank), std::ios::binary);
    ASSERT_TRUE(in) << "rank " << rank << " wrote no " << job.output(rank);
    std::int64_t header[3];
    while (in.read(reinterpret_cast<char*>(header), sizeof header)) {
      const auto t = static_cast<std::size_t>(header[0]);
      ASSERT_LT(t, tensors.size());
      ASSERT_TRUE(header[1] >= 0 && header[1] <= header[2] && header[2] <= tensors[t].numel())
          << "rank " << rank << " tensor " << t << " [" << header[1] << ", " << header[2] << ")";
      for (std::int64_t e = header[1]; e < header[2]; ++e) {
        float value = 0;
        ASSERT_TRUE(in.read(reinterpret_cast<char*>(&value), sizeof value)) << "rank " << rank << ": short file";
        master[t][static_cast<std::size_t>(e)] = value;
        ++covered[t][static_cast<std::size_t>(e)];
      }
    }
  }
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    for (std::size_t e = 0; e < covered[t].size(); ++e) {
      ASSERT_EQ(covered[t][e], 1) << "element " << e << " of tensor " << tensors[t].name
                                  << " is held by that many ranks, expected exactly one";
    }
  }

  const std::vector<std::vector<float>> reference = trainReference(kSeed);
  bool bitwise = true;
  double max_abs = 0;
  double max_rel = 0;
  std::string worst;
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    for (std::size_t e = 0; e < reference[t].size(); ++e) {
      const float want = reference[t][e];
      const float got = master[t][e];
      if (std::bit_cast<std::uint32_t>(want) != std::bit_cast<std::uint32_t>(got)) bitwise = false;
      const double abs = std::fabs(static_cast<double>(got) - static_cast<double>(want));
      const double rel = abs / std::max(std::fabs(static_cast<double>(want)), 1e-30);
      if (!(abs <= max_abs)) {
        max_abs = abs;
        std::ostringstream text;
        text << tensors[t].name << "[" << e << "]: reference " << want << ", dbuf " << got;
        worst = text.str();
      }
      max_rel = std::max(max_rel, rel);
      EXPECT_LE(rel, 1e-6) << tensors[t].name << "[" << e << "]: reference " << want << ", dbuf " << got;
      if (rel > 1e-6) return;  // the first is enough
    }
  }
  std::cout << "training: " << kTrainSteps << " steps, " << kTrainWorld << " ranks: master weights "
            << (bitwise ? "bitwise equal to" : "within tolerance of") << " the single-process reference (max abs diff "
            << max_abs << ", max rel diff " << max_rel << (worst.empty() ? "" : "; largest at " + worst) << ")\n";
  RecordProperty("bitwise", bitwise ? "true" : "false");
  RecordProperty("max_rel_diff", std::to_string(max_rel));
}

// ----------------------------------------------------------------- large

TEST(LargeGroup, ShardsLargerThanOneDaemonStep) {
  DBUF_SKIP_WITHOUT_A_GPU_IF_NEEDED();
  Node node;
  ASSERT_NO_FATAL_FAILURE(node.daemon.start());
  runJob(node, {"large", "large", "", 2, 99, false});
}

// Two jobs whose ops take several daemon steps each: the daemon gives the
// jobs steps in turn (one fp32 reduction scratch for all of them).
TEST(LargeGroup, TwoJobsWithMultiStepOpsInterleave) {
  DBUF_SKIP_WITHOUT_A_GPU_IF_NEEDED();
  Node node;
  ASSERT_NO_FATAL_FAILURE(node.daemon.start());
  Job a(node.dir, node.daemon, {"large-a", "large", "bf16", 2, 101, false});
  Job b(node.dir, node.daemon, {"large-b", "large", "bf16", 2, 102, false});
  a.expectAllPassed(node.daemon);
  b.expectAllPassed(node.daemon);
}

}  // namespace
}  // namespace dbuf::coll
