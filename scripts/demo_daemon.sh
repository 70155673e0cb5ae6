#!/usr/bin/env bash
# The daemon part of `make demo`: start dbufd on a temp socket with
# config/dbufd.toml (host backend), run a job of 4 rank processes that attach,
# register decoder layers of a bundled model (every dimension divided by
# DEMO_SHRINK to fit a small machine) and run DEMO_STEPS training-like steps
# through the daemon's collectives, then stop the daemon with SIGTERM.
set -euo pipefail
build_dir=${1:-build}
model=${2:-models/llama3-8b.json}
ranks=${DEMO_RANKS:-4}
layers=${DEMO_LAYERS:-4}
steps=${DEMO_STEPS:-3}
shrink=${DEMO_SHRINK:-4}

source "$(dirname "$0")/temp_dbufd.sh"
start_temp_dbufd "$build_dir" info

echo "== dbufd on $socket: job 'demo', $ranks ranks, first $layers decoder layers of $(basename "$model" .json)" \
  "(dims / $shrink), rows:32, $steps training steps =="

pids=()
for ((rank = 0; rank < ranks; ++rank)); do
  "$build_dir/bin/dbuf-demo-rank" --socket "$socket" --job demo --rank "$rank" --world-size "$ranks" \
    --model "$model" --layers "$layers" --granularity rows:32 --steps "$steps" --shrink "$shrink" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done

stop_temp_dbufd || status=1
echo "-- dbufd log --"
cat "$workdir/dbufd.log"
exit $status
