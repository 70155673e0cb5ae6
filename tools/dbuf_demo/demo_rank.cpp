// dbuf-demo-rank: one trainer process of the `make demo` job. Attaches to
// dbufd, registers decoder layers of a bundled model as groups (a collective
// with the other ranks), writes into its shards, maps and releases one
// unsharded slot, and prints its plan summary and memory use.
//
//   dbuf-demo-rank --socket PATH --job ID --rank R --world-size W
//                  --model FILE.json [--layers N] [--granularity RULE]
#include <sys/resource.h>

#include <charconv>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "dbuf/client.hpp"
#include "dbuf/plan_io/model_file.hpp"

namespace {

struct Args {
  std::string socket, job = "demo", model, granularity = "rows:32";
  std::uint32_t rank = 0, world_size = 1, layers = 4;
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
         parseCount(values, "--layers", args.layers);
}

dbuf::GroupSpec groupOf(const dbuf::planner::UnitSpec& unit, const std::string& granularity) {
  dbuf::GroupSpec spec;
  spec.name = unit.name;
  spec.granularity = granularity;
  for (const auto& tensor : unit.tensors) spec.tensors.push_back({tensor.name, tensor.shape, "", -1});
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

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (!parse(argc, argv, args)) {
    std::fprintf(stderr,
                 "usage: dbuf-demo-rank --socket PATH --model FILE [--job ID] [--rank R] [--world-size W] "
                 "[--layers N] [--granularity RULE]\n");
    return 2;
  }
  auto model = dbuf::plan_io::loadModelFile(args.model);
  if (!model) return fail(args, "model", model.error());
  auto client = dbuf::Client::connect({args.socket, std::chrono::seconds(30)});
  if (!client) return fail(args, "connect", client.error());
  if (auto attached = client->attach({.job = args.job, .rank = args.rank, .world_size = args.world_size}); !attached) {
    return fail(args, "attach", attached.error());
  }
  std::vector<dbuf::Group> groups;
  std::size_t shard_bytes = 0;
  for (const auto& unit : model->units) {
    if (unit.name.rfind("layers.", 0) != 0) continue;  // decoder layers only
    if (groups.size() == args.layers) break;
    auto group = client->registerGroup(groupOf(unit, args.granularity));
    if (!group) return fail(args, unit.name.c_str(), group.error());
    // Write this rank's id into the first and last element of every tensor it
    // holds: touches a page or two, not the whole shard.
    for (std::size_t t = 0; t < group->plan().tensors.size(); ++t) {
      const dbuf::TensorView view = group->shardView(t);
      if (view.numel() == 0) continue;
      view.data<float>()[0] = static_cast<float>(args.rank);
      view.data<float>()[view.numel() - 1] = static_cast<float>(args.rank);
    }
    shard_bytes += group->shardBytes();
    groups.push_back(std::move(*group));
  }
  if (groups.empty()) {
    std::fprintf(stderr, "rank %u: no decoder layers in %s\n", args.rank, args.model.c_str());
    return 1;
  }
  // One unshard / reshard cycle: a slot is mapped, then its pages are released.
  if (auto mapped = groups.front().unshard(); !mapped) return fail(args, "unshard", mapped.error());
  const std::size_t slot_elems = static_cast<std::size_t>(groups.front().plan().devices) *
                                 static_cast<std::size_t>(groups.front().plan().shard_elems);
  if (auto released = groups.front().reshard(); !released) return fail(args, "reshard", released.error());

  const auto& plan = groups.front().plan();
  std::size_t held = 0;
  for (std::size_t t = 0; t < plan.tensors.size(); ++t) held += groups.front().shardView(t).numel() > 0;
  std::printf(
      "rank %u/%u: %zu groups, S = %lld elements per group (%s), holds parts of %zu of %zu tensors of %s; "
      "shards %.1f MiB (fp32 master + grad), one unsharded slot %.1f MiB (bf16), max RSS %.1f MiB\n",
      args.rank, args.world_size, groups.size(), static_cast<long long>(plan.shard_elems), args.granularity.c_str(),
      held, plan.tensors.size(), groups.front().name().c_str(), static_cast<double>(shard_bytes) / (1 << 20),
      2.0 * static_cast<double>(slot_elems) * 2 / (1 << 20), static_cast<double>(residentKiB()) / 1024);
  if (auto detached = client->detach(); !detached) return fail(args, "detach", detached.error());
  return 0;
}
