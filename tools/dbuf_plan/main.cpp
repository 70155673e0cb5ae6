// dbuf-plan: plan a model's FSDP units and print the report. See cli.hpp.
#include <iostream>
#include <string>
#include <vector>

#include "cli.hpp"

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + (argc > 0 ? 1 : 0), argv + argc);
  return dbuf::plan_cli::runCli(args, std::cout, std::cerr);
}
