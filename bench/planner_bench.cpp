// Planner quality and speed, side by side with the paper's three fixed orders
// and the lower bound, on every bundled model. See docs/planner.md.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "dbuf/plan_io/model_file.hpp"
#include "dbuf/planner/bounds.hpp"
#include "dbuf/planner/search.hpp"
#include "dbuf/planner/unit_plan.hpp"

using namespace dbuf;
using namespace dbuf::planner;

int main(int argc, char** argv) {
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) files.emplace_back(argv[i]);
  const std::vector<std::int64_t> device_counts{8, 64, 256, 1024};
  const std::vector<std::string> rules{"element", "rows:32", "block:128x128"};
  for (const auto& path : files) {
    auto model = plan_io::loadModelFile(path);
    if (!model) { std::fprintf(stderr, "%s\n", model.error().message.c_str()); return 2; }
    for (auto V : device_counts) for (const auto& rule : rules) {
      PlanOptions options;
      options.devices = V;
      options.default_rule = *GranularityRule::parse(rule);
      auto t0 = std::chrono::steady_clock::now();
      auto plan = planModel(model->units, options);
      double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (!plan) { std::fprintf(stderr, "%s\n", plan.error().message.c_str()); return 1; }
      double ours = 0, lb = 0, ideal = 0, three = 0; std::int64_t tries = 0; bool exh = true;
      for (std::size_t u = 0; u < plan->units.size(); ++u) {
        const auto& p = plan->units[u];
        ours += double(p.shard_elems); lb += double(p.lower_bound_elems); ideal += double(p.ideal_elems);
        exh = exh && p.exhaustive;
      }
      // three fixed orders, exact
      PlanOptions fixed = options;
      fixed.search.strategies = {Strategy::kGivenOrder, Strategy::kSizeDescending, Strategy::kGranularityDescending};
      fixed.search.max_scan_steps = 200000;
      auto t1 = std::chrono::steady_clock::now();
      auto plan3 = planModel(model->units, fixed);
      double ms3 = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t1).count();
      bool worse = false;
      for (std::size_t u = 0; u < plan3->units.size(); ++u) {
        three += double(plan3->units[u].shard_elems);
        if (plan->units[u].shard_elems > plan3->units[u].shard_elems) worse = true;
      }
      std::printf("%-14s V=%-5lld %-14s gap_lb=%.4f%% three_gap=%.4f%% lb/ideal=%.3f ms=%.2f ms3=%.1f %s%s\n",
                  model->model.c_str(), (long long)V, rule.c_str(), (ours / lb - 1) * 100, (three / lb - 1) * 100,
                  lb / ideal, ms, ms3, worse ? "WORSE " : "", exh ? "" : "non-exhaustive");
    }
  }
}
