# dbuf_daemon_config: dbufd's configuration (TOML), single-instance lock file
# and logging setup. Included from daemon/CMakeLists.txt (or from the top level
# while there is none); paths are relative to this file, not to the includer.
include_guard(GLOBAL)

find_package(tomlplusplus 3 REQUIRED)
find_package(spdlog REQUIRED)

add_library(dbuf_daemon_config STATIC
  ${CMAKE_CURRENT_LIST_DIR}/src/config.cpp
  ${CMAKE_CURRENT_LIST_DIR}/src/lock_file.cpp
  ${CMAKE_CURRENT_LIST_DIR}/src/logging.cpp)
target_include_directories(dbuf_daemon_config PUBLIC ${CMAKE_CURRENT_LIST_DIR}/include)
# spdlog is in the public logging.hpp; toml++ stays behind config.cpp.
target_link_libraries(dbuf_daemon_config
  PUBLIC dbuf_common spdlog::spdlog
  PRIVATE tomlplusplus::tomlplusplus dbuf_warnings)
