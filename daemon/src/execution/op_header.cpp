#include "op_header.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#include "dbuf/ipc/protocol.hpp"

namespace dbuf::daemon {
namespace {

std::string textOf(const OpHeader& header) {
  return {header.text, ::strnlen(header.text, OpHeader::kText)};
}

bool sameOp(const OpHeader& a, const OpHeader& b) {
  return a.sequence == b.sequence && a.op == b.op && a.reduce == b.reduce && a.accumulate == b.accumulate &&
         a.root == b.root && std::memcmp(&a.pre_scale, &b.pre_scale, sizeof(float)) == 0 &&
         std::memcmp(&a.post_scale, &b.post_scale, sizeof(float)) == 0 && a.group_digest == b.group_digest;
}

}  // namespace

void setText(OpHeader& header, const std::string& text) {
  const std::size_t length = std::min(text.size(), OpHeader::kText - 1);
  std::memcpy(header.text, text.data(), length);
  header.text[length] = '\0';
}

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
  for (std::uint32_t n = 0; n < headers.size(); ++n) {
    if (headers[n].magic != OpHeader::kMagic) {
      fatal = true;  // nothing it sends can be read: the job cannot go on across nodes
      return Error{ErrorCode::kConflict,
                   layout.describeNode(n) + "'s dbufd speaks another version of the exchange between nodes (" +
                       std::to_string(headers[n].magic) + ", this one " + std::to_string(OpHeader::kMagic) +
                       "): every node of a job needs the same dbufd",
                   layout.ranksOf(n)};
    }
  }
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

}  // namespace dbuf::daemon
