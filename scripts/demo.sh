#!/usr/bin/env bash
# make demo: plan a bundled model at a few device counts with dbuf-plan and
# print ours against FSDP2 / FSDP1 / ZeRO-3 / Megatron-FSDP side by side.
set -euo pipefail
build_dir=${1:-build}
model=${2:-models/gpt-oss-120b.json}
rule=${DEMO_RULE:-rows:32}
for devices in 8 256 1024; do
  echo "== $(basename "$model" .json), $devices ranks, granularity $rule =="
  "$build_dir/bin/dbuf-plan" --model "$model" --devices "$devices" --granularity "$rule" --format table --summary
  echo
done
