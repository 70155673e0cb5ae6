#pragma once
/// \file
/// The command lines of dbuf's programs (dbufd, dbufctl, dbuf-plan,
/// dbuf-soak, the benchmarks): CLI11 apps with one set of conventions, so
/// that every program has the same help layout, `--version`, and errors.
///
///   CLI::App app{"what the program does", "dbufd"};
///   dbuf::cli::useConventions(app);
///   app.add_option("--socket", socket, "...");
///   if (const auto done = dbuf::cli::parse(app, argc, argv)) return *done;
///
/// Conventions: `-h, --help` prints the help (of the subcommand given, if
/// any) and `--version` prints "PROGRAM VERSION (commit COMMIT)", both to
/// stdout with exit status 0; a bad command line prints one line on stderr,
/// "PROGRAM: what is wrong, naming the option (see --help)", and exits with
/// kExitUsage (2), whatever CLI11's own code for the error.

#include <CLI/CLI.hpp>
#include <optional>
#include <span>
#include <string>

namespace dbuf::cli {

inline constexpr int kExitUsage = 2;

/// --version, the help layout and the error format above.
void useConventions(CLI::App& app);

/// Parses argv into app's options; nullopt to go on, or the exit status to
/// return from main now (help or version printed: 0; a bad command line: 2).
[[nodiscard]] std::optional<int> parse(CLI::App& app, int argc, const char* const* argv);

/// Throws CLI::ArgumentMismatch ("--devices needs a value") where one of app's
/// options that takes a value is last or followed by a word starting with
/// "--"; parse() calls it, before CLI11, which would take that word as the
/// value (`--option=--x` gives such a value on purpose).
void refuseMissingValues(const CLI::App& app, std::span<const std::string> args);

/// CLI11's error in the words dbuf's programs use ("--devices needs a
/// value", "unknown option '--frob'", "--model given more than once").
[[nodiscard]] std::string inPlainWords(const CLI::ParseError& error);

/// A bad command line found after parsing (what CLI11 cannot check): printed
/// as parse() prints CLI11's errors; returns kExitUsage.
[[nodiscard]] int usageError(const CLI::App& app, const std::string& message);

}  // namespace dbuf::cli
