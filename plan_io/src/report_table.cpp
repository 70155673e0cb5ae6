// The side-by-side table: ours, the proven lower bound and the four baselines
// per unit, then a TOTAL row and the diagnoses. Cells are built as strings
// first so every column can be sized to its widest cell.
#include <algorithm>
#include <cstdio>
#include <iterator>
#include <string>
#include <vector>

#include "dbuf/common/int_math.hpp"
#include "dbuf/plan_io/report.hpp"

namespace dbuf::plan_io {
namespace {

struct Group {
  std::string title;
  std::size_t columns = 0;
};

struct Column {
  std::string header;
  bool left = false;  ///< left-aligned (names); numbers are right-aligned
};

std::string fixed(double value, int decimals) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.*f", decimals, value);
  return buffer;
}

std::string inflationText(double value) {
  return fixed(value, 4) + "x";
}

std::string inflationOf(std::int64_t devices, std::int64_t shard, std::int64_t numel) {
  return inflationText(static_cast<double>(devices) * static_cast<double>(shard) /
                       static_cast<double>(std::max<std::int64_t>(numel, 1)));
}

std::string timeText(double micros) {
  if (micros >= 1e6) return fixed(micros / 1e6, 2) + " s";
  if (micros >= 1e3) return fixed(micros / 1e3, 2) + " ms";
  return fixed(micros, 1) + " us";
}

/// Units whose plans are the same in every reported number (names aside).
bool samePlan(const UnitReport& a, const UnitReport& b) {
  if (a.numel != b.numel || a.devices != b.devices || a.shard_elems != b.shard_elems ||
      a.lower_bound_elems != b.lower_bound_elems || a.padding_elems != b.padding_elems ||
      a.split_blocks != b.split_blocks || a.fsdp2 != b.fsdp2 ||
      a.fsdp1 != b.fsdp1 || a.zero3 != b.zero3 || a.megatron != b.megatron || a.tensors.size() != b.tensors.size() ||
      a.diagnosis.has_value() != b.diagnosis.has_value()) {
    return false;
  }
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    if (a.tensors[i].shape != b.tensors[i].shape || a.tensors[i].offset != b.tensors[i].offset ||
        a.tensors[i].granularity_elems != b.tensors[i].granularity_elems) {
      return false;
    }
  }
  return true;
}

/// A run of units shown as one row: [first, first + count).
struct Run {
  std::size_t first = 0;
  std::size_t count = 1;
};

std::vector<Run> runsOf(const PlanReport& report, bool summary) {
  std::vector<Run> runs;
  for (std::size_t u = 0; u < report.units.size(); ++u) {
    if (summary && !runs.empty() && samePlan(report.units[runs.back().first], report.units[u])) {
      ++runs.back().count;
    } else {
      runs.push_back({u, 1});
    }
  }
  return runs;
}

std::string runName(const PlanReport& report, const Run& run) {
  if (run.count == 1) return report.units[run.first].name;
  return report.units[run.first].name + " .. " + report.units[run.first + run.count - 1].name + " (x" +
         std::to_string(run.count) + ")";
}

void addBaselineCells(std::vector<std::string>& row, std::int64_t devices, std::int64_t shard, std::int64_t split,
                      std::int64_t numel) {
  row.push_back(std::to_string(shard));
  row.push_back(inflationOf(devices, shard, numel));
  row.push_back(std::to_string(split));
}

std::string padTo(const std::string& text, std::size_t width, bool left) {
  if (text.size() >= width) return text;
  const std::string fill(width - text.size(), ' ');
  return left ? text + fill : fill + text;
}

std::string listNames(const std::vector<std::string>& names, std::size_t shown) {
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < shown; ++i) {
    if (i > 0) out += ", ";
    out += names[i];
  }
  if (names.size() > shown) out += ", ... (" + std::to_string(names.size() - shown) + " more)";
  return out;
}

void writeDiagnoses(const PlanReport& report, const std::vector<Run>& runs, std::string& out) {
  std::string text;
  for (const Run& run : runs) {
    const UnitReport& unit = report.units[run.first];
    if (!unit.diagnosis) continue;
    const DiagnosisReport& diagnosis = *unit.diagnosis;
    const std::int64_t ideal = ceilDiv(unit.numel, std::max<std::int64_t>(unitDevices(report, unit), 1));
    text +=
        "  " + runName(report, run) + ": bound S >= " + std::to_string(unit.lower_bound_elems) + " is " +
        fixed(static_cast<double>(unit.lower_bound_elems) / static_cast<double>(std::max<std::int64_t>(ideal, 1)), 3) +
        "x ceil(N/V) = " + std::to_string(ideal) + "\n";
    if (!diagnosis.forcing_tensors.empty()) {
      text += "    forced by: " + listNames(diagnosis.forcing_tensors, 4) + "\n";
    }
    std::vector<std::string> fixes;
    if (diagnosis.merge_units) {
      fixes.push_back("merge " + std::to_string(*diagnosis.merge_units) + " consecutive units into one");
    }
    if (diagnosis.finer_rule)
      fixes.push_back("granularity " + *diagnosis.finer_rule + " for every tensor with coarser blocks");
    if (diagnosis.hsdp_devices) {
      fixes.push_back("HSDP with shard groups of " + std::to_string(*diagnosis.hsdp_devices) + " devices");
    }
    if (fixes.empty()) {
      text += "    no fix found by merging units, a finer rule or HSDP\n";
    } else {
      text += "    fix (any one): ";
      for (std::size_t i = 0; i < fixes.size(); ++i) text += (i > 0 ? "; or " : "") + fixes[i];
      text += "\n";
    }
  }
  if (text.empty()) {
    out += "Every unit's lower bound is within 5% of ceil(N/V).\n";
  } else {
    out += "Units whose lower bound is more than 5% above ceil(N/V), for any layout:\n" + text;
  }
}

std::string bytesText(std::int64_t bytes) {
  constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  auto value = static_cast<double>(bytes);
  std::size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < std::size(kUnits)) {
    value /= 1024.0;
    ++unit;
  }
  return unit == 0 ? std::to_string(bytes) + " B" : fixed(value, 2) + " " + kUnits[unit];
}

/// `--tp / --ep`: what the units hold, and the granularities tensor parallelism makes impossible.
void writeModelParallel(const ModelParallelReport& parallel, std::string& out) {
  out += "\nComposed with tensor parallelism " + std::to_string(parallel.tp) + " and expert parallelism " +
         std::to_string(parallel.ep) + ": each unit is what one rank holds (the Megatron plan's chunks; a unit's "
         "routed experts, an ep rank's, sharded over devices / ep ranks)\n";
  constexpr std::size_t kShown = 8;
  for (std::size_t i = 0; i < parallel.diagnoses.size() && i < kShown; ++i) out += "  " + parallel.diagnoses[i] + "\n";
  if (parallel.diagnoses.size() > kShown) {
    out += "  ... and " + std::to_string(parallel.diagnoses.size() - kShown) + " more (--format json lists all)\n";
  }
}

/// The `--merge auto` summary: what merging cost and what it bought.
void writeMerge(const MergeReport& merge, std::string& out) {
  const std::int64_t merged_away = merge.units - static_cast<std::int64_t>(merge.runs.size());
  out += "\nMerged with --merge auto under an unsharded budget of " + bytesText(merge.budget_bytes) + " (" +
         std::to_string(merge.budget_bytes) + " bytes) per rank: " + std::to_string(merge.units) + " units as " +
         std::to_string(merge.runs.size()) + " (" + std::to_string(merged_away) + " merges), planned in " +
         timeText(merge.merge_ms * 1000.0) + "\n";
  out += "  all-gather volume: " + inflationText(merge.inflation) + " N merged, " +
         inflationText(merge.unmerged_inflation) + " N without merging (within 1.05 N: " +
         (merge.within_target ? "yes" : "no, the least volume within the budget") + ")\n";
  out += "  peak unsharded buffer per rank: " + bytesText(merge.peak_unsharded_bytes) + " merged, " +
         bytesText(merge.unmerged_peak_unsharded_bytes) + " without merging\n";
  std::vector<std::string> over;
  for (const MergeRunReport& run : merge.runs) {
    if (run.over_budget) over.push_back(run.name + " (" + bytesText(run.unsharded_bytes) + ")");
  }
  if (!over.empty()) out += "  above the budget alone, kept unmerged: " + listNames(over, 4) + "\n";
}

}  // namespace

std::string writePlanTable(const PlanReport& report, const TableOptions& options) {
  const std::vector<Group> groups = {{"", 2},      {"ours", 3},   {"lower bound", 2},   {"FSDP2", 3},
                                     {"FSDP1", 3}, {"ZeRO-3", 3}, {"Megatron-FSDP", 3}, {"", 1}};
  std::vector<Column> columns = {{"unit", true}, {"numel", false}};
  columns.push_back({"S", false});
  columns.push_back({"infl", false});
  columns.push_back({"split", false});
  columns.push_back({"S", false});
  columns.push_back({"infl", false});
  for (int b = 0; b < 4; ++b) {
    columns.push_back({"S", false});
    columns.push_back({"infl", false});
    columns.push_back({"split", false});
  }
  columns.push_back({"plan", false});

  const std::int64_t devices = report.devices;
  std::vector<std::vector<std::string>> rows;
  const std::vector<Run> runs = runsOf(report, options.summary);
  // Sums of S over units: elements per rank for the whole model; volumes (V*S) for its inflation, V the
  // unit's own ranks (a unit of routed experts under expert parallelism has fewer).
  std::int64_t ours = 0, ours_split = 0, bound = 0, ours_volume = 0, bound_volume = 0;
  std::int64_t base_shard[4] = {0, 0, 0, 0};
  std::int64_t base_split[4] = {0, 0, 0, 0};
  std::int64_t base_volume[4] = {0, 0, 0, 0};
  for (const Run& run : runs) {
    const UnitReport& unit = report.units[run.first];
    const BaselineReport* baselines[4] = {&unit.fsdp2, &unit.fsdp1, &unit.zero3, &unit.megatron};
    double plan_us = 0;
    for (std::size_t u = run.first; u < run.first + run.count; ++u) plan_us += report.units[u].plan_us;
    const auto count = static_cast<std::int64_t>(run.count);
    const std::int64_t unit_devices = unitDevices(report, unit);
    std::vector<std::string> row = {runName(report, run), std::to_string(unit.numel)};
    addBaselineCells(row, unit_devices, unit.shard_elems, unit.split_blocks, unit.numel);
    row.push_back(std::to_string(unit.lower_bound_elems));
    row.push_back(inflationOf(unit_devices, unit.lower_bound_elems, unit.numel));
    for (int b = 0; b < 4; ++b) {
      addBaselineCells(row, unit_devices, baselines[b]->shard_elems, baselines[b]->split_blocks, unit.numel);
      base_shard[b] += count * baselines[b]->shard_elems;
      base_split[b] += count * baselines[b]->split_blocks;
      base_volume[b] += count * unit_devices * baselines[b]->shard_elems;
    }
    row.push_back(timeText(plan_us));
    rows.push_back(std::move(row));
    ours += count * unit.shard_elems;
    ours_split += count * unit.split_blocks;
    bound += count * unit.lower_bound_elems;
    ours_volume += count * unit_devices * unit.shard_elems;
    bound_volume += count * unit_devices * unit.lower_bound_elems;
  }
  const std::int64_t numel = report.total.numel;
  std::vector<std::string> total = {"TOTAL", std::to_string(numel)};
  const auto add_total = [&](std::int64_t shard, std::int64_t volume, std::int64_t split) {
    total.push_back(std::to_string(shard));
    total.push_back(inflationOf(1, volume, numel));
    total.push_back(std::to_string(split));
  };
  add_total(ours, ours_volume, ours_split);
  total.push_back(std::to_string(bound));
  total.push_back(inflationOf(1, bound_volume, numel));
  for (int b = 0; b < 4; ++b) add_total(base_shard[b], base_volume[b], base_split[b]);
  total.push_back(timeText(report.total.plan_ms * 1000.0));

  std::vector<std::size_t> widths(columns.size());
  for (std::size_t c = 0; c < columns.size(); ++c) {
    widths[c] = columns[c].header.size();
    for (const auto& row : rows) widths[c] = std::max(widths[c], row[c].size());
    widths[c] = std::max(widths[c], total[c].size());
  }
  // Widen the last column of a group whose title is wider than its columns.
  {
    std::size_t c = 0;
    for (const Group& group : groups) {
      std::size_t span = 0;
      for (std::size_t k = 0; k < group.columns; ++k) span += widths[c + k] + (k > 0 ? 2 : 0);
      if (group.title.size() > span) widths[c + group.columns - 1] += group.title.size() - span;
      c += group.columns;
    }
  }

  const auto render = [&](const std::vector<std::string>& cells) {
    std::string line;
    std::size_t c = 0;
    for (std::size_t g = 0; g < groups.size(); ++g) {
      if (g > 0) line += " | ";
      for (std::size_t k = 0; k < groups[g].columns; ++k, ++c) {
        if (k > 0) line += "  ";
        line += padTo(cells[c], widths[c], columns[c].left);
      }
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    return line + "\n";
  };

  std::string out;
  out += "model " + (report.model.empty() ? std::string("(unnamed)") : report.model) + ", " + std::to_string(devices) +
         " ranks, granularity " + report.granularity + ", alignment " + std::to_string(report.align_elems) +
         " elements (" + std::to_string(report.align_bytes) +
         " bytes).\nS = elements per rank, infl = V*S/N, split = blocks cut by a shard boundary.\n\n";
  {
    std::string line;
    std::size_t c = 0;
    for (std::size_t g = 0; g < groups.size(); ++g) {
      if (g > 0) line += " | ";
      std::size_t span = 0;
      for (std::size_t k = 0; k < groups[g].columns; ++k) span += widths[c + k] + (k > 0 ? 2 : 0);
      line += padTo(groups[g].title, span, true);
      c += groups[g].columns;
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  }
  std::vector<std::string> headers;
  headers.reserve(columns.size());
  for (const Column& column : columns) headers.push_back(column.header);
  out += render(headers);
  const std::string header_line = render(headers);
  std::string rule(header_line.size() - 1, '-');
  out += rule + "\n";
  for (const auto& row : rows) out += render(row);
  out += rule + "\n";
  out += render(total);
  out += "\n";
  writeDiagnoses(report, runs, out);
  if (report.merge) writeMerge(*report.merge, out);
  if (report.model_parallel) writeModelParallel(*report.model_parallel, out);
  return out;
}

}  // namespace dbuf::plan_io
