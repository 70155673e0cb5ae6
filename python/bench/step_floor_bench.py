"""The training step against its floor: dbuf.torch and FSDP2 against replicas that communicate nothing.

  python bench/step_floor_bench.py [--rounds 2] [--world 4] [--models llama,qwen3moe,gpt-oss]
                                   [--optims single,foreach,fused] [--mps fp32,bf16] [--steps 12] [--quick]

Runs tests/ranks/trainer_hf.py (transformers models with tiny configs, AdamW,
``--world`` rank processes) three ways in each configuration, one after the
other within a round (their order turns each round, these machines are noisy):

* ``floor``: each process trains a replica of its own on its share of the
  batch, with nothing sharded or communicated (``--backend replica``): what a
  step costs without data parallelism's work;
* ``FSDP2``: torch's fully_shard over gloo;
* ``dbuf``: the same script under dbuf's switch (``DBUF_FSDP=1``) on a real dbufd;
* with ``--compare-fast-path`` also ``dbuf-slow``: dbuf with its torch-function
  fast path off (``DBUF_TORCH_FAST_PATH=0``: every operator on its DTensors
  through torch's dispatcher, as before that path), side by side.

A run's step time is its slowest rank's median over the steps after the first
two (warm-up). Prints each run, then per configuration the median and the
worst (largest) over the rounds of dbuf / floor, dbuf / FSDP2 and
FSDP2 / floor, where each backend's step goes (forward and backward,
gradient clipping, the optimizer's step and zero_grad), and where the
machine's time goes in a step: the ranks' time on a CPU, runnable but waiting
for one, and blocked (Linux's schedstat of each rank's thread), dbufd's CPU
time, and the CPU time left over (CPUs x step - the ranks' CPU time -
dbufd's: idle, or another process's). ``--quick``: single-tensor AdamW in fp32 only (the
configuration of issue 41's acceptance). Needs $DBUF_DAEMON.
"""

from __future__ import annotations

import argparse
import os
import itertools
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

BACKENDS = {"floor": "replica", "FSDP2": "fsdp2", "dbuf": "dbuf"}
SLOW = "dbuf-slow"  # dbuf without its fast path (--compare-fast-path)
# Tiny configs (trainer_hf.py's): a vocabulary (101) and MLP width (70) that 4 ranks do not divide evenly.
SIZE = ["--hidden", "256", "--layers", "4", "--seq", "256", "--global-batch", "8"]


def one_run(daemon, tmp: Path, world: int, backend: str, flags: list[str], steps: int,
            tag: str) -> tuple[float, dict[str, float], dict[str, float]]:
    """The step's seconds (the slowest rank's median), each phase's (the slowest rank's median of it) and
    where the machine's time went in a step (machine_time)."""
    out = tmp / f"{backend}-{tag}"
    env = {"DBUF_FSDP": "1" if backend in ("dbuf", SLOW) else "0",
           "DBUF_TORCH_FAST_PATH": "0" if backend == SLOW else "1",
           "DBUF_BENCH_DAEMON_PID": str(daemon.process.pid)}
    script_backend = "dbuf" if backend == SLOW else backend
    run_ranks("trainer_hf.py", world, daemon.socket, str(out), "--backend", script_backend, *SIZE,
              "--steps", str(steps), *flags, job=f"floor-{backend}-{tag}", env=env, timeout=1800)
    results = [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]
    step = max(statistics.median(result["step_s"][2:]) for result in results)
    phases = {phase: max(statistics.median(result["phase_s"][phase][2:]) for result in results)
              for phase in results[0]["phase_s"]}
    return step, phases, machine_time(results, step)


def machine_time(results: list[dict], step: float) -> dict[str, float]:
    """Seconds per step (after the first two): the ranks' on a CPU, runnable but waiting for one, and blocked
    (each rank's median, summed over the ranks), dbufd's CPU time (over the timed steps, read by rank 0),
    and the CPU time they leave over in a step of `step` seconds (idle, or another process's)."""
    def summed(per_step) -> float:
        return sum(statistics.median(per_step(result)[2:]) for result in results)

    on_cpu = summed(lambda r: r["sched_s"]["on cpu"])
    waiting = summed(lambda r: r["sched_s"]["waiting for a cpu"])
    blocked = summed(lambda r: [s - c - w for s, c, w in zip(r["step_s"], r["sched_s"]["on cpu"],
                                                                r["sched_s"]["waiting for a cpu"])])
    daemon_cpu = results[0]["daemon_cpu_s"]
    daemon = (daemon_cpu[-1] - daemon_cpu[2]) / (len(daemon_cpu) - 3)
    cpus = len(os.sched_getaffinity(0))
    return {"ranks on a CPU": on_cpu, "ranks waiting for one": waiting, "ranks blocked": blocked,
            "dbufd": daemon, "left over": cpus * step - on_cpu - daemon}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--models", default="llama,qwen3moe,gpt-oss")
    p.add_argument("--optims", default="single,foreach,fused")
    p.add_argument("--mps", default="fp32,bf16")
    p.add_argument("--steps", type=int, default=12, help="training steps (the first two not timed)")
    p.add_argument("--quick", action="store_true", help="single-tensor AdamW in fp32 only")
    p.add_argument("--compare-fast-path", action="store_true", help="also dbuf without its fast path")
    args = p.parse_args()
    if args.steps < 3:
        p.error("--steps must be at least 3")
    optims, mps = (["single"], ["fp32"]) if args.quick else (args.optims.split(","), args.mps.split(","))
    configurations = list(itertools.product(args.models.split(","), optims, mps))
    backends = {**BACKENDS, **({SLOW: SLOW} if args.compare_fast_path else {})}
    times: dict[tuple[tuple[str, str, str], str], list[float]] = {}
    phases: dict[tuple[tuple[str, str, str], str], list[dict[str, float]]] = {}
    machine: dict[tuple[tuple[str, str, str], str], list[dict[str, float]]] = {}
    with Daemon(timeouts={"collective_ms": 300000, "register_ms": 300000}) as daemon, \
            tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for config in configurations:
                model, optim, mp = config
                flags = ["--model", model, "--optim", optim, "--mp", mp]
                order = list(backends)
                order = order[round_ % len(order):] + order[: round_ % len(order)]
                for name in order:
                    tag = f"{round_}-{model}-{optim}-{mp}"
                    seconds, parts, spent = one_run(daemon, Path(tmp), args.world, backends[name], flags,
                                                    args.steps, tag)
                    times.setdefault((config, name), []).append(seconds)
                    phases.setdefault((config, name), []).append(parts)
                    machine.setdefault((config, name), []).append(spent)
                    print(f"round {round_} {model:8s} {optim:7s} {mp:4s} {name:5s}: step {seconds * 1e3:7.1f} ms ("
                          + ", ".join(f"{phase} {value * 1e3:.1f}" for phase, value in parts.items()) + ")",
                          flush=True)
    print()
    ratios_shown = [("dbuf", "floor"), ("dbuf", "FSDP2"), ("FSDP2", "floor")]
    if args.compare_fast_path:
        ratios_shown.append(("dbuf", SLOW))
    print(f"{'model':8s} {'AdamW':7s} {'mp':4s} | " + " | ".join(f"{a + '/' + b:>17s}" for a, b in ratios_shown))
    print(f"{'':22s} | " + " | ".join(f"{'median   worst':>17s}" for _ in ratios_shown))
    for config in configurations:
        cells = []
        for numerator, denominator in ratios_shown:
            ratios = [a / b for a, b in zip(times[(config, numerator)], times[(config, denominator)])]
            cells.append(f"{statistics.median(ratios):7.3f} {max(ratios):7.3f}")
        print(f"{config[0]:8s} {config[1]:7s} {config[2]:4s} | " + " | ".join(f"{c:>17s}" for c in cells))
    print()
    print_medians("Where the step goes: each phase's median over the rounds, ms (the slowest rank's median per run)",
                  phases, configurations, backends)
    print()
    print_medians(f"Where the machine's time goes in a step: medians over the rounds, ms, summed over the ranks "
                  f"({len(os.sched_getaffinity(0))} CPUs; left over = CPUs x step - the ranks' CPU time - dbufd's: "
                  f"idle, or another process's)",
                  machine, configurations, backends)


def print_medians(title: str, runs: dict, configurations: list, backends: dict) -> None:
    """One row per configuration and backend: each column's median over the rounds, in ms."""
    print(title)
    names = list(runs[(configurations[0], "floor")][0])
    print(f"{'model':8s} {'AdamW':7s} {'mp':4s} {'':9s} | " + " | ".join(f"{n:>21s}" for n in names))
    for config in configurations:
        for backend in backends:
            medians = [statistics.median(run[n] for run in runs[(config, backend)]) * 1e3 for n in names]
            print(f"{config[0]:8s} {config[1]:7s} {config[2]:4s} {backend:9s} | "
                  + " | ".join(f"{m:21.1f}" for m in medians))


if __name__ == "__main__":
    main()
