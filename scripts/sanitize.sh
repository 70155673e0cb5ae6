#!/usr/bin/env bash
# Builds dbuf under a sanitizer and runs its CTest suite (docs/reliability.md).
#
#   scripts/sanitize.sh KIND [BUILD_DIR] [--subset]
#
# KIND: address,undefined (default BUILD_DIR build-asan) or thread (build-tsan).
# --subset: builds and runs only the suites with real daemons, client threads
#   and rank processes, and the unit suites of the daemon's and the client's
#   threads (subset_targets below), for a CI budget too small for the whole
#   suite under TSan.
#
# Self-contained (needs only scripts/install-deps.sh): it configures its own
# tree, lean (-O1, line tables only, no benchmarks), builds it and runs every
# test but the Python ones (the venv's module is not instrumented). A
# sanitizer finding ends the process that made it (-fno-sanitize-recover=all,
# halt_on_error), so it fails its test. Prints one summary line; exits non-zero
# on a failed configure, build or test.
# Environment: JOBS (build and ctest parallelism, default nproc), CTEST_ARGS
# (more ctest arguments, e.g. "-R Daemon").
set -euo pipefail

usage() {
  echo "usage: $0 address,undefined|thread [BUILD_DIR] [--subset]" >&2
  exit 2
}

kind=""
dir=""
subset=0
for arg in "$@"; do
  case "$arg" in
    --subset) subset=1 ;;
    -h|--help) usage ;;
    -*) usage ;;
    *)
      if [[ -z "$kind" ]]; then kind="$arg"
      elif [[ -z "$dir" ]]; then dir="$arg"
      else usage
      fi ;;
  esac
done

root="$(cd "$(dirname "$0")/.." && pwd)"
case "$kind" in
  address,undefined|undefined,address)
    kind=address,undefined
    : "${dir:=build-asan}"
    test_timeout=600
    # Leaks: see docs/reliability.md (threads abandoned on purpose keep their memory).
    export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0}"
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
    ;;
  thread)
    : "${dir:=build-tsan}"
    # The tests' own deadlines are 10 times longer under TSan (tests/support/sanitizers.hpp).
    test_timeout=1200
    # tests/tsan.supp: reports proved false (each with its proof).
    export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$root/tests/tsan.supp}"
    ;;
  *) usage ;;
esac
[[ "$dir" = /* ]] || dir="$root/$dir"
jobs="${JOBS:-$(nproc)}"

start=$(date +%s)
log() { echo "sanitize.sh [$kind]: $*"; }

log "configuring $dir"
# -O1 and line tables (-g1): about half the compile time of RelWithDebInfo's
# -O2 -g, and still a source line for every frame of a report.
cmake -S "$root" -B "$dir" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" \
  -DDBUF_CUDA=OFF -DDBUF_BUILD_BENCH=OFF -DDBUF_WERROR=ON \
  -DDBUF_PYTHON= \
  "-DDBUF_SANITIZE=$kind" >/dev/null

# The subset: the suites of real daemons with client threads and rank
# processes, and the unit suites of the daemon's and the client's threads
# (Gloo links, the daemon watch); not the single-threaded unit suites
# (planner, kernels, config, CLI) nor the collectives' numerics (their code
# paths are the integration suite's). Only their targets are built.
subset_targets=(ipc_socket_test ipc_ring_test integration_test multiprocess_test collective_failures_test
                collective_failures_process_test multinode_test daemon_unit_test client_unit_test)
targets=()
if ((subset)); then
  for target in "${subset_targets[@]}"; do targets+=(--target "$target"); done
fi

log "building with -j$jobs"
cmake --build "$dir" -j "$jobs" "${targets[@]}" >"$dir/sanitize-build.log" 2>&1 || {
  tail -n 60 "$dir/sanitize-build.log"
  echo "sanitize.sh [$kind]: BUILD FAILED after $(( $(date +%s) - start )) s (log: $dir/sanitize-build.log)"
  exit 1
}
built=$(date +%s)
log "built in $((built - start)) s"

select=(-LE python)
if ((subset)); then
  # What is not built is a placeholder test named <target>_NOT_BUILT.
  select=(-LE 'python|soak' -E '_NOT_BUILT$')
fi

set +e
(cd "$dir" && ctest -j "$jobs" --timeout "$test_timeout" --output-on-failure "${select[@]}" ${CTEST_ARGS:-} >"$dir/sanitize-test.log" 2>&1)
rc=$?
set -e
done_=$(date +%s)
grep -E "tests passed|tests failed|^\s+[0-9]+ - |Total Test time" "$dir/sanitize-test.log" || true
summary=$(grep -E "tests passed" "$dir/sanitize-test.log" | tail -n 1)
if ((rc == 0)); then status=PASS; else status=FAIL; fi
if ((rc != 0)); then
  # The failed tests' own output (--output-on-failure puts it after each
  # one's result line), so a CI log that keeps only stdout says why.
  awk '/^ *[0-9]+\/[0-9]+ Test +#/ { show = ($0 !~ / Passed /) } show' "$dir/sanitize-test.log" | tail -n 300
fi
echo "sanitize.sh [$kind]: $status: ${summary:-no ctest summary}; build $((built - start)) s, tests $((done_ - built)) s, total $((done_ - start)) s (log: $dir/sanitize-test.log)"
exit $rc
