#include "dbuf/cli/command_line.hpp"

#include <algorithm>
#include <iostream>
#include <regex>
#include <string>
#include <vector>

#include "dbuf/common/build_info.hpp"

namespace dbuf::cli {

void useConventions(CLI::App& app) {
  app.set_version_flag("--version", versionText(app.get_name()), "Print the version and git commit, then exit");
  app.set_help_flag("-h,--help", "Print this help, then exit");
  app.get_formatter()->column_width(34);
}

void refuseMissingValues(const CLI::App& app, std::span<const std::string> args) {
  for (std::size_t i = 0; i < args.size(); ++i) {
    const CLI::Option* option = app.get_option_no_throw(args[i]);
    if (option == nullptr || option->get_expected_min() == 0) continue;  // not an option, or a flag
    if (i + 1 < args.size() && !args[i + 1].starts_with("--")) continue;
    // CLI11 would take the next option's name as the value ("--devices: '--model' is not an integer", or a file
    // named --typo for `--output --typo`); `--output=--x` still gives such a value on purpose.
    throw CLI::ArgumentMismatch(args[i] + " needs a value");
  }
}

std::optional<int> parse(CLI::App& app, int argc, const char* const* argv) {
  try {
    const std::vector<std::string> args(argv + std::min(argc, 1), argv + argc);
    refuseMissingValues(app, args);
    app.parse(std::vector<std::string>(args.rbegin(), args.rend()));  // CLI11 takes them last first
    return std::nullopt;
  } catch (const CLI::ParseError& error) {
    if (error.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) {
      return app.exit(error);  // --help or --version, printed to stdout
    }
    return usageError(app, inPlainWords(error));
  }
}

std::string inPlainWords(const CLI::ParseError& error) {
  const std::string what = error.what();
  // CLI11's phrasings (CLI/Error.hpp) of the errors every program meets, reworded; the rest as they are.
  static const std::regex kTwice(R"((\S+): At Most 1 required but received \d+)");
  static const std::regex kNoValue(R"((\S+): \d+ required \S+ missing)");
  static const std::regex kExtra(R"(The following argument was not expected: (\S+))");
  std::smatch match;
  if (std::regex_match(what, match, kTwice)) return match[1].str() + " given more than once";
  if (std::regex_match(what, match, kNoValue)) return match[1].str() + " needs a value";
  if (std::regex_match(what, match, kExtra)) {
    const std::string argument = match[1].str();
    return (argument.starts_with("-") ? "unknown option '" : "unexpected argument '") + argument + "'";
  }
  return what;
}

int usageError(const CLI::App& app, const std::string& message) {
  std::cerr << app.get_name() << ": " << message << " (see --help)\n";
  return kExitUsage;
}

}  // namespace dbuf::cli
