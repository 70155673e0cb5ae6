#!/usr/bin/env bash
# make bench: every benchmark, side by side in one run. Results that matter are
# recorded in docs/ with this command.
set -euo pipefail
build_dir=${1:-build}
echo "== planner: quality vs lower bound and the paper's three fixed orders; speed (one core) =="
taskset -c 0 "$build_dir/bin/bench_planner" models
echo "== planner: 200 generated models x V in {8, 64, 256, 1024} x 3 rules, gap to the proven bound and plan time (one core; docs/planner.md adds the proofs) =="
taskset -c 0 "$build_dir/bin/bench_planner_families" --worst 3
echo "== kernels: fused multi-tensor CPU ops over 1000 tensors, bandwidth vs memcpy (1 thread and the default) =="
"$build_dir/bin/bench_kernels" models/llama3-8b.json
echo "== control: round-trip latency between two processes (bare shared memory, Unix socket, Boost message_queue, dbuf rings busy / sleeping) =="
"$build_dir/bin/bench_control" --iterations 200000
echo "== collectives: allGather / reduceScatter through dbufd, 4 and 8 rank processes, vs memcpy of the same bytes; unsharded memory of a 32-layer model (moderate sizes; docs/collectives.md has the full run) =="
"$build_dir/bin/bench_collectives" --quick
python=${2:-.venv/bin/python}
if [[ -x "$python" ]]; then
  echo "== python: no-op round trip from Python vs from C++ (goal: under 2 us more) =="
  DBUF_DAEMON="$build_dir/bin/dbufd" "$python" python/bench/bench_overhead.py
  echo "== python: the example GPT, 4 ranks: dbuf.torch vs PyTorch FSDP2 (gloo) step time, bytes, memory; both vs one process =="
  daemon=$(realpath "$build_dir/bin/dbufd")
  python=$(realpath -s "$python")
  (cd python/examples && DBUF_DAEMON="$daemon" "$python" compare.py --steps 30 --backends fsdp2 dbuf)
  echo "== python: torch's AdamW on RaggedShard DTensors vs plain tensors vs FSDP2's Shard(0) DTensors =="
  "$python" python/bench/optimizer_step_bench.py
  echo "== python: a transformers Llama, 4 ranks: dbuf.torch vs FSDP2 step time, DCP save and load time =="
  DBUF_DAEMON="$daemon" "$python" python/bench/checkpoint_bench.py
  echo "== python: a unit's slot cycle (acquire, all-gather, touch, reshard), 4 ranks: slots kept mapped across reshard vs mapped afresh =="
  DBUF_DAEMON="$daemon" "$python" python/bench/slot_cycle_bench.py
  echo "== python: the step against its floor (transformers Llama, Qwen3-MoE, GPT-OSS, 4 ranks; AdamW single-tensor, foreach, fused; fp32 and bf16): dbuf / replicas that communicate nothing, dbuf / FSDP2, and dbuf without its fast path =="
  DBUF_DAEMON="$daemon" "$python" python/bench/step_floor_bench.py --compare-fast-path
  echo "== python: a trainer written for FSDP2 (transformers Llama, 4 ranks), AC and compile: dbuf vs FSDP2 step time, peak memory =="
  DBUF_DAEMON="$daemon" "$python" python/bench/trainer_bench.py
  echo "== python: FSDP with TP / EP (4 ranks, dp2 x tp2 and ep2 x dp2): dbuf vs FSDP2 all-gather bytes, peak unsharded parameters =="
  DBUF_DAEMON="$daemon" "$python" python/bench/parallel_bench.py
  echo "== planner: FSDP composed with TP 8 and EP 8-64 on the bundled models: all-gather inflation vs FSDP2's and Megatron-FSDP's formulas =="
  "$python" python/bench/parallel_plan_bench.py --dbuf-plan "$build_dir/bin/dbuf-plan"
  if [[ $EUID -eq 0 ]]; then echo "== python: a job across 2 nodes (network namespaces, 1 Gbit/s links): dbuf vs gloo all-gather / reduce-scatter, time and bytes on the wire =="; DBUF_DAEMON="$daemon" "$python" python/bench/multinode_bench.py --quick; fi
fi
