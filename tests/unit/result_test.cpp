// Result<T> / Error basics (common/result.hpp).
#include "dbuf/common/result.hpp"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

namespace dbuf {
namespace {

Result<int> half(int value) {
  if (value % 2 != 0) return makeError(ErrorCode::kInvalidArgument, std::to_string(value) + " is odd");
  return value / 2;
}

Result<void> check(bool good) {
  if (!good) return makeError(ErrorCode::kInfeasible, "not good");
  return {};
}

TEST(Result, HoldsAValue) {
  const Result<int> result = half(8);
  ASSERT_TRUE(result.ok());
  EXPECT_TRUE(static_cast<bool>(result));
  EXPECT_EQ(result.value(), 4);
  EXPECT_EQ(*result, 4);
}

TEST(Result, HoldsAnError) {
  const Result<int> result = half(7);
  ASSERT_FALSE(result.ok());
  EXPECT_FALSE(static_cast<bool>(result));
  EXPECT_EQ(result.error().code, ErrorCode::kInvalidArgument);
  EXPECT_EQ(result.error().message, "7 is odd");
}

TEST(Result, ArrowAndMutation) {
  Result<std::vector<int>> result = std::vector<int>{1, 2, 3};
  EXPECT_EQ(result->size(), 3U);
  result->push_back(4);
  (*result)[0] = 9;
  EXPECT_EQ(result.value(), (std::vector<int>{9, 2, 3, 4}));
}

TEST(Result, MoveOnlyValues) {
  Result<std::unique_ptr<int>> result = std::make_unique<int>(5);
  ASSERT_TRUE(result.ok());
  std::unique_ptr<int> taken = std::move(result).value();
  ASSERT_NE(taken, nullptr);
  EXPECT_EQ(*taken, 5);
}

TEST(Result, MovesErrorsOut) {
  Result<std::string> result = makeError(ErrorCode::kNotFound, "no such unit");
  Error error = std::move(result).error();
  EXPECT_EQ(error.code, ErrorCode::kNotFound);
  EXPECT_EQ(error.message, "no such unit");
}

TEST(ResultVoid, OkAndError) {
  const Result<void> good = check(true);
  EXPECT_TRUE(good.ok());
  EXPECT_TRUE(static_cast<bool>(good));
  const Result<void> bad = check(false);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code, ErrorCode::kInfeasible);
  EXPECT_EQ(bad.error().message, "not good");
  Result<void> moved = check(false);
  const Error error = std::move(moved).error();
  EXPECT_EQ(error.message, "not good");
}

TEST(Error, WithContextPrefixesAndKeepsCode) {
  Error error = makeError(ErrorCode::kIo, "cannot read");
  error = std::move(error).withContext("tensor 'w'");
  error = std::move(error).withContext("file m.json: unit 'layers.0'");
  EXPECT_EQ(error.code, ErrorCode::kIo);
  EXPECT_EQ(error.message, "file m.json: unit 'layers.0': tensor 'w': cannot read");
}

TEST(Error, WithContextOnAResultsError) {
  Result<int> result = half(3);
  ASSERT_FALSE(result);
  const Error error = std::move(result).error().withContext("while halving");
  EXPECT_EQ(error.message, "while halving: 3 is odd");
  EXPECT_EQ(error.code, ErrorCode::kInvalidArgument);
}

TEST(ErrorCode, Names) {
  EXPECT_EQ(toString(ErrorCode::kInvalidArgument), "invalid argument");
  EXPECT_EQ(toString(ErrorCode::kNotFound), "not found");
  EXPECT_EQ(toString(ErrorCode::kIo), "i/o error");
  EXPECT_EQ(toString(ErrorCode::kInfeasible), "infeasible");
  EXPECT_EQ(toString(ErrorCode::kInternal), "internal error");
}

}  // namespace
}  // namespace dbuf
