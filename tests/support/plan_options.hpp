#pragma once
/// \file
/// PlanOptions for the planner's tests. Include as "support/plan_options.hpp"
/// (header only; needs gtest and the planner).

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "dbuf/planner/unit_plan.hpp"

namespace dbuf::planner::testing {

/// Options for V = `devices` with a default rule (a test failure if it does not parse).
inline PlanOptions optionsFor(std::int64_t devices, const std::string& rule = "element",
                              std::int64_t align_bytes = 16) {
  PlanOptions options;
  options.devices = devices;
  auto parsed = GranularityRule::parse(rule);
  EXPECT_TRUE(parsed.ok()) << rule;
  if (parsed) options.default_rule = *parsed;
  options.align_bytes = align_bytes;
  return options;
}

}  // namespace dbuf::planner::testing
