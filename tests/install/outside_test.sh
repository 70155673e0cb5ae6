#!/usr/bin/env bash
# Outside programs against the staging install (fixture dbuf_staging): the C
# and the C++ program of outside/ built the way a user outside this tree
# builds them, checked to link the installed libdbuf.so.0 (not the build
# tree's), then run against the installed dbufd on a temporary socket: each
# forks two ranks that all-gather and reduce-scatter (and, in C++,
# all-reduce) and check every element bitwise.
#   outside_test.sh cmake|pkg-config STAGING LIBDIR OUTSIDE_SOURCES WORKDIR BUILD_DIR
# cmake:      find_package(dbuf 0.1) with CMAKE_PREFIX_PATH=STAGING, one
#             project per language (a C-only project too)
# pkg-config: cc / c++ with $(pkg-config --cflags --libs dbuf),
#             PKG_CONFIG_PATH=STAGING/LIBDIR/pkgconfig
set -euo pipefail
mode=$1
staging=$2
libdir=$3
sources=$4
work=$5
build=$6
die() { echo "FAIL: $*" >&2; exit 1; }
ms() { echo $(( ($(date +%s%N) - $1) / 1000000 )); }

rm -rf "$work"
mkdir -p "$work"
installed_lib="$staging/$libdir/libdbuf.so.0"
[[ -f "$installed_lib" ]] || die "no $installed_lib: the install_staging fixture did not run"

programs=()
case "$mode" in
  cmake)
    for language in C CXX; do
      start=$(date +%s%N)
      dir="$work/build-$language"
      cmake -S "$sources" -B "$dir" -G "Unix Makefiles" -DCMAKE_BUILD_TYPE=Release -DOUTSIDE_LANGUAGE=$language \
        -DCMAKE_PREFIX_PATH="$staging" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF >"$dir.log" 2>&1 ||
        { cat "$dir.log" >&2; die "configuring the $language project"; }
      found=$(sed -n 's/^dbuf_DIR:PATH=//p' "$dir/CMakeCache.txt")
      [[ "$found" == "$staging/$libdir/cmake/dbuf" ]] || die "find_package(dbuf) found $found, not the staging install"
      cmake --build "$dir" >>"$dir.log" 2>&1 || { cat "$dir.log" >&2; die "building the $language project"; }
      echo "$language project: find_package(dbuf 0.1) from $found, configured and built in $(ms "$start") ms"
    done
    programs=("$work/build-C/outside_c" "$work/build-CXX/outside_cpp")
    ;;
  pkg-config)
    export PKG_CONFIG_PATH="$staging/$libdir/pkgconfig"
    pkg-config --exists --print-errors 'dbuf >= 0.1' || die "pkg-config does not find dbuf >= 0.1"
    prefix=$(pkg-config --variable=prefix dbuf)
    [[ "$prefix" == "$staging" ]] || die "pkg-config's dbuf has prefix $prefix, not $staging"
    read -r -a cflags <<<"$(pkg-config --cflags dbuf)"
    read -r -a libs <<<"$(pkg-config --libs dbuf)"
    rpath="-Wl,-rpath,$(pkg-config --variable=libdir dbuf)"
    echo "pkg-config --cflags --libs dbuf: ${cflags[*]} ${libs[*]}"
    start=$(date +%s%N)
    cc -std=c99 -D_POSIX_C_SOURCE=200809L -O2 -Wall -Wextra -Wpedantic -Werror "${cflags[@]}" \
      "$sources/outside.c" -o "$work/outside_c" "${libs[@]}" "$rpath"
    c++ -std=c++20 -O2 -Wall -Wextra -Wpedantic -Werror "${cflags[@]}" \
      "$sources/outside.cpp" -o "$work/outside_cpp" "${libs[@]}" "$rpath"
    echo "compiled with cc and c++ in $(ms "$start") ms"
    programs=("$work/outside_c" "$work/outside_cpp")
    ;;
  *) die "mode must be cmake or pkg-config, not $mode" ;;
esac

# Linked against the installed libdbuf.so.0, and nothing of the build tree.
for program in "${programs[@]}"; do
  [[ -x "$program" ]] || die "$program was not built"
  readelf -d "$program" | grep -q 'NEEDED.*\[libdbuf\.so\.0\]' || die "$program does not need libdbuf.so.0"
  resolved=$(ldd "$program" | sed -n 's/^[[:space:]]*libdbuf\.so\.0 => \([^ ]*\) .*/\1/p')
  [[ "$(realpath "$resolved")" == "$(realpath "$installed_lib")" ]] ||
    die "$program loads libdbuf.so.0 from '$resolved', not $installed_lib"
  # (The staging install may lie inside the build tree: its lib/ is what counts.)
  if ldd "$program" | grep -qF "$build/lib/"; then die "$program loads from the build tree: $(ldd "$program")"; fi
  if readelf -d "$program" | grep -E '\((RPATH|RUNPATH)\)' | grep -qF "$build/lib"; then
    die "$program has the build tree's lib/ in its RPATH"
  fi
  echo "$(basename "$program"): NEEDED libdbuf.so.0 => $resolved"
done

# The installed dbufd, with the installed configuration, on a socket of its
# own, and no metrics endpoint (the shipped file's port is for the node's one
# dbufd; tests run side by side).
socket="$work/dbufd.sock"
"$staging/bin/dbufd" --config "$staging/share/dbuf/dbufd.toml" --socket "$socket" --log-level warn \
  --metrics-listen "" >"$work/dbufd.log" 2>&1 &
daemon=$!
trap 'kill -TERM "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true' EXIT
for _ in $(seq 200); do [[ -S "$socket" ]] && break; kill -0 "$daemon" 2>/dev/null || break; sleep 0.05; done
[[ -S "$socket" ]] || { cat "$work/dbufd.log" >&2; die "the installed dbufd did not start"; }

for program in "${programs[@]}"; do
  start=$(date +%s%N)
  name=$(basename "$program")
  if ! timeout 90 "$program" "$socket" "outside-$mode-$name"; then
    echo "--- dbufd's log:" >&2
    cat "$work/dbufd.log" >&2
    die "$name failed against the installed dbufd"
  fi
  echo "$name ran in $(ms "$start") ms"
done

trap - EXIT
kill -TERM "$daemon"
status=0
wait "$daemon" || status=$?
((status == 0)) || { cat "$work/dbufd.log" >&2; die "dbufd exited with $status on SIGTERM"; }
echo "ok: $mode"
