#pragma once
/// \file
/// The layout search: the smallest shard size S and an order of the items
/// whose earliest-feasible placement fits in V*S.
///
/// For a fixed order and S, earliest placement is optimal (`placeInOrder`), so
/// the search is over orders and over S, on placeable sizes only
/// (`nextPlaceableShard`), over classes of interchangeable tensors (tensors of
/// one length whose blocks at least V - 1 of them share pool into one), in
/// these steps:
///  1. sizes upwards from the lower bound, each tried with the paper's three
///     fixed orders (given, size descending, granularity descending) and the
///     order search, until one fits or a work budget is spent (small units are
///     solved exactly here);
///  2. then sizes growing geometrically until the beam search (or another
///     strategy) fits one; the heaviest classes' block multiples below it;
///     and bisection between the last failure and the best. Over all orders
///     feasibility is monotone in S except at the sizes where a tensor may
///     span a whole shard (multiples of its block), so bisection runs on the
///     other sizes and those exceptional ones below the result are tried one
///     by one;
///  3. the fixed orders at every size left below the result, as far as the
///     budget goes (`scan_complete`: the result is never above their optima);
///  4. with `proof_work`, the exhaustive search (bisecting) and the exact
///     order search on the sizes still open between the proven bound and the
///     result.
/// Sizes the exact searches refute raise the proven bound: a refuted
/// ordinary size rules out every ordinary size below it.

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
  kOrderSearch,            ///< depth-first search over orders for each S, exact within its budget
  kBeamSearch,             ///< beam search over orders for each S, see search.cpp
  kExhaustiveSearch,       ///< every order at once for one S: small units, and proofs
  kInterleavedSearch,      ///< every order of the heavy classes, the other tensors in a fixed order
};

[[nodiscard]] std::string_view toString(Strategy strategy) noexcept;

struct SearchOptions {
  /// Nodes the order search may visit per shard size; within it the search is
  /// exact for that size (and a failure refutes it).
  std::int64_t node_budget = 4000;
  /// Work (items placed by the fixed orders, order-search nodes times
  /// classes, beam states) the scan upwards from the bound may spend before
  /// the search probes and bisects; the same again for the exceptional sizes
  /// and again for the fixed orders' scan below the result. About 4 ns each.
  std::int64_t scan_work = 200000;
  /// Work (as for scan_work) spent, after the search, on the sizes between
  /// the proven bound and the result that nothing rules out yet: to prove
  /// the result optimal (or find a smaller one). First the exhaustive search
  /// (a dynamic program over every multiset of placed classes; up to 16 M of
  /// them; a run costs multisets x classes), bisecting, then on the smallest
  /// open size again and again; on relaxations where the unit has more
  /// multisets than a few runs of a share of the work afford (light tensors
  /// left out; classes of one length merged with the gcd of their blocks;
  /// lengths pooled whatever their counts: three, each with a third of the
  /// work). Then the order search on the smallest open size. 0: none (a
  /// proof can take far longer than the plan: up to seconds for a MoE layer
  /// of hundreds of experts).
  std::int64_t proof_work = 0;
  /// The exhaustive search joins the portfolio (ahead of the order and beam
  /// searches, which it makes redundant: it decides every size exactly) for
  /// units where one run costs at most this (multisets of placed classes x
  /// classes). Outside it only proofs use it (proof_work).
  std::int64_t exhaustive_work = 50000;
  /// Where that costs more (kInterleavedSearch), at the sizes near the
  /// result: the exhaustive search itself where a run costs at most this,
  /// else the exhaustive search over the heaviest classes with the other
  /// tensors chained in a fixed order, as many classes kept as that cost
  /// allows (not exact: it never refutes a size); at the probe's sizes, and
  /// first at the others, the same within a quarter of this. At most 12
  /// runs of each a unit.
  std::int64_t interleave_work = 200000;
  /// States the beam keeps per depth; 0: about 20,000 / (items x classes),
  /// within [4, 64].
  std::int64_t beam_width = 0;
  /// Restrict the portfolio to these strategies (empty: all). Without
  /// kBeamSearch the scan upwards goes on past its budget with a doubling step.
  /// Where none applies to the unit (an exhaustive search too large for it)
  /// the given order stands in.
  std::vector<Strategy> strategies;
};

struct SearchResult {
  Layout layout;
  Strategy strategy = Strategy::kGivenOrder;
  std::int64_t shard_sizes_tried = 0;
  /// Every placeable size below the result was tried with the fixed orders of
  /// the portfolio, so the result is no larger than any of their optima.
  bool scan_complete = true;
  /// No layout exists below this size: the lower bound (bounds.hpp), raised
  /// past the sizes the exact order search refuted. At most the result.
  std::int64_t proven_bound_elems = 0;
  /// The result is optimal over all orders (it equals `proven_bound_elems`).
  bool proven_optimal = false;
};

/// Orders of the fixed strategies (not the searches, which depend on S).
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

/// The exhaustive search alone for one S: `decided` false when the unit has
/// more than 16 M multisets of placed classes (it did not run); otherwise
/// `offsets` is a layout, or nullopt, which proves that no order fits.
struct ExhaustiveOutcome {
  bool decided = false;
  std::optional<std::vector<std::int64_t>> offsets;
};
[[nodiscard]] ExhaustiveOutcome placeExhaustively(const LayoutProblem& problem, std::int64_t shard_elems);

/// The beam search alone for one S (`width` 0: chosen as for SearchOptions).
/// Returns offsets when a layout fits in V*S; never proves that none does.
[[nodiscard]] std::optional<std::vector<std::int64_t>> placeByBeam(const LayoutProblem& problem,
                                                                   std::int64_t shard_elems, std::int64_t width = 0);

/// The interleaved search alone for one S (SearchOptions::interleave_work):
/// every order of the heaviest classes interleaved every way with the other
/// tensors in size order, as many classes kept as a run costing at most
/// `work` allows. Returns offsets when a layout fits in V*S; nullopt also
/// when no split costs that little. Never proves that none fits.
[[nodiscard]] std::optional<std::vector<std::int64_t>> placeInterleaved(const LayoutProblem& problem,
                                                                        std::int64_t shard_elems, std::int64_t work);

}  // namespace dbuf::planner
