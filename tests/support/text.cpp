#include "support/text.hpp"

#include <fstream>
#include <sstream>

namespace dbuf::testing {

bool startsWith(const std::string& text, const std::string& prefix) {
  return text.starts_with(prefix);
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::string readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace dbuf::testing
