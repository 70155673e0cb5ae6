// One rank of a dbuf-soak job (`dbuf-soak rank ...`): attaches to dbufd,
// registers the job's groups (random shapes, rules and dtype pairs drawn from
// the job's seed), then runs random batches of collectives for as long as it
// lives, checking every result bitwise against the reference
// (tests/collectives/reference.hpp), which it computes for every rank: each
// rank's inputs are a pure function of seed, op, rank, tensor and element.
//
// Every rank of a job must submit the same ops in the same order. They agree
// on them through the daemon's op sequence: after a barrier that completed
// with sequence s, the k-th op after it is drawn from (seed, s, k) and must
// complete with sequence s + 1 + k. A failed op (a rank of the job was
// killed, or came back and is out of step) sends every rank back to barriers
// until one completes on all of them. The random ops never contain a barrier,
// so a rank that is out of step can only meet the others' barrier: any other
// op it submits mismatches theirs, which the daemon reports on every rank.
//
// The supervisor reads what happened from the rank's counters (soak_stats.hpp);
// details of a wrong result go to stderr.
#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dbuf/client.hpp"
#include "reference.hpp"
#include "soak_rank.hpp"
#include "soak_stats.hpp"

namespace dbuf::soak {
namespace {

using coll::GroupSim;
using coll::Stream;
using std::chrono::milliseconds;

volatile std::sig_atomic_t g_stop = 0;

void onTerm(int /*signal*/) {
  g_stop = 1;
}

void say(const RankArgs& args, const std::string& text) {
  std::fprintf(stderr, "[%s rank %u/%u] %s\n", args.job.c_str(), args.rank, args.world, text.c_str());
  std::fflush(stderr);
}

std::uint64_t mix(std::uint64_t a, std::uint64_t b) {
  return coll::hashKey(a, Stream::kTrain, b, 0, 0, 0, 0);
}

// ---------------------------------------------------------------- the job's groups

struct DTypePair {
  DType sharded;
  DType unsharded;
};

// Every pair the host backend converts between (the collectives suite's).
constexpr DTypePair kPairs[] = {
    {DType::kF32, DType::kF32},    {DType::kF32, DType::kBF16},  {DType::kF32, DType::kF16},
    {DType::kF32, DType::kF8E4M3}, {DType::kBF16, DType::kBF16}, {DType::kBF16, DType::kF8E4M3},
    {DType::kF16, DType::kF16},    {DType::kF16, DType::kBF16},  {DType::kBF16, DType::kF32},
};

std::int64_t draw(std::mt19937_64& rng, std::int64_t lo, std::int64_t hi) {
  return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
}

std::size_t drawIndex(std::mt19937_64& rng, std::size_t n) {
  return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng);
}

std::string drawRule(std::mt19937_64& rng) {
  switch (draw(rng, 0, 3)) {
    case 0:
      return "element";
    case 1:
      return "rows:" + std::to_string(draw(rng, 1, 8));
    case 2:
      return "block:" + std::to_string(1 << draw(rng, 1, 4)) + "x" + std::to_string(1 << draw(rng, 1, 4));
    default:
      return "matrix";
  }
}

/// Group `index` of a job: the same on every rank (drawn from the job's seed).
GroupSpec groupSpec(std::uint64_t seed, std::uint32_t index, std::int64_t max_elements, bool full_size) {
  std::mt19937_64 rng(mix(seed, 1000 + index));
  const DTypePair pair = kPairs[drawIndex(rng, std::size(kPairs))];
  GroupSpec spec;
  spec.name = "g" + std::to_string(index);
  spec.sharded_dtype = pair.sharded;
  spec.unsharded_dtype = pair.unsharded;
  spec.granularity = drawRule(rng);
  spec.align_bytes = draw(rng, 0, 1) == 0 ? 16 : 64;
  // A size scale per group, so that a job has small and large groups.
  const std::int64_t scale = std::max<std::int64_t>(64, max_elements >> (full_size ? 0 : draw(rng, 0, 6)));
  const std::int64_t tensors = draw(rng, 1, 6);
  std::int64_t total = 0;
  for (std::int64_t t = 0; t < tensors && total < scale; ++t) {
    TensorSpec tensor;
    tensor.name = "t" + std::to_string(t);
    const std::int64_t room = std::max<std::int64_t>(1, scale - total);
    switch (draw(rng, 0, 2)) {
      case 0:
        tensor.shape = {draw(rng, 1, std::min<std::int64_t>(room, 4096))};
        break;
      case 1: {
        const std::int64_t rows = draw(rng, 1, 512);
        tensor.shape = {rows, draw(rng, 1, std::max<std::int64_t>(1, room / rows))};
        break;
      }
      default: {
        const std::int64_t experts = draw(rng, 1, 8);
        const std::int64_t rows = draw(rng, 1, 64);
        tensor.shape = {experts, rows, draw(rng, 1, std::max<std::int64_t>(1, room / (experts * rows)))};
      }
    }
    if (draw(rng, 0, 3) == 0) tensor.granularity = drawRule(rng);  // a per-tensor rule now and then
    std::int64_t numel = 1;
    for (const std::int64_t d : tensor.shape) numel *= d;
    total += numel;
    spec.tensors.push_back(std::move(tensor));
  }
  return spec;
}

struct SoakGroup {
  std::uint32_t index = 0;
  Group group;
  GroupSim sim;
  std::uint64_t last_used = 0;  ///< batch number that last needed its slot
};

// ---------------------------------------------------------------- one rank

class SoakRank {
 public:
  SoakRank(const RankArgs& args, RankStats& stats) : args_(args), stats_(stats) {}

  int run() {
    if (!attach() || !registerGroups()) return finish();
    while (!ended_) {
      if (!resync()) break;
      while (!ended_ && runBatch()) {
      }
    }
    return finish();
  }

 private:
  // ---- ending

  void end(RankEnd how, const std::string& why = {}) {
    if (ended_) return;
    ended_ = true;
    stats_.end.store(static_cast<std::uint32_t>(how), std::memory_order_relaxed);
    if (!why.empty()) say(args_, std::string(rankEndName(how)) + ": " + why);
  }

  int finish() {
    if (!ended_) end(RankEnd::kStopped);
    const auto how = static_cast<RankEnd>(stats_.end.load(std::memory_order_relaxed));
    if (client_ && how != RankEnd::kDaemonGone) {
      groups_.clear();
      (void)client_->detach(milliseconds(2000));
    }
    switch (how) {
      case RankEnd::kWrongResult:
        return 1;
      case RankEnd::kFailed:
      case RankEnd::kStuck:
        return 2;
      default:
        return 0;
    }
  }

  /// Counts a failed call and decides what it means: true when the rank
  /// should go on (resynchronise), false when it ended.
  bool failed(const Error& error, const std::string& what, std::int64_t call_started_ns) {
    if (g_stop != 0) {
      stats_.shutdown_errors.fetch_add(1, std::memory_order_relaxed);
      end(RankEnd::kStopped);
      return false;
    }
    const auto code = static_cast<std::uint32_t>(error.code);
    stats_.errors[code < kErrorCodes ? code : kErrorCodes - 1].fetch_add(1, std::memory_order_relaxed);
    const std::string text = what + ": " + std::string(toString(error.code)) + ": " + error.message;
    switch (error.code) {
      case ErrorCode::kUnavailable: {
        std::int64_t none = 0;
        if (stats_.unavailable_call_ns.compare_exchange_strong(none, call_started_ns)) {
          stats_.unavailable_return_ns.store(monotonicNs(), std::memory_order_relaxed);
        }
        end(RankEnd::kDaemonGone, text);
        return false;
      }
      case ErrorCode::kConflict:
        // A rank of the job is gone (its ranks listed) or out of step (a
        // mismatch): a job that restarts its ranks waits for them.
        if (!args_.persistent && !error.ranks.empty()) {
          end(RankEnd::kJobLostRank, text);
          return false;
        }
        return true;
      case ErrorCode::kTimeout:
      case ErrorCode::kCancelled:
        return true;  // counted; the supervisor judges them
      default:
        end(RankEnd::kFailed, text);
        return false;
    }
  }

  // ---- set-up

  bool attach() {
    ClientOptions options{args_.socket, milliseconds(args_.op_timeout_ms), [] { return g_stop != 0; }};
    auto client = Client::connect(options);
    if (!client) {
      failed(client.error(), "connect", monotonicNs());
      if (!ended_) end(RankEnd::kFailed, "connect: " + client.error().message);
      return false;
    }
    AttachOptions attach;
    attach.job = args_.job;
    attach.rank = args_.rank;
    attach.world_size = args_.world;
    attach.persistent = args_.persistent;
    // The killed process this one replaces may not be released yet: its
    // rank is then still attached (kConflict) for a moment.
    const auto deadline = monotonicNs() + args_.recover_ms * 1'000'000;
    for (;;) {
      const std::int64_t started = monotonicNs();
      auto attached = client->attach(attach);
      if (attached) break;
      if (!failed(attached.error(), "attach", started)) return false;
      if (monotonicNs() > deadline) {
        end(RankEnd::kStuck, "could not attach within " + std::to_string(args_.recover_ms) + " ms");
        return false;
      }
      std::this_thread::sleep_for(milliseconds(20));
    }
    if (client->reattached()) stats_.reattached.fetch_add(1, std::memory_order_relaxed);
    client_.emplace(std::move(*client));
    return true;
  }

  bool registerGroups() {
    const auto deadline = monotonicNs() + args_.recover_ms * 1'000'000;
    for (std::uint32_t index = 0; index < args_.groups; ++index) {
      const GroupSpec spec = groupSpec(args_.seed, index, args_.max_elements, args_.full_size);
      for (;;) {
        const std::int64_t started = monotonicNs();
        auto group = client_->registerGroup(spec);
        if (group) {
          GroupSim sim(group->plan(), spec.sharded_dtype, spec.unsharded_dtype);
          groups_.push_back(SoakGroup{index, std::move(*group), std::move(sim)});
          break;
        }
        if (!failed(group.error(), "register " + spec.name, started)) return false;
        if (monotonicNs() > deadline) {
          end(RankEnd::kStuck, "could not register " + spec.name + " within " + std::to_string(args_.recover_ms) +
                                   " ms");
          return false;
        }
        std::this_thread::sleep_for(milliseconds(20));
      }
    }
    return true;
  }

  /// Barriers until one completes on every rank; its sequence is the base
  /// of the ops that follow.
  bool resync() {
    const auto deadline = monotonicNs() + args_.recover_ms * 1'000'000;
    for (;;) {
      if (g_stop != 0) {
        end(RankEnd::kStopped);
        return false;
      }
      const std::int64_t started = monotonicNs();
      auto result = submitAndWait([&] { return client_->submitBarrier(); });
      if (result) {
        base_ = result->sequence;
        next_ = 0;
        stats_.resyncs.fetch_add(1, std::memory_order_relaxed);
        stats_.ops[static_cast<std::uint32_t>(OpKind::kBarrier)].fetch_add(1, std::memory_order_relaxed);
        return true;
      }
      if (!failed(result.error(), "barrier", started)) return false;
      if (monotonicNs() > deadline) {
        end(RankEnd::kStuck, "no barrier completed within " + std::to_string(args_.recover_ms) + " ms");
        return false;
      }
      std::this_thread::sleep_for(milliseconds(10));
    }
  }

  template <typename Submit>
  Result<OpResult> submitAndWait(Submit submit) {
    auto handle = submit();
    if (!handle) return std::move(handle).error();
    return client_->wait(*handle);
  }

  // ---- a batch of ops

  struct Op {
    OpKind kind = OpKind::kAllGather;
    SoakGroup* group = nullptr;
    ReduceOptions reduce;
    std::uint32_t root = 0;
    std::uint64_t round = 0;  ///< hash key of its inputs: the sequence it must complete with
    std::optional<OpHandle> handle;
  };

  std::vector<Op> drawBatch() {
    std::mt19937_64 rng(mix(mix(args_.seed, base_), next_));
    constexpr float kScales[] = {1.0F, 0.5F, 2.0F, 0.37F, -1.25F, 3.0F};
    SoakGroup* pick[2] = {&groups_[drawIndex(rng, groups_.size())], &groups_[drawIndex(rng, groups_.size())]};
    std::vector<Op> batch(1 + drawIndex(rng, 3));
    for (std::size_t i = 0; i < batch.size(); ++i) {
      Op& op = batch[i];
      op.kind = static_cast<OpKind>(draw(rng, 0, 3));
      op.group = pick[drawIndex(rng, 2)];
      op.reduce.mode = draw(rng, 0, 1) == 0 ? ReduceMode::kSum : ReduceMode::kAvg;
      op.reduce.pre_scale = kScales[drawIndex(rng, std::size(kScales))];
      op.reduce.post_scale = kScales[drawIndex(rng, std::size(kScales))];
      // accumulate adds into an fp32 sharded gradient only.
      op.reduce.accumulate = op.kind == OpKind::kReduceScatter && op.group->sim.sharded() == DType::kF32 &&
                             draw(rng, 0, 2) == 0;
      op.root = static_cast<std::uint32_t>(draw(rng, 0, args_.world - 1));
      op.round = base_ + 1 + next_ + i;
    }
    return batch;
  }

  /// Every group of the batch holds a slot (two at most: prefetch depth 1),
  /// the least recently used other one released to make room.
  bool holdSlots(const std::vector<Op>& batch) {
    ++batches_;
    for (const Op& op : batch) op.group->last_used = batches_;
    for (const Op& op : batch) {
      if (op.group->group.unsharded()) continue;
      const auto held = std::count_if(groups_.begin(), groups_.end(),
                                      [](const SoakGroup& g) { return g.group.unsharded(); });
      if (held >= 2) {
        SoakGroup* oldest = nullptr;
        for (SoakGroup& g : groups_) {
          if (g.group.unsharded() && g.last_used != batches_ && (oldest == nullptr || g.last_used < oldest->last_used))
            oldest = &g;
        }
        if (auto released = oldest->group.reshard(); !released) {
          failed(released.error(), "reshard", monotonicNs());
          return false;
        }
      }
      const std::int64_t started = monotonicNs();
      if (auto acquired = op.group->group.acquireSlot(); !acquired) {
        failed(acquired.error(), "acquireSlot", started);
        return false;
      }
      // A fresh slot holds nothing defined; no op reads a slot it did not write first.
      for (std::uint32_t r = 0; r < args_.world; ++r) op.group->sim.forgetSlot(r);
    }
    return true;
  }

  bool runBatch() {
    if (g_stop != 0) {
      end(RankEnd::kStopped);
      return false;
    }
    std::vector<Op> batch = drawBatch();
    if (!holdSlots(batch)) return false;
    for (const Op& op : batch) writeInputs(op);
    const std::int64_t started = monotonicNs();
    std::optional<Error> error;
    for (Op& op : batch) {
      auto handle = submit(op);
      if (!handle) {
        error = std::move(handle).error();
        break;
      }
      op.handle = *handle;
    }
    for (Op& op : batch) {
      if (!op.handle) continue;
      auto result = client_->wait(*op.handle);
      if (!result) {
        if (!error) error = std::move(result).error();
        continue;
      }
      if (!error && result->sequence != op.round) {
        end(RankEnd::kWrongResult, std::string(opKindName(op.kind)) + " on " + op.group->group.name() +
                                       " completed with sequence " + std::to_string(result->sequence) +
                                       ", expected " + std::to_string(op.round));
        return false;
      }
    }
    next_ += batch.size();
    if (error) {
      failed(*error, "batch", started);
      return false;  // resynchronise (or end)
    }
    for (const Op& op : batch) simulate(op);
    for (const Op& op : batch) {
      if (!check(*op.group, op)) return false;
      stats_.ops[static_cast<std::uint32_t>(op.kind)].fetch_add(1, std::memory_order_relaxed);
    }
    return true;
  }

  Result<OpHandle> submit(const Op& op) {
    Group& group = op.group->group;
    switch (op.kind) {
      case OpKind::kAllGather:
        return group.submitAllGather();
      case OpKind::kReduceScatter:
        return group.submitReduceScatter(op.reduce);
      case OpKind::kAllReduce:
        return group.submitAllReduce(op.reduce);
      default:
        return group.submitBroadcast(op.root);
    }
  }

  static void simulate(const Op& op) {
    GroupSim& sim = op.group->sim;
    switch (op.kind) {
      case OpKind::kAllGather:
        return sim.allGather();
      case OpKind::kReduceScatter:
        return sim.reduceScatter(op.reduce);
      case OpKind::kAllReduce:
        return sim.allReduce(op.reduce);
      default:
        return sim.broadcast(op.root);
    }
  }

  // ---- inputs: this rank's memory, and every rank's in the simulator

  void writeInputs(const Op& op) {
    SoakGroup& g = *op.group;
    switch (op.kind) {
      case OpKind::kAllGather:
        return writeShards(g, op.round);
      case OpKind::kReduceScatter:
        if (op.reduce.accumulate) writeShardGrads(g, op.round);
        return writeGrads(g, op.round);
      case OpKind::kAllReduce:
        return writeGrads(g, op.round);
      default:
        return writeParams(g, op.round);
    }
  }

  std::uint64_t key(const SoakGroup& g, Stream stream, std::uint64_t round, std::uint32_t rank, std::size_t t,
                    std::int64_t e) const {
    return coll::hashKey(args_.seed, stream, round, rank, g.index, t, static_cast<std::uint64_t>(e));
  }

  void writeShards(SoakGroup& g, std::uint64_t round) {
    const auto& tensors = g.group.plan().tensors;
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      const TensorView view = g.group.shardView(t);
      for (std::int64_t i = 0; i < view.numel(); ++i) {
        coll::storeElement(view.dtype, view.base, i, coll::paramValue(key(g, Stream::kShard, round, 0, t, view.begin + i)));
      }
      for (std::int64_t e = 0; e < tensors[t].numel; ++e) {
        g.sim.setShard(tensors[t].offset + e, coll::paramValue(key(g, Stream::kShard, round, 0, t, e)));
      }
    }
  }

  void writeShardGrads(SoakGroup& g, std::uint64_t round) {
    const auto& tensors = g.group.plan().tensors;
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      const TensorView view = g.group.shardGradView(t);
      for (std::int64_t i = 0; i < view.numel(); ++i) {
        coll::storeElement(view.dtype, view.base, i,
                           coll::moderateValue(key(g, Stream::kShardGrad, round, 0, t, view.begin + i)));
      }
      for (std::int64_t e = 0; e < tensors[t].numel; ++e) {
        g.sim.setShardGrad(tensors[t].offset + e, coll::moderateValue(key(g, Stream::kShardGrad, round, 0, t, e)));
      }
    }
    g.sim.markShardGradKnown();
  }

  void writeGrads(SoakGroup& g, std::uint64_t round) {
    const auto& tensors = g.group.plan().tensors;
    const DType grad = g.sim.grad();
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      const TensorView view = *g.group.unshardedGradView(t);
      for (std::uint32_t r = 0; r < args_.world; ++r) {
        for (std::int64_t e = 0; e < tensors[t].numel; ++e) {
          const float value = coll::gradValue(key(g, Stream::kGrad, round, r, t, e), grad);
          g.sim.setGrad(r, tensors[t].offset + e, value);
          if (r == args_.rank) coll::storeElement(view.dtype, view.base, e, value);
        }
      }
    }
    for (std::uint32_t r = 0; r < args_.world; ++r) g.sim.markGradsKnown(r);
  }

  std::uint32_t paramBits(const SoakGroup& g, std::uint64_t hash) const {
    if (g.sim.quantized()) return static_cast<std::uint32_t>(hash & 0xffU);
    std::byte bits[4] = {};
    coll::storeElement(g.sim.unsharded(), bits, 0, coll::paramValue(hash));
    return coll::elementBits(g.sim.unsharded(), bits, 0);
  }

  void writeParams(SoakGroup& g, std::uint64_t round) {
    const auto& tensors = g.group.plan().tensors;
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      const TensorView view = *g.group.unshardedView(t);
      for (std::uint32_t r = 0; r < args_.world; ++r) {
        for (std::int64_t e = 0; e < tensors[t].numel; ++e) {
          const std::uint32_t bits = paramBits(g, key(g, Stream::kParams, round, r, t, e));
          g.sim.setParamBits(r, tensors[t].offset + e, bits);
          if (r == args_.rank) coll::setElementBits(view.dtype, view.base, e, bits);
        }
      }
    }
    if (g.sim.quantized()) {
      // The scales are exposed read-only; a trainer with fp8 params of its own writes them there.
      const std::span<const float> scales = g.group.unshardedScales();
      auto* writable = const_cast<float*>(scales.data());  // NOLINT(cppcoreguidelines-pro-type-const-cast)
      for (std::int64_t b = 0; b < g.sim.totalBlocks(); ++b) {
        for (std::uint32_t r = 0; r < args_.world; ++r) {
          const float scale = std::fabs(coll::moderateValue(key(g, Stream::kScales, round, r, 0, b)));
          g.sim.setScale(r, b, scale);
          if (r == args_.rank) writable[b] = scale;
        }
      }
    }
    for (std::uint32_t r = 0; r < args_.world; ++r) g.sim.markParamsKnown(r);
  }

  // ---- checks

  /// Compares n elements of `dtype` bitwise; on a difference ends the rank
  /// with a description of the first one.
  bool same(const Op& op, const char* buffer, std::size_t t, DType dtype, const std::byte* actual,
            const std::byte* expected, std::int64_t n) {
    const std::size_t bytes = static_cast<std::size_t>(n * sizeBytes(dtype));
    stats_.bytes.fetch_add(bytes, std::memory_order_relaxed);
    if (n <= 0 || std::memcmp(actual, expected, bytes) == 0) return true;
    std::int64_t first = 0;
    while (coll::elementBits(dtype, actual, first) == coll::elementBits(dtype, expected, first)) ++first;
    end(RankEnd::kWrongResult,
        std::string(opKindName(op.kind)) + " (sequence " + std::to_string(op.round) + ") on group " +
            op.group->group.name() + ": " + buffer + " of tensor " + std::to_string(t) + ", element " +
            std::to_string(first) + ": expected " + coll::showBits(dtype, coll::elementBits(dtype, expected, first)) +
            ", got " + coll::showBits(dtype, coll::elementBits(dtype, actual, first)));
    return false;
  }

  /// What the op wrote into this rank's memory, against the simulator.
  bool check(const SoakGroup& g, const Op& op) {
    const GroupSim& sim = g.sim;
    const std::uint32_t rank = args_.rank;
    const auto at = [](const std::byte* base, DType dtype, std::int64_t global) {
      return base + global * sizeBytes(dtype);
    };
    const auto& tensors = g.group.plan().tensors;
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      const std::int64_t offset = tensors[t].offset;
      if (op.kind == OpKind::kReduceScatter) {
        const TensorView view = g.group.shardGradView(t);
        if (!same(op, "sharded gradient", t, view.dtype, view.base,
                  at(sim.shardGrad(), sim.sharded(), offset + view.begin), view.numel())) {
          return false;
        }
      } else if (op.kind == OpKind::kAllReduce) {
        const TensorView view = *g.group.unshardedGradView(t);
        if (!same(op, "unsharded gradient", t, view.dtype, view.base, at(sim.grads(rank), sim.grad(), offset),
                  tensors[t].numel)) {
          return false;
        }
      } else {
        const TensorView view = *g.group.unshardedView(t);
        if (!same(op, "unsharded params", t, view.dtype, view.base, at(sim.params(rank), sim.unsharded(), offset),
                  tensors[t].numel)) {
          return false;
        }
      }
    }
    if (sim.quantized() && (op.kind == OpKind::kAllGather || op.kind == OpKind::kBroadcast)) {
      const std::span<const float> scales = g.group.unshardedScales();
      return same(op, "fp8 scales", 0, DType::kF32, reinterpret_cast<const std::byte*>(scales.data()),
                  reinterpret_cast<const std::byte*>(sim.scales(rank).data()), sim.totalBlocks());
    }
    return true;
  }

  const RankArgs& args_;
  RankStats& stats_;
  std::optional<Client> client_;
  std::vector<SoakGroup> groups_;
  std::uint64_t base_ = 0;     ///< sequence of the barrier that last brought the job in step
  std::uint64_t next_ = 0;     ///< ops submitted since
  std::uint64_t batches_ = 0;  ///< batches drawn (slot recency)
  bool ended_ = false;
};

}  // namespace

int runRank(const RankArgs& args) {
  struct sigaction action {};
  action.sa_handler = onTerm;
  ::sigaction(SIGTERM, &action, nullptr);
  RankStats* stats = mapStats(args.stats_path, false);
  const int status = SoakRank(args, *stats).run();
  unmapStats(stats);
  return status;
}

}  // namespace dbuf::soak
