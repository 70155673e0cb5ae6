#pragma once
/// \file
/// Which build of dbuf this is: the project's version and the git commit it
/// was built from. Every binary's `--version`, dbufd's status (dbufctl
/// status) and its `dbuf_build_info` metric say it. The definition is
/// generated at build time (common/build_info.cmake), in the library
/// dbuf_build_info.

#include <string>
#include <string_view>

namespace dbuf {

struct BuildInfo {
  std::string_view version;  ///< the project's version (CMake's PROJECT_VERSION)
  std::string_view commit;   ///< 12 hex digits of the git commit, "-dirty" after local changes, or "unknown"
};

[[nodiscard]] const BuildInfo& buildInfo() noexcept;

/// "PROGRAM VERSION (commit COMMIT)": what `--version` prints.
[[nodiscard]] inline std::string versionText(std::string_view program) {
  const BuildInfo& info = buildInfo();
  return std::string(program) + " " + std::string(info.version) + " (commit " + std::string(info.commit) + ")";
}

}  // namespace dbuf
