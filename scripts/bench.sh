#!/usr/bin/env bash
# make bench: every benchmark, side by side in one run. Results that matter are
# recorded in docs/ with this command.
set -euo pipefail
build_dir=${1:-build}
echo "== planner: quality vs lower bound and the paper's three fixed orders; speed (one core) =="
taskset -c 0 "$build_dir/bin/bench_planner" models
echo "== kernels: fused multi-tensor CPU ops over 1000 tensors, bandwidth vs memcpy (1 thread and the default) =="
"$build_dir/bin/bench_kernels" models/llama3-8b.json
echo "== control: round-trip latency between two processes (bare shared memory, Unix socket, Boost message_queue, dbuf rings busy / sleeping) =="
"$build_dir/bin/bench_control" --iterations 200000
echo "== collectives: allGather / reduceScatter through dbufd, 4 and 8 rank processes, vs memcpy of the same bytes; unsharded memory of a 32-layer model (moderate sizes; docs/collectives.md has the full run) =="
"$build_dir/bin/bench_collectives" --quick
