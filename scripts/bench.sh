#!/usr/bin/env bash
# make bench: every benchmark, side by side in one run. Results that matter are
# recorded in docs/ with this command.
set -euo pipefail
build_dir=${1:-build}
echo "== planner: quality vs lower bound and the paper's three fixed orders; speed (one core) =="
taskset -c 0 "$build_dir/bin/bench_planner" models
echo "== kernels: fused multi-tensor CPU ops over 1000 tensors, bandwidth vs memcpy (1 thread and the default) =="
"$build_dir/bin/bench_kernels" models/llama3-8b.json
