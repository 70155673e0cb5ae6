#!/usr/bin/env bash
# The Python part of `make demo`: dbufd on a temp socket, then the example GPT
# (python/examples/train_gpt.py, plain torch.nn, real text from the `fortunes`
# package) trained by 4 torchrun rank processes through it with
# dbuf.torch.fully_shard: a few steps, each rank's loss and step time printed.
set -euo pipefail
build_dir=${1:-build}
python=${2:-.venv/bin/python}
steps=${DEMO_PY_STEPS:-6}
ranks=${DEMO_RANKS:-4}

source "$(dirname "$0")/temp_dbufd.sh"
start_temp_dbufd "$build_dir" warn

echo "== PyTorch through dbufd: the example GPT, $ranks torchrun ranks, dbuf.torch.fully_shard, $steps steps =="
DBUF_SOCKET="$socket" OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES= "$python" -m torch.distributed.run \
  --nproc-per-node "$ranks" --rdzv-backend c10d --rdzv-endpoint localhost:0 \
  python/examples/train_gpt.py --backend dbuf --steps "$steps" --warmup-steps 1 --out "$workdir/run" --print-steps
