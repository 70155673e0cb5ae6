#pragma once
// Collectives of a job across nodes, host backend. A node's ranks are
// contiguous in the job, so they own one contiguous range of every group
// buffer, and each op is hierarchical: the node's ranks through shared
// memory (the CPU kernels, in bounded steps on the daemon's loop, as on one
// node), then an exchange of node pieces with every other node over Gloo's
// transport (on the job's link thread; never one per rank), then the node's
// ranks again:
//
//   all-gather      local all-gather; the node's pieces -> staging; to every
//                   node (and fp8 scales); staging -> every rank
//   reduce-scatter  local sum of the node's ranks (fp32, rank order, pre
//                   scale); each node gets every node's partial of its own
//                   pieces (fp32); each rank's piece = factor * sum of the
//                   nodes' partials (node order), cast or accumulated into
//                   its sharded gradient
//   all-reduce      as reduce-scatter into the node's pieces, cast to the
//                   gradient dtype, then to every node; staging -> every rank
//   broadcast       root's buffer -> staging; Gloo broadcast from its node;
//                   staging -> every other rank
//
// So a reduction sums, per element, in fp32:
//   acc = sum over nodes n (in order) of ( sum over n's ranks (in order) of
//   (grad_r * pre) ); then acc * factor, rounded to the destination — the
//   same on every node and in every run (docs/multinode.md).
//
// An op runs in rounds of at most kRoundElements, two in flight (one
// exchanged while the next is prepared), so the staging memory is bounded.
// With round 0 each node's daemon sends the others a header with the op it
// runs (or why it failed here): the k-th op of every node must match, and a
// failure on one node fails the op on all of them with its code, text and
// ranks. That is the op's commit point: Gloo reads and writes only the
// daemon's own staging memory, so a node whose op fails after it (a rank
// died) still sends the rounds the others expect, and the last round of an
// op of several carries a verdict that fails it everywhere.

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <type_traits>

#include "dbuf/common/result.hpp"
#include "executor.hpp"
#include "node_link.hpp"

namespace dbuf::daemon {

/// What each node's daemon says about collective `sequence` before it runs
/// (and, for an op of several rounds, after its last): sent as it is in
/// memory between daemons of the same build and byte order, which `magic`
/// checks.
struct OpHeader {
  static constexpr std::size_t kRanks = 16;
  static constexpr std::size_t kText = 384;
  /// "DBH" and the layout's version (1).
  static constexpr std::uint32_t kMagic = 0x01484244;
  std::uint32_t magic = kMagic;
  std::uint64_t sequence = 0;
  std::uint64_t group_digest = 0;
  std::uint8_t op = 0;
  std::uint8_t reduce = 0;
  std::uint8_t accumulate = 0;
  std::uint8_t fatal = 0;    ///< failed for good: no later op of the job runs across nodes
  std::uint16_t status = 0;  ///< 0: ready; else the error's code on the wire (ipc::toWire)
  std::uint16_t rank_count = 0;
  std::uint32_t root = 0;
  float pre_scale = 1.0F;
  float post_scale = 1.0F;
  std::uint32_t ranks[kRanks] = {};  ///< the error's ranks (the first kRanks)
  char text[kText] = {};             ///< the op in words, or the error's message (NUL-terminated)
};
static_assert(sizeof(OpHeader) == 48 + 4 * OpHeader::kRanks + OpHeader::kText);
static_assert(std::is_trivially_copyable_v<OpHeader>);

/// The verdict every node reaches alike from the headers of one op (one per
/// node, in node order): kConflict if a node's daemon speaks another layout,
/// else the first failed node's error (its code, "on node
/// N (ranks a-b): " and its message, its ranks), else kConflict naming the
/// nodes whose op differs from node 0's, else nothing. `fatal` is set when a
/// failed node said so.
[[nodiscard]] Result<void> judgeHeaders(std::span<const OpHeader> headers, const NodeLayout& layout, bool& fatal);

/// The header of a failed op (text truncated to fit).
[[nodiscard]] OpHeader failureHeader(std::uint64_t sequence, const Error& error, bool fatal);

/// What keeps a job's nodes in step for an executor whose data moves
/// another way (NCCL): each op is its header exchange alone, with every
/// rule above (the k-th op of every node matches, a failure on one node
/// fails it on all, a lost link is met again, the job's `after_meeting`
/// at each meeting). loseLink() ends the link from outside: the data path
/// failed on this node, so the nodes meet again (and set it up anew).
class NodeSync : public Executor {
 public:
  /// Collective `sequence` (the next one) and those after it fail on every
  /// node with `why` until the nodes have met again.
  virtual void loseLink(std::uint64_t sequence, const Error& why) = 0;
  /// `lost` runs (on the calling thread: the loop's) each time the link is
  /// lost, before the nodes can meet again.
  virtual void whenLinkLost(std::function<void()> lost) = 0;
};

/// A job's NodeSync (NodeExecutor with no data of its own).
[[nodiscard]] std::unique_ptr<NodeSync> nodeSync(const NodeJob& job, const ClusterContext& cluster);

/// A job across nodes on the host backend: the node's ranks through the CPU
/// kernels, the nodes' parts through Gloo.
[[nodiscard]] std::unique_ptr<Executor> nodeExecutor(const NodeJob& job, const ClusterContext& cluster);

#if defined(DBUF_WITH_CUDA)
/// A job across nodes on GPUs, one rank per GPU: this node's ranks of one
/// NCCL communicator over every node's, made at each meeting of the nodes
/// (its unique id through the job's store); each op's headers go to the
/// other nodes first (nodeSync()), and an op that does not end within the
/// job's collective timeout aborts the communicator.
[[nodiscard]] Result<std::unique_ptr<Executor>> ncclNodeExecutor(std::vector<int> devices, NodeJob job,
                                                                 const ClusterContext& cluster);
#endif

}  // namespace dbuf::daemon
