"""Step time and peak memory of a trainer written for FSDP2, on dbuf (its switch) and on FSDP2, side by side.

  python bench/trainer_bench.py [--rounds 2] [--world 4] [--hidden 256] [--layers 4] [--seq 512] [--steps 5]

Runs tests/ranks/trainer_hf.py (a transformers Llama, AdamW, 4 rank
processes; dbuf on a real dbufd under DBUF_FSDP=1, FSDP2 over gloo) in four
configurations: activation checkpointing off, full AC (torchtitan's
checkpoint_wrapper), full AC with each block compiled (fullgraph), and 4
micro-batches per step accumulated without gradient sync
(``--only NAME`` runs one).
Backends alternate within a round. A run's step time is its slowest rank's
median over the steps after the first two (compilation and warm-up); its
peak memory the largest resident memory a rank added over what it held
before making the model (parameters, gradients, optimizer state,
activations, and for dbuf the shared memory of dbufd's slots and shards the
rank touched). Prints each run, then per configuration dbuf / FSDP2 of the
median and worst step times and of the peak memory. Needs $DBUF_DAEMON.
"""

from __future__ import annotations

import argparse
import os
import statistics
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

CONFIGURATIONS = {"no AC": ["--ac", "none"], "full AC": ["--ac", "full"],
                  "full AC + compile": ["--ac", "full", "--compile"],
                  "accumulate 4 without sync": ["--ac", "none", "--accum", "4"]}


def one_run(daemon, tmp: Path, backend: str, world: int, flags: list[str], tag: str) -> tuple[float, float]:
    out = tmp / f"{backend}-{tag}"
    env = {"DBUF_FSDP": "1" if backend == "dbuf" else "0"}
    run_ranks("trainer_hf.py", world, daemon.socket, str(out), "--backend", backend, *flags,
              job=f"bench-{backend}-{tag}", env=env, timeout=1800)
    results = [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]
    step = max(statistics.median(result["step_s"][2:]) for result in results)
    peak = max(result["peak_rss_bytes"] for result in results)
    return step, peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=5, help="training steps (the first two not timed)")
    p.add_argument("--only", choices=list(CONFIGURATIONS), default=None, help="one configuration")
    args = p.parse_args()
    configurations = {args.only: CONFIGURATIONS[args.only]} if args.only else CONFIGURATIONS
    if args.steps < 3:
        p.error("--steps must be at least 3")
    size = ["--model", "llama", "--hidden", str(args.hidden), "--layers", str(args.layers), "--seq", str(args.seq),
            "--global-batch", str(2 * args.world), "--steps", str(args.steps)]
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with Daemon(timeouts={"collective_ms": 300000, "register_ms": 300000}) as daemon, \
            tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name, flags in configurations.items():
                for backend in ("fsdp2", "dbuf") if round_ % 2 else ("dbuf", "fsdp2"):
                    tag = f"{round_}-{name.replace(' ', '_').replace('+', 'and')}"
                    step, peak = one_run(daemon, Path(tmp), backend, args.world, [*size, *flags], tag)
                    runs.setdefault((name, backend), []).append((step, peak))
                    print(f"round {round_} {name:18s} {backend:5s}: step {step:.3f} s, peak memory "
                          f"{peak / 2**20:.0f} MiB", flush=True)
    for name in configurations:
        dbuf, fsdp2 = runs[(name, "dbuf")], runs[(name, "fsdp2")]
        steps_d, steps_f = [s for s, _ in dbuf], [s for s, _ in fsdp2]
        peak_d, peak_f = max(m for _, m in dbuf), max(m for _, m in fsdp2)
        print(f"{name}: step dbuf {statistics.median(steps_d):.3f} s (worst {max(steps_d):.3f}), FSDP2 "
              f"{statistics.median(steps_f):.3f} s (worst {max(steps_f):.3f}); dbuf / FSDP2 median "
              f"{statistics.median(steps_d) / statistics.median(steps_f):.2f}, worst {max(steps_d) / max(steps_f):.2f}; "
              f"peak memory dbuf {peak_d / 2**20:.0f} MiB, FSDP2 {peak_f / 2**20:.0f} MiB, dbuf / FSDP2 "
              f"{peak_d / peak_f:.2f}")


if __name__ == "__main__":
    main()
