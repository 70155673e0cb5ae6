// Granularity rules: parsing, printing and resolution to a block length.
#include "dbuf/planner/granularity.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dbuf::planner {
namespace {

using Kind = GranularityRule::Kind;
using Shape = std::vector<std::int64_t>;

GranularityRule rule(const std::string& text) {
  auto parsed = GranularityRule::parse(text);
  EXPECT_TRUE(parsed.ok()) << text;
  return parsed ? *parsed : GranularityRule{};
}

std::int64_t resolve(const Shape& shape, const std::string& text, std::optional<int> tp_dim = std::nullopt) {
  auto resolved = resolveGranularity(shape, rule(text), tp_dim);
  EXPECT_TRUE(resolved.ok()) << text << ": " << (resolved ? "" : resolved.error().message);
  return resolved ? *resolved : -1;
}

TEST(GranularityParse, EveryRuleKind) {
  EXPECT_EQ(rule("element"), (GranularityRule{Kind::kElement, 0, 0, 0}));
  EXPECT_EQ(rule("matrix"), (GranularityRule{Kind::kMatrix, 0, 0, 0}));
  EXPECT_EQ(rule("rows:32"), (GranularityRule{Kind::kRows, 32, 0, 0}));
  EXPECT_EQ(rule("rows:1"), (GranularityRule{Kind::kRows, 1, 0, 0}));
  EXPECT_EQ(rule("block:128x64"), (GranularityRule{Kind::kBlock, 128, 64, 0}));
  EXPECT_EQ(rule("4096"), (GranularityRule{Kind::kCount, 0, 0, 4096}));
  EXPECT_EQ(rule("1"), (GranularityRule{Kind::kCount, 0, 0, 1}));
}

TEST(GranularityParse, DefaultRuleIsElement) {
  EXPECT_EQ(GranularityRule{}.kind, Kind::kElement);
  EXPECT_EQ(GranularityRule{}.toString(), "element");
}

TEST(GranularityParse, ToStringRoundTrips) {
  for (const std::string text : {"element", "matrix", "rows:32", "rows:7", "block:128x128", "block:3x5", "4096", "1"}) {
    const GranularityRule parsed = rule(text);
    EXPECT_EQ(parsed.toString(), text);
    EXPECT_EQ(rule(parsed.toString()), parsed) << text;
  }
}

TEST(GranularityParse, RejectsBadRules) {
  for (const std::string text :
       {"rows:0", "block:4", "block:0x4", "block:4x0", "block:x4", "block:4x", "block:4x4x4", "-3", "0", "", "rowz:4",
        "rows:", "rows:-2", "rows:3.5", "rows:12abc", "rows: 4", "Element", "matrix ", "12abc", "+5", "block:-1x4",
        "rows:99999999999999999999999"}) {
    const auto parsed = GranularityRule::parse(text);
    ASSERT_FALSE(parsed.ok()) << "accepted '" << text << "'";
    EXPECT_EQ(parsed.error().code, ErrorCode::kInvalidArgument) << text;
    EXPECT_NE(parsed.error().message.find("'" + text + "'"), std::string::npos)
        << "message should quote the rule: " << parsed.error().message;
  }
}

TEST(GranularityResolve, VectorRules) {
  const Shape v{12};
  EXPECT_EQ(resolve(v, "element"), 1);
  EXPECT_EQ(resolve(v, "matrix"), 12);
  EXPECT_EQ(resolve(v, "rows:4"), 4);  // a vector is a column of one-element rows
  EXPECT_EQ(resolve(v, "rows:5"), 5);  // 1D keeps R even when it does not divide (one matrix)
  EXPECT_EQ(resolve(v, "block:3x128"), 3);
  EXPECT_EQ(resolve(v, "6"), 6);
  EXPECT_EQ(resolve(v, "12"), 12);
}

TEST(GranularityResolve, MatrixRules) {
  const Shape m{8, 6};  // M = 8 rows of K = 6
  EXPECT_EQ(resolve(m, "element"), 1);
  EXPECT_EQ(resolve(m, "matrix"), 48);
  EXPECT_EQ(resolve(m, "rows:2"), 12);
  EXPECT_EQ(resolve(m, "rows:8"), 48);
  EXPECT_EQ(resolve(m, "block:4x128"), 24);  // C does not matter: FSDP keeps whole rows
  EXPECT_EQ(resolve(m, "16"), 16);
}

TEST(GranularityResolve, TwoDimKeepsBandsWhenRowsDoNotDivide) {
  // M % R != 0: a 2D tensor keeps R*K (only its last band is short; cuts still
  // fall on band edges measured from the start).
  EXPECT_EQ(resolve({10, 6}, "rows:4"), 24);
  EXPECT_EQ(resolve({10, 6}, "block:3x2"), 18);
  EXPECT_EQ(resolve({7, 5}, "rows:2"), 10);
}

TEST(GranularityResolve, ThreeDimFallsBackToWholeMatrixWhenRowsDoNotDivide) {
  // [E, M, K]: the rule applies to each [M, K] matrix.
  EXPECT_EQ(resolve({4, 8, 6}, "rows:2"), 12);  // 8 % 2 == 0: R*K
  EXPECT_EQ(resolve({4, 8, 6}, "block:4x4"), 24);
  EXPECT_EQ(resolve({4, 10, 6}, "rows:4"), 60);  // 10 % 4 != 0: M*K
  EXPECT_EQ(resolve({4, 10, 6}, "block:3x3"), 60);
  EXPECT_EQ(resolve({4, 10, 6}, "matrix"), 60);
  EXPECT_EQ(resolve({4, 10, 6}, "element"), 1);
  // 4D: leading dims are all "matrix count".
  EXPECT_EQ(resolve({2, 3, 8, 5}, "rows:4"), 20);
  EXPECT_EQ(resolve({2, 3, 8, 5}, "rows:3"), 40);
  EXPECT_EQ(resolve({2, 3, 8, 5}, "matrix"), 40);
  // A single matrix with a leading 1 behaves like 2D.
  EXPECT_EQ(resolve({1, 10, 6}, "rows:4"), 24);
}

TEST(GranularityResolve, ExplicitCountMustDivideNumel) {
  EXPECT_EQ(resolve({4, 6}, "8"), 8);
  EXPECT_EQ(resolve({4, 6}, "24"), 24);
  EXPECT_EQ(resolve({4, 6}, "1"), 1);
  for (const std::int64_t count : {5, 7, 48, 25}) {
    const auto resolved = resolveGranularity(Shape{4, 6}, GranularityRule{Kind::kCount, 0, 0, count});
    ASSERT_FALSE(resolved.ok()) << count;
    EXPECT_EQ(resolved.error().code, ErrorCode::kInvalidArgument);
    EXPECT_NE(resolved.error().message.find("does not divide"), std::string::npos) << resolved.error().message;
  }
}

TEST(GranularityResolve, ClampedToNumel) {
  EXPECT_EQ(resolve({5}, "rows:8"), 5);
  EXPECT_EQ(resolve({10, 4}, "rows:100"), 40);  // 2D keeps R*K = 400, clamped to 40
  EXPECT_EQ(resolve({3}, "block:16x16"), 3);
  EXPECT_EQ(resolve({1}, "matrix"), 1);
  EXPECT_EQ(resolve({1, 1}, "rows:32"), 1);
}

TEST(GranularityResolve, TensorParallelDimensionRaisesToLcm) {
  // [M, K] sharded on dim 1: FSDP may cut only between whole rows of K.
  EXPECT_EQ(resolve({8, 6}, "element", 1), 6);
  EXPECT_EQ(resolve({8, 6}, "rows:2", 1), 12);  // lcm(12, 6)
  EXPECT_EQ(resolve({8, 6}, "4", 1), 12);       // lcm(4, 6)
  EXPECT_EQ(resolve({8, 6}, "matrix", 1), 48);
  // [E, M, K]: dim 1 means whole [M, K] matrices, dim 2 whole rows.
  EXPECT_EQ(resolve({4, 8, 6}, "element", 1), 48);
  EXPECT_EQ(resolve({4, 8, 6}, "element", 2), 6);
  EXPECT_EQ(resolve({4, 8, 6}, "rows:2", 2), 12);
  EXPECT_EQ(resolve({4, 8, 6}, "rows:2", 1), 48);
  EXPECT_EQ(resolve({2, 3, 8, 5}, "element", 2), 40);  // prod(shape[2:])
  EXPECT_EQ(resolve({2, 3, 8, 5}, "10", 3), 10);       // lcm(10, 5)
  EXPECT_EQ(resolve({2, 3, 8, 5}, "4", 3), 20);        // lcm(4, 5)
  // The count must still divide numel (42 % 4 != 0), whatever tp_dim does.
  EXPECT_FALSE(resolveGranularity(Shape{7, 6}, GranularityRule{Kind::kCount, 0, 0, 4}, 1).ok());
}

TEST(GranularityResolve, TensorParallelDimensionOutOfRange) {
  for (const int dim : {0, -1, 2, 5}) {
    const auto resolved = resolveGranularity(Shape{8, 6}, GranularityRule{}, dim);
    ASSERT_FALSE(resolved.ok()) << dim;
    EXPECT_EQ(resolved.error().code, ErrorCode::kInvalidArgument);
    EXPECT_NE(resolved.error().message.find("tp_dim"), std::string::npos) << resolved.error().message;
  }
  EXPECT_FALSE(resolveGranularity(Shape{12}, GranularityRule{}, 1).ok());  // a vector has no dim > 0
}

// A rule's R (or the explicit count) may be any positive int64, so R * K can
// overflow. The result must still be a block length in [1, numel] (or an
// error), never zero or negative.
//
// Row counts near int64's range: R is clamped to M before R*K is formed, so
// nothing overflows and the result is one whole matrix.
TEST(GranularityResolve, HugeRowCountsDoNotOverflow) {
  const Shape m{8, 16};
  for (const std::string text : {"rows:1000000000000000000", "rows:4611686018427387904", "rows:9223372036854775807",
                                 "block:4611686018427387904x2"}) {
    const auto resolved = resolveGranularity(m, rule(text));
    if (!resolved.ok()) continue;  // an error is acceptable
    EXPECT_GE(*resolved, 1) << text;
    EXPECT_LE(*resolved, 128) << text;
  }
  const auto three_d = resolveGranularity(Shape{2, 8, 16}, rule("rows:1000000000000000000"));
  if (three_d.ok()) {
    EXPECT_EQ(*three_d, 128);
  }
}

TEST(GranularityResolve, LargeButSafeRowCountsClampToNumel) {
  EXPECT_EQ(resolve({8, 16}, "rows:1000000000"), 128);
  EXPECT_EQ(resolve({8, 16}, "block:1000000000x128"), 128);
  EXPECT_EQ(resolve({4, 8, 16}, "rows:1000000000"), 128);  // 8 % R != 0: the whole matrix
  EXPECT_EQ(resolve({100}, "rows:1000000000"), 100);
}

TEST(GranularityResolve, RejectsBadShapes) {
  for (const Shape& shape : {Shape{}, Shape{0}, Shape{4, 0}, Shape{-3, 4}, Shape{2, 3, -1}}) {
    const auto resolved = resolveGranularity(shape, GranularityRule{});
    ASSERT_FALSE(resolved.ok());
    EXPECT_EQ(resolved.error().code, ErrorCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace dbuf::planner
