#!/usr/bin/env bash
# The fixture of tests/install: `cmake --install` of the build tree into a
# fresh staging prefix, and its layout checked: every file where the FHS
# (GNUInstallDirs) puts it, nothing else (no tests, benchmarks, static
# libraries), nothing that points back into the build tree, and the files
# written for the prefix (the unit, tmpfiles.d, dbuf.pc) naming this prefix.
#   staging_install.sh BUILD_DIR STAGING LIBDIR
set -euo pipefail
build=$1
staging=$2
libdir=$3
source_dir=$(cd "$(dirname "$0")/../.." && pwd)
die() { echo "FAIL: $*" >&2; exit 1; }

rm -rf "$staging"
mkdir -p "$(dirname "$staging")"
start=$(date +%s%N)
cmake --install "$build" --prefix "$staging" >"$staging.log" 2>&1 || { cat "$staging.log" >&2; die "cmake --install"; }
echo "cmake --install $build --prefix $staging: $(( ($(date +%s%N) - start) / 1000000 )) ms"
cd "$staging"

expected=(
  bin/dbufd bin/dbufctl bin/dbuf-plan
  "$libdir/libdbuf.so.0.1.0" "$libdir/libdbuf.so.0" "$libdir/libdbuf.so"
  "$libdir/cmake/dbuf/dbufConfig.cmake" "$libdir/cmake/dbuf/dbufConfigVersion.cmake"
  "$libdir/cmake/dbuf/dbufTargets.cmake" "$libdir/pkgconfig/dbuf.pc"
  include/dbuf/dbuf.h include/dbuf/client.hpp include/dbuf/common/dtype.hpp include/dbuf/common/result.hpp
  include/dbuf/planner/unit_plan.hpp
  share/dbuf/dbufd.toml
  lib/systemd/system/dbufd.service lib/sysusers.d/dbufd.conf lib/tmpfiles.d/dbufd.conf
  share/doc/dbuf/README.md share/doc/dbuf/configuration.md share/doc/dbuf/operations.md
  share/doc/dbuf/examples/development.toml
)
for path in "${expected[@]}"; do [[ -e "$path" ]] || die "not installed: $path"; done
for exe in bin/dbufd bin/dbufctl bin/dbuf-plan; do [[ -x "$exe" ]] || die "$exe is not executable"; done
[[ -L "$libdir/libdbuf.so" && -L "$libdir/libdbuf.so.0" && ! -L "$libdir/libdbuf.so.0.1.0" ]] ||
  die "libdbuf.so and libdbuf.so.0 must be links to libdbuf.so.0.1.0"
[[ "$(readlink "$libdir/libdbuf.so.0")" == libdbuf.so.0.1.0 ]] ||
  die "libdbuf.so.0 -> $(readlink "$libdir/libdbuf.so.0")"

# Nothing but these folders' files: no test, benchmark, fuzzer or archive.
allowed=(
  "bin/(dbufd|dbufctl|dbuf-plan)"
  "$libdir/libdbuf\.so(\.0(\.1\.0)?)?" "$libdir/cmake/dbuf/dbuf[A-Za-z-]*\.cmake" "$libdir/pkgconfig/dbuf\.pc"
  "include/dbuf/(dbuf\.h|client\.hpp)" "include/dbuf/common/(dtype|result)\.hpp" "include/dbuf/planner/[a-z_]+\.hpp"
  "share/dbuf/dbufd\.toml" "share/doc/dbuf/.*"
  "lib/systemd/system/dbufd\.service" "lib/sysusers\.d/dbufd\.conf" "lib/tmpfiles\.d/dbufd\.conf"
)
pattern="^($(IFS='|'; echo "${allowed[*]}"))\$"
unexpected=$(find . \( -type f -o -type l \) | sed 's|^\./||' | grep -v -E "$pattern" || true)
[[ -z "$unexpected" ]] || die "installed but not expected: $unexpected"

# Every header an installed header includes is installed too.
while IFS= read -r header; do
  while IFS= read -r included; do
    [[ -f "include/$included" ]] || die "$header includes $included, which is not installed"
  done < <(sed -n 's/^#include "\(dbuf\/[^"]*\)".*/\1/p' "$header")
done < <(find include -type f)

# No RPATH / RUNPATH (the build tree's is removed on install).
for elf in bin/dbufd bin/dbufctl bin/dbuf-plan "$libdir/libdbuf.so.0.1.0"; do
  dynamic=$(readelf -d "$elf")
  if grep -qE '\((RPATH|RUNPATH)\)' <<<"$dynamic"; then die "$elf has an RPATH: $(grep PATH <<<"$dynamic")"; fi
done

# Written for this prefix.
grep -qxF "ExecStart=$staging/bin/dbufd --config /etc/dbufd/dbufd.toml" lib/systemd/system/dbufd.service ||
  die "the unit does not start $staging/bin/dbufd: $(grep ExecStart= lib/systemd/system/dbufd.service)"
grep -qF "Documentation=file:$staging/share/doc/dbuf/configuration.md" lib/systemd/system/dbufd.service ||
  die "the unit's Documentation= is not under $staging"
grep -qE "^C /etc/dbufd/dbufd.toml .* $staging/share/dbuf/dbufd.toml\$" lib/tmpfiles.d/dbufd.conf ||
  die "tmpfiles.d does not copy $staging/share/dbuf/dbufd.toml"
grep -qxF "prefix=$staging" "$libdir/pkgconfig/dbuf.pc" || die "dbuf.pc: $(grep prefix= "$libdir/pkgconfig/dbuf.pc")"
cmp -s share/dbuf/dbufd.toml "$source_dir/config/dbufd.toml" || die "share/dbuf/dbufd.toml is not config/dbufd.toml"

echo "ok: $(find . -type f | wc -l) files, $(find . -type l | wc -l) links in $staging"
