#pragma once
// The part of an op across nodes that runs between the nodes, one round at a
// time on the job's link thread (node_link.hpp), over the daemon's own
// staging memory only: Gloo never touches a rank's memory.

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "dbuf/common/dtype.hpp"
#include "dbuf/common/result.hpp"
#include "dbuf/ipc/ring.hpp"
#include "node_link.hpp"
#include "op_header.hpp"

namespace dbuf::daemon {

/// One of the two buffers of a round's data: round j uses buffers[j % 2].
/// In a round every rank's part contributes one piece of the round's
/// length, rank r's at r * length (so a node's pieces are contiguous).
struct RoundBuffer {
  std::vector<std::byte> params;  ///< all-gather, broadcast: the unsharded dtype
  // Reductions, in the dtype they sum in (fp32; fp64 for fp64 gradients):
  std::vector<std::byte> partial;   ///< this node's sum of its ranks, every rank's piece
  std::vector<std::byte> received;  ///< every node's partial of this node's pieces, node by node
  std::vector<std::byte> grads;   ///< all-reduce: the result in the gradient dtype
};

/// The daemon's own memory for the ops' inter-node part: what Gloo reads and
/// writes. Shared with the link's steps, which may outlive the op.
struct Staging {
  std::array<RoundBuffer, 2> rounds;
  std::vector<float> scales;  ///< fp8 all-gather and broadcast: every block's scale (with round 0)
  /// Set by an exchange whose headers said the job cannot go on.
  std::atomic<bool> fatal{false};
};

/// What the link's steps of one op share.
struct OpLink {
  /// The nodes' headers refused the op: its later rounds send nothing, on
  /// every node alike.
  std::atomic<bool> refused{false};
};

/// The part of one op that runs between the nodes in one round (on the link
/// thread, over the staging memory only).
struct Transfer {
  ipc::OpCode op = ipc::OpCode::kBarrier;
  std::int64_t length = 0;   ///< each rank's piece (broadcast: the round's run of the buffer)
  std::size_t buffer = 0;    ///< staging.rounds[buffer]
  std::int64_t unsharded_bytes = 0;
  DType grad = DType::kF32;
  double factor = 1.0;  ///< CollectiveArgs::factor
  std::vector<std::size_t> scale_counts;  ///< fp8, round 0: each node's scales (broadcast: all on the root's)
  std::uint32_t root_node = 0;            ///< broadcast
  bool data = true;                       ///< false: the header alone (a barrier, or a failure before the data)
  std::optional<OpHeader> header;         ///< round 0: exchanged first; the op's verdict
  std::optional<OpHeader> verdict;        ///< the last round of several: whether every node's rounds were right

  [[nodiscard]] Result<void> run(const LinkChannel& channel, const std::shared_ptr<Staging>& owner,
                                 OpLink& shared) const;

 private:
  void allGather(const LinkChannel& channel, const std::shared_ptr<Staging>& owner, RoundBuffer& round,
                 std::vector<float>& scales) const;
  Result<void> reduction(const LinkChannel& channel, const std::shared_ptr<Staging>& owner, RoundBuffer& round) const;
  void broadcast(const LinkChannel& channel, const std::shared_ptr<Staging>& owner, RoundBuffer& round,
                 std::vector<float>& scales) const;
};

}  // namespace dbuf::daemon
