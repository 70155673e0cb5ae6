"""DCP save and load time, dbuf.torch against FSDP2, on the same transformers model, side by side.

  python bench/checkpoint_bench.py [--rounds 3] [--world 4] [--hidden 512] [--layers 4]

Each round runs tests/ranks/checkpoint_hf.py once per backend (4 rank
processes; dbuf on a real dbufd, FSDP2 over gloo): one training step, then
``get_state_dict`` + ``dcp.save`` of model and AdamW state, then a fresh job
of the same backend that loads it (``get_state_dict`` + ``dcp.load`` +
``set_state_dict``). A backend's time for a round is its slowest rank's.
Prints every round and the ratio dbuf / FSDP2 of the medians and of the
worst rounds. Needs $DBUF_DAEMON (a dbufd binary) and transformers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))
from conftest import run_ranks  # noqa: E402

from dbuf.testing import Daemon  # noqa: E402


def one_round(daemon, tmp: Path, backend: str, world: int, size: list[str], tag: str) -> tuple[float, float]:
    checkpoint = tmp / f"{backend}-{tag}"
    out = tmp / f"{backend}-{tag}-save"
    common = ["--backend", backend, "--model", "llama", *size]
    run_ranks("checkpoint_hf.py", world, daemon.socket, str(out), *common, "--steps", "1", "--save-at", "1",
              "--checkpoint", str(checkpoint), job=f"save-{backend}-{tag}", timeout=900)
    save = max(torch.load(f"{out}.{r}", weights_only=False)["save_s"] for r in range(world))
    out = tmp / f"{backend}-{tag}-load"
    run_ranks("checkpoint_hf.py", world, daemon.socket, str(out), *common, "--steps", "1", "--start", "1",
              "--load", str(checkpoint), job=f"load-{backend}-{tag}", timeout=900)
    load = max(torch.load(f"{out}.{r}", weights_only=False)["load_s"] for r in range(world))
    return save, load


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()
    size = ["--hidden", str(args.hidden), "--layers", str(args.layers)]
    times: dict[str, list[tuple[float, float]]] = {"dbuf": [], "fsdp2": []}
    with Daemon(timeouts={"collective_ms": 120000, "register_ms": 120000}) as daemon, \
            tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for backend in ("fsdp2", "dbuf") if round_ % 2 else ("dbuf", "fsdp2"):
                save, load = one_round(daemon, Path(tmp), backend, args.world, size, str(round_))
                times[backend].append((save, load))
                print(f"round {round_} {backend:5s}: save {save:.3f} s, load {load:.3f} s", flush=True)
    for index, what in enumerate(("save", "load")):
        dbuf = [t[index] for t in times["dbuf"]]
        fsdp2 = [t[index] for t in times["fsdp2"]]
        print(f"{what}: dbuf median {statistics.median(dbuf):.3f} s worst {max(dbuf):.3f} s; FSDP2 median "
              f"{statistics.median(fsdp2):.3f} s worst {max(fsdp2):.3f} s; dbuf / FSDP2 medians "
              f"{statistics.median(dbuf) / statistics.median(fsdp2):.2f}, worst {max(dbuf) / max(fsdp2):.2f}")


if __name__ == "__main__":
    main()
