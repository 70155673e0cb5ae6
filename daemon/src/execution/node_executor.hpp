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
//   reduce-scatter  local sum of the node's ranks (fp32, or fp64 for fp64;
//                   rank order, pre scale); each node gets every node's
//                   partial of its own pieces; each rank's piece = factor * sum of the
//                   nodes' partials (node order), cast or accumulated into
//                   its sharded gradient
//   all-reduce      as reduce-scatter into the node's pieces, cast to the
//                   gradient dtype, then to every node; staging -> every rank
//   broadcast       root's buffer -> staging; Gloo broadcast from its node;
//                   staging -> every other rank
//
// So a reduction sums, per element, in fp32 (fp64 for fp64 gradients):
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

#include "dbuf/common/result.hpp"
#include "executor.hpp"
#include "node_link.hpp"
#include "op_header.hpp"

namespace dbuf::daemon {

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
