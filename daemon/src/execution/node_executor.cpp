#include "node_executor.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <utility>
#include <vector>

#include "dbuf/ipc/protocol.hpp"
#include "dbuf/kernels/runner.hpp"
#include "executor.hpp"
#include "local_collective.hpp"
#include "node_meetings.hpp"
#include "node_transfer.hpp"
#include "rank_text.hpp"

namespace dbuf::daemon {
namespace {

using kernels::ConstBuffer;
using kernels::MutBuffer;
using kernels::Segment;

/// Elements one round exchanges at most, all the ranks' pieces together.
/// Two rounds are in flight (one exchanged, the next prepared), so this
/// bounds a job's staging memory whatever its groups' size.
constexpr std::int64_t kRoundElements = std::int64_t{1} << 22;

class NodeExecutor final : public NodeSync {
 public:
  /// headers_only: every op is its header exchange alone (nodeSync()).
  NodeExecutor(const NodeJob& job, const ClusterContext& cluster, bool headers_only)
      : headers_only_(headers_only), meetings_(job, cluster), runner_(kernels::Options{kernels::defaultThreads()}) {}

  Result<bool> begin(const CollectiveArgs& args, const GroupGeometry& geometry,
                     std::span<const RankBuffers> ranks) override;
  Result<bool> step() override;
  [[nodiscard]] bool waiting() const noexcept override;
  [[nodiscard]] std::uint64_t bytesWritten() const noexcept override { return written_; }
  Result<void> queued() override { return {}; }
  Result<bool> done() override { return true; }
  void quiesce() noexcept override {}  // the link's steps never touch a rank's memory
  [[nodiscard]] bool runsBarriers() const noexcept override { return true; }
  [[nodiscard]] bool wakesTheLoop() const noexcept override { return true; }  // the link's thread does
  void opFailed(std::uint64_t sequence, const Error& error) override;
  void abandon(std::uint64_t sequence, const Error& why) override;
  void ranksAttached() override;
  [[nodiscard]] const Error* unavailable() override;
  void loseLink(std::uint64_t sequence, const Error& why) override;
  void whenLinkLost(std::function<void()> lost) override { meetings_.whenLost(std::move(lost)); }

 private:
  using LocalStep = std::function<Result<void>()>;
  enum class Batch : std::uint8_t { kNone, kBefore, kAfter };
  /// Round j's pieces: [offset, offset + length) of every rank's part
  /// (broadcast: of the whole buffer).
  [[nodiscard]] std::int64_t roundOffset(std::int64_t j) const noexcept { return j * round_length_; }
  [[nodiscard]] std::int64_t roundLength(std::int64_t j) const noexcept {
    return std::min(round_length_, span_ - roundOffset(j));
  }
  /// What round j does on this node before its exchange (kBefore) or after it.
  [[nodiscard]] std::vector<LocalStep> roundSteps(Batch batch, std::int64_t j);
  std::vector<LocalStep> allGatherBefore(std::int64_t j, RoundBuffer& round);
  std::vector<LocalStep> allGatherAfter(std::int64_t j, RoundBuffer& round);
  std::vector<LocalStep> reductionBefore(std::int64_t j, RoundBuffer& round);
  std::vector<LocalStep> reductionAfter(std::int64_t j, RoundBuffer& round);
  std::vector<LocalStep> broadcastBefore(std::int64_t j, RoundBuffer& round);
  std::vector<LocalStep> broadcastAfter(std::int64_t j, RoundBuffer& round);
  /// Sizes the staging memory for the op (it only grows).
  void sizeStaging();
  /// A step that runs `run` and counts `bytes` written.
  LocalStep counted(std::int64_t bytes, std::function<Result<void>()> run);
  /// Round j's exchange; `verdict` replaces the last round's (a failure).
  [[nodiscard]] Transfer transfer(std::int64_t j, const std::optional<OpHeader>& failed_verdict) const;
  /// Posts `transfer` for the op (its link state `shared`; a fresh one for
  /// a failure's header alone).
  void post(const Transfer& transfer, std::shared_ptr<OpLink> shared = nullptr);
  /// After a failure here once the op was committed: the rounds the other
  /// nodes still expect, with `verdict` (a failure) at the end.
  void postRemainingRounds(const OpHeader& verdict);
  /// A failure's header alone, as round 0 of op `sequence` (no data follows).
  void postFailureHeader(std::uint64_t sequence, const Error& error, bool fatal);
  [[nodiscard]] OpHeader readyHeader() const;
  /// The op moves no data here: a barrier, or every op of a nodeSync().
  [[nodiscard]] bool headersOnly() const noexcept { return headers_only_ || args_.op == ipc::OpCode::kBarrier; }
  [[nodiscard]] bool scalesTravel() const noexcept;
  /// Node n's fp8 scales: [first, first + count).
  [[nodiscard]] Result<std::pair<std::int64_t, std::int64_t>> nodeScales(std::uint32_t node) const;
  [[nodiscard]] bool rootHere() const noexcept;
  Result<bool> failed(const Error& error);

  bool headers_only_;
  NodeMeetings meetings_;
  kernels::CpuRunner runner_;

  // The op.
  bool active_ = false;
  CollectiveArgs args_;
  std::uint64_t number_ = 0;  // args_.sequence since the nodes met
  const GroupGeometry* geometry_ = nullptr;
  std::span<const RankBuffers> ranks_;
  std::shared_ptr<OpLink> op_link_;
  std::vector<kernels::ConstBuffer> sources_;  // the node's ranks' gradients
  LocalCollective local_;                      // the all-gather's part among the node's ranks
  bool local_running_ = false;
  std::uint64_t local_written_ = 0;        // local_'s bytes already counted
  std::vector<std::size_t> scale_counts_;  // fp8 all-gather and broadcast: each node's scales
  std::pair<std::int64_t, std::int64_t> my_scales_{0, 0};  // this node's: first, count
  std::int64_t span_ = 0;                  // elements the rounds cover (per rank part; broadcast: the buffer)
  std::int64_t round_length_ = 0;
  std::int64_t rounds_ = 0;
  std::int64_t prepared_ = 0;  // rounds whose before-steps ran (or run now)
  std::int64_t posted_ = 0;    // rounds whose exchange is posted
  std::int64_t finished_ = 0;  // rounds whose after-steps ran (or run now)
  std::array<std::shared_ptr<NodeLink::Ticket>, 2> tickets_;
  std::vector<LocalStep> steps_;
  std::size_t next_step_ = 0;
  Batch batch_ = Batch::kNone;
  std::uint64_t written_ = 0;
};

Result<bool> NodeExecutor::begin(const CollectiveArgs& args, const GroupGeometry& geometry,
                                 std::span<const RankBuffers> ranks) {
  if (const Error* why = unavailable()) return *why;  // (ops queued before the link was lost)
  // Not while the nodes meet, or an earlier op's rounds still run (in the staging memory).
  if (auto ready = meetings_.readyForAnOp(); !ready || !*ready) return ready;
  args_ = args;
  number_ = meetings_.sinceMeeting(args.sequence);
  geometry_ = &geometry;
  ranks_ = ranks;
  op_link_ = std::make_shared<OpLink>();
  written_ = 0;
  steps_.clear();
  next_step_ = 0;
  batch_ = Batch::kNone;
  prepared_ = posted_ = finished_ = 0;
  local_running_ = false;
  local_written_ = 0;
  scale_counts_.clear();
  const NodeLayout& layout = meetings_.layout();
  if (headersOnly()) {
    span_ = round_length_ = 0;
    rounds_ = 1;
    active_ = true;
    return true;
  }
  const std::uint32_t world = layout.firstRank(layout.nodes());
  span_ = args.op == ipc::OpCode::kBroadcast ? world * geometry.shard_elems : geometry.shard_elems;
  const std::int64_t per_rank = std::max<std::int64_t>(1, kRoundElements / world);
  round_length_ = args.op == ipc::OpCode::kBroadcast ? per_rank * world : per_rank;
  round_length_ = std::max<std::int64_t>(1, std::min(round_length_, span_));
  rounds_ = std::max<std::int64_t>(1, (span_ + round_length_ - 1) / round_length_);
  if (scalesTravel()) {
    for (std::uint32_t n = 0; n < layout.nodes(); ++n) {
      auto scales = nodeScales(n);
      if (!scales) return std::move(scales).error();
      scale_counts_.push_back(static_cast<std::size_t>(scales->second));
      if (n == layout.node) my_scales_ = *scales;
    }
  }
  sizeStaging();
  if (args.op == ipc::OpCode::kAllGather) {
    sources_.resize(ranks.size());
    local_ = LocalCollective(args, geometry_, ranks, sources_, {}, runner_, layout.firstRank(layout.node));
    local_running_ = true;
  } else {
    sources_.clear();
    for (const RankBuffers& rank : ranks) {
      sources_.push_back(ConstBuffer{rank.grads, geometry.grad, world * geometry.shard_elems});
    }
  }
  active_ = true;
  return true;
}

bool NodeExecutor::scalesTravel() const noexcept {
  return geometry_->quantized() && (args_.op == ipc::OpCode::kAllGather || args_.op == ipc::OpCode::kBroadcast);
}

bool NodeExecutor::rootHere() const noexcept {
  const NodeLayout& layout = meetings_.layout();
  const std::uint32_t first = layout.firstRank(layout.node);
  return args_.root >= first && args_.root < first + layout.rankCount(layout.node);
}

void NodeExecutor::sizeStaging() {
  const GroupGeometry& g = *geometry_;
  const NodeLayout& layout = meetings_.layout();
  const std::uint32_t world = layout.firstRank(layout.nodes());
  // Broadcast rounds are runs of the whole buffer; the others, a piece per rank.
  const std::int64_t elements = args_.op == ipc::OpCode::kBroadcast ? round_length_ : world * round_length_;
  for (RoundBuffer& round : meetings_.staging()->rounds) {
    const auto grow = [](auto& buffer, std::int64_t size) {
      if (std::cmp_less(buffer.size(), size)) buffer.resize(static_cast<std::size_t>(size));
    };
    switch (args_.op) {
      case ipc::OpCode::kAllGather:
      case ipc::OpCode::kBroadcast:
        grow(round.params, elements * sizeBytes(g.unsharded));
        break;
      case ipc::OpCode::kAllReduce:
        grow(round.grads, elements * sizeBytes(g.grad));
        [[fallthrough]];
      case ipc::OpCode::kReduceScatter:
        grow(round.partial, elements * sizeBytes(g.accumulation()));
        grow(round.received, layout.nodes() * layout.rankCount(layout.node) * round_length_ * sizeBytes(g.accumulation()));
        break;
      default:
        break;
    }
  }
  if (scalesTravel() && std::cmp_less(meetings_.staging()->scales.size(), g.total_blocks)) {
    meetings_.staging()->scales.resize(static_cast<std::size_t>(g.total_blocks));
  }
}

Result<std::pair<std::int64_t, std::int64_t>> NodeExecutor::nodeScales(std::uint32_t node) const {
  const NodeLayout& layout = meetings_.layout();
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

NodeExecutor::LocalStep NodeExecutor::counted(std::int64_t bytes, std::function<Result<void>()> run) {
  return [this, bytes, run = std::move(run)]() -> Result<void> {
    if (auto done = run(); !done) return done;
    written_ += static_cast<std::uint64_t>(bytes);
    return {};
  };
}

std::vector<NodeExecutor::LocalStep> NodeExecutor::roundSteps(Batch batch, std::int64_t j) {
  RoundBuffer& round = meetings_.staging()->rounds[static_cast<std::size_t>(j % 2)];
  const bool before = batch == Batch::kBefore;
  if (headersOnly()) return {};  // the exchange alone
  switch (args_.op) {
    case ipc::OpCode::kAllGather:
      return before ? allGatherBefore(j, round) : allGatherAfter(j, round);
    case ipc::OpCode::kReduceScatter:
    case ipc::OpCode::kAllReduce:
      return before ? reductionBefore(j, round) : reductionAfter(j, round);
    case ipc::OpCode::kBroadcast:
      return before ? broadcastBefore(j, round) : broadcastAfter(j, round);
    default:
      return {};
  }
}

std::vector<NodeExecutor::LocalStep> NodeExecutor::allGatherBefore(std::int64_t j, RoundBuffer& round) {
  // The node's pieces, from its first rank (which has every part of the
  // node after the local all-gather), and in round 0 its scales.
  const GroupGeometry& g = *geometry_;
  const NodeLayout& layout = meetings_.layout();
  const std::int64_t S = g.shard_elems;
  const std::int64_t total = layout.firstRank(layout.nodes()) * S;
  const std::int64_t length = roundLength(j);
  const std::int64_t offset = roundOffset(j);
  std::vector<Segment> pieces;
  for (std::uint32_t r = layout.firstRank(layout.node); r < layout.firstRank(layout.node + 1); ++r) {
    pieces.push_back(Segment{r * S + offset, r * length, length, 0, 0});
  }
  const ConstBuffer leader{ranks_[0].params, g.unsharded, total};
  const MutBuffer staged{round.params.data(), g.unsharded, layout.firstRank(layout.nodes()) * length};
  std::vector<LocalStep> steps;
  steps.push_back(counted(static_cast<std::int64_t>(pieces.size()) * length * sizeBytes(g.unsharded),
                          [this, leader, staged, pieces] { return runner_.copy(leader, staged, pieces); }));
  if (j == 0 && scalesTravel()) {
    const auto [first, count] = my_scales_;
    const Segment mine{first, first, count, 0, 0};
    const ConstBuffer from{ranks_[0].scales, DType::kF32, g.total_blocks};
    const MutBuffer to{meetings_.staging()->scales.data(), DType::kF32, g.total_blocks};
    steps.push_back(counted(count * 4, [this, from, to, mine] {
      return mine.count == 0 ? Result<void>{} : runner_.copy(from, to, {&mine, 1});
    }));
  }
  return steps;
}

std::vector<NodeExecutor::LocalStep> NodeExecutor::allGatherAfter(std::int64_t j, RoundBuffer& round) {
  // The other nodes' pieces (and in round 0 their scales) to every rank.
  const GroupGeometry& g = *geometry_;
  const NodeLayout& layout = meetings_.layout();
  const std::uint32_t world = layout.firstRank(layout.nodes());
  const std::int64_t S = g.shard_elems;
  const std::int64_t length = roundLength(j);
  const std::int64_t offset = roundOffset(j);
  std::vector<Segment> pieces;
  for (std::uint32_t r = 0; r < world; ++r) {
    if (r >= layout.firstRank(layout.node) && r < layout.firstRank(layout.node + 1)) continue;
    pieces.push_back(Segment{r * length, r * S + offset, length, 0, 0});
  }
  std::vector<Segment> scales;
  if (j == 0 && scalesTravel()) {
    const auto [first, count] = my_scales_;
    if (first > 0) scales.push_back(Segment{0, 0, first, 0, 0});
    if (first + count < g.total_blocks) {
      scales.push_back(Segment{first + count, first + count, g.total_blocks - first - count, 0, 0});
    }
  }
  const ConstBuffer gathered{round.params.data(), g.unsharded, world * length};
  const ConstBuffer staged_scales{meetings_.staging()->scales.data(), DType::kF32, g.total_blocks};
  std::vector<LocalStep> steps;
  for (const RankBuffers& rank : ranks_) {
    const MutBuffer params{rank.params, g.unsharded, world * S};
    steps.push_back(counted(static_cast<std::int64_t>(pieces.size()) * length * sizeBytes(g.unsharded),
                            [this, gathered, params, pieces] {
                              return pieces.empty() ? Result<void>{} : runner_.copy(gathered, params, pieces);
                            }));
    if (!scales.empty()) {
      const MutBuffer to{rank.scales, DType::kF32, g.total_blocks};
      steps.push_back(counted(0, [this, staged_scales, to, scales] { return runner_.copy(staged_scales, to, scales); }));
    }
  }
  return steps;
}

std::vector<NodeExecutor::LocalStep> NodeExecutor::reductionBefore(std::int64_t j, RoundBuffer& round) {
  // The node's partial of every rank's piece: its ranks' gradients summed in
  // rank order, pre-scaled (in fp32; fp64 for fp64).
  const GroupGeometry& g = *geometry_;
  const std::uint32_t world = meetings_.layout().firstRank(meetings_.layout().nodes());
  const std::int64_t length = roundLength(j);
  const std::int64_t offset = roundOffset(j);
  std::vector<Segment> pieces;
  for (std::uint32_t r = 0; r < world; ++r) pieces.push_back(Segment{r * g.shard_elems + offset, r * length, length, 0, 0});
  const MutBuffer partial{round.partial.data(), g.accumulation(), world * length};
  const kernels::ReduceOptions sum{args_.pre_scale, 1.0F, false};
  return {counted(world * length * sizeBytes(partial.dtype),
                  [this, partial, sum, pieces] { return runner_.reduce(sources_, partial, sum, pieces); })};
}

std::vector<NodeExecutor::LocalStep> NodeExecutor::reductionAfter(std::int64_t j, RoundBuffer& round) {
  const GroupGeometry& g = *geometry_;
  const NodeLayout& layout = meetings_.layout();
  const std::uint32_t world = layout.firstRank(layout.nodes());
  const std::int64_t length = roundLength(j);
  const std::int64_t offset = roundOffset(j);
  std::vector<LocalStep> steps;
  if (args_.op == ipc::OpCode::kAllReduce) {
    // The whole result of the round, every rank's piece, to every rank.
    std::vector<Segment> pieces;
    for (std::uint32_t r = 0; r < world; ++r) {
      pieces.push_back(Segment{r * length, r * g.shard_elems + offset, length, 0, 0});
    }
    const ConstBuffer result{round.grads.data(), g.grad, world * length};
    for (const RankBuffers& rank : ranks_) {
      const MutBuffer grads{rank.grads, g.grad, world * g.shard_elems};
      steps.push_back(counted(world * length * sizeBytes(g.grad),
                              [this, result, grads, pieces] { return runner_.copy(result, grads, pieces); }));
    }
    return steps;
  }
  // Each rank's piece: the nodes' partials of it summed in node order.
  const std::int64_t mine = layout.rankCount(layout.node) * length;
  std::vector<ConstBuffer> partials;
  for (std::uint32_t n = 0; n < layout.nodes(); ++n) {
    partials.push_back(ConstBuffer{round.received.data() + n * mine * sizeBytes(g.accumulation()), g.accumulation(), mine});
  }
  const kernels::ReduceOptions finish{1.0F, args_.factor(g.world, g.accumulation()), args_.accumulate};
  for (std::size_t i = 0; i < ranks_.size(); ++i) {
    const MutBuffer shard_grad{ranks_[i].shard_grad, g.sharded, g.shard_elems};
    const Segment piece{static_cast<std::int64_t>(i) * length, offset, length, 0, 0};
    steps.push_back(counted(length * sizeBytes(g.sharded), [this, partials, shard_grad, finish, piece] {
      return runner_.reduce(partials, shard_grad, finish, {&piece, 1});
    }));
  }
  return steps;
}

std::vector<NodeExecutor::LocalStep> NodeExecutor::broadcastBefore(std::int64_t j, RoundBuffer& round) {
  if (!rootHere()) return {};
  const GroupGeometry& g = *geometry_;
  const std::int64_t total = g.world * g.shard_elems;
  const std::int64_t length = roundLength(j);
  const RankBuffers& root = ranks_[args_.root - meetings_.layout().firstRank(meetings_.layout().node)];
  const Segment run{roundOffset(j), 0, length, 0, 0};
  const ConstBuffer from{root.params, g.unsharded, total};
  const MutBuffer staged{round.params.data(), g.unsharded, length};
  std::vector<LocalStep> steps;
  steps.push_back(counted(length * sizeBytes(g.unsharded),
                          [this, from, staged, run] { return runner_.copy(from, staged, {&run, 1}); }));
  if (j == 0 && scalesTravel()) {
    const Segment all{0, 0, g.total_blocks, 0, 0};
    const ConstBuffer scales{root.scales, DType::kF32, g.total_blocks};
    const MutBuffer to{meetings_.staging()->scales.data(), DType::kF32, g.total_blocks};
    steps.push_back(counted(0, [this, scales, to, all] { return runner_.copy(scales, to, {&all, 1}); }));
  }
  return steps;
}

std::vector<NodeExecutor::LocalStep> NodeExecutor::broadcastAfter(std::int64_t j, RoundBuffer& round) {
  const GroupGeometry& g = *geometry_;
  const std::int64_t total = g.world * g.shard_elems;
  const std::int64_t length = roundLength(j);
  const std::uint32_t first = meetings_.layout().firstRank(meetings_.layout().node);
  const Segment run{0, roundOffset(j), length, 0, 0};
  const Segment all{0, 0, g.total_blocks, 0, 0};
  const ConstBuffer staged{round.params.data(), g.unsharded, length};
  const ConstBuffer staged_scales{meetings_.staging()->scales.data(), DType::kF32, g.total_blocks};
  std::vector<LocalStep> steps;
  for (std::size_t i = 0; i < ranks_.size(); ++i) {
    if (first + i == args_.root) continue;
    const MutBuffer params{ranks_[i].params, g.unsharded, total};
    steps.push_back(counted(length * sizeBytes(g.unsharded),
                            [this, staged, params, run] { return runner_.copy(staged, params, {&run, 1}); }));
    if (j == 0 && scalesTravel()) {
      const MutBuffer to{ranks_[i].scales, DType::kF32, g.total_blocks};
      steps.push_back(counted(0, [this, staged_scales, to, all] { return runner_.copy(staged_scales, to, {&all, 1}); }));
    }
  }
  return steps;
}

OpHeader NodeExecutor::readyHeader() const {
  OpHeader header;
  header.sequence = number_;
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

Transfer NodeExecutor::transfer(std::int64_t j, const std::optional<OpHeader>& failed_verdict) const {
  Transfer t;
  t.op = args_.op;
  t.buffer = static_cast<std::size_t>(j % 2);
  t.data = !headersOnly();
  if (j == 0) t.header = readyHeader();
  if (j + 1 == rounds_ && rounds_ > 1) t.verdict = failed_verdict ? *failed_verdict : readyHeader();
  if (!t.data) return t;
  const GroupGeometry& g = *geometry_;
  const NodeLayout& layout = meetings_.layout();
  t.length = roundLength(j);
  t.unsharded_bytes = sizeBytes(g.unsharded);
  t.grad = g.grad;
  t.factor = args_.factor(g.world, g.accumulation());
  if (j == 0) t.scale_counts = scale_counts_;
  for (std::uint32_t n = 0; n < layout.nodes(); ++n) {
    if (args_.root >= layout.firstRank(n) && args_.root < layout.firstRank(n + 1)) t.root_node = n;
  }
  return t;
}

void NodeExecutor::post(const Transfer& transfer, std::shared_ptr<OpLink> shared) {
  tickets_[transfer.buffer] = meetings_.link().post(
      [transfer, staging = meetings_.staging(), shared = shared ? std::move(shared) : op_link_](const LinkChannel& channel) {
        return transfer.run(channel, staging, *shared);
      });
}

Result<bool> NodeExecutor::step() {
  if (!active_) return makeError(ErrorCode::kInternal, "dbufd: a step of a job across nodes with no op begun (a bug)");
  if (local_running_) {
    auto stepped = local_.step();
    if (!stepped) return failed(stepped.error());
    written_ += local_.bytesWritten() - std::exchange(local_written_, local_.bytesWritten());
    local_running_ = !*stepped;
    return false;
  }
  if (batch_ != Batch::kNone) {
    if (next_step_ < steps_.size()) {
      if (auto done = steps_[next_step_++](); !done) return failed(done.error());
      if (next_step_ < steps_.size()) return false;
    }
    const Batch done = std::exchange(batch_, Batch::kNone);
    if (done == Batch::kBefore) {
      if (posted_ == 0) meetings_.commit(args_.sequence);
      post(transfer(posted_++, std::nullopt));
      return false;
    }
    if (finished_ == rounds_) {
      active_ = false;
      return true;
    }
    return false;
  }
  const auto start = [this](Batch batch, std::vector<LocalStep> steps) {
    steps_ = std::move(steps);
    next_step_ = 0;
    batch_ = batch;
  };
  if (finished_ < posted_) {
    const NodeLink::Ticket& ticket = *tickets_[static_cast<std::size_t>(finished_ % 2)];
    if (ticket.done.load(std::memory_order_acquire)) {
      if (!ticket.result) return failed(ticket.result.error());
      start(Batch::kAfter, roundSteps(Batch::kAfter, finished_++));
      return false;
    }
  }
  if (prepared_ < rounds_ && prepared_ - finished_ < 2) {  // round prepared_'s buffer is free
    start(Batch::kBefore, roundSteps(Batch::kBefore, prepared_++));
  }
  return false;
}

bool NodeExecutor::waiting() const noexcept {
  if (!active_ || local_running_ || batch_ != Batch::kNone) return false;
  if (prepared_ < rounds_ && prepared_ - finished_ < 2) return false;
  return finished_ < posted_ && !tickets_[static_cast<std::size_t>(finished_ % 2)]->done.load(std::memory_order_acquire);
}

Result<bool> NodeExecutor::failed(const Error& error) {
  // Another node lost a rank, or this node's exchange timed out or lost its
  // connections: the other nodes lose the link too, and meet this one again.
  if (meetings_.up() && (meetings_.staging()->fatal.load() || meetings_.link().broken())) meetings_.lose(error);
  return error;  // the data plane fails the op; opFailed() then tells the other nodes what they still expect
}

const Error* NodeExecutor::unavailable() {
  return meetings_.unavailable();
}

void NodeExecutor::ranksAttached() {
  meetings_.ranksAttached();
}

void NodeExecutor::postRemainingRounds(const OpHeader& verdict) {
  while (posted_ < rounds_) post(transfer(posted_++, verdict));
  active_ = false;
}

void NodeExecutor::postFailureHeader(std::uint64_t sequence, const Error& error, bool fatal) {
  Transfer header_only;
  header_only.data = false;
  header_only.header = failureHeader(meetings_.sinceMeeting(sequence), error, fatal);
  post(header_only, std::make_shared<OpLink>());
}

void NodeExecutor::opFailed(std::uint64_t sequence, const Error& error) {
  if (!meetings_.up()) return;  // the other nodes lose the link too
  if (meetings_.committed() != sequence) {
    // The other nodes have not heard of this op from here: round 0's header
    // tells them it failed (and this node sends no data).
    meetings_.commit(sequence);
    postFailureHeader(sequence, error, false);
    return;
  }
  // Failed here after its commit: the other nodes expect the rest of its
  // rounds, and learn from the last one's verdict that it failed.
  if (active_ && args_.sequence == sequence) postRemainingRounds(failureHeader(number_, error, false));
}

void NodeExecutor::abandon(std::uint64_t sequence, const Error& why) {
  meetings_.rankMissing();
  loseLink(sequence, why);
}

void NodeExecutor::loseLink(std::uint64_t sequence, const Error& why) {
  if (meetings_.lost()) return;  // the lost link told the other nodes all it will
  // Up, or being made (its steps then run once it is): the other nodes
  // learn from this node's next header that the link is lost.
  const bool committed = meetings_.committed() == sequence;
  if (committed && active_ && posted_ < rounds_) {
    postRemainingRounds(failureHeader(number_, why, true));
  } else {
    // The op that was running (if any) has told the other nodes all it had
    // to: their next one is the first to learn that the link is lost.
    postFailureHeader(committed ? sequence + 1 : sequence, why, true);
  }
  meetings_.lose(why);
}

}  // namespace

std::unique_ptr<Executor> nodeExecutor(const NodeJob& job, const ClusterContext& cluster) {
  return std::make_unique<NodeExecutor>(job, cluster, false);
}

std::unique_ptr<NodeSync> nodeSync(const NodeJob& job, const ClusterContext& cluster) {
  return std::make_unique<NodeExecutor>(job, cluster, true);
}

}  // namespace dbuf::daemon
