#pragma once
// Ranks in the daemon's error messages, spelled one way everywhere.

#include <cstdint>
#include <string>
#include <vector>

namespace dbuf::daemon {

/// "1, 3, 4".
[[nodiscard]] inline std::string rankList(const std::vector<std::uint32_t>& ranks) {
  std::string text;
  for (const std::uint32_t rank : ranks) text += (text.empty() ? "" : ", ") + std::to_string(rank);
  return text;
}

/// "rank 2" or "ranks 1, 3".
[[nodiscard]] inline std::string ranksPhrase(const std::vector<std::uint32_t>& ranks) {
  return (ranks.size() > 1 ? "ranks " : "rank ") + rankList(ranks);
}

/// "has" or "have", agreeing with ranksPhrase(ranks).
[[nodiscard]] inline const char* hasOrHave(const std::vector<std::uint32_t>& ranks) {
  return ranks.size() > 1 ? "have" : "has";
}

/// Why nothing collective can run while ranks of `job` are gone:
/// "rank 2 of job j disconnected and has not attached again".
[[nodiscard]] inline std::string goneRanksText(const std::vector<std::uint32_t>& gone, const std::string& job) {
  return ranksPhrase(gone) + " of job " + job + " disconnected and " + hasOrHave(gone) + " not attached again";
}

/// "rank 4" or "ranks 2-3": `count` consecutive ranks from `first`.
[[nodiscard]] inline std::string rankSpan(std::uint32_t first, std::uint32_t count) {
  if (count == 1) return "rank " + std::to_string(first);
  return "ranks " + std::to_string(first) + "-" + std::to_string(first + count - 1);
}

/// "0-6, 9": sorted ranks with consecutive runs collapsed.
[[nodiscard]] inline std::string rankRanges(const std::vector<std::uint32_t>& ranks) {
  std::string text;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    text += (text.empty() ? "" : ", ") + std::to_string(ranks[i]);
    if (j > i) text += "-" + std::to_string(ranks[j]);
    i = j + 1;
  }
  return text;
}

}  // namespace dbuf::daemon
