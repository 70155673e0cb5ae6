#include "node_executor.hpp"

#include <gloo/allgatherv.h>
#include <gloo/alltoallv.h>
#include <gloo/broadcast.h>
#include <gloo/context.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "dbuf/ipc/protocol.hpp"
#include "dbuf/kernels/runner.hpp"
#include "executor.hpp"
#include "local_collective.hpp"
#include "rank_text.hpp"

namespace dbuf::daemon {
namespace {

using kernels::ConstBuffer;
using kernels::MutBuffer;
using kernels::Segment;

constexpr std::int64_t kChunk = LocalCollective::kStepElements;

void setText(OpHeader& header, const std::string& text) {
  const std::size_t length = std::min(text.size(), OpHeader::kText - 1);
  std::memcpy(header.text, text.data(), length);
  header.text[length] = '\0';
}

std::string textOf(const OpHeader& header) {
  return {header.text, ::strnlen(header.text, OpHeader::kText)};
}

bool sameOp(const OpHeader& a, const OpHeader& b) {
  return a.sequence == b.sequence && a.op == b.op && a.reduce == b.reduce && a.accumulate == b.accumulate &&
         a.root == b.root && std::memcmp(&a.pre_scale, &b.pre_scale, sizeof(float)) == 0 &&
         std::memcmp(&a.post_scale, &b.post_scale, sizeof(float)) == 0 && a.group_digest == b.group_digest;
}

/// The daemon's own memory for an op's inter-node part: what Gloo reads and
/// writes. Shared with the link's steps, which may outlive the op.
struct Staging {
  std::vector<std::byte> params;  ///< world * S of the unsharded dtype
  std::vector<float> scales;      ///< fp8: total_blocks
  std::vector<float> partial;     ///< world * S: this node's sum of its ranks' gradients
  std::vector<float> received;    ///< nodes * (this node's ranks * S): every node's partial of this node's range
  std::vector<std::byte> grads;   ///< all-reduce: world * S of the gradient dtype
  /// Set by an exchange whose headers said the job cannot go on.
  std::atomic<bool> fatal{false};
};

/// Gloo's counts: per_rank elements for each rank of each node.
template <typename Count>
std::vector<Count> perNode(const NodeLayout& layout, std::int64_t per_rank) {
  std::vector<Count> counts;
  for (std::uint32_t n = 0; n < layout.nodes(); ++n) counts.push_back(static_cast<Count>(layout.rankCount(n) * per_rank));
  return counts;
}

/// In place: every node's `counts[n]` elements of `base` (node n's at the
/// sum of the counts before it) to every node.
template <typename T>
void gatherInPlace(const LinkChannel& channel, T* base, const std::vector<std::size_t>& counts) {
  std::size_t first = 0;
  for (std::uint32_t n = 0; n < channel.layout.node; ++n) first += counts[n];
  gloo::AllgathervOptions options(channel.context);
  options.setInput(base + first, counts[channel.layout.node]);
  options.setOutput(base, counts);
  options.setTag(channel.tag);
  options.setTimeout(channel.timeout);
  gloo::allgatherv(options);
}

/// What one op sends between the nodes once their headers agree (run on the
/// link thread, over the staging memory only).
struct Transfer {
  ipc::OpCode op = ipc::OpCode::kBarrier;
  std::int64_t shard_elems = 0;
  std::int64_t unsharded_bytes = 0;
  DType grad = DType::kF32;
  float factor = 1.0F;
  std::vector<std::size_t> scale_counts;  ///< fp8: each node's scales
  std::uint32_t root_node = 0;            ///< broadcast

  [[nodiscard]] Result<void> run(const LinkChannel& channel, Staging& staging) const {
    switch (op) {
      case ipc::OpCode::kAllGather:
        return allGather(channel, staging);
      case ipc::OpCode::kReduceScatter:
      case ipc::OpCode::kAllReduce:
        return reduction(channel, staging);
      case ipc::OpCode::kBroadcast:
        return broadcast(channel, staging);
      default:
        return {};  // a barrier: the headers were the exchange
    }
  }

 private:
  Result<void> allGather(const LinkChannel& channel, Staging& staging) const {
    gatherInPlace(channel, reinterpret_cast<std::uint8_t*>(staging.params.data()),
                  perNode<std::size_t>(channel.layout, shard_elems * unsharded_bytes));
    if (!scale_counts.empty()) gatherInPlace(channel, staging.scales.data(), scale_counts);
    return {};
  }

  Result<void> reduction(const LinkChannel& channel, Staging& staging) const {
    const NodeLayout& layout = channel.layout;
    const std::int64_t mine = layout.rankCount(layout.node) * shard_elems;
    gloo::AlltoallvOptions options(channel.context);
    options.setInput(staging.partial.data(), perNode<std::int64_t>(layout, shard_elems));
    options.setOutput(staging.received.data(), std::vector<std::int64_t>(layout.nodes(), mine));
    options.setTag(channel.tag);
    options.setTimeout(channel.timeout);
    gloo::alltoallv(options);
    if (op == ipc::OpCode::kReduceScatter) return {};
    // All-reduce: this node's range of the result (the nodes' partials in
    // node order, as a reduce-scatter sums them), then every node's.
    std::vector<ConstBuffer> partials;
    for (std::uint32_t n = 0; n < layout.nodes(); ++n) {
      partials.push_back(ConstBuffer{staging.received.data() + n * mine, DType::kF32, mine});
    }
    const auto total = static_cast<std::int64_t>(staging.partial.size());
    const Segment range{0, layout.firstRank(layout.node) * shard_elems, mine, 0, 0};
    if (auto reduced = kernels::reduce(partials, MutBuffer{staging.grads.data(), grad, total},
                                       kernels::ReduceOptions{1.0F, factor, false}, {&range, 1});
        !reduced) {
      return reduced;
    }
    gatherInPlace(channel, reinterpret_cast<std::uint8_t*>(staging.grads.data()),
                  perNode<std::size_t>(layout, shard_elems * sizeBytes(grad)));
    return {};
  }

  Result<void> broadcast(const LinkChannel& channel, Staging& staging) const {
    gloo::BroadcastOptions options(channel.context);
    options.setOutput(reinterpret_cast<std::uint8_t*>(staging.params.data()), staging.params.size());
    options.setRoot(static_cast<int>(root_node));
    options.setTag(channel.tag);
    options.setTimeout(channel.timeout);
    gloo::broadcast(options);
    if (!scale_counts.empty()) {
      gloo::BroadcastOptions scales(channel.context);
      scales.setOutput(staging.scales.data(), staging.scales.size());
      scales.setRoot(static_cast<int>(root_node));
      scales.setTag(channel.tag);
      scales.setTimeout(channel.timeout);
      gloo::broadcast(scales);
    }
    return {};
  }
};

class NodeExecutor final : public Executor {
 public:
  NodeExecutor(const NodeJob& job, const ClusterContext& cluster)
      : link_(job, cluster), runner_(kernels::Options{kernels::defaultThreads()}), staging_(std::make_shared<Staging>()) {
    // Meet the other nodes now, while the ranks register their groups.
    static_cast<void>(link_.post([](const LinkChannel&) { return Result<void>{}; }));
  }

  Result<bool> begin(const CollectiveArgs& args, const GroupGeometry& geometry,
                     std::span<const RankBuffers> ranks) override;
  Result<bool> step() override;
  [[nodiscard]] bool waiting() const noexcept override {
    return phase_ == Phase::kExchange && exchange_ && !exchange_->done.load(std::memory_order_acquire);
  }
  [[nodiscard]] std::uint64_t bytesWritten() const noexcept override { return written_; }
  Result<void> queued() override { return {}; }
  Result<bool> done() override { return true; }
  void quiesce() noexcept override {}  // the link's steps never touch a rank's memory
  [[nodiscard]] bool runsBarriers() const noexcept override { return true; }
  [[nodiscard]] bool wakesTheLoop() const noexcept override { return true; }  // the link's thread does
  void opFailed(std::uint64_t sequence, const Error& error) override;
  void abandon(std::uint64_t sequence, const Error& why) override;
  [[nodiscard]] const Error* unusable() const noexcept override {
    return unusable_ ? &*unusable_ : nullptr;
  }

 private:
  enum class Phase : std::uint8_t { kIdle, kBefore, kExchange, kAfter };
  using LocalStep = std::function<Result<void>()>;

  /// Queues steps over [0, count) elements in chunks: each calls
  /// `run(offset, n)` and counts n * bytes_per_element written.
  void chunked(std::vector<LocalStep>& steps, std::int64_t count, std::int64_t bytes_per_element,
               std::function<Result<void>(std::int64_t, std::int64_t)> run);
  Result<void> planAllGather();
  Result<void> planReduction();
  Result<void> planBroadcast();
  /// The exchange: the header, then the op's transfers (on the link thread).
  NodeLink::Step exchange(OpHeader header) const;
  [[nodiscard]] OpHeader readyHeader() const;
  /// This node's part of the fp8 scales: [first, first + count).
  [[nodiscard]] Result<std::pair<std::int64_t, std::int64_t>> nodeScales(std::uint32_t node) const;

  NodeLink link_;
  kernels::CpuRunner runner_;
  std::shared_ptr<Staging> staging_;

  Phase phase_ = Phase::kIdle;
  CollectiveArgs args_;
  const GroupGeometry* geometry_ = nullptr;
  std::span<const RankBuffers> ranks_;
  std::vector<LocalStep> before_;
  std::vector<LocalStep> after_;
  std::size_t next_step_ = 0;
  std::vector<kernels::ConstBuffer> sources_;
  std::shared_ptr<NodeLink::Ticket> exchange_;
  LocalCollective local_;       // the all-gather's local part
  bool local_running_ = false;  // local_ has steps left
  std::uint64_t written_ = 0;
  /// The sequence whose ready header was posted (it then fails, if it does,
  /// on every node alike), or none.
  std::optional<std::uint64_t> committed_;
  std::vector<std::size_t> scale_counts_;  // fp8 all-gather and broadcast: each node's scales
  bool abandoned_ = false;
  std::optional<Error> unusable_;  // set with abandoned_ once the other nodes know
};

Result<bool> NodeExecutor::begin(const CollectiveArgs& args, const GroupGeometry& geometry,
                                 std::span<const RankBuffers> ranks) {
  if (!link_.connected() || !link_.idle()) {
    // Still meeting the other nodes, or an earlier op's exchange still runs
    // (it reads the staging memory): not yet. A failed meeting is tried again.
    if (!link_.connected() && link_.idle()) {
      static_cast<void>(link_.post([](const LinkChannel&) { return Result<void>{}; }));
    }
    return false;
  }
  args_ = args;
  geometry_ = &geometry;
  ranks_ = ranks;
  before_.clear();
  after_.clear();
  next_step_ = 0;
  written_ = 0;
  local_running_ = false;
  exchange_.reset();
  Result<void> planned;
  switch (args.op) {
    case ipc::OpCode::kAllGather:
      planned = planAllGather();
      break;
    case ipc::OpCode::kReduceScatter:
    case ipc::OpCode::kAllReduce:
      planned = planReduction();
      break;
    case ipc::OpCode::kBroadcast:
      planned = planBroadcast();
      break;
    default:
      break;  // a barrier: the exchange alone
  }
  if (!planned) return std::move(planned).error();
  scale_counts_.clear();
  if (args.op != ipc::OpCode::kBarrier && geometry.quantized()) {
    for (std::uint32_t n = 0; n < link_.layout().nodes(); ++n) {
      auto scales = nodeScales(n);
      if (!scales) return std::move(scales).error();
      scale_counts_.push_back(static_cast<std::size_t>(scales->second));
    }
  }
  phase_ = Phase::kBefore;
  return true;
}

void NodeExecutor::chunked(std::vector<LocalStep>& steps, std::int64_t count, std::int64_t bytes_per_element,
                           std::function<Result<void>(std::int64_t, std::int64_t)> run) {
  for (std::int64_t offset = 0; offset < count; offset += kChunk) {
    const std::int64_t n = std::min(kChunk, count - offset);
    steps.emplace_back([this, run, offset, n, bytes_per_element]() -> Result<void> {
      if (auto done = run(offset, n); !done) return done;
      written_ += static_cast<std::uint64_t>(n * bytes_per_element);
      return {};
    });
  }
}

Result<std::pair<std::int64_t, std::int64_t>> NodeExecutor::nodeScales(std::uint32_t node) const {
  const NodeLayout& layout = link_.layout();
  const GroupGeometry& g = *geometry_;
  const std::int64_t first = g.ranks[layout.firstRank(node)].first_scale;
  std::int64_t next = first;
  for (std::uint32_t r = layout.firstRank(node); r < layout.firstRank(node) + layout.rankCount(node); ++r) {
    if (g.ranks[r].scales > 0 && g.ranks[r].first_scale != next) {
      return makeError(ErrorCode::kInternal, "dbufd: a node's fp8 scales are not contiguous (a bug)");
    }
    next += g.ranks[r].scales;
  }
  return std::pair{first, next - first};
}

Result<void> NodeExecutor::planAllGather() {
  const GroupGeometry& g = *geometry_;
  const NodeLayout& layout = link_.layout();
  const std::uint32_t me = layout.node;
  const std::int64_t S = g.shard_elems;
  const std::int64_t total = g.world * S;
  const std::int64_t esz = sizeBytes(g.unsharded);
  Staging& staging = *staging_;
  staging.params.resize(static_cast<std::size_t>(total * esz));
  if (g.quantized()) staging.scales.resize(static_cast<std::size_t>(g.total_blocks));
  // 1. The node's ranks gather their own parts (one step of local_ per call).
  sources_.resize(ranks_.size());
  local_ = LocalCollective(args_, geometry_, ranks_, sources_, {}, runner_, layout.firstRank(me));
  local_running_ = true;
  // 2. The node's chunk (and scales), from its first rank, into staging.
  const std::int64_t chunk_first = layout.firstRank(me) * S;
  const std::int64_t chunk = layout.rankCount(me) * S;
  const ConstBuffer leader{ranks_[0].params, g.unsharded, total};
  const MutBuffer staged{staging.params.data(), g.unsharded, total};
  chunked(before_, chunk, esz, [this, leader, staged, chunk_first](std::int64_t offset, std::int64_t n) {
    const Segment segment{chunk_first + offset, chunk_first + offset, n, 0, 0};
    return runner_.copy(leader, staged, {&segment, 1});
  });
  std::pair<std::int64_t, std::int64_t> scales{0, 0};
  if (g.quantized()) {
    auto mine = nodeScales(me);
    if (!mine) return std::move(mine).error();
    scales = *mine;
    const ConstBuffer from{ranks_[0].scales, DType::kF32, g.total_blocks};
    const MutBuffer to{staging.scales.data(), DType::kF32, g.total_blocks};
    before_.emplace_back([this, from, to, scales]() {
      const Segment segment{scales.first, scales.first, scales.second, 0, 0};
      return scales.second == 0 ? Result<void>{} : runner_.copy(from, to, {&segment, 1});
    });
  }
  // 3. After the exchange: the other nodes' chunks (and scales) to every rank.
  const ConstBuffer gathered{staging.params.data(), g.unsharded, total};
  for (const RankBuffers& rank : ranks_) {
    const MutBuffer params{rank.params, g.unsharded, total};
    const auto copy = [this, gathered, params](std::int64_t first) {
      return [this, gathered, params, first](std::int64_t offset, std::int64_t n) {
        const Segment segment{first + offset, first + offset, n, 0, 0};
        return runner_.copy(gathered, params, {&segment, 1});
      };
    };
    chunked(after_, chunk_first, esz, copy(0));
    chunked(after_, total - chunk_first - chunk, esz, copy(chunk_first + chunk));
    if (g.quantized()) {
      const ConstBuffer from{staging.scales.data(), DType::kF32, g.total_blocks};
      const MutBuffer to{rank.scales, DType::kF32, g.total_blocks};
      after_.emplace_back([this, from, to, scales, blocks = g.total_blocks]() -> Result<void> {
        const Segment below{0, 0, scales.first, 0, 0};
        const Segment above{scales.first + scales.second, scales.first + scales.second,
                            blocks - scales.first - scales.second, 0, 0};
        if (below.count > 0) {
          if (auto done = runner_.copy(from, to, {&below, 1}); !done) return done;
        }
        return above.count > 0 ? runner_.copy(from, to, {&above, 1}) : Result<void>{};
      });
    }
  }
  return {};
}

Result<void> NodeExecutor::planReduction() {
  const GroupGeometry& g = *geometry_;
  const NodeLayout& layout = link_.layout();
  const std::uint32_t me = layout.node;
  const std::int64_t S = g.shard_elems;
  const std::int64_t total = g.world * S;
  const std::int64_t mine = layout.rankCount(me) * S;
  Staging& staging = *staging_;
  staging.partial.resize(static_cast<std::size_t>(total));
  staging.received.resize(static_cast<std::size_t>(layout.nodes() * mine));
  // 1. The node's partial: its ranks' gradients summed in rank order, pre-scaled.
  sources_.clear();
  for (const RankBuffers& rank : ranks_) sources_.push_back(ConstBuffer{rank.grads, g.grad, total});
  const MutBuffer partial{staging.partial.data(), DType::kF32, total};
  const kernels::ReduceOptions sum{args_.pre_scale, 1.0F, false};
  chunked(before_, total, std::int64_t{sizeof(float)}, [this, partial, sum](std::int64_t offset, std::int64_t n) {
    const Segment segment{offset, offset, n, 0, 0};
    return runner_.reduce(sources_, partial, sum, {&segment, 1});
  });
  if (args_.op == ipc::OpCode::kAllReduce) {
    // 3. After the exchange, staging.grads holds the whole result.
    staging.grads.resize(static_cast<std::size_t>(total * sizeBytes(g.grad)));
    const ConstBuffer result{staging.grads.data(), g.grad, total};
    for (const RankBuffers& rank : ranks_) {
      const MutBuffer grads{rank.grads, g.grad, total};
      chunked(after_, total, sizeBytes(g.grad), [this, result, grads](std::int64_t offset, std::int64_t n) {
        const Segment segment{offset, offset, n, 0, 0};
        return runner_.copy(result, grads, {&segment, 1});
      });
    }
    return {};
  }
  // 3. Each rank's piece: the nodes' partials of it summed in node order.
  const float factor = args_.factor(g.world);
  const kernels::ReduceOptions finish{1.0F, factor, args_.accumulate};
  for (std::size_t i = 0; i < ranks_.size(); ++i) {
    const MutBuffer shard_grad{ranks_[i].shard_grad, g.sharded, S};
    chunked(after_, S, sizeBytes(g.sharded), [this, shard_grad, finish, i, S, mine](std::int64_t offset, std::int64_t n) {
      std::vector<ConstBuffer> partials;
      for (std::uint32_t node = 0; node < link_.layout().nodes(); ++node) {
        partials.push_back(ConstBuffer{staging_->received.data() + node * mine, DType::kF32, mine});
      }
      const Segment segment{static_cast<std::int64_t>(i) * S + offset, offset, n, 0, 0};
      return runner_.reduce(partials, shard_grad, finish, {&segment, 1});
    });
  }
  return {};
}

Result<void> NodeExecutor::planBroadcast() {
  const GroupGeometry& g = *geometry_;
  const NodeLayout& layout = link_.layout();
  const std::int64_t total = g.world * g.shard_elems;
  const std::int64_t esz = sizeBytes(g.unsharded);
  Staging& staging = *staging_;
  staging.params.resize(static_cast<std::size_t>(total * esz));
  if (g.quantized()) staging.scales.resize(static_cast<std::size_t>(g.total_blocks));
  const std::uint32_t first = layout.firstRank(layout.node);
  const bool root_here = args_.root >= first && args_.root < first + layout.rankCount(layout.node);
  const MutBuffer staged{staging.params.data(), g.unsharded, total};
  const MutBuffer staged_scales{staging.scales.data(), DType::kF32, g.total_blocks};
  const auto copier = [this](ConstBuffer from, MutBuffer to) {
    return [this, from, to](std::int64_t offset, std::int64_t n) {
      const Segment segment{offset, offset, n, 0, 0};
      return runner_.copy(from, to, {&segment, 1});
    };
  };
  if (root_here) {
    const RankBuffers& root = ranks_[args_.root - first];
    chunked(before_, total, esz, copier(ConstBuffer{root.params, g.unsharded, total}, staged));
    if (g.quantized()) {
      chunked(before_, g.total_blocks, std::int64_t{sizeof(float)},
              copier(ConstBuffer{root.scales, DType::kF32, g.total_blocks}, staged_scales));
    }
  }
  for (std::size_t i = 0; i < ranks_.size(); ++i) {
    if (root_here && first + i == args_.root) continue;
    chunked(after_, total, esz,
            copier(ConstBuffer{staging.params.data(), g.unsharded, total}, MutBuffer{ranks_[i].params, g.unsharded, total}));
    if (g.quantized()) {
      chunked(after_, g.total_blocks, std::int64_t{sizeof(float)},
              copier(ConstBuffer{staging.scales.data(), DType::kF32, g.total_blocks},
                     MutBuffer{ranks_[i].scales, DType::kF32, g.total_blocks}));
    }
  }
  return {};
}

OpHeader NodeExecutor::readyHeader() const {
  OpHeader header;
  header.sequence = args_.sequence;
  header.group_digest = args_.op == ipc::OpCode::kBarrier ? 0 : geometry_->digest;
  header.op = static_cast<std::uint8_t>(args_.op);
  header.reduce = static_cast<std::uint8_t>(args_.reduce);
  header.accumulate = args_.accumulate ? 1 : 0;
  header.root = args_.root;
  header.pre_scale = args_.pre_scale;
  header.post_scale = args_.post_scale;
  setText(header, args_.description);
  return header;
}

Result<bool> NodeExecutor::step() {
  switch (phase_) {
    case Phase::kBefore: {
      if (local_running_) {
        auto stepped = local_.step();
        if (!stepped) return std::move(stepped).error();
        written_ = local_.bytesWritten();
        local_running_ = !*stepped;
        return false;
      }
      if (next_step_ < before_.size()) {
        if (auto done = before_[next_step_++](); !done) return std::move(done).error();
        return false;
      }
      committed_ = args_.sequence;
      exchange_ = link_.post(exchange(readyHeader()));
      phase_ = Phase::kExchange;
      next_step_ = 0;
      return false;
    }
    case Phase::kExchange: {
      if (!exchange_->done.load(std::memory_order_acquire)) return false;
      if (!exchange_->result) {
        const Error& error = exchange_->result.error();
        phase_ = Phase::kIdle;
        if (staging_->fatal.load() && !abandoned_) {
          abandoned_ = true;  // another node's rank is gone: so is this job, on every node
          unusable_ = error;
          link_.breakLink(error);
        }
        return error;
      }
      phase_ = Phase::kAfter;
      [[fallthrough]];
    }
    case Phase::kAfter:
      if (next_step_ < after_.size()) {
        if (auto done = after_[next_step_++](); !done) return std::move(done).error();
        return next_step_ == after_.size() ? Result<bool>(true) : Result<bool>(false);
      }
      phase_ = Phase::kIdle;
      return true;
    case Phase::kIdle:
      break;
  }
  return makeError(ErrorCode::kInternal, "dbufd: a step of a job across nodes with no op begun (a bug)");
}

NodeLink::Step NodeExecutor::exchange(OpHeader header) const {
  // Everything the step needs is copied or shared: it may outlive the op.
  Transfer transfer;
  transfer.op = args_.op;
  if (args_.op != ipc::OpCode::kBarrier) {
    const GroupGeometry& g = *geometry_;
    const NodeLayout& layout = link_.layout();
    transfer.shard_elems = g.shard_elems;
    transfer.unsharded_bytes = sizeBytes(g.unsharded);
    transfer.grad = g.grad;
    transfer.factor = args_.factor(g.world);
    transfer.scale_counts = scale_counts_;
    for (std::uint32_t n = 0; n < layout.nodes(); ++n) {
      if (args_.root >= layout.firstRank(n) && args_.root < layout.firstRank(n) + layout.rankCount(n)) {
        transfer.root_node = n;
      }
    }
  }
  return [header, transfer, staging = staging_](const LinkChannel& channel) -> Result<void> {
    // 1. The headers: every node draws the same verdict from them.
    std::vector<OpHeader> headers(channel.layout.nodes());
    OpHeader mine = header;
    gloo::AllgathervOptions options(channel.context);
    options.setInput(reinterpret_cast<std::uint8_t*>(&mine), sizeof(OpHeader));
    options.setOutput(reinterpret_cast<std::uint8_t*>(headers.data()),
                      std::vector<std::size_t>(channel.layout.nodes(), sizeof(OpHeader)));
    options.setTag(channel.tag);
    options.setTimeout(channel.timeout * 2);  // a node's own collective timeout fires first
    gloo::allgatherv(options);
    bool fatal = false;
    if (auto verdict = judgeHeaders(headers, channel.layout, fatal); !verdict) {
      if (fatal) staging->fatal.store(true);
      return verdict;
    }
    if (header.status != 0) return {};  // this node failed the op: nothing more to send
    // 2. The op's data.
    return transfer.run(channel, *staging);
  };
}

void NodeExecutor::opFailed(std::uint64_t sequence, const Error& error) {
  if (abandoned_ || committed_ == sequence) return;  // the other nodes know already
  committed_ = sequence;
  static_cast<void>(link_.post(exchange(failureHeader(sequence, error, false))));
}

void NodeExecutor::abandon(std::uint64_t sequence, const Error& why) {
  if (abandoned_) return;
  abandoned_ = true;
  // The op that was running committed already: the other nodes' next one
  // is the first to learn that this job cannot go on.
  const std::uint64_t first_failing = committed_ == sequence ? sequence + 1 : sequence;
  static_cast<void>(link_.post(exchange(failureHeader(first_failing, why, true))));
  link_.breakLink(why);
  unusable_ = why;
}

}  // namespace

OpHeader failureHeader(std::uint64_t sequence, const Error& error, bool fatal) {
  OpHeader header;
  header.sequence = sequence;
  header.status = static_cast<std::uint16_t>(ipc::toWire(error.code));
  header.fatal = fatal ? 1 : 0;
  header.rank_count = static_cast<std::uint16_t>(std::min(error.ranks.size(), OpHeader::kRanks));
  std::copy_n(error.ranks.begin(), header.rank_count, header.ranks);
  setText(header, error.message);
  return header;
}

Result<void> judgeHeaders(std::span<const OpHeader> headers, const NodeLayout& layout, bool& fatal) {
  fatal = std::any_of(headers.begin(), headers.end(), [](const OpHeader& h) { return h.status != 0 && h.fatal != 0; });
  for (std::uint32_t n = 0; n < headers.size(); ++n) {
    const OpHeader& h = headers[n];
    if (h.status == 0) continue;
    std::vector<std::uint32_t> ranks(h.ranks, h.ranks + std::min<std::size_t>(h.rank_count, OpHeader::kRanks));
    const ErrorCode code = ipc::fromWire(static_cast<ipc::WireError>(h.status));
    return Error{code, "on " + layout.describeNode(n) + ": " + textOf(h), std::move(ranks)};
  }
  const OpHeader& first = headers.front();
  std::vector<std::uint32_t> differing;
  std::string text = "collective #" + std::to_string(first.sequence) + " does not match across nodes:";
  for (std::uint32_t n = 0; n < headers.size(); ++n) {
    const bool same = sameOp(headers[n], first);
    if (!same) {
      for (std::uint32_t r : layout.ranksOf(n)) differing.push_back(r);
    }
    const bool only_plan = !same && headers[n].group_digest != first.group_digest && textOf(headers[n]) == textOf(first);
    text += " " + layout.describeNode(n) + " " + textOf(headers[n]) +
            (only_plan ? " (its group was registered differently)" : "") + (n + 1 < headers.size() ? ";" : "");
  }
  if (differing.empty()) return {};
  return Error{ErrorCode::kConflict, std::move(text), std::move(differing)};
}

std::unique_ptr<Executor> nodeExecutor(const NodeJob& job, const ClusterContext& cluster) {
  return std::make_unique<NodeExecutor>(job, cluster);
}

}  // namespace dbuf::daemon
