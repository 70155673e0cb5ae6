// Placement rules (layout.hpp) against the oracle's direct reading of the
// rules of a valid layout.
#include "dbuf/planner/layout.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "support/oracle.hpp"

namespace dbuf::planner {
namespace {

namespace t = dbuf::planner::testing;

std::int64_t randomAlign(std::mt19937_64& rng) {
  static constexpr std::int64_t kAligns[] = {1, 1, 2, 4, 8};
  return kAligns[t::uniform(rng, 0, 4)];
}

TEST(EarliestFeasibleOffset, MatchesBruteForceScan) {
  std::mt19937_64 rng(0x5eed0001);
  int found = 0;
  int none = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const LayoutItem item = t::randomItem(rng, 60);
    const std::int64_t align = randomAlign(rng);
    const std::int64_t shard = align * t::uniform(rng, 1, 48 / align + 1);
    const std::int64_t position = t::uniform(rng, 0, 120);
    const auto expected = t::bruteEarliestOffset(position, item, shard, align);
    const auto actual = earliestFeasibleOffset(position, item, shard, align);
    ASSERT_EQ(actual, expected) << "n=" << item.numel << " g=" << item.granularity << " S=" << shard
                                << " a=" << align << " position=" << position;
    (expected ? found : none)++;
  }
  // The generator must exercise both outcomes.
  EXPECT_GT(found, 1000);
  EXPECT_GT(none, 1000);
}

TEST(EarliestFeasibleOffset, MatchesBruteForceScanAtLargerSizes) {
  // Longer items, coarser alignment and blocks that share factors with S.
  std::mt19937_64 rng(0x5eed0006);
  for (int trial = 0; trial < 20000; ++trial) {
    static constexpr std::int64_t kAligns[] = {1, 4, 8, 16, 32};
    const std::int64_t align = kAligns[t::uniform(rng, 0, 4)];
    const std::int64_t numel = t::uniform(rng, 1, 2000);
    const std::int64_t unit = t::uniform(rng, 1, 6) * (t::uniform(rng, 0, 1) ? align : 1);
    const LayoutItem item{numel, std::clamp<std::int64_t>(unit * t::uniform(rng, 1, 40), 1, numel)};
    const std::int64_t shard = align * t::uniform(rng, 1, 600 / align + 1);
    const std::int64_t position = t::uniform(rng, 0, 3000);
    ASSERT_EQ(earliestFeasibleOffset(position, item, shard, align), t::bruteEarliestOffset(position, item, shard, align))
        << "n=" << item.numel << " g=" << item.granularity << " S=" << shard << " a=" << align
        << " position=" << position;
    ASSERT_EQ(placeable(item, shard, align), t::brutePlaceable(item, shard, align));
  }
}

TEST(EarliestFeasibleOffset, HandChecked) {
  // n=10, g=4, S=8, a=1: crossing at 8 needs start = 8 (mod 4) = 0 mod 4, and
  // reaching past 16 needs 8 % 4 == 0 (true). Earliest from 1 is 4.
  EXPECT_EQ(earliestFeasibleOffset(1, {10, 4}, 8, 1), 4);
  EXPECT_EQ(earliestFeasibleOffset(0, {10, 4}, 8, 1), 0);
  // n=10, g=3, S=8: crossing twice needs 3 | 8: no. It must cross 8 once,
  // with 8 - r = 0 (mod 3) and r + 10 <= 16: r = 2 (cut 6 elements in).
  EXPECT_EQ(earliestFeasibleOffset(0, {10, 3}, 8, 1), 2);
  EXPECT_EQ(earliestFeasibleOffset(3, {10, 3}, 8, 1), 5);  // [5, 15) is cut at 8, 3 elements in
  EXPECT_EQ(earliestFeasibleOffset(4, {10, 3}, 8, 1), 5);
  EXPECT_EQ(earliestFeasibleOffset(6, {10, 3}, 8, 1), 10);  // 6 and 7 are off the residue: next shard
  // Fits without crossing: first position.
  EXPECT_EQ(earliestFeasibleOffset(3, {5, 5}, 8, 1), 3);
  // Alignment rounds the position up.
  EXPECT_EQ(earliestFeasibleOffset(3, {2, 1}, 8, 4), 4);
  // An unsplittable item longer than S can never be placed.
  EXPECT_EQ(earliestFeasibleOffset(0, {9, 9}, 8, 1), std::nullopt);
}

TEST(Placeable, AgreesWithSomeValidOffset) {
  std::mt19937_64 rng(0x5eed0002);
  for (int trial = 0; trial < 20000; ++trial) {
    const LayoutItem item = t::randomItem(rng, 60);
    const std::int64_t align = randomAlign(rng);
    const std::int64_t shard = align * t::uniform(rng, 1, 48 / align + 1);
    bool any = false;
    for (std::int64_t offset = 0; offset <= 2 * shard + item.numel && !any; ++offset) {
      any = t::offsetValid(item, offset, shard, align);
    }
    ASSERT_EQ(placeable(item, shard, align), any)
        << "n=" << item.numel << " g=" << item.granularity << " S=" << shard << " a=" << align;
  }
}

TEST(SplitBlocks, MatchesBruteForceCount) {
  std::mt19937_64 rng(0x5eed0003);
  for (int trial = 0; trial < 20000; ++trial) {
    const LayoutItem item = t::randomItem(rng, 80);
    const std::int64_t shard = t::uniform(rng, 1, 30);
    const std::int64_t offset = t::uniform(rng, 0, 100);
    ASSERT_EQ(splitBlocks(item, offset, shard), t::bruteSplitBlocks(item, offset, shard))
        << "n=" << item.numel << " g=" << item.granularity << " S=" << shard << " o=" << offset;
    // A placement is valid (alignment 1) exactly when it splits nothing.
    ASSERT_EQ(splitBlocks(item, offset, shard) == 0, t::offsetValid(item, offset, shard, 1));
  }
}

TEST(SplitBlocks, HandChecked) {
  // n=20 in blocks of 4, cut every 5: cuts 5, 10, 15 hit blocks 1, 2, 3.
  EXPECT_EQ(countSplitBlocks({20, 4}, 5, 5), 3);
  EXPECT_EQ(countSplitBlocks({20, 4}, 8, 8), 0);   // cuts on block edges
  EXPECT_EQ(countSplitBlocks({20, 4}, 20, 5), 0);  // no cut inside (0, 20)
  // Several cuts in one block count once: n=10, g=10, cuts 3, 5, 7, 9.
  EXPECT_EQ(countSplitBlocks({10, 10}, 3, 2), 1);
  // Cuts in two blocks, two in each: n=12, g=6, cuts 1, 3, 5, 7, 9, 11.
  EXPECT_EQ(countSplitBlocks({12, 6}, 1, 2), 2);
  EXPECT_EQ(countSplitBlocks({12, 1}, 1, 1), 0);  // element granularity never splits
  // splitBlocks measures cuts from the item's offset: [6, 26) with S = 8 is
  // cut at 8, 16, 24 -> relative 2, 10, 18 with g = 4 -> blocks 0, 2, 4.
  EXPECT_EQ(splitBlocks({20, 4}, 6, 8), 3);
  EXPECT_EQ(splitBlocks({20, 4}, 4, 8), 0);
  EXPECT_EQ(splitBlocks({20, 4}, 0, 100), 0);
}

Layout makeLayout(std::int64_t shard, std::vector<std::int64_t> offsets) { return Layout{shard, std::move(offsets)}; }

TEST(DescribeViolation, AcceptsValidLayouts) {
  const LayoutProblem problem{{{6, 2}, {4, 4}, {3, 1}}, 2, 1};
  // S = 7, capacity 14: the element-granular item 2 straddles the cut at 7.
  EXPECT_EQ(describeViolation(problem, makeLayout(7, {0, 9, 6})), "");
  EXPECT_EQ(describeViolation(problem, makeLayout(8, {0, 8, 12})), "");
  EXPECT_EQ(describeViolation(problem, makeLayout(8, {2, 12, 8})), "");  // order in memory need not be declaration order
}

TEST(DescribeViolation, CatchesEachRule) {
  const LayoutProblem problem{{{6, 2}, {4, 4}, {3, 1}}, 2, 2};
  // Overlap: item 1 starts inside item 0.
  EXPECT_NE(describeViolation(problem, makeLayout(8, {0, 4, 12})).find("overlap"), std::string::npos);
  // Same offset twice is an overlap too.
  EXPECT_NE(describeViolation(problem, makeLayout(8, {8, 0, 8})).find("overlap"), std::string::npos);
  // Misaligned offset (a = 2).
  EXPECT_NE(describeViolation(problem, makeLayout(8, {0, 8, 13})).find("aligned"), std::string::npos);
  // Past V*S = 16.
  EXPECT_NE(describeViolation(problem, makeLayout(8, {0, 8, 14})).find("past"), std::string::npos);
  // Split block: item 1 (g = 4) at 6 is cut at 8, 2 elements in.
  EXPECT_NE(describeViolation(problem, makeLayout(8, {0, 6, 12})).find("split"), std::string::npos);
  // S not a multiple of the alignment, or not positive.
  EXPECT_NE(describeViolation(problem, makeLayout(7, {0, 8, 12})), "");
  EXPECT_NE(describeViolation(problem, makeLayout(0, {0, 8, 12})), "");
  // Wrong number of offsets.
  EXPECT_NE(describeViolation(problem, makeLayout(8, {0, 8})), "");
}

TEST(DescribeViolation, AgreesWithOracleOnRandomLayouts) {
  std::mt19937_64 rng(0x5eed0004);
  int valid = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const LayoutProblem problem = t::randomProblem(rng);
    const std::int64_t shard = problem.align_elems * t::uniform(rng, 1, 12);
    std::vector<std::int64_t> offsets;
    for (std::size_t i = 0; i < problem.items.size(); ++i) {
      offsets.push_back(problem.align_elems * t::uniform(rng, 0, problem.devices * shard / problem.align_elems));
    }
    const bool oracle_valid = t::checkLayout(problem, shard, offsets).empty();
    ASSERT_EQ(describeViolation(problem, makeLayout(shard, offsets)).empty(), oracle_valid)
        << t::describe(problem) << " S=" << shard << " offsets=" << t::describe(offsets);
    valid += oracle_valid;
  }
  EXPECT_GT(valid, 200);  // both outcomes exercised
}

TEST(PlaceInOrder, ProducesValidLayoutsInTheGivenOrder) {
  std::mt19937_64 rng(0x5eed0005);
  int placed = 0;
  for (int trial = 0; trial < 5000; ++trial) {
    const LayoutProblem problem = t::randomProblem(rng);
    std::vector<std::uint32_t> order(problem.items.size());
    std::iota(order.begin(), order.end(), 0U);
    std::shuffle(order.begin(), order.end(), rng);
    const std::int64_t shard = problem.align_elems * t::uniform(rng, 1, 16);
    const auto offsets = placeInOrder(problem, order, shard);
    // Same decision as the oracle's own earliest placement, same offsets.
    std::vector<std::int64_t> expected;
    ASSERT_EQ(offsets.has_value(), t::earliestPlacementFits(problem, order, shard, &expected))
        << t::describe(problem) << " S=" << shard;
    if (!offsets) continue;
    ++placed;
    EXPECT_EQ(*offsets, expected);
    EXPECT_EQ(t::checkLayout(problem, shard, *offsets), "");
    for (std::size_t k = 1; k < order.size(); ++k) {
      EXPECT_GE((*offsets)[order[k]], (*offsets)[order[k - 1]] + problem.items[order[k - 1]].numel);
    }
  }
  EXPECT_GT(placed, 500);
}

// Divisor: the double-precision estimate, once corrected, is the exact
// quotient, up to the range the searches use and past it.
TEST(Divisor, QuotientsAreExact) {
  std::mt19937_64 rng(0xd1b0);
  for (int trial = 0; trial < 200000; ++trial) {
    const std::int64_t divisor = std::int64_t{1} << t::uniform(rng, 0, 40);
    const Divisor d(t::uniform(rng, 1, divisor));
    const std::int64_t x = t::uniform(rng, 0, std::int64_t{1} << t::uniform(rng, 0, 62));
    ASSERT_EQ(d.quotient(x), x / d.value()) << x << " / " << d.value();
    ASSERT_EQ(d.remainder(x), x % d.value()) << x << " % " << d.value();
  }
  const Divisor three(3);
  for (const std::int64_t x : {std::int64_t{0}, std::int64_t{2}, (std::int64_t{1} << 50) - 1, std::int64_t{1} << 50,
                               std::numeric_limits<std::int64_t>::max()}) {
    EXPECT_EQ(three.quotient(x), x / 3) << x;
  }
}

TEST(TotalNumel, SumsItems) {
  EXPECT_EQ(totalNumel(LayoutProblem{{{6, 2}, {4, 4}, {3, 1}}, 2, 1}), 13);
  EXPECT_EQ(totalNumel(LayoutProblem{}), 0);
}

}  // namespace
}  // namespace dbuf::planner
