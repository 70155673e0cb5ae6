#include "node_transfer.hpp"

#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <chrono>
#include <cstring>
#include <numeric>
#include <utility>

#include "dbuf/kernels/ops.hpp"

namespace dbuf::daemon {
namespace {

using kernels::ConstBuffer;
using kernels::MutBuffer;
using kernels::Segment;

template <typename T>
T* as(std::vector<std::byte>& bytes) {
  return reinterpret_cast<T*>(bytes.data());  // NOLINT(cppcoreguidelines-pro-type-reinterpret-cast)
}

/// Gloo's counts: per_rank elements for each rank of each node.
template <typename Count>
std::vector<Count> perNode(const NodeLayout& layout, std::int64_t per_rank) {
  std::vector<Count> counts;
  for (std::uint32_t n = 0; n < layout.nodes(); ++n) counts.push_back(static_cast<Count>(layout.rankCount(n) * per_rank));
  return counts;
}

/// The slot prefix of dbufd's exchanges (Gloo's own collectives use small
/// prefixes of their own; the job's tag tells the jobs apart).
constexpr std::uint8_t kExchangeSlotPrefix = 0xdb;

/// Bytes [offset, offset + bytes) of a buffer.
struct Range {
  std::size_t offset = 0;
  std::size_t bytes = 0;
};

/// One exchange with every other node at once, over Gloo's transport: from
/// node n, from[n] of `receiving`; to node n, to[n] of `sending` (they may be
/// one buffer when the ranges do not overlap); `owner` keeps that memory
/// alive. Every receive is posted before any send, and the sends start with
/// the next node: Gloo's TCP pair sends a payload only once the peer's
/// receive is posted, so a collective that sends first (as Gloo's
/// allgatherv and alltoallv do) leaves the two directions of a link taking
/// turns; posted this way both directions of every link carry data at once
/// (docs/multinode.md, Benchmark). The watchdog ends the waits after
/// `timeout` (LinkTimeout); what Gloo still holds then stays with the
/// communicator.
void exchange(const LinkChannel& channel, const std::shared_ptr<void>& owner, std::byte* sending,
              std::size_t sending_bytes, const std::vector<Range>& to, std::byte* receiving,
              std::size_t receiving_bytes, const std::vector<Range>& from, std::chrono::milliseconds timeout) {
  const std::uint32_t nodes = channel.layout.nodes();
  const std::uint32_t me = channel.layout.node;
  const auto slot = gloo::Slot::build(kExchangeSlotPrefix, channel.tag);
  std::unique_ptr<gloo::transport::UnboundBuffer> in = channel.context->createUnboundBuffer(receiving, receiving_bytes);
  std::unique_ptr<gloo::transport::UnboundBuffer> out =
      sending == receiving && sending_bytes == receiving_bytes
          ? nullptr
          : channel.context->createUnboundBuffer(sending, sending_bytes);
  gloo::transport::UnboundBuffer& send_from = out ? *out : *in;
  int receives = 0;
  int sends = 0;
  for (std::uint32_t i = 1; i < nodes; ++i) {
    const std::uint32_t n = (me + nodes - i) % nodes;
    if (from[n].bytes == 0) continue;
    in->recv(static_cast<int>(n), slot, from[n].offset, from[n].bytes);
    ++receives;
  }
  for (std::uint32_t i = 1; i < nodes; ++i) {
    const std::uint32_t n = (me + i) % nodes;
    if (to[n].bytes == 0) continue;
    send_from.send(static_cast<int>(n), slot, to[n].offset, to[n].bytes);
    ++sends;
  }
  channel.watchdog.arm({in.get(), &send_from}, std::chrono::steady_clock::now() + timeout);
  // Gloo's own timeout would close every connection of the context (every
  // job sharing it would fail): it is given one longer than any wait.
  constexpr std::chrono::milliseconds kLongerThanTheWatchdog = std::chrono::hours(24 * 365);
  bool done = true;
  for (int i = 0; i < receives && done; ++i) done = in->waitRecv(kLongerThanTheWatchdog);
  for (int i = 0; i < sends && done; ++i) done = send_from.waitSend(kLongerThanTheWatchdog);
  if (channel.watchdog.disarm() || !done) {
    struct Leftover {
      std::unique_ptr<gloo::transport::UnboundBuffer> in;
      std::unique_ptr<gloo::transport::UnboundBuffer> out;
      std::shared_ptr<void> memory;
    };
    channel.communicator.keep(std::make_shared<Leftover>(Leftover{std::move(in), std::move(out), owner}));
    throw LinkTimeout("the exchange with the other nodes timed out after " + std::to_string(timeout.count()) + " ms");
  }
}

/// In place: every node's `counts[n]` elements of `base` (node n's after
/// those of the nodes before it) to every node.
template <typename T>
void gatherInPlace(const LinkChannel& channel, const std::shared_ptr<void>& owner, T* base,
                   const std::vector<std::size_t>& counts, std::chrono::milliseconds timeout) {
  std::vector<Range> slices;
  std::size_t offset = 0;
  for (const std::size_t count : counts) {
    slices.push_back(Range{offset, count * sizeof(T)});
    offset += count * sizeof(T);
  }
  const std::vector<Range> mine(counts.size(), slices[channel.layout.node]);
  auto* bytes = reinterpret_cast<std::byte*>(base);  // NOLINT(cppcoreguidelines-pro-type-reinterpret-cast)
  exchange(channel, owner, bytes, offset, mine, bytes, offset, slices, timeout);
}

/// `bytes` of `base` from node `root` to every other node.
void broadcastFrom(const LinkChannel& channel, const std::shared_ptr<void>& owner, std::byte* base,
                   std::size_t bytes, std::uint32_t root) {
  const bool sender = channel.layout.node == root;
  std::vector<Range> to(channel.layout.nodes(), Range{0, sender ? bytes : 0});
  std::vector<Range> from(channel.layout.nodes(), Range{});
  if (!sender) from[root] = Range{0, bytes};
  exchange(channel, owner, base, bytes, to, base, bytes, from, channel.timeout);
}

/// Every node's header of one op to every node (in node order).
std::vector<OpHeader> exchangeHeaders(const LinkChannel& channel, const OpHeader& mine,
                                      std::chrono::milliseconds timeout) {
  auto headers = std::make_shared<std::vector<OpHeader>>(channel.layout.nodes());
  (*headers)[channel.layout.node] = mine;
  gatherInPlace(channel, headers, headers->data(), std::vector<std::size_t>(channel.layout.nodes(), 1), timeout);
  return *headers;
}

}  // namespace

Result<void> Transfer::run(const LinkChannel& channel, const std::shared_ptr<Staging>& owner,
                         OpLink& shared) const {
  Staging& staging = *owner;
  if (header) {
    bool fatal = false;
    // A node's own collective timeout fires first: it then sends its failure.
    if (auto judged = judgeHeaders(exchangeHeaders(channel, *header, channel.timeout * 2), channel.layout, fatal);
        !judged) {
      if (fatal) staging.fatal.store(true);
      shared.refused.store(true);
      return judged;
    }
    if (header->status != 0) return {};  // this node failed the op before its data: nothing more to send
  }
  if (shared.refused.load()) return {};  // its header failed the op on every node
  if (data) {
    RoundBuffer& round = staging.rounds[buffer];
    switch (op) {
      case ipc::OpCode::kAllGather:
        allGather(channel, owner, round, staging.scales);
        break;
      case ipc::OpCode::kReduceScatter:
      case ipc::OpCode::kAllReduce:
        if (auto reduced = reduction(channel, owner, round); !reduced) return reduced;
        break;
      case ipc::OpCode::kBroadcast:
        broadcast(channel, owner, round, staging.scales);
        break;
      default:
        break;
    }
  }
  if (!verdict) return {};
  bool fatal = false;
  auto judged = judgeHeaders(exchangeHeaders(channel, *verdict, channel.timeout), channel.layout, fatal);
  if (fatal) staging.fatal.store(true);
  return judged;
}

void Transfer::allGather(const LinkChannel& channel, const std::shared_ptr<Staging>& owner, RoundBuffer& round,
                         std::vector<float>& scales) const {
  gatherInPlace(channel, owner, as<std::uint8_t>(round.params),
                perNode<std::size_t>(channel.layout, length * unsharded_bytes), channel.timeout);
  if (!scale_counts.empty()) gatherInPlace(channel, owner, scales.data(), scale_counts, channel.timeout);
}

Result<void> Transfer::reduction(const LinkChannel& channel, const std::shared_ptr<Staging>& owner,
                                RoundBuffer& round) const {
  const NodeLayout& layout = channel.layout;
  // Node n gets this node's partial of its pieces; this node gets every
  // node's partial of its own, node by node.
  const DType summed = accumulationDType(grad);
  const auto bytes = [summed](std::int64_t elements) { return static_cast<std::size_t>(elements * sizeBytes(summed)); };
  const std::int64_t mine = layout.rankCount(layout.node) * length;
  std::vector<Range> to;
  std::vector<Range> from;
  for (std::uint32_t n = 0; n < layout.nodes(); ++n) {
    to.push_back(Range{bytes(layout.firstRank(n) * length), bytes(layout.rankCount(n) * length)});
    from.push_back(Range{bytes(n * mine), bytes(mine)});
  }
  std::memcpy(round.received.data() + bytes(layout.node * mine),
              round.partial.data() + bytes(layout.firstRank(layout.node) * length), bytes(mine));
  exchange(channel, owner, round.partial.data(), round.partial.size(), to, round.received.data(),
           round.received.size(), from, channel.timeout);
  if (op == ipc::OpCode::kReduceScatter) return {};
  // All-reduce: this node's pieces of the result (the nodes' partials in
  // node order, as a reduce-scatter sums them), then every node's.
  std::vector<ConstBuffer> partials;
  for (std::uint32_t n = 0; n < layout.nodes(); ++n) {
    partials.push_back(ConstBuffer{round.received.data() + bytes(n * mine), summed, mine});
  }
  const std::int64_t pieces = layout.firstRank(layout.nodes()) * length;
  const Segment range{0, layout.firstRank(layout.node) * length, mine, 0, 0};
  if (auto reduced = kernels::reduce(partials, MutBuffer{round.grads.data(), grad, pieces},
                                     kernels::ReduceOptions{1.0F, factor, false}, {&range, 1});
      !reduced) {
    return reduced;
  }
  gatherInPlace(channel, owner, as<std::uint8_t>(round.grads), perNode<std::size_t>(layout, length * sizeBytes(grad)),
                channel.timeout);
  return {};
}

void Transfer::broadcast(const LinkChannel& channel, const std::shared_ptr<Staging>& owner, RoundBuffer& round,
                         std::vector<float>& scales) const {
  broadcastFrom(channel, owner, round.params.data(), static_cast<std::size_t>(length * unsharded_bytes), root_node);
  if (!scale_counts.empty()) {
    // Every block's scale (the buffer may be longer, from a larger group).
    const std::size_t blocks = std::accumulate(scale_counts.begin(), scale_counts.end(), std::size_t{0});
    broadcastFrom(channel, owner, reinterpret_cast<std::byte*>(scales.data()), blocks * sizeof(float), root_node);
  }
}

}  // namespace dbuf::daemon
