#pragma once
// Collectives of a job across nodes, host backend. A node's ranks are
// contiguous in the job, so they own one contiguous range of every group
// buffer, and each op is hierarchical: the node's ranks through shared
// memory (the CPU kernels, in bounded steps on the daemon's loop, as on one
// node), one inter-node exchange of node chunks through Gloo (on the job's
// link thread, never one per rank), then the node's ranks again.
//
//   all-gather      local all-gather; node chunk -> staging; Gloo allgatherv
//                   of node chunks (and fp8 scales); staging -> every rank
//   reduce-scatter  local sum of the node's ranks (fp32, rank order, pre
//                   scale); Gloo alltoallv of the node partials (fp32); each
//                   rank's piece = factor * sum of the nodes' partials (node
//                   order), cast or accumulated into its sharded gradient
//   all-reduce      as reduce-scatter into the node's range, cast to the
//                   gradient dtype, then Gloo allgatherv; staging -> every rank
//   broadcast       root's buffer -> staging; Gloo broadcast from its node;
//                   staging -> every other rank
//
// So a reduction of ranks r in node order sums, per element, in fp32:
//   acc = sum over nodes n (in order) of ( sum over n's ranks (in order) of
//   (grad_r * pre) ); then acc * factor, rounded to the destination — the
//   same on every node and in every run (docs/multinode.md).
//
// Before the exchange, each node's daemon sends the others a header with the
// op it runs (or why it failed here): the k-th op of every node must match,
// and a failure on one node fails the op on all of them with its code, text
// and ranks. The exchange is the op's commit point: what Gloo reads and
// writes is the daemon's own staging memory, so an op failed locally after
// it (a rank died) cannot leave another node waiting or its memory in use.

#include <cstdint>
#include <span>
#include <string>

#include "dbuf/common/result.hpp"
#include "node_link.hpp"

namespace dbuf::daemon {

/// What each node's daemon says about collective `sequence` before it runs.
struct OpHeader {
  static constexpr std::size_t kRanks = 16;
  static constexpr std::size_t kText = 384;
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
static_assert(sizeof(OpHeader) == 40 + 4 * OpHeader::kRanks + OpHeader::kText);

/// The verdict every node reaches alike from the headers of one op (one per
/// node, in node order): the first failed node's error (its code, "on node
/// N (ranks a-b): " and its message, its ranks), else kConflict naming the
/// nodes whose op differs from node 0's, else nothing. `fatal` is set when a
/// failed node said so.
[[nodiscard]] Result<void> judgeHeaders(std::span<const OpHeader> headers, const NodeLayout& layout, bool& fatal);

/// The header of a failed op (text truncated to fit).
[[nodiscard]] OpHeader failureHeader(std::uint64_t sequence, const Error& error, bool fatal);

}  // namespace dbuf::daemon
