"""FSDP with tensor and expert parallelism: all-gather bytes and peak unsharded parameters, dbuf / FSDP2.

  python bench/parallel_bench.py [--world 4] [--hidden 256] [--intermediate 688] [--layers 4] [--seq 32]

Runs tests/ranks/trainer_parallel.py (4 rank processes; dbuf on a real dbufd
under DBUF_FSDP=1, FSDP2 over gloo; TP's and EP's own collectives over gloo in
both) in three layouts: a transformers Llama at dp 2 x tp 2 (the Megatron
plan), the same with sequence parallel norms in bf16, and a Qwen3-MoE at
ep 2 x dp 2 (experts Shard(0) over ep, the rest HSDP). Per layout, per step
(every step is the same; the figure is the largest rank's):

* all-gather bytes: FSDP2's all-gathers into one tensor (its padded
  parameter groups) against dbuf's (V*S of each unit's planned buffer);
* peak unsharded parameters: the most bytes of gathered parameters a rank
  held at once (FSDP2's groups from unshard to reshard, dbuf's slots). dbuf
  runs with its default prefetch depth (2: up to two units gathered ahead
  of the one computing, in each of a process's dbuf jobs: the MoE's experts
  are a job of their own) and with 1 (one ahead, FSDP2's backward
  prefetch). FSDP2 on CPU gathers a unit ahead in backward only (forward's
  prefetch is implicit in its CUDA streams), so the figure depends on the
  prefetch policy as much as on the layout; all-gather bytes do not.

Both figures are counts, not timings: one run per layout. Checks that the
losses agree (they are bit for bit equal at these degrees, see
test_parallel.py). Needs $DBUF_DAEMON.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))
from conftest import run_ranks  # noqa: E402

# The ranks as a user's launcher starts them: new interpreters, not forked from the tests' launchers.
os.environ.setdefault("DBUF_TEST_FRESH_RANKS", "1")

from dbuf.testing import Daemon  # noqa: E402

LAYOUTS = {
    "dp2 x tp2, Llama": ["--model", "llama", "--tp", "2"],
    "dp2 x tp2 + SP, Llama, bf16": ["--model", "llama", "--tp", "2", "--sp", "--mp", "bf16"],
    "ep2 x dp2, Qwen3-MoE": ["--model", "qwen3moe", "--ep", "2"],  # torchtitan's layout: two dbuf jobs
}
DEFAULT_DEPTH = 2  # dbuf.torch's default prefetch_depth


def one_run(daemon, tmp: Path, backend: str, world: int, flags: list[str], tag: str, depth: int) -> dict:
    out = tmp / f"{backend}-{tag}"
    env = {"DBUF_FSDP": "1" if backend == "dbuf" else "0", "DBUF_PREFETCH_DEPTH": str(depth)}  # (dbuf's only)
    run_ranks("trainer_parallel.py", world, daemon.socket, str(out), "--backend", backend, *flags,
              job=f"bench-{backend}-{tag}", env=env, timeout=1800)
    results = [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]
    return {
        "losses": results[0]["losses"],
        "all_gather_bytes": max(max(r["all_gather_bytes"]) for r in results),
        "peak_unsharded_bytes": max(max(r["peak_unsharded_bytes"]) for r in results),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    model = ["--hidden", str(args.hidden), "--intermediate", str(args.intermediate), "--layers", str(args.layers),
             "--seq", str(args.seq), "--steps", str(args.steps)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp_dir, Daemon(timeouts={"collective_ms": 60000,
                                                                    "register_ms": 60000}) as daemon:
        for index, (name, flags) in enumerate(LAYOUTS.items()):
            fsdp2 = one_run(daemon, Path(tmp_dir), "fsdp2", args.world, model + flags, f"{index}", DEFAULT_DEPTH)
            for depth in (DEFAULT_DEPTH, 1):
                dbuf = one_run(daemon, Path(tmp_dir), "dbuf", args.world, model + flags, f"{index}-{depth}", depth)
                if dbuf["losses"][0] != fsdp2["losses"][0]:
                    sys.exit(f"{name}: the first losses differ: dbuf {dbuf['losses']}, FSDP2 {fsdp2['losses']}")
                rows.append((name, depth, fsdp2, dbuf))
                print(f"{name}: FSDP2 {fsdp2}, dbuf (prefetch depth {depth}) {dbuf}", flush=True)
    print(f"\n{args.world} ranks; hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers. "
          f"dbuf / FSDP2 per step (largest rank):")
    print(f"{'layout':<30} {'depth':>5} {'all-gather KiB':>22} {'ratio':>6} {'peak unsharded KiB':>20} {'ratio':>6}")
    for name, depth, fsdp2, dbuf in rows:
        gather = f"{dbuf['all_gather_bytes'] / 1024:.1f} / {fsdp2['all_gather_bytes'] / 1024:.1f}"
        peak = f"{dbuf['peak_unsharded_bytes'] / 1024:.1f} / {fsdp2['peak_unsharded_bytes'] / 1024:.1f}"
        print(f"{name:<30} {depth:>5} {gather:>22} {dbuf['all_gather_bytes'] / fsdp2['all_gather_bytes']:>6.3f} "
              f"{peak:>20} {dbuf['peak_unsharded_bytes'] / fsdp2['peak_unsharded_bytes']:>6.3f}")


if __name__ == "__main__":
    main()
