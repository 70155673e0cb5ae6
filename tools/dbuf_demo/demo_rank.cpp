// dbuf-demo-rank: one trainer process of the `make demo` job. Attaches to
// dbufd, registers decoder layers of a bundled model as groups (a collective
// with the other ranks), fills its fp32 master shards, then runs a few
// training-like steps through the daemon's collectives: per layer, unshard
// (all-gather to bf16, the next layer prefetched asynchronously), a fake
// forward that reads every gathered parameter, fake gradients written into
// the unsharded gradient, reduce-scatter (avg) into the fp32 sharded
// gradient, reshard; then an SGD update of the master shards. Rank 0 prints
// per-step times and the bandwidth achieved.
//
//   dbuf-demo-rank --socket PATH --job ID --rank R --world-size W
//                  --model FILE.json [--layers N] [--granularity RULE]
//                  [--steps N] [--shrink K]
//
// --shrink K divides every dimension of every tensor by K (at least 1), so
// that the demo's layers keep their structure but fit a small machine.
#include <sys/resource.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "dbuf/client.hpp"
#include "dbuf/kernels/convert.hpp"
#include "dbuf/plan_io/model_file.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  std::string socket, job = "demo", model, granularity = "rows:32";
  std::uint32_t rank = 0, world_size = 1, layers = 4, steps = 3, shrink = 1;
};

bool parseCount(const std::map<std::string, std::string>& values, const std::string& flag, std::uint32_t& out) {
  const auto found = values.find(flag);
  if (found == values.end()) return true;  // keep the default
  const std::string& text = found->second;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), out);
  return error == std::errc() && end == text.data() + text.size();
}

bool parse(int argc, char** argv, Args& args) {
  std::map<std::string, std::string> values;
  for (int i = 1; i + 1 < argc; i += 2) values[argv[i]] = argv[i + 1];
  if (argc % 2 == 0 || !values.contains("--socket") || !values.contains("--model")) return false;
  args.socket = values["--socket"];
  args.model = values["--model"];
  if (values.contains("--job")) args.job = values["--job"];
  if (values.contains("--granularity")) args.granularity = values["--granularity"];
  return parseCount(values, "--rank", args.rank) && parseCount(values, "--world-size", args.world_size) &&
         parseCount(values, "--layers", args.layers) && parseCount(values, "--steps", args.steps) &&
         parseCount(values, "--shrink", args.shrink) && args.shrink > 0;
}

dbuf::GroupSpec groupOf(const dbuf::planner::UnitSpec& unit, const std::string& granularity, std::uint32_t shrink) {
  dbuf::GroupSpec spec;
  spec.name = unit.name;
  spec.granularity = granularity;
  for (const auto& tensor : unit.tensors) {
    std::vector<std::int64_t> shape = tensor.shape;
    for (std::int64_t& dim : shape) dim = std::max<std::int64_t>(1, dim / shrink);
    spec.tensors.push_back({tensor.name, shape, "", -1});
  }
  return spec;
}

long residentKiB() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss;
}

int fail(const Args& args, const char* what, const dbuf::Error& error) {
  std::fprintf(stderr, "rank %u: %s: %s\n", args.rank, what, error.message.c_str());
  return 1;
}

/// Deterministic initial master weights: small values that differ per element.
void initialiseMaster(dbuf::Group& group) {
  for (std::size_t t = 0; t < group.plan().tensors.size(); ++t) {
    const dbuf::TensorView view = group.shardView(t);
    for (std::int64_t i = 0; i < view.numel(); ++i) {
      view.data<float>()[i] = static_cast<float>((view.begin + i) % 97) * 1e-3F;
    }
  }
}

/// The fake forward: reads every gathered parameter (so the gather is real
/// work the trainer depends on). The fake backward: a gradient that depends
/// on the parameter and the rank. Returns the forward's checksum.
double fakeForwardBackward(dbuf::Group& group, std::uint32_t rank) {
  double checksum = 0;
  for (std::size_t t = 0; t < group.plan().tensors.size(); ++t) {
    const auto params = group.unshardedView(t);
    const auto grads = group.unshardedGradView(t);
    if (!params || !grads) continue;
    const auto* p = params->data<std::uint16_t>();
    auto* g = grads->data<std::uint16_t>();
    for (std::int64_t i = 0; i < params->numel(); ++i) {
      const float value = dbuf::kernels::bf16ToFloat(p[i]);
      checksum += value;
      g[i] = dbuf::kernels::floatToBf16(0.5F * value + 1e-3F * static_cast<float>(rank));
    }
  }
  return checksum;
}

void sgdUpdate(dbuf::Group& group, float learning_rate) {
  for (std::size_t t = 0; t < group.plan().tensors.size(); ++t) {
    const dbuf::TensorView weight = group.shardView(t);
    const dbuf::TensorView grad = group.shardGradView(t);
    for (std::int64_t i = 0; i < weight.numel(); ++i) weight.data<float>()[i] -= learning_rate * grad.data<float>()[i];
  }
}

/// One training step over every layer; returns the bytes the daemon moved
/// for this rank (its gathered params in, its gradient out).
dbuf::Result<double> trainStep(dbuf::Client& client, std::vector<dbuf::Group>& layers, std::uint32_t rank) {
  double moved = 0;
  dbuf::OpHandle gathering{};
  auto prefetch = [&](std::size_t i) -> dbuf::Result<void> {
    if (auto slot = layers[i].acquireSlot(); !slot) return slot;
    auto handle = layers[i].submitAllGather();
    if (!handle) return std::move(handle).error();
    gathering = *handle;
    return {};
  };
  if (auto first = prefetch(0); !first) return first.error();
  for (std::size_t i = 0; i < layers.size(); ++i) {
    if (auto gathered = client.wait(gathering); !gathered) return std::move(gathered).error();
    if (i + 1 < layers.size()) {
      // Prefetch depth 1: the next layer gathers while this one computes.
      if (auto next = prefetch(i + 1); !next) return next.error();
    }
    fakeForwardBackward(layers[i], rank);
    if (auto reduced = layers[i].reduceScatter({dbuf::ReduceMode::kAvg}); !reduced) return reduced.error();
    if (auto released = layers[i].reshard(); !released) return released.error();
    const auto& plan = layers[i].plan();
    moved += 2.0 * static_cast<double>(plan.devices) * static_cast<double>(plan.shard_elems) * 2;  // bf16 in and out
  }
  for (dbuf::Group& layer : layers) sgdUpdate(layer, 0.01F);
  if (auto synced = client.barrier(); !synced) return synced.error();
  return moved;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (!parse(argc, argv, args)) {
    std::fprintf(stderr,
                 "usage: dbuf-demo-rank --socket PATH --model FILE [--job ID] [--rank R] [--world-size W] "
                 "[--layers N] [--granularity RULE] [--steps N] [--shrink K]\n");
    return 2;
  }
  auto model = dbuf::plan_io::loadModelFile(args.model);
  if (!model) return fail(args, "model", model.error());
  auto client = dbuf::Client::connect({args.socket, std::chrono::seconds(30)});
  if (!client) return fail(args, "connect", client.error());
  if (auto attached = client->attach({.job = args.job, .rank = args.rank, .world_size = args.world_size});
      !attached) {
    return fail(args, "attach", attached.error());
  }
  std::vector<dbuf::Group> layers;
  std::size_t shard_bytes = 0;
  for (const auto& unit : model->units) {
    if (unit.name.rfind("layers.", 0) != 0) continue;  // decoder layers only
    if (layers.size() == args.layers) break;
    auto group = client->registerGroup(groupOf(unit, args.granularity, args.shrink));
    if (!group) return fail(args, unit.name.c_str(), group.error());
    initialiseMaster(*group);
    shard_bytes += group->shardBytes();
    layers.push_back(std::move(*group));
  }
  if (layers.empty()) {
    std::fprintf(stderr, "rank %u: no decoder layers in %s\n", args.rank, args.model.c_str());
    return 1;
  }
  const auto& plan = layers.front().plan();
  std::size_t held = 0;
  for (std::size_t t = 0; t < plan.tensors.size(); ++t) held += layers.front().shardView(t).numel() > 0;
  std::printf("rank %u/%u: %zu layers, S = %lld elements per layer (%s), holds parts of %zu of %zu tensors of %s; "
              "shards %.1f MiB (fp32 master + grad)\n",
              args.rank, args.world_size, layers.size(), static_cast<long long>(plan.shard_elems),
              args.granularity.c_str(), held, plan.tensors.size(), layers.front().name().c_str(),
              static_cast<double>(shard_bytes) / (1 << 20));
  std::fflush(stdout);
  for (std::uint32_t step = 1; step <= args.steps; ++step) {
    const auto started = Clock::now();
    auto moved = trainStep(*client, layers, args.rank);
    if (!moved) return fail(args, "training step", moved.error());
    const double seconds = std::chrono::duration<double>(Clock::now() - started).count();
    if (args.rank == 0) {
      std::printf("step %u: %.1f ms, %.1f MiB gathered + reduced per rank, %.2f GB/s per rank, %.2f GB/s all ranks\n",
                  step, seconds * 1e3, *moved / (1 << 20), *moved / seconds / 1e9,
                  *moved * args.world_size / seconds / 1e9);
      std::fflush(stdout);
    }
  }
  std::printf("rank %u: max RSS %.1f MiB\n", args.rank, static_cast<double>(residentKiB()) / 1024);
  if (auto detached = client->detach(); !detached) return fail(args, "detach", detached.error());
  return 0;
}
