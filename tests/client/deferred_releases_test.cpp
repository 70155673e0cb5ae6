// The connection's deferred releases, the bookkeeping behind
// Group::reshardOnStream (the stream points themselves need a GPU): a
// release whose stream is not there yet stays, in order; finished and failed
// ones go; the first error comes back; waiting finishes every one.
#include <gtest/gtest.h>

#include <chrono>
#include <optional>
#include <string>

#include "connection.hpp"

namespace dbuf {
namespace {

/// A release whose stream is there when the test says so.
class FakeRelease final : public Connection::DeferredRelease {
 public:
  explicit FakeRelease(std::string name) : name_(std::move(name)) {}

  Result<bool> finishRelease(bool wait) override {
    ++asked;
    if (!reached && !wait) return false;
    finished_waiting = wait;
    if (failure) return makeError(ErrorCode::kTimeout, name_ + ": " + *failure);
    return true;
  }

  bool reached = false;
  std::optional<std::string> failure;
  int asked = 0;
  bool finished_waiting = false;

 private:
  std::string name_;
};

Connection unconnected() {
  return Connection(UniqueFd(), std::chrono::milliseconds(1000));
}

TEST(DeferredReleases, OnlyThoseWhoseStreamsAreThereFinishAndTheRestKeepTheirOrder) {
  Connection connection = unconnected();
  FakeRelease a("a");
  FakeRelease b("b");
  FakeRelease c("c");
  connection.deferred_releases = {&a, &b, &c};
  b.reached = true;
  ASSERT_TRUE(connection.finishReleases(false).ok());
  EXPECT_EQ(connection.deferred_releases, (std::vector<Connection::DeferredRelease*>{&a, &c}));
  EXPECT_EQ(a.asked, 1);
  EXPECT_EQ(b.asked, 1);
  EXPECT_EQ(c.asked, 1);
  EXPECT_FALSE(b.finished_waiting);

  ASSERT_TRUE(connection.finishReleases(false).ok());  // nobody is there: nothing goes
  EXPECT_EQ(connection.deferred_releases.size(), 2U);
  ASSERT_TRUE(connection.finishReleases(true).ok());  // waiting: everyone goes
  EXPECT_TRUE(connection.deferred_releases.empty());
  EXPECT_TRUE(a.finished_waiting);
  EXPECT_TRUE(c.finished_waiting);
}

TEST(DeferredReleases, FailedReleasesGoAndTheFirstErrorComesBack) {
  Connection connection = unconnected();
  FakeRelease a("a");
  FakeRelease b("b");
  FakeRelease c("c");
  FakeRelease d("d");
  connection.deferred_releases = {&a, &b, &c, &d};
  a.reached = b.reached = d.reached = true;
  b.failure = "drain timed out";
  d.failure = "dbufd is gone";
  const auto finished = connection.finishReleases(false);
  ASSERT_FALSE(finished.ok());
  EXPECT_EQ(finished.error().code, ErrorCode::kTimeout);
  EXPECT_EQ(finished.error().message, "b: drain timed out");
  EXPECT_EQ(connection.deferred_releases, (std::vector<Connection::DeferredRelease*>{&c}))
      << "a failed release is over, not retried";
  EXPECT_EQ(d.asked, 1) << "a failure does not stop the others";
}

}  // namespace
}  // namespace dbuf
