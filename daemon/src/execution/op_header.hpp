#pragma once
// What each node's dbufd says of an op before the nodes move its data, and
// the verdict every node reaches alike from what all said
// (node_executor.hpp: the commit point of an op across nodes).

#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

#include "dbuf/common/result.hpp"
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

/// `text` as the header's (truncated to fit, NUL-terminated).
void setText(OpHeader& header, const std::string& text);

}  // namespace dbuf::daemon
