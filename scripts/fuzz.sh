#!/usr/bin/env bash
# Coverage-guided fuzzing of every parser of outside input dbufd has
# (libFuzzer, clang 14 with ASan + UBSan; docs/reliability.md, "Fuzzing").
#
#   scripts/fuzz.sh [SECONDS_PER_HARNESS]     (default 60; 0: regressions only)
#
# Configures and builds build-fuzz/ (incremental; nothing of build/ is used),
# then for each harness in fuzz/: runs its committed inputs once
# (fuzz/regressions/<harness>/ and its seeds fuzz/corpus/<harness>/: each
# must pass), then fuzzes it for SECONDS on a temporary copy of its seeds.
# One summary line per harness. Exits non-zero if any harness crashed,
# leaked, hung or ran out of memory; the reproducer is kept under
# build-fuzz/findings/<harness>/, the log under build-fuzz/logs/.
# Environment: DBUF_FUZZ_JOBS (build parallelism, default nproc),
# DBUF_FUZZ_HARNESSES (a subset, space-separated).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SECONDS_PER_HARNESS=${1:-60}
if ! [[ $SECONDS_PER_HARNESS =~ ^[0-9]+$ ]]; then
  echo "usage: scripts/fuzz.sh [SECONDS_PER_HARNESS]" >&2
  exit 2
fi
BUILD=$ROOT/build-fuzz
HARNESSES=(${DBUF_FUZZ_HARNESSES:-fuzz_protocol fuzz_ring fuzz_config fuzz_model fuzz_node fuzz_group fuzz_admin})

# Longest input per harness: a frame (header + a few KiB of payload), a ring
# script of at most 512 steps, a config file, a model file, a node message,
# an operator's request.
declare -A MAX_LEN=([fuzz_protocol]=8192 [fuzz_ring]=8192 [fuzz_config]=8192 [fuzz_model]=16384 [fuzz_node]=4096 [fuzz_group]=8192 [fuzz_admin]=4096)

for tool in clang++-14 cmake; do
  if ! command -v "$tool" >/dev/null; then
    echo "fuzz: $tool not found (scripts/install-deps.sh installs it)" >&2
    exit 1
  fi
done

build_start=$(date +%s)
cmake -S . -B "$BUILD" -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDBUF_CUDA=OFF \
  -DDBUF_FUZZ=ON -DDBUF_BUILD_TESTS=OFF -DDBUF_BUILD_BENCH=OFF >"$BUILD.configure.log" 2>&1 ||
  { cat "$BUILD.configure.log" >&2; exit 1; }
mv "$BUILD.configure.log" "$BUILD/configure.log"
cmake --build "$BUILD" --target dbuf_fuzz -j"${DBUF_FUZZ_JOBS:-$(nproc)}"
echo "fuzz: build took $(($(date +%s) - build_start)) s"

mkdir -p "$BUILD/logs" "$BUILD/findings"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/dbuf-fuzz.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# ASan: leaks are findings; UBSan: a report ends the run (the build also
# says -fno-sanitize-recover=all) with a stack.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:symbolize=1}
# llvm-14's symbolizer names the functions and lines in a report's stack.
if [[ -z ${ASAN_SYMBOLIZER_PATH:-} && -x /usr/lib/llvm-14/bin/llvm-symbolizer ]]; then
  export ASAN_SYMBOLIZER_PATH=/usr/lib/llvm-14/bin/llvm-symbolizer
fi
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

failed=()
summary=()
for h in "${HARNESSES[@]}"; do
  exe=$BUILD/bin/$h
  log=$BUILD/logs/$h.log
  findings=$BUILD/findings/$h
  mkdir -p "$findings"
  flags=(-timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 -max_len="${MAX_LEN[$h]:-8192}"
         -artifact_prefix="$findings/")

  # 1. Committed inputs, each run once: fixed findings stay fixed.
  inputs=()
  for dir in "fuzz/regressions/$h" "fuzz/corpus/$h"; do
    [[ -d $dir ]] || continue
    while IFS= read -r -d '' file; do inputs+=("$file"); done \
      < <(find "$dir" -type f ! -name 'README*' -print0 | sort -z)
  done
  if ((${#inputs[@]} > 0)) && ! "$exe" "${flags[@]}" "${inputs[@]}" >"$log" 2>&1; then
    summary+=("$h: a committed input fails (see $log)")
    failed+=("$h")
    continue
  fi
  if ((SECONDS_PER_HARNESS == 0)); then
    summary+=("$h: ${#inputs[@]} committed inputs pass")
    continue
  fi

  # 2. Fuzzing, on a copy of the seeds (the copy grows; the tree does not).
  corpus=$WORK/$h
  mkdir -p "$corpus"
  [[ -d fuzz/corpus/$h ]] && cp fuzz/corpus/$h/* "$corpus"/
  rc=0
  "$exe" "${flags[@]}" -max_total_time="$SECONDS_PER_HARNESS" -print_final_stats=1 "$corpus" >>"$log" 2>&1 || rc=$?
  done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 || true)
  execs=$(grep -oE 'stat::number_of_executed_units: [0-9]+' "$log" | tail -1 | grep -oE '[0-9]+$' || echo "?")
  cov=$(grep -oE 'cov: [0-9]+' <<<"$done_line" | grep -oE '[0-9]+' || echo "?")
  ft=$(grep -oE 'ft: [0-9]+' <<<"$done_line" | grep -oE '[0-9]+' || echo "?")
  files=$(find "$corpus" -type f | wc -l)
  if ((rc != 0)); then
    kind=$(grep -oE 'ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer): [a-z-]+|runtime error|fuzz property violated' \
      "$log" | head -1 || true)
    summary+=("$h: FAILED (exit $rc: ${kind:-see log}); reproducer in $findings/, log $log")
    failed+=("$h")
  else
    summary+=("$h: ${execs} executions in ${SECONDS_PER_HARNESS} s, cov: $cov ft: $ft, corpus $files files")
  fi
done

echo
echo "fuzz summary (${SECONDS_PER_HARNESS} s per harness):"
printf '  %s\n' "${summary[@]}"
if ((${#failed[@]} > 0)); then
  echo "fuzz: findings in: ${failed[*]}" >&2
  exit 1
fi
