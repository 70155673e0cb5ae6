# Install rules, the CMake package, dbuf.pc and the .deb (CPack). Included at
# the end of the top-level CMakeLists.txt (and before its early return in
# DBUF_CLIENT_ONLY builds); docs/operations.md, "Installing", has the layout.
#
# Components:
#   runtime   dbufd, dbufctl, dbuf-plan, libdbuf.so.0*, the shipped
#             configuration, the systemd units, the docs
#   dev       the headers, the libdbuf.so link, the CMake package, dbuf.pc
#   conffile  /etc/dbufd/dbufd.toml, for the .deb only (EXCLUDE_FROM_ALL:
#             `cmake --install` never writes outside its prefix)
# DBUF_CLIENT_ONLY: the library and its headers (and their package files).
#
# The systemd units, tmpfiles.d and dbuf.pc name installed paths; they are
# written at install time for the prefix being installed to (the .deb's /usr,
# or `cmake --install --prefix DIR`), so that an install into DIR names DIR.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# Not when dbuf is built inside another project (python/ adds this tree as a
# subdirectory and installs its module alone).
option(DBUF_INSTALL "Generate dbuf's install rules and package (on when dbuf is the top-level project)"
       ${PROJECT_IS_TOP_LEVEL})
if(NOT DBUF_INSTALL)
  return()
endif()

set(DBUF_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/dbuf)

# --- libdbuf and its headers ---------------------------------------------
install(TARGETS dbuf_client_shared EXPORT dbufTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime NAMELINK_COMPONENT dev)
# What dbuf/dbuf.h and dbuf/client.hpp include, and nothing else of
# common/ (its other headers are the daemon's); the planner is exported
# whole (libclient/libdbuf.map), so all its headers.
install(FILES libclient/include/dbuf/dbuf.h libclient/include/dbuf/client.hpp
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/dbuf COMPONENT dev)
install(FILES common/include/dbuf/common/dtype.hpp common/include/dbuf/common/result.hpp
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/dbuf/common COMPONENT dev)
install(DIRECTORY planner/include/dbuf/planner
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/dbuf COMPONENT dev FILES_MATCHING PATTERN "*.hpp")

# find_package(dbuf 0.1): the imported target dbuf::client. The SONAME
# promises one ABI per major version, so any 0.x satisfies a request for 0.1.
install(EXPORT dbufTargets NAMESPACE dbuf:: DESTINATION ${DBUF_INSTALL_CMAKEDIR} COMPONENT dev)
configure_package_config_file(cmake/dbufConfig.cmake.in ${PROJECT_BINARY_DIR}/package/dbufConfig.cmake
  INSTALL_DESTINATION ${DBUF_INSTALL_CMAKEDIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/package/dbufConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/package/dbufConfig.cmake ${PROJECT_BINARY_DIR}/package/dbufConfigVersion.cmake
  DESTINATION ${DBUF_INSTALL_CMAKEDIR} COMPONENT dev)

# dbuf_install_for_prefix(SOURCE DESTINATION NAME COMPONENT [FROM TO]...):
# installs SOURCE as DESTINATION/NAME (DESTINATION relative to the prefix)
# with each FROM replaced by TO, where TO may use @PREFIX@ for the prefix
# being installed to (not the one configured: cpack installs to /usr,
# `cmake --install --prefix DIR` to DIR).
function(dbuf_install_for_prefix source destination name component)
  set(replacements "")
  set(pairs ${ARGN})
  while(pairs)
    list(POP_FRONT pairs from to)
    string(REPLACE "@PREFIX@" "\${CMAKE_INSTALL_PREFIX}" to "${to}")
    string(APPEND replacements "  string(REPLACE [==[${from}]==] \"${to}\" _text \"\${_text}\")\n")
  endwhile()
  # Written beside the build, under a name of its own for each place installed
  # to (a staging install and cpack's may run at the same time), then
  # installed as any file is (DESTDIR, the manifest, "-- Installing:").
  set(generated "${PROJECT_BINARY_DIR}/package/for-prefix/\${_where}/${destination}/${name}")
  install(CODE "block()
  string(MD5 _where \"\$ENV{DESTDIR}\${CMAKE_INSTALL_PREFIX}\")
  file(READ [==[${source}]==] _text)
${replacements}  file(WRITE \"${generated}\" \"\${_text}\")
  file(INSTALL DESTINATION \"\${CMAKE_INSTALL_PREFIX}/${destination}\" TYPE FILE FILES \"${generated}\")
endblock()" COMPONENT ${component})
endfunction()

# pkg-config: one .pc for C and C++ (C++ callers add -std=c++20 themselves:
# Cflags cannot say it for C++ alone).
dbuf_install_for_prefix(${PROJECT_SOURCE_DIR}/cmake/dbuf.pc.in ${CMAKE_INSTALL_LIBDIR}/pkgconfig dbuf.pc dev
  "@prefix@" "@PREFIX@"
  "@includedir@" "${CMAKE_INSTALL_INCLUDEDIR}"
  "@libdir@" "${CMAKE_INSTALL_LIBDIR}"
  "@VERSION@" "${PROJECT_VERSION}")

if(DBUF_CLIENT_ONLY)
  return()
endif()

# --- the daemon and the tools ------------------------------------------------
install(TARGETS dbufd dbufctl dbuf-plan RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT runtime)

# The shipped configuration (every key at its default) goes to
# share/dbuf/dbufd.toml, the factory copy that dbufd.tmpfiles copies to
# /etc/dbufd/dbufd.toml when there is none. The .deb also ships
# /etc/dbufd/dbufd.toml itself as a conffile, so dpkg keeps an operator's
# edits across upgrades and asks before replacing them.
install(FILES config/dbufd.toml DESTINATION ${CMAKE_INSTALL_DATADIR}/dbuf COMPONENT runtime)
install(FILES config/dbufd.toml DESTINATION /etc/dbufd COMPONENT conffile EXCLUDE_FROM_ALL)

# systemd: lib/ under the prefix (systemd reads /usr/lib and /usr/local/lib;
# never the multiarch library directory). The unit starts the dbufd of this
# prefix.
dbuf_install_for_prefix(${PROJECT_SOURCE_DIR}/systemd/dbufd.service lib/systemd/system dbufd.service runtime
  "/usr/bin/dbufd" "@PREFIX@/${CMAKE_INSTALL_BINDIR}/dbufd"
  "file:/usr/share/doc/dbuf/" "file:@PREFIX@/${CMAKE_INSTALL_DOCDIR}/")
install(FILES systemd/dbufd.sysusers DESTINATION lib/sysusers.d RENAME dbufd.conf COMPONENT runtime)
dbuf_install_for_prefix(${PROJECT_SOURCE_DIR}/systemd/dbufd.tmpfiles lib/tmpfiles.d dbufd.conf runtime
  "/usr/share/dbuf/dbufd.toml" "@PREFIX@/${CMAKE_INSTALL_DATADIR}/dbuf/dbufd.toml")

install(FILES README.md DESTINATION ${CMAKE_INSTALL_DOCDIR} COMPONENT runtime)
install(DIRECTORY docs/ DESTINATION ${CMAKE_INSTALL_DOCDIR} COMPONENT runtime)
install(DIRECTORY config/examples DESTINATION ${CMAKE_INSTALL_DOCDIR} COMPONENT runtime)

# --- the .deb: `cpack -G DEB` in the build tree ---------------------------------
set(DBUF_DEB_MAINTAINER "dbuf maintainers <dbuf@localhost>" CACHE STRING "Maintainer field of the .deb")
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME dbuf)
set(CPACK_PACKAGE_VENDOR dbuf)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "per-node daemon of sharded (FSDP) training state, and its client library")
set(CPACK_PACKAGE_DESCRIPTION "dbufd owns the sharded training state of a node's GPUs and runs grouped
AllGather / ReduceScatter for the trainers attached to it (RaggedShard
placement, a structure-aware layout planner). The package holds dbufd, its
systemd unit, dbufctl, dbuf-plan, and libdbuf (C and C++ API) with its
headers, CMake package (find_package(dbuf)) and pkg-config file (dbuf.pc).")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
# One package of every component, conffile included.
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_COMPONENTS_GROUPING ALL_COMPONENTS_IN_ONE)
set(CPACK_COMPONENTS_ALL runtime dev conffile)
set(CPACK_DEBIAN_PACKAGE_NAME dbuf)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)  # dbuf_0.1.0_amd64.deb; the architecture from dpkg
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "${DBUF_DEB_MAINTAINER}")
set(CPACK_DEBIAN_PACKAGE_SECTION misc)
set(CPACK_DEBIAN_PACKAGE_HOMEPAGE "https://arxiv.org/abs/2602.22437")
# Depends: from the binaries' libraries, by dpkg-shlibdeps (dpkg-dev).
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
# Works without systemd (postinst falls back to useradd), is meant for it.
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS systemd)
# A shlibs file for libdbuf.so.0, so that packages built against it depend on this version or newer.
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS_POLICY ">=")
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
  ${PROJECT_SOURCE_DIR}/packaging/deb/postinst
  ${PROJECT_SOURCE_DIR}/packaging/deb/prerm
  ${PROJECT_SOURCE_DIR}/packaging/deb/postrm
  ${PROJECT_SOURCE_DIR}/packaging/deb/conffiles
  ${PROJECT_SOURCE_DIR}/packaging/deb/triggers)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)  # scripts 0755, the rest 0644
set(CPACK_SOURCE_GENERATOR TGZ)
set(CPACK_SOURCE_IGNORE_FILES "/\\\\.git/" "/\\\\.venv/" "/build[^/]*/" "/gpu-bundle/")
include(CPack)
