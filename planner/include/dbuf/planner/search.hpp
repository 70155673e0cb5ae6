#pragma once
/// \file
/// The layout search: the smallest shard size S and an order of the items
/// whose earliest-feasible placement fits in V*S.
///
/// For a fixed order and S, earliest placement is optimal (`placeInOrder`), so
/// the search is over orders and over S. Shard sizes are visited in increasing
/// order, skipping every size some item rules out on its own
/// (`nextPlaceableShard`); at each size a portfolio of orders is tried and the
/// first that fits wins. The portfolio always contains the paper's three fixed
/// orders (given, size descending, granularity descending), so the result is
/// never worse than the best of them.

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "dbuf/planner/layout.hpp"

namespace dbuf::planner {

enum class Strategy : std::uint8_t {
  kGivenOrder,             ///< the order the tensors were declared in
  kSizeDescending,         ///< largest tensors first (stable)
  kGranularityDescending,  ///< coarsest blocks first (stable)
  kOrderSearch,            ///< depth-first search over orders for each S, see search.cpp
};

[[nodiscard]] std::string_view toString(Strategy strategy) noexcept;

struct SearchOptions {
  /// Shard sizes tried one by one before the scan starts doubling its step.
  /// Beyond the budget the result is still valid but may skip a smaller
  /// feasible size (`SearchResult::scan_complete` turns false).
  std::int64_t max_scan_steps = 1000000;
  /// Nodes the order search may visit per shard size.
  std::int64_t node_budget = 4000;
  /// The order search runs at every size until it has spent this many nodes
  /// in total on the unit (small units are searched exactly at every size);
  /// after that, only at the first `leading_searches` sizes above the lower
  /// bound and where a heavy class's block length divides S.
  std::int64_t search_nodes_total = 200000;
  std::int64_t leading_searches = 16;
  /// Restrict the portfolio to these strategies (empty: all).
  std::vector<Strategy> strategies;
};

struct SearchResult {
  Layout layout;
  Strategy strategy = Strategy::kGivenOrder;
  std::int64_t shard_sizes_tried = 0;
  /// Every placeable size below the result was tried with the fixed orders of
  /// the portfolio, so the result is no larger than any of their optima.
  bool scan_complete = true;
  /// The result is optimal over all orders: it equals the lower bound, or the
  /// order search ran to completion (exact) at every size below it and found
  /// nothing.
  bool proven_optimal = false;
};

/// Orders of the fixed strategies (not kOrderSearch, which depends on S).
[[nodiscard]] std::vector<std::uint32_t> fixedOrder(const LayoutProblem& problem, Strategy strategy);

/// Best layout over the portfolio. Always succeeds for a non-empty problem with
/// valid items (S = total length always works).
[[nodiscard]] SearchResult solveLayout(const LayoutProblem& problem, const SearchOptions& options = {});

/// Searches orders for one S, depth first, least waste first (so the first
/// descent is a best-fit construction), cutting any multiset of placed tensors
/// reached before with an earlier end. Exact (`*exact` set) when it finishes
/// within `node_budget` nodes. Returns offsets when a layout fits in V*S.
[[nodiscard]] std::optional<std::vector<std::int64_t>> placeBySearch(const LayoutProblem& problem,
                                                                     std::int64_t shard_elems, std::int64_t node_budget,
                                                                     bool* exact = nullptr);

}  // namespace dbuf::planner
