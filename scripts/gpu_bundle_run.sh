#!/usr/bin/env bash
# The GPU bundle's runner (copied to gpu-bundle/run by make_gpu_bundle.sh).
#
#   gpu-bundle/run [RESULTS_DIR]     # default ./gpu-results
#   gpu-bundle/run --check           # the bundle is whole; runs nothing
#
# (gpu-bundle/run as it travels is scripts/gpu_bundle_launch.sh: it unpacks
# the bundle's payload.tar.xz, then runs this from the unpacked tree.)
#
# Runs every GPU test executable (bin/gpu_tests.txt), then every GPU benchmark
# (bin/bench_gpu_*), then the longest test (gpu_collectives_test) last, each
# under `timeout` (GPU_TEST_TIMEOUT / GPU_BENCH_TIMEOUT seconds, default 300)
# and all within GPU_RUN_BUDGET seconds if set (device time is lent by the
# minute: what does not fit is marked NOT RUN, and the quick checks and the
# benchmark figures come before the long suite), and writes into RESULTS_DIR: environment.txt,
# <name>.log (stdout + stderr), <test>.xml (GoogleTest), <bench>.json and
# summary.txt (also printed). Exits 0 when every executable exited 0, else 1
# (an executable NOT RUN for the budget counts as a failure).
# Works from any working directory; executables run with the bundle's root as
# theirs (benchmarks default to models/*.json).
set -uo pipefail

BUNDLE=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd -P)
BIN="$BUNDLE/bin"
TEST_TIMEOUT=${GPU_TEST_TIMEOUT:-300}
BENCH_TIMEOUT=${GPU_BENCH_TIMEOUT:-300}
RUN_BUDGET=${GPU_RUN_BUDGET:-0} # 0: no limit
if ! [[ $RUN_BUDGET =~ ^[0-9]+$ ]]; then
  echo "run: GPU_RUN_BUDGET must be a whole number of seconds, got '$RUN_BUDGET'" >&2
  exit 2
fi
RUN_BUDGET=$((10#$RUN_BUDGET)) # "08" is eight, not bad octal
unset RUN_AS                   # run_one's per-call result name
RUN_DEADLINE=$(($(date +%s) + RUN_BUDGET))
KILL_AFTER=10 # seconds between timeout's TERM and its KILL

# budget_left: seconds an executable may still take (a large number without
# a budget), keeping room for timeout's KILL and the summary.
budget_left() {
  if ((RUN_BUDGET == 0)); then
    echo 1000000
  else
    echo $((RUN_DEADLINE - $(date +%s) - KILL_AFTER - 5))
  fi
}
# Run after the benchmarks: the longest by far, so that a budget cut costs
# part of it rather than the figures.
LAST_TESTS=(gpu_collectives_test)

# --check: the bundle is whole (every listed test executable is here and runs
# far enough to load its libraries: `--gtest_list_tests`; dbufd: `--help`),
# then exit; no GPU needed. The size test runs it after packing.
if [[ ${1:-} == --check ]]; then
  export LD_LIBRARY_PATH="$BUNDLE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  [[ -f "$BIN/gpu_tests.txt" ]] || { echo "run --check: $BIN/gpu_tests.txt is missing" >&2; exit 1; }
  checked=0
  while read -r name; do
    [[ -z "$name" ]] && continue
    if ! "$BIN/$name" --gtest_list_tests >/dev/null 2>&1; then
      echo "run --check: $name does not start: $("$BIN/$name" --gtest_list_tests 2>&1 | head -n 3)" >&2
      exit 1
    fi
    checked=$((checked + 1))
  done <"$BIN/gpu_tests.txt"
  "$BIN/dbufd" --help >/dev/null || { echo "run --check: dbufd does not start" >&2; exit 1; }
  echo "run --check: $checked test executables and dbufd start from $BUNDLE"
  exit 0
fi

RESULTS_DIR=${1:-./gpu-results}
mkdir -p "$RESULTS_DIR" || {
  echo "run: cannot create $RESULTS_DIR" >&2
  exit 1
}
RESULTS_DIR=$(cd "$RESULTS_DIR" && pwd -P)
ENV_FILE="$RESULTS_DIR/environment.txt"
SUMMARY="$RESULTS_DIR/summary.txt"

PYTHON=$(command -v python3 || true)

# --- NCCL ---------------------------------------------------------------------
# The folder holding libnccl.so.2: ldconfig's cache, then the pip package
# nvidia-nccl-cu13 (nvidia.nccl, maybe a namespace package), then the usual
# site-packages folders.
nccl_candidates() {
  local ldconfig line
  ldconfig=$(command -v ldconfig || true)
  [[ -z "$ldconfig" && -x /sbin/ldconfig ]] && ldconfig=/sbin/ldconfig
  if [[ -n "$ldconfig" ]]; then
    "$ldconfig" -p 2>/dev/null | awk '/^[[:space:]]*libnccl\.so\.2 / {print $NF}' |
      while read -r line; do dirname "$line"; done
  fi
  if [[ -n "$PYTHON" ]]; then
    "$PYTHON" - <<'EOF' 2>/dev/null
import os
try:
    import nvidia.nccl as m
    base = m.__file__ and os.path.dirname(m.__file__)
    if not base:
        base = list(m.__path__)[0]
    print(os.path.join(base, "lib"))
except Exception:
    pass
EOF
    local user_site
    user_site=$("$PYTHON" -m site --user-site 2>/dev/null || true)
    [[ -n "$user_site" ]] && echo "$user_site/nvidia/nccl/lib"
    "$PYTHON" -c 'import site
for p in site.getsitepackages(): print(p + "/nvidia/nccl/lib")' 2>/dev/null
  fi
  local dir
  for dir in /usr/local/lib/python3*/site-packages /usr/local/lib/python3*/dist-packages \
    /usr/lib/python3*/site-packages /usr/lib/python3*/dist-packages /usr/lib/python3/dist-packages; do
    [[ -d "$dir" ]] && echo "$dir/nvidia/nccl/lib"
  done
}

NCCL_DIR=""
while read -r dir; do
  [[ -n "$dir" && -e "$dir/libnccl.so.2" ]] || continue
  NCCL_DIR=$(cd "$dir" && pwd -P)
  break
done < <(nccl_candidates)

LD_LIBRARY_PATH="$BUNDLE/lib${NCCL_DIR:+:$NCCL_DIR}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
export DBUF_BIN_DIR="$BIN"
# A failing NCCL call then leaves its cause in the logs.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

# --- environment.txt ------------------------------------------------------------
{
  echo "== date"
  date
  date -u
  echo
  echo "== uname -a"
  uname -a
  [[ -r /etc/os-release ]] && sed -n 's/^PRETTY_NAME=//p' /etc/os-release
  echo "glibc: $(ldd --version 2>/dev/null | head -n 1)"
  echo
  echo "== bundle"
  echo "$BUNDLE"
  sed -n '/^Built from/,$p' "$BUNDLE/README.txt" 2>/dev/null
  echo
  echo "== NCCL"
  if [[ -n "$NCCL_DIR" ]]; then
    echo "libnccl.so.2: $NCCL_DIR/libnccl.so.2 -> $(readlink -f "$NCCL_DIR/libnccl.so.2")"
  else
    echo "libnccl.so.2: NOT FOUND (ldconfig, python3 nvidia.nccl, site-packages): NCCL tests will skip"
  fi
  if [[ -n "$PYTHON" ]]; then
    "$PYTHON" -c 'import importlib.metadata as m
for d in ("nvidia-nccl-cu13", "nvidia-nccl-cu12"):
    try: print("pip", d, m.version(d))
    except Exception: pass' 2>/dev/null
  fi
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  echo "NCCL_DEBUG=$NCCL_DEBUG"
  echo "DBUF_BIN_DIR=$DBUF_BIN_DIR"
  echo
  echo "== nvidia-smi"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi 2>&1
    echo
    echo "== nvidia-smi -q | head -50"
    nvidia-smi -q 2>&1 | head -n 50
  else
    echo "nvidia-smi: not found"
  fi
  echo
  echo "== nvcc --version"
  if command -v nvcc >/dev/null; then nvcc --version 2>&1; else echo "nvcc: not on PATH"; fi
  echo
  echo "== CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>}"
} >"$ENV_FILE" 2>&1

# --- running ---------------------------------------------------------------------
: >"$SUMMARY"
all_ok=1
total_passed=0 total_failed=0 total_skipped=0

# gtest_counts NAME: "passed failed skipped" from NAME.xml, else NAME.log.
gtest_counts() {
  local xml="$RESULTS_DIR/$1.xml" log="$RESULTS_DIR/$1.log" counts=""
  if [[ -s "$xml" && -n "$PYTHON" ]]; then
    counts=$("$PYTHON" - "$xml" <<'EOF' 2>/dev/null
import sys, xml.etree.ElementTree as ET
passed = failed = skipped = 0
for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    if case.find("failure") is not None or case.find("error") is not None:
        failed += 1
    elif case.find("skipped") is not None or case.get("result") == "skipped":
        skipped += 1
    elif case.get("status", "run") == "run" and case.get("result", "completed") == "completed":
        passed += 1
print(passed, failed, skipped)
EOF
    )
  fi
  if [[ -z "$counts" && -s "$log" ]]; then
    local p f s
    p=$(sed -n 's/^\[  PASSED  \] \([0-9][0-9]*\) tests\{0,1\}\..*/\1/p' "$log" | tail -n 1)
    f=$(sed -n 's/^\[  FAILED  \] \([0-9][0-9]*\) tests\{0,1\}, listed below.*/\1/p' "$log" | tail -n 1)
    s=$(sed -n 's/^\[  SKIPPED \] \([0-9][0-9]*\) tests\{0,1\}, listed below.*/\1/p' "$log" | tail -n 1)
    [[ -n "$p$f$s" ]] && counts="${p:-0} ${f:-0} ${s:-0}"
  fi
  echo "${counts:-? ? ?}"
}

# run_one KIND EXE TIMEOUT ARGS...: one executable, one summary line. Its
# results go by the name RUN_AS (default EXE): RUN_AS.log, RUN_AS.json for a
# benchmark (ARGS say where it writes it), RUN_AS.xml for a test.
run_one() {
  local kind=$1 exe="$BIN/$2" limit=$3
  shift 3
  local name=${RUN_AS:-$(basename "$exe")}
  local log="$RESULTS_DIR/$name.log" rc status detail start secs
  local left
  left=$(budget_left)
  if ((left < 15)); then
    echo "run: $kind $name NOT RUN: GPU_RUN_BUDGET=${RUN_BUDGET}s spent" | tee "$log"
    printf '%-32s rc=%-4s %-7s %5ss  %s\n' "$name" - "NOT RUN" 0 "GPU_RUN_BUDGET spent" >>"$SUMMARY"
    all_ok=0
    return
  fi
  ((limit > left)) && limit=$left
  echo "run: $kind $name (timeout ${limit}s)"
  if [[ ! -x "$exe" ]]; then
    echo "run: $exe is missing or not executable" >"$log"
    rc=127
  else
    start=$(date +%s)
    (cd "$BUNDLE" && exec timeout --kill-after="$KILL_AFTER" "$limit" "$exe" "$@") >"$log" 2>&1
    rc=$?
    secs=$(($(date +%s) - start))
  fi
  case $rc in
    0) status=PASS ;;
    124 | 137) status=TIMEOUT ;;
    *) status=FAIL ;;
  esac
  ((rc == 0)) || all_ok=0
  if [[ $kind == test ]]; then
    local p f s
    read -r p f s <<<"$(gtest_counts "$name")"
    detail="gtest passed=$p failed=$f skipped=$s"
    [[ $p =~ ^[0-9]+$ ]] && total_passed=$((total_passed + p))
    [[ $f =~ ^[0-9]+$ ]] && total_failed=$((total_failed + f))
    [[ $s =~ ^[0-9]+$ ]] && total_skipped=$((total_skipped + s))
  else
    if [[ -s "$RESULTS_DIR/$name.json" ]]; then
      detail="bench json=$name.json"
    else
      detail="bench no json: $(grep -m 1 -i 'skipped' "$log" || tail -n 1 "$log")"
    fi
  fi
  printf '%-32s rc=%-4s %-7s %5ss  %s\n' "$name" "$rc" "$status" "${secs:-0}" "$detail" >>"$SUMMARY"
}

tests=()
if [[ -f "$BIN/gpu_tests.txt" ]]; then
  while read -r name; do
    [[ -n "$name" && "$name" != \#* ]] && tests+=("$name")
  done <"$BIN/gpu_tests.txt"
else
  echo "run: $BIN/gpu_tests.txt is missing" | tee -a "$SUMMARY" >&2
  all_ok=0
fi
run_test() {
  rm -f "$RESULTS_DIR/$1.xml"
  run_one test "$1" "$TEST_TIMEOUT" "--gtest_output=xml:$RESULTS_DIR/$1.xml"
}
is_last_test() {
  local last
  for last in "${LAST_TESTS[@]}"; do [[ $1 == "$last" ]] && return 0; done
  return 1
}
for name in "${tests[@]}"; do
  is_last_test "$name" || run_test "$name"
done

for exe in "$BIN"/bench_gpu_*; do
  [[ -f "$exe" && -x "$exe" ]] || continue
  name=$(basename "$exe")
  rm -f "$RESULTS_DIR/$name.json"
  run_one bench "$name" "$BENCH_TIMEOUT" --json "$RESULTS_DIR/$name.json"
done

# The overlap benchmark again under MPS, when its control daemon can be
# started here (private pipe / log directories, stopped afterwards): whether
# MPS lets the daemon's work overlap a trainer's compute decides deployments.
if ! [[ -x "$BIN/bench_gpu_overlap" ]] || ! command -v nvidia-cuda-mps-control >/dev/null; then
  echo "bench_gpu_overlap under MPS: not run (no bench_gpu_overlap or no nvidia-cuda-mps-control)" >>"$SUMMARY"
elif (($(budget_left) < 30)); then
  echo "bench_gpu_overlap under MPS: NOT RUN (GPU_RUN_BUDGET spent)" >>"$SUMMARY"
  all_ok=0
else
  export CUDA_MPS_PIPE_DIRECTORY="$RESULTS_DIR/mps/pipe" CUDA_MPS_LOG_DIRECTORY="$RESULTS_DIR/mps/log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d >"$RESULTS_DIR/mps/start.log" 2>&1; then
    sleep 1
    rm -f "$RESULTS_DIR/bench_gpu_overlap_mps.json"
    RUN_AS=bench_gpu_overlap_mps run_one bench bench_gpu_overlap "$BENCH_TIMEOUT" --label mps \
      --json "$RESULTS_DIR/bench_gpu_overlap_mps.json"
    echo quit | nvidia-cuda-mps-control >>"$RESULTS_DIR/mps/start.log" 2>&1
  else
    echo "bench_gpu_overlap under MPS: nvidia-cuda-mps-control -d failed (mps/start.log)" >>"$SUMMARY"
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
fi

# The Python package's GPU tests (DLPack CUDA views, stream ordering, a short
# dbuf.torch training), with the GPU machine's python3 when it has torch,
# numpy and pytest (the bundle carries dbuf only: built for the build's Python).
if [[ -d "$BUNDLE/python/dbuf" ]]; then
  python_log="$RESULTS_DIR/python_gpu.log"
  if ! PYTHONPATH="$BUNDLE/python" python3 -c 'import torch, numpy, pytest, dbuf' >"$python_log" 2>&1; then
    printf '%-32s rc=%-4s %-7s %5ss  %s\n' python_gpu - "NOT RUN" 0 \
      "python3 lacks torch / numpy / pytest or cannot load dbuf (python_gpu.log)" >>"$SUMMARY"
  elif (($(budget_left) < 60)); then
    printf '%-32s rc=%-4s %-7s %5ss  %s\n' python_gpu - "NOT RUN" 0 "GPU_RUN_BUDGET spent" >>"$SUMMARY"
  else
    python_limit=$TEST_TIMEOUT
    (($(budget_left) < python_limit)) && python_limit=$(budget_left)
    start=$(date +%s)
    (cd "$BUNDLE/python/tests" && PYTHONPATH="$BUNDLE/python" DBUF_DAEMON="$BIN/dbufd" exec timeout \
      --kill-after="$KILL_AFTER" "$python_limit" python3 -m pytest -q -p no:cacheprovider test_gpu.py) \
      >"$python_log" 2>&1
    rc=$?
    case $rc in
      0) status=PASS ;;
      5) status=SKIP ;; # pytest: every test skipped (no GPU torch sees, or dbuf built without CUDA)
      *) status=FAIL all_ok=0 ;;
    esac
    printf '%-32s rc=%-4s %-7s %5ss  %s\n' python_gpu "$rc" "$status" "$(($(date +%s) - start))" \
      "$(tail -n 1 "$python_log")" >>"$SUMMARY"
  fi
fi

for name in "${tests[@]}"; do
  is_last_test "$name" && run_test "$name"
done

{
  echo "--"
  echo "gtest cases: passed=$total_passed failed=$total_failed skipped=$total_skipped"
  # Skips are right on a machine without a GPU. Where nvidia-smi sees one, a
  # "no usable CUDA device" skip means the binaries could not use it (driver
  # too old for the CUDA 13 runtime, visibility): that is a failure.
  if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    if grep -lq -e 'no usable CUDA device' -e 'skipped: no usable CUDA device' "$RESULTS_DIR"/*.log 2>/dev/null; then
      echo "FAIL: nvidia-smi lists a GPU but tests or benchmarks found no usable CUDA device:"
      grep -l -e 'no usable CUDA device' "$RESULTS_DIR"/*.log | sed 's/^/  /'
      all_ok=0
    elif ((total_skipped > 0)); then
      echo "note: $total_skipped GPU test cases skipped for other reasons (e.g. no NCCL, one GPU): read their logs"
    fi
  fi
  if ((all_ok)); then echo "result: PASS"; else echo "result: FAIL"; fi
} >>"$SUMMARY"

echo
echo "== $SUMMARY"
cat "$SUMMARY"
((all_ok)) && exit 0
exit 1
