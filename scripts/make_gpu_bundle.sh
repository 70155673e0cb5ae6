#!/usr/bin/env bash
# make_gpu_bundle.sh BUILD_DIR [BUNDLE_DIR]
#
# Packs what the GPU checks need from a CUDA build (-DDBUF_CUDA=ON) into one
# self-contained folder (default gpu-bundle/) that is copied to a machine with
# an NVIDIA GPU and run there as `BUNDLE_DIR/run [RESULTS_DIR]`. `make
# gpu-bundle` builds build-gpu/ and calls this script.
#
# The bundle as it travels (BUNDLE_DIR, at most 48 MiB: a device run carries
# 64 MiB with the working tree):
#   run             scripts/gpu_bundle_launch.sh: unpacks payload.tar.xz
#                   once (into BUNDLE_DIR/unpacked/, else $TMPDIR) and runs
#                   the unpacked runner with its arguments
#   payload.tar.xz  the bundle's tree below, packed (~7 MB; ~60 MB unpacked)
#   README.txt      the tree's README.txt
# The tree (gpu-bundle/ in the payload):
#   bin/            every executable a CTest test labelled `gpu` runs (listed,
#                   one name a line, in bin/gpu_tests.txt), every GPU
#                   benchmark (bench_gpu_*), and the helpers GPU tests may
#                   spawn: dbufd and whatever the build's bin/ holds named
#                   coll*rank*, cf*rank*, mp*rank*, dbuf*, gpu* (with `_` or
#                   `-` after the prefix). Copies are `strip --strip-all`ed
#                   (the dynamic symbols stay).
#   lib/            shared libraries those binaries need that the GPU machine
#                   may lack (rule below); often empty.
#   models/         the model files (benchmarks default to models/*.json,
#                   relative to the working directory; `run` runs from the
#                   bundle's root).
#   python/         the Python package built with CUDA (BUILD_DIR/python-package,
#                   `make gpu-bundle` installs it there) and its GPU tests
#                   (python/tests/test_gpu.py with what it imports); `run`
#                   runs them where the GPU machine's python3 has torch.
#   run             scripts/gpu_bundle_run.sh (`run --check`: the tree is
#                   whole, no GPU needed)
#   README.txt      what it is, how to run it, where results go.
#
# lib/ rule, per `ldd` of every binary in bin/:
#   - never: the CUDA driver (libcuda.so*), NCCL (libnccl*), anything
#     libnvidia* -- these must come from the GPU machine (driver, pip NCCL);
#     the CUDA runtime is linked statically and NCCL is dlopen'ed;
#   - always: a library resolved outside /lib, /lib64, /usr/lib, /usr/lib64
#     (e.g. /usr/local/lib, a build tree);
#   - also, from those system folders: libraries that a stock Ubuntu / Debian
#     image does not ship (libspdlog*, libfmt*, libtomlplusplus*, libgtest*,
#     libgmock*, libboost*, libgloo*, libhiredis*, libibverbs*, libnl-*,
#     libprometheus-cpp*, libcivetweb*: dbufd's metrics endpoint), as the GPU
#     machine is a different image;
#   - everything else in the system folders (glibc, libstdc++, libgcc_s, libm)
#     is left to the GPU machine. The newest GLIBC_ / GLIBCXX_ symbol
#     versions the binaries need are printed and written to README.txt.
set -euo pipefail

die() {
  echo "make_gpu_bundle: $*" >&2
  exit 1
}

(($# >= 1 && $# <= 2)) || die "usage: $0 BUILD_DIR [BUNDLE_DIR]"
BUILD_DIR=$1
BUNDLE_DIR=${2:-gpu-bundle}
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
SOURCE_DIR=$(cd "$SCRIPT_DIR/.." && pwd -P)
MAX_TRAVELLING_MIB=${MAX_GPU_BUNDLE_MIB:-48}

[[ -f "$BUILD_DIR/CMakeCache.txt" ]] || die "$BUILD_DIR is not a configured CMake build (no CMakeCache.txt)"
BUILD_DIR=$(cd "$BUILD_DIR" && pwd -P)
BUILD_BIN="$BUILD_DIR/bin"
[[ -d "$BUILD_BIN" ]] || die "$BUILD_BIN does not exist: build $BUILD_DIR first"
for tool in ctest python3 ldd strip tar xz; do
  command -v "$tool" >/dev/null || die "needs '$tool' on PATH"
done

# --- the gpu-labelled tests' executables -------------------------------------
ctest_json=$(ctest --test-dir "$BUILD_DIR" -L gpu --show-only=json-v1) ||
  die "ctest --test-dir $BUILD_DIR -L gpu --show-only=json-v1 failed"
mapfile -t test_exes < <(python3 -c '
import json, sys
seen = []
for test in json.load(sys.stdin).get("tests", []):
    command = test.get("command") or []
    if command and command[0] not in seen:
        seen.append(command[0])
print("\n".join(seen))
' <<<"$ctest_json" | sed '/^$/d')
((${#test_exes[@]} > 0)) ||
  die "$BUILD_DIR has no CTest test labelled 'gpu': not a CUDA build? (configure with -DDBUF_CUDA=ON and build it)"
for exe in "${test_exes[@]}"; do
  [[ -x "$exe" ]] || die "gpu test executable $exe is missing: build $BUILD_DIR first"
done

# --- the tree, staged, then packed into BUNDLE_DIR -------------------------------
rm -rf "$BUNDLE_DIR"
mkdir -p "$BUNDLE_DIR"
TRAVELLING_DIR=$(cd "$BUNDLE_DIR" && pwd -P)
STAGE=$(mktemp -d "${TMPDIR:-/tmp}/gpu-bundle-stage.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
BUNDLE_DIR="$STAGE/gpu-bundle" # the tree; what follows fills it
mkdir -p "$BUNDLE_DIR/bin" "$BUNDLE_DIR/lib"

copy_exe() { # SRC: into bin/, debug info and static symbols stripped
  local dest
  dest="$BUNDLE_DIR/bin/$(basename "$1")"
  [[ -e "$dest" ]] && return 0
  cp -L "$1" "$dest"
  chmod 755 "$dest"
  strip --strip-all "$dest"
}

: >"$BUNDLE_DIR/bin/gpu_tests.txt"
for exe in "${test_exes[@]}"; do
  copy_exe "$exe"
  basename "$exe" >>"$BUNDLE_DIR/bin/gpu_tests.txt"
done

benches=()
helpers=()
shopt -s nullglob
for exe in "$BUILD_BIN"/*; do
  [[ -f "$exe" && -x "$exe" ]] || continue
  name=$(basename "$exe")
  case "$name" in
    bench_gpu_*) benches+=("$name") ;;
    dbufd | coll[_-]rank* | cf[_-]rank* | mp[_-]rank* | dbuf[_-]* | gpu[_-]*)
      [[ -e "$BUNDLE_DIR/bin/$name" ]] && continue # a gpu test, copied above
      helpers+=("$name")
      ;;
    *) continue ;;
  esac
  copy_exe "$exe"
done
shopt -u nullglob

# Model files: the benchmarks' default inputs (models/<name>.json).
if [[ -d "$SOURCE_DIR/models" ]]; then
  mkdir -p "$BUNDLE_DIR/models"
  cp "$SOURCE_DIR"/models/*.json "$BUNDLE_DIR/models/"
fi

# The Python package and its GPU tests, when the build has them.
if [[ -d "$BUILD_DIR/python-package/dbuf" ]]; then
  mkdir -p "$BUNDLE_DIR/python/tests"
  cp -r "$BUILD_DIR/python-package/dbuf" "$BUNDLE_DIR/python/"
  find "$BUNDLE_DIR/python/dbuf" -name '*.so' -exec strip --strip-debug {} +
  cp "$SOURCE_DIR"/python/tests/{conftest.py,rank_launcher.py,test_gpu.py} "$BUNDLE_DIR/python/tests/"
  cp -r "$SOURCE_DIR/python/tests/ranks" "$BUNDLE_DIR/python/tests/"
  find "$BUNDLE_DIR/python" -name __pycache__ -prune -exec rm -rf {} +
fi

# --- lib/ (rule at the top) ----------------------------------------------------
is_system_dir() {
  case "$1" in
    /lib/* | /lib64/* | /usr/lib/* | /usr/lib64/*) return 0 ;;
    *) return 1 ;;
  esac
}
libs_copied=()
missing_libs=()
for exe in "$BUNDLE_DIR"/bin/*; do
  [[ -f "$exe" && -x "$exe" ]] || continue
  while read -r soname arrow path _; do
    [[ "$arrow" == "=>" ]] || continue # linux-vdso, the loader itself
    if [[ "$path" == "not" ]]; then
      missing_libs+=("$(basename "$exe"): $soname")
      continue
    fi
    case "$soname" in
      libcuda.so* | libnccl* | libnvidia*) continue ;;
    esac
    if is_system_dir "$path"; then
      case "$soname" in
        libspdlog* | libfmt* | libtomlplusplus* | libgtest* | libgmock* | libboost* | libgloo* | libhiredis* | \
          libibverbs* | libnl-* | libprometheus-cpp* | libcivetweb*) ;;
        *) continue ;;
      esac
    fi
    [[ -e "$BUNDLE_DIR/lib/$soname" ]] && continue
    cp -L "$path" "$BUNDLE_DIR/lib/$soname"
    chmod 644 "$BUNDLE_DIR/lib/$soname"
    strip --strip-debug "$BUNDLE_DIR/lib/$soname"
    libs_copied+=("$soname ($path)")
  done < <(ldd "$exe" 2>/dev/null || true)
done
# A copied library's own dependencies are in the ldd output of the binary
# that pulled it in (ldd lists the whole closure), so one pass suffices.
((${#missing_libs[@]} == 0)) || die "ldd cannot resolve: ${missing_libs[*]}"

# --- symbol versions the GPU machine's glibc / libstdc++ must provide ---------
newest_version() { # PREFIX: newest PREFIX_x.y symbol version over bin/*
  local exe
  for exe in "$BUNDLE_DIR"/bin/*; do
    [[ -f "$exe" && -x "$exe" ]] || continue
    objdump -T "$exe" 2>/dev/null | grep -o "$1_[0-9][0-9.]*" || true
  done | sort -uV | tail -n 1
}
glibc_needed=unknown
glibcxx_needed=unknown
if command -v objdump >/dev/null; then
  glibc_needed=$(newest_version GLIBC)
  glibcxx_needed=$(newest_version GLIBCXX)
fi

# --- run, README.txt -------------------------------------------------------------
cp "$SCRIPT_DIR/gpu_bundle_run.sh" "$BUNDLE_DIR/run"
chmod 755 "$BUNDLE_DIR/run"

commit=$(git -C "$SOURCE_DIR" rev-parse --short HEAD 2>/dev/null || echo unknown)
# --no-optional-locks: read only, never rewrites the index under other users.
if [[ -n "$(git -C "$SOURCE_DIR" --no-optional-locks status --porcelain --untracked-files=no 2>/dev/null)" ]]; then
  commit="$commit + uncommitted changes"
fi
cuda_version=$(sed -n 's/^CMAKE_CUDA_COMPILER_VERSION:[A-Z]*=//p' "$BUILD_DIR/CMakeCache.txt" | head -n 1)
[[ -n "$cuda_version" ]] ||
  cuda_version=$(grep -o 'CMAKE_CUDA_COMPILER_VERSION "[^"]*"' "$BUILD_DIR"/CMakeFiles/*/CMakeCUDACompiler.cmake 2>/dev/null |
    head -n 1 | cut -d'"' -f2 || true)
cuda_archs=$(grep -rhoE 'sm_[0-9]+[a-z]?' "$BUILD_DIR" --include=flags.make 2>/dev/null | sort -uV | paste -sd' ' - || true)

cat >"$BUNDLE_DIR/README.txt" <<EOF
dbuf GPU bundle
===============

The dbuf GPU tests (CTest label 'gpu') and GPU benchmarks, built on another
machine, packed to run on a machine with an NVIDIA GPU. Nothing else of dbuf
is needed there: no source tree, no CMake, no compiler.

The GPU machine needs: the NVIDIA driver (libcuda.so.1, nvidia-smi), bash and
coreutils (timeout). NCCL (libnccl.so.2) is optional: 'run' finds it through
ldconfig or the pip package nvidia-nccl-cu13 (python3); without it the NCCL
tests skip themselves. The CUDA runtime is linked into the binaries.

Run
---
    gpu-bundle/run [RESULTS_DIR]        # RESULTS_DIR defaults to ./gpu-results
    gpu-bundle/run --check              # the bundle is whole; runs nothing

from any working directory. The bundle travels packed (run, README.txt,
payload.tar.xz): its run unpacks the payload once, into gpu-bundle/unpacked/
(or \$TMPDIR where that is read-only), with tar and xz or else python3. Environment:
    GPU_TEST_TIMEOUT   seconds per test executable (default 300)
    GPU_BENCH_TIMEOUT  seconds per benchmark (default 300)
    GPU_RUN_BUDGET     seconds for the whole run (default: no limit); what no
                       longer fits is marked NOT RUN in summary.txt
    NCCL_DEBUG         passed on (default WARN: NCCL's failures in the logs)

'run' runs every test executable in bin/gpu_tests.txt (whole binary, all of
its cases), then every bin/bench_gpu_* (bench_gpu_overlap again under MPS
where nvidia-cuda-mps-control starts), then gpu_collectives_test, the longest,
last (a budget cut costs part of it, not the figures), each under 'timeout', with the
bundle's root as working directory, DBUF_BIN_DIR=<bundle>/bin (where tests
find helper binaries) and LD_LIBRARY_PATH starting with <bundle>/lib and the
NCCL folder it found. It exits 0 when every executable exited 0, else 1.

Results (all in RESULTS_DIR)
----------------------------
    summary.txt        one line per executable: name, exit code,
                       PASS / FAIL / TIMEOUT, and for tests the GoogleTest
                       counts (passed / failed / skipped); also printed
    environment.txt    date, uname, nvidia-smi, nvidia-smi -q (head), the
                       NCCL found, LD_LIBRARY_PATH
    <test>.xml         GoogleTest XML report of each test executable
    <name>.log         stdout + stderr of each executable
    <bench>.json       each benchmark's results (absent when it skipped)

Contents
--------
    bin/               executables (debug info and symbol tables stripped); bin/gpu_tests.txt
    lib/               shared libraries the GPU machine may lack (may be empty)
    models/            model files (benchmark inputs)
    run                the runner

Built from
----------
    commit             $commit
    built on           $(uname -srm), $(date -u '+%Y-%m-%d %H:%M UTC')
    CUDA               ${cuda_version:-unknown}, code for ${cuda_archs:-unknown}
    needs glibc        ${glibc_needed:-none} (newest symbol version used)
    needs libstdc++    ${glibcxx_needed:-none} (newest symbol version used)
EOF

# --- packing -----------------------------------------------------------------------
tree_size=$(du -sh "$BUNDLE_DIR" | cut -f1)
XZ_OPT=${XZ_OPT:--6 -T0} tar -cJf "$TRAVELLING_DIR/payload.tar.xz" -C "$STAGE" gpu-bundle
cp "$SCRIPT_DIR/gpu_bundle_launch.sh" "$TRAVELLING_DIR/run"
chmod 755 "$TRAVELLING_DIR/run"
cp "$BUNDLE_DIR/README.txt" "$TRAVELLING_DIR/README.txt"

# --- report -----------------------------------------------------------------------
echo "make_gpu_bundle: $TRAVELLING_DIR"
echo "  tests:   $(tr '\n' ' ' <"$BUNDLE_DIR/bin/gpu_tests.txt")"
echo "  benches: ${benches[*]:-(none)}"
echo "  helpers: ${helpers[*]:-(none)}"
if ((${#libs_copied[@]} > 0)); then
  echo "  lib/:    ${libs_copied[*]}"
else
  echo "  lib/:    (empty: every library needed is a system one)"
fi
echo "  needs:   ${glibc_needed:-no GLIBC_} / ${glibcxx_needed:-no GLIBCXX_} on the GPU machine"
travelling_kib=$(du -sk "$TRAVELLING_DIR" | cut -f1)
echo "  size:    $(du -sh "$TRAVELLING_DIR" | cut -f1) as it travels (payload.tar.xz, run, README.txt), $tree_size unpacked"
((travelling_kib <= MAX_TRAVELLING_MIB * 1024)) ||
  die "the bundle is ${travelling_kib} KiB as it travels, over ${MAX_TRAVELLING_MIB} MiB"
