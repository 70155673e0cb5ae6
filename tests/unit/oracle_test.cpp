// The oracle itself (tests/support): checked against hand-solved instances
// and against its fully independent definition (every order, every offset).
// Nothing here calls the planner's placement or search.
#include "support/oracle.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace dbuf::planner {
namespace {

namespace t = dbuf::planner::testing;

std::vector<std::uint32_t> randomOrder(std::mt19937_64& rng, std::size_t size) {
  std::vector<std::uint32_t> order(size);
  std::iota(order.begin(), order.end(), 0U);
  std::shuffle(order.begin(), order.end(), rng);
  return order;
}

// The oracle's own building blocks agree with each other: the memoised
// all-offsets search and earliest placement give the same answer for every
// order (this is what lets oracleShard use earliest placement).
TEST(Oracle, FixedOrderSearchAgreesWithEarliestPlacement) {
  std::mt19937_64 rng(0x5ea50002);
  for (int trial = 0; trial < 800; ++trial) {
    const LayoutProblem problem = t::randomProblem(rng, {.max_items = 4, .max_total = 30});
    const auto order = randomOrder(rng, problem.items.size());
    for (std::int64_t shard = problem.align_elems; shard <= 24; shard += problem.align_elems) {
      std::vector<std::int64_t> offsets;
      const bool feasible = t::fixedOrderFeasible(problem, order, shard, &offsets);
      ASSERT_EQ(feasible, t::earliestPlacementFits(problem, order, shard)) << t::describe(problem) << " S=" << shard;
      if (feasible) {
        ASSERT_EQ(t::checkLayout(problem, shard, offsets), "");
      }
    }
  }
}

TEST(Oracle, SmallHandCheckedOptima) {
  // Partition-like: items 3, 3, 2, 2, 2 unsplittable on V = 2 need S = 6.
  EXPECT_EQ(t::oracleShard({{{3, 3}, {3, 3}, {2, 2}, {2, 2}, {2, 2}}, 2, 1}), 6);
  // 5, 3, 3 unsplittable on V = 2: {5} and {3, 3} -> S = 6.
  EXPECT_EQ(t::oracleShard({{{5, 5}, {3, 3}, {3, 3}}, 2, 1}), 6);
  // Element granularity packs perfectly: ceil(11 / 3) = 4.
  EXPECT_EQ(t::oracleShard({{{5, 1}, {3, 1}, {3, 1}}, 3, 1}), 4);
  // Alignment 4 and three items of 1: each takes a 4-element slot; V = 3 -> S = 4.
  EXPECT_EQ(t::oracleShard({{{1, 1}, {1, 1}, {1, 1}}, 3, 4}), 4);
  // A 10-element item in blocks of 4 (last block short) on V = 3 with a
  // 2-element item: S = 4 works (blocks 4, 4, 2 then the small one).
  EXPECT_EQ(t::oracleShard({{{10, 4}, {2, 1}}, 3, 1}), 4);
  // Same with blocks of 3: S must be >= 3; S = 4 splits (crossing twice needs
  // 3 | S), S = 6 works: [0, 10) cut at 6 = 2 blocks, item 2 at 10.
  EXPECT_EQ(t::oracleShard({{{10, 3}, {2, 1}}, 3, 1}), 6);
}

// Any valid layout, read in memory order, is a placement respecting some
// order; so the optimum over all layouts is the minimum over every
// permutation of the all-offsets fixed-order search. That is slow but
// assumes nothing about earliest placement; oracleShard must match it.
TEST(Oracle, EqualsMinimumOverEveryPermutationOfAllOffsetSearch) {
  std::mt19937_64 rng(0x0ac10001);
  for (int trial = 0; trial < 400; ++trial) {
    const LayoutProblem problem = t::randomProblem(rng, {.max_items = 5, .max_total = 30, .whole_percent = 30});
    std::vector<std::uint32_t> order(problem.items.size());
    std::iota(order.begin(), order.end(), 0U);
    std::int64_t best = INT64_MAX;
    do {
      best = std::min(best, t::bruteForceFixedOrder(problem, order));
    } while (std::next_permutation(order.begin(), order.end()));
    const t::OracleResult oracle = t::oracleSolve(problem);
    ASSERT_EQ(oracle.shard_elems, best) << t::describe(problem);
    ASSERT_EQ(t::checkLayout(problem, oracle.shard_elems, oracle.offsets), "") << t::describe(problem);
  }
}

TEST(Oracle, LayoutChecksByHand) {
  const LayoutProblem problem{{{6, 2}, {4, 4}}, 2, 2};
  EXPECT_EQ(t::checkLayout(problem, 6, std::vector<std::int64_t>{0, 6}), "");
  EXPECT_NE(t::checkLayout(problem, 6, std::vector<std::int64_t>{2, 10}), "");  // 10 + 4 > 12
  EXPECT_EQ(t::checkLayout(problem, 6, std::vector<std::int64_t>{6, 2}), "");   // memory order need not be item order
  EXPECT_NE(t::checkLayout(problem, 6, std::vector<std::int64_t>{0, 4}), "");   // overlap
  EXPECT_NE(t::checkLayout(problem, 6, std::vector<std::int64_t>{1, 7}), "");   // misaligned
  EXPECT_NE(t::checkLayout(problem, 5, std::vector<std::int64_t>{0, 6}), "");   // S not a multiple of a
  EXPECT_TRUE(t::offsetValid({6, 2}, 2, 6, 2));    // cut at 6 is 4 in: on a block edge
  EXPECT_FALSE(t::offsetValid({6, 3}, 2, 6, 2));   // 4 % 3 != 0
  EXPECT_TRUE(t::offsetValid({6, 3}, 3, 6, 1));    // cut 3 in
  EXPECT_FALSE(t::offsetValid({6, 3}, 3, 6, 2));   // same place, misaligned
  EXPECT_EQ(t::bruteSplitBlocks({12, 4}, 2, 5), 1);  // cuts 3 (block 0) and 8 (an edge) in
  EXPECT_EQ(t::bruteSplitBlocks({12, 4}, 2, 3), 3);  // cuts 1, 4, 7, 10 in: blocks 0, 1, 2
}

TEST(Oracle, GeneratorIsDeterministicAndInRange) {
  std::mt19937_64 first(7);
  std::mt19937_64 second(7);
  const t::GeneratorOptions options{.min_items = 2, .max_items = 5, .max_total = 30, .max_devices = 6};
  bool saw_non_divisor = false;
  bool saw_divisor = false;
  for (int trial = 0; trial < 2000; ++trial) {
    const LayoutProblem a = t::randomProblem(first, options);
    const LayoutProblem b = t::randomProblem(second, options);
    ASSERT_EQ(t::describe(a), t::describe(b));
    ASSERT_GE(a.items.size(), 2U);
    ASSERT_LE(a.items.size(), 5U);
    ASSERT_GE(a.devices, 1);
    ASSERT_LE(a.devices, 6);
    ASSERT_TRUE(a.align_elems == 1 || a.align_elems == 2 || a.align_elems == 4);
    std::int64_t total = 0;
    for (const LayoutItem& item : a.items) {
      ASSERT_GE(item.numel, 1);
      ASSERT_GE(item.granularity, 1);
      ASSERT_LE(item.granularity, item.numel);
      total += item.numel;
      if (item.granularity > 1 && item.granularity < item.numel) {
        (item.numel % item.granularity == 0 ? saw_divisor : saw_non_divisor) = true;
      }
    }
    ASSERT_LE(total, 30);
  }
  EXPECT_TRUE(saw_divisor);
  EXPECT_TRUE(saw_non_divisor);
}

}  // namespace
}  // namespace dbuf::planner
