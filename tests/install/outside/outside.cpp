// A program from outside the dbuf tree, in C++20, built against an installed
// libdbuf (tests/install): the C program's job (outside.c) through
// dbuf/client.hpp, and the planner's part of the API (dbuf::planner, declared
// in the headers client.hpp includes) called directly. Two ranks (this
// process forks them) attach to the dbufd at SOCKET as job JOB, register a
// group of two fp32 tensors, all-gather their shards, reduce-scatter
// gradients and all-reduce them, checking every element bitwise. Any error
// ends it with a message and a non-zero status.
//
//   outside_cpp SOCKET JOB
#include <dbuf/client.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

constexpr std::uint32_t kWorld = 2;
constexpr std::chrono::milliseconds kTimeout{20000};

[[noreturn]] void fail(std::uint32_t rank, const std::string& what) {
  std::fprintf(stderr, "outside_cpp rank %u: %s\n", rank, what.c_str());
  std::exit(1);
}

template <typename T>
T check(std::uint32_t rank, const char* what, dbuf::Result<T> result) {
  if (!result) fail(rank, std::string(what) + ": " + result.error().message);
  return std::move(result).value();
}
void check(std::uint32_t rank, const char* what, const dbuf::Result<void>& result) {
  if (!result) fail(rank, std::string(what) + ": " + result.error().message);
}

// Exact in fp32: the sum of two ranks' values is the same in any order.
float paramValue(std::size_t tensor, std::int64_t element) {
  return static_cast<float>(tensor * 1000 + static_cast<std::size_t>(element)) * 0.5F;
}
float gradValue(std::uint32_t rank, std::size_t tensor, std::int64_t element) {
  return static_cast<float>((rank + 1) * 10000 + tensor * 100 + static_cast<std::size_t>(element)) * 0.25F;
}

void expectBits(std::uint32_t rank, const char* op, std::size_t tensor, std::int64_t element, float got, float want) {
  if (std::bit_cast<std::uint32_t>(got) != std::bit_cast<std::uint32_t>(want)) {
    fail(rank, std::string(op) + ": tensor " + std::to_string(tensor) + " element " + std::to_string(element) +
                   " is " + std::to_string(got) + ", not " + std::to_string(want));
  }
}

int runRank(const std::string& socket, const std::string& job, std::uint32_t rank) {
  auto client = check(rank, "connect", dbuf::Client::connect({.socket_path = socket, .timeout = kTimeout}));
  check(rank, "attach", client.attach({.job = job, .rank = rank, .world_size = kWorld}));
  dbuf::GroupSpec spec;
  spec.name = "layer";
  spec.tensors.resize(2);
  spec.tensors[0].name = "w";
  spec.tensors[0].shape = {6, 4};
  spec.tensors[1].name = "b";
  spec.tensors[1].shape = {5};
  spec.granularity = "rows:2";  // w in blocks of 2 rows; b (1D) by element
  spec.sharded_dtype = dbuf::DType::kF32;
  spec.unsharded_dtype = dbuf::DType::kF32;
  auto group = check(rank, "registerGroup", client.registerGroup(spec));
  const dbuf::GroupPlan& plan = group.plan();
  if (plan.devices != kWorld || plan.tensors.size() != 2) fail(rank, "the plan is not of 2 tensors over 2 ranks");

  // The planner through the library: this rank's slice of each tensor is the
  // one its shard view shows.
  std::int64_t checked = 0;
  for (std::size_t t = 0; t < plan.tensors.size(); ++t) {
    const dbuf::TensorView shard = group.shardView(t);
    const auto slice = dbuf::planner::sliceOnRank(plan.tensors[t], plan.shard_elems, rank);
    const std::int64_t begin = slice ? slice->begin : 0;
    const std::int64_t end = slice ? slice->end : 0;
    if (shard.numel() != end - begin || (shard.numel() > 0 && shard.begin != begin)) {
      fail(rank, "the shard view of tensor " + std::to_string(t) + " is not the planner's slice");
    }
    for (std::int64_t e = shard.begin; e < shard.end; ++e) shard.data<float>()[e - shard.begin] = paramValue(t, e);
  }

  check(rank, "unshard", group.unshard());  // all-gather
  for (std::size_t t = 0; t < plan.tensors.size(); ++t) {
    const dbuf::TensorView params = check(rank, "unshardedView", group.unshardedView(t));
    if (params.begin != 0 || params.end != plan.tensors[t].numel) fail(rank, "the unsharded view is not whole");
    for (std::int64_t e = 0; e < params.end; ++e, ++checked) {
      expectBits(rank, "all-gather", t, e, params.data<float>()[e], paramValue(t, e));
    }
    const dbuf::TensorView grads = check(rank, "unshardedGradView", group.unshardedGradView(t));
    for (std::int64_t e = 0; e < grads.end; ++e) grads.data<float>()[e] = gradValue(rank, t, e);
  }

  check(rank, "reduceScatter", group.reduceScatter({.mode = dbuf::ReduceMode::kSum}));
  for (std::size_t t = 0; t < plan.tensors.size(); ++t) {
    const dbuf::TensorView sum = group.shardGradView(t);
    for (std::int64_t e = sum.begin; e < sum.end; ++e, ++checked) {
      const float want = gradValue(0, t, e) + gradValue(1, t, e);
      expectBits(rank, "reduce-scatter", t, e, sum.data<float>()[e - sum.begin], want);
    }
  }

  // All-reduce (avg) in place: post_scale / 2 of an exact sum is exact.
  check(rank, "allReduce", group.allReduce({.mode = dbuf::ReduceMode::kAvg}));
  for (std::size_t t = 0; t < plan.tensors.size(); ++t) {
    const dbuf::TensorView grads = check(rank, "unshardedGradView", group.unshardedGradView(t));
    for (std::int64_t e = 0; e < grads.end; ++e, ++checked) {
      const float want = (gradValue(0, t, e) + gradValue(1, t, e)) * (1.0F / 2.0F);
      expectBits(rank, "all-reduce", t, e, grads.data<float>()[e], want);
    }
  }

  check(rank, "reshard", group.reshard());
  check(rank, "barrier", client.barrier());
  check(rank, "detach", client.detach());
  std::printf("outside_cpp rank %u: ok, %lld elements checked bitwise\n", rank, static_cast<long long>(checked));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s SOCKET JOB\n", argv[0]);
    return 2;
  }
  std::vector<pid_t> ranks;
  for (std::uint32_t r = 0; r < kWorld; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("fork");
      return 1;
    }
    if (pid == 0) {
      ::alarm(60);  // a hang fails too
      const int rc = runRank(argv[1], argv[2], r);
      std::fflush(stdout);
      ::_exit(rc);
    }
    ranks.push_back(pid);
  }
  bool failed = false;
  for (std::uint32_t r = 0; r < kWorld; ++r) {
    int status = 0;
    if (::waitpid(ranks[r], &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::fprintf(stderr, "outside_cpp: rank %u failed (wait status %d)\n", r, status);
      failed = true;
    }
  }
  if (!failed) std::printf("outside_cpp: ok\n");
  return failed ? 1 : 0;
}
