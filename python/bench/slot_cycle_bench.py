"""A unit's slot cycle as dbuf.torch runs it, with and without slots kept mapped across reshard.

    python bench/slot_cycle_bench.py [--world 4] [--groups 5] [--elems 600000] [--cycles 40] [--rounds 3]

``--world`` rank processes, one dbufd; each registers ``--groups`` fp32 groups
(one tensor of ``--elems`` elements: a transformer layer's parameters) and
cycles through them as a forward does: acquire a slot, all-gather, read every
parameter and zero every gradient (what the layer's compute and
prepare_gradients touch), reshard. With a pool of ``prefetch_depth + 1 = 2``
slots, as many as dbuf.torch keeps for the current unit and one prefetched.

Two ways, side by side, their order turned each round (these machines are
noisy): ``unkept`` (a slot is mapped afresh at each acquire, zero pages in its
place at reshard) and ``kept`` (``attach(keep_slot_mappings=True)``, what
dbuf.torch does: a group that gets its slot back maps nothing). Prints each
phase's median over ranks and cycles, in ms per group, per round; then the
median and the worst (largest) over rounds of kept / unkept for the whole
cycle. ``touch again`` is the same read and zeroing repeated at once: what
touching costs once the pages are mapped. Needs $DBUF_DAEMON.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

import dbuf
from dbuf.testing import Daemon

PHASES = ("acquire", "all-gather", "touch", "touch again", "reshard")


def rank_main(socket: str, job: str, rank: int, args: argparse.Namespace, keep: bool, results) -> None:
    torch.set_num_threads(1)
    client = dbuf.Client(socket, timeout=60.0)
    client.attach(job, rank, args.world, prefetch_depth=1, keep_slot_mappings=keep)
    rows = max(1, args.elems // 600)
    groups = [client.register_group(f"layer{g}", [dbuf.TensorSpec("w", (rows, 600))], unsharded_dtype="fp32")
              for g in range(args.groups)]
    seconds = {phase: [] for phase in PHASES}

    def touch(group) -> None:
        float(group.unsharded_view("w").torch().sum())
        group.unsharded_grad_view("w").torch().zero_()

    for cycle in range(args.cycles):
        for group in groups:
            marks = [time.perf_counter()]
            group.acquire_slot()
            marks.append(time.perf_counter())
            group.all_gather()
            marks.append(time.perf_counter())
            touch(group)
            marks.append(time.perf_counter())
            touch(group)
            marks.append(time.perf_counter())
            group.reshard()
            marks.append(time.perf_counter())
            if cycle >= 3:  # warm-up: the pool's first use, first mappings
                for phase, start, end in zip(PHASES, marks, marks[1:]):
                    seconds[phase].append(end - start)
    results.put({phase: values for phase, values in seconds.items()})
    client.detach()


def one_run(daemon: Daemon, args: argparse.Namespace, keep: bool, tag: str) -> dict[str, float]:
    """Each phase's median over every rank's cycles, seconds."""
    context = mp.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=rank_main, args=(daemon.socket, f"slots-{tag}", r, args, keep, results))
             for r in range(args.world)]
    for process in ranks:
        process.start()
    gathered = [results.get(timeout=600) for _ in ranks]
    for process in ranks:
        process.join(60)
        if process.exitcode != 0:
            raise SystemExit(f"a rank failed (exit {process.exitcode})")
    return {phase: statistics.median(v for rank in gathered for v in rank[phase]) for phase in PHASES}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--groups", type=int, default=5)
    p.add_argument("--elems", type=int, default=600_000, help="fp32 elements per group")
    p.add_argument("--cycles", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.cycles <= 3:
        p.error("--cycles must be more than 3 (the first three are not timed)")
    ratios = []
    print(f"{'round':5s} {'way':7s} | " + " | ".join(f"{phase:>11s}" for phase in PHASES) + " | cycle (ms per group)")
    with Daemon() as daemon:
        for round_ in range(args.rounds):
            ways = [False, True] if round_ % 2 == 0 else [True, False]
            cycle = {}
            for keep in ways:
                medians = one_run(daemon, args, keep, f"{round_}-{keep}")
                cycle[keep] = sum(medians.values())
                print(f"{round_:5d} {'kept' if keep else 'unkept':7s} | "
                      + " | ".join(f"{medians[phase] * 1e3:11.3f}" for phase in PHASES)
                      + f" | {cycle[keep] * 1e3:.3f}", flush=True)
            ratios.append(cycle[True] / cycle[False])
    print(f"kept / unkept, whole cycle: median {statistics.median(ratios):.3f}, worst {max(ratios):.3f}")


if __name__ == "__main__":
    main()
