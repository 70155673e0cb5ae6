"""Step time and DCP save and load time, dbuf.torch against FSDP2, on the same transformers model, side by side.

  python bench/checkpoint_bench.py [--rounds 3] [--world 4] [--hidden 512] [--layers 4] [--steps 6]

Each round runs tests/ranks/checkpoint_hf.py once per backend (4 rank
processes; dbuf on a real dbufd, FSDP2 over gloo; a transformers Llama):
``--steps`` training steps, then ``get_state_dict`` + ``dcp.save`` of model
and AdamW state, then a fresh job of the same backend that loads it
(``get_state_dict`` + ``dcp.load`` + ``set_state_dict``). A backend's figure
for a round is its slowest rank's: the median of its steps after the first
two, the save, the load. Prints every round and the ratio dbuf / FSDP2 of the
medians and of the worst rounds. Needs $DBUF_DAEMON (a dbufd binary) and
transformers.
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


def one_round(daemon, tmp: Path, backend: str, world: int, size: list[str], steps: int,
              tag: str) -> tuple[float, float, float]:
    checkpoint = tmp / f"{backend}-{tag}"
    out = tmp / f"{backend}-{tag}-save"
    common = ["--backend", backend, "--model", "llama", *size]
    run_ranks("checkpoint_hf.py", world, daemon.socket, str(out), *common, "--steps", str(steps), "--save-at",
              str(steps), "--checkpoint", str(checkpoint), job=f"save-{backend}-{tag}", timeout=900)
    results = [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]
    step = max(statistics.median(result["step_s"][2:]) for result in results)
    save = max(result["save_s"] for result in results)
    out = tmp / f"{backend}-{tag}-load"
    run_ranks("checkpoint_hf.py", world, daemon.socket, str(out), *common, "--steps", str(steps), "--start",
              str(steps), "--load", str(checkpoint), job=f"load-{backend}-{tag}", timeout=900)
    load = max(torch.load(f"{out}.{r}", weights_only=False)["load_s"] for r in range(world))
    return step, save, load


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=6, help="training steps before the save (the first two not timed)")
    args = p.parse_args()
    if args.steps < 3:
        p.error("--steps must be at least 3")
    size = ["--hidden", str(args.hidden), "--layers", str(args.layers)]
    times: dict[str, list[tuple[float, float, float]]] = {"dbuf": [], "fsdp2": []}
    with Daemon(timeouts={"collective_ms": 120000, "register_ms": 120000}) as daemon, \
            tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for backend in ("fsdp2", "dbuf") if round_ % 2 else ("dbuf", "fsdp2"):
                step, save, load = one_round(daemon, Path(tmp), backend, args.world, size, args.steps, str(round_))
                times[backend].append((step, save, load))
                print(f"round {round_} {backend:5s}: step {step:.3f} s, save {save:.3f} s, load {load:.3f} s",
                      flush=True)
    for index, what in enumerate(("step", "save", "load")):
        dbuf = [t[index] for t in times["dbuf"]]
        fsdp2 = [t[index] for t in times["fsdp2"]]
        print(f"{what}: dbuf median {statistics.median(dbuf):.3f} s worst {max(dbuf):.3f} s; FSDP2 median "
              f"{statistics.median(fsdp2):.3f} s worst {max(fsdp2):.3f} s; dbuf / FSDP2 medians "
              f"{statistics.median(dbuf) / statistics.median(fsdp2):.2f}, worst {max(dbuf) / max(fsdp2):.2f}")


if __name__ == "__main__":
    main()
