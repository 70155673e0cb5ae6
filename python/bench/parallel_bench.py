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
  runs with ``DBUF_PREFETCH_DEPTH=1``, FSDP2's one unit of prefetch (its
  default of 2 holds one unit more, for overlap); the MoE with 2, as its
  experts are a unit nested in their layer's (root, layer and experts
  gathered at once take three slots).

Both figures are counts, not timings: one run per layout. Checks that the
losses agree (they are bit for bit equal at these degrees, see
test_parallel.py). Needs $DBUF_DAEMON.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))
from conftest import run_ranks  # noqa: E402

from dbuf.testing import Daemon  # noqa: E402

# (flags, dbuf's prefetch depth): FSDP2's one unit ahead; the MoE's experts are a unit inside their
# layer's, so the root, a layer and its experts are held at once: three slots, no room to prefetch.
LAYOUTS = {
    "dp2 x tp2, Llama": (["--model", "llama", "--tp", "2"], 1),
    "dp2 x tp2 + SP, Llama, bf16": (["--model", "llama", "--tp", "2", "--sp", "--mp", "bf16"], 1),
    "ep2 x dp2, Qwen3-MoE": (["--model", "qwen3moe", "--ep", "2"], 2),
}


def one_run(daemon, tmp: Path, backend: str, world: int, flags: list[str], tag: str, depth: int) -> dict:
    out = tmp / f"{backend}-{tag}"
    env = {"DBUF_FSDP": "1" if backend == "dbuf" else "0", "DBUF_PREFETCH_DEPTH": str(depth)}
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
        for index, (name, (flags, depth)) in enumerate(LAYOUTS.items()):
            runs = {backend: one_run(daemon, Path(tmp_dir), backend, args.world, model + flags, f"{index}", depth)
                    for backend in ("fsdp2", "dbuf")}
            if runs["dbuf"]["losses"][0] != runs["fsdp2"]["losses"][0]:
                sys.exit(f"{name}: the first losses differ: dbuf {runs['dbuf']['losses']}, FSDP2 "
                         f"{runs['fsdp2']['losses']}")
            rows.append((name, runs["fsdp2"], runs["dbuf"]))
            print(f"{name}: FSDP2 {runs['fsdp2']}, dbuf {runs['dbuf']}", flush=True)
    print(f"\n{args.world} ranks; hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers. "
          f"dbuf / FSDP2 per step (largest rank):")
    print(f"{'layout':<30} {'all-gather KiB':>22} {'ratio':>6} {'peak unsharded KiB':>22} {'ratio':>6}")
    for name, fsdp2, dbuf in rows:
        gather = f"{dbuf['all_gather_bytes'] / 1024:.1f} / {fsdp2['all_gather_bytes'] / 1024:.1f}"
        peak = f"{dbuf['peak_unsharded_bytes'] / 1024:.1f} / {fsdp2['peak_unsharded_bytes'] / 1024:.1f}"
        print(f"{name:<30} {gather:>22} {dbuf['all_gather_bytes'] / fsdp2['all_gather_bytes']:>6.3f} "
              f"{peak:>22} {dbuf['peak_unsharded_bytes'] / fsdp2['peak_unsharded_bytes']:>6.3f}")


if __name__ == "__main__":
    main()
