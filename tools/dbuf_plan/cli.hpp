#pragma once
/// \file
/// `dbuf-plan`: argument parsing and the whole run, as a library so tests and
/// other tools can drive it in-process. `main.cpp` only adapts argv.
///
/// Exit status: 0 success (and --help), 2 bad input (usage, model file,
/// planner input, output file), 1 an internal error (a bug).

#include <cstdint>
#include <ostream>
#include <span>
#include <string>
#include <string_view>

#include "dbuf/common/result.hpp"

namespace dbuf::plan_cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitInternal = 1;
inline constexpr int kExitBadInput = 2;

inline constexpr std::int64_t kMaxDevices = std::int64_t{1} << 20;
inline constexpr std::int64_t kMaxAlignBytes = std::int64_t{1} << 20;

struct CliOptions {
  std::string model;
  std::int64_t devices = 0;
  std::string granularity = "element";
  std::int64_t align_bytes = 16;
  std::string format = "table";       ///< table, json or svg
  std::string output;                 ///< empty: stdout
  std::string unit;                   ///< svg: the unit to draw; table/json: report only this unit
  bool ranks = false;                 ///< json: per-rank slices of every tensor
  bool summary = false;               ///< table: collapse runs of identical units
  std::string merge = "none";         ///< none or auto (merge consecutive units, planner/merge.hpp)
  std::int64_t unsharded_budget = 0;  ///< --merge auto: bytes per rank of the largest unit's unsharded buffer
  std::int64_t tp = 1;                ///< tensor parallel degree: plan what one tp rank holds
  std::int64_t ep = 1;                ///< expert parallel degree: routed experts a unit of their own per ep rank
  bool help = false;
  bool version = false;
};

/// Parses the arguments after the program name (CLI11, with the conventions
/// of dbuf's programs: cli/). Accepts `--flag value` and `--flag=value`.
/// Errors are one-line messages naming the option.
[[nodiscard]] Result<CliOptions> parseArgs(std::span<const std::string> args);

/// A size for `flag` (--unsharded-budget): a positive byte count, optionally
/// with a unit, B, KiB, MiB, GiB, TiB (powers of 1024) or kB / KB, MB, GB, TB
/// (powers of 1000), as dbufd's configuration writes sizes.
[[nodiscard]] Result<std::int64_t> parseBytes(std::string_view flag, const std::string& text);

/// "" when `text` is a size as parseBytes takes it, else what is wrong with it
/// (a CLI11 check: dbuf-plan's --unsharded-budget, bench_planner_merge's --budgets).
[[nodiscard]] std::string byteCountProblem(const std::string& text);

/// The text --help prints.
[[nodiscard]] std::string usage();

/// Runs dbuf-plan with `args` (after the program name): the report goes to
/// `out` (or the --output file), one error line to `err`. Returns the exit
/// status. Never throws.
int runCli(std::span<const std::string> args, std::ostream& out, std::ostream& err);

}  // namespace dbuf::plan_cli
