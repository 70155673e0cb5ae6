"""Runs the example GPT three ways and compares them: reference, PyTorch FSDP2, dbuf.

    python compare.py --steps 50                           # reference vs FSDP2
    python compare.py --steps 50 --backends fsdp2 dbuf     # and dbuf, against a dbufd it starts
    python compare.py --backends dbuf --expect-bitwise dbuf --steps 10   # the dbuf acceptance check

(a) reference.run_reference in this process; (b) ``torchrun --nproc-per-node N train_gpt.py
--backend fsdp2`` (gloo, CPU: CUDA_VISIBLE_DEVICES is emptied so FSDP2's default mesh is the
CPU one); (c) ``--backend dbuf`` against a dbufd started here (``--dbufd``, else $DBUF_DAEMON,
else build/bin/dbufd; ``--config config/dbufd.toml --socket <tmp>/dbufd.sock --log-level warn``,
stopped with SIGTERM), the ``dbuf`` package importable from this Python. torchrun runs with
OMP_NUM_THREADS=1, a free rendezvous port (c10d at localhost:0) and a hard ``--timeout``.

Prints per step the rank-0 loss of each run and, per backend, the largest absolute and relative
difference from the reference over the ranks; then per backend the median and worst step time
(the slowest rank's, warm-up steps left out), all-gather bytes per step and peak unsharded
parameter+gradient bytes, and the dbuf / fsdp2 step-time ratio. Writes everything to
``--out/summary.json`` (the runs' rank JSONs beside it). Exits non-zero when a run fails or a
backend named by ``--expect-bitwise`` is not bitwise equal to the reference at every step.

Measured drift of FSDP2 from the reference (torch 2.15.0 CPU, gloo, 50 steps, the defaults:
d_model 256, 4 layers, 4 heads, seq 128, micro-batch 4, lr 5e-4, wd 0.1, seed 0):
- 4 ranks: none. Every loss of every rank at every step is bitwise equal (max relative
  difference 0 at each of the 50 steps). gloo's CPU reduce-scatter adds the ranks' fp32
  gradients in rank order, its ReduceOp.AVG divides by 4, which is exactly * 0.25, FSDP2's dim-0
  padding adds no arithmetic, and the single-tensor AdamW is elementwise, so sharding does not
  change it.
- 3 ranks (dim-0 padding on most parameters): max relative loss difference per step 0 at steps
  0-1, 2e-5..5e-5 at steps 2-6, 7.4e-4 at step 7, 2e-5..2.5e-4 at steps 8-23, 4.6e-4 and 1.1e-3
  at steps 24-25, then 5e-3..3.6e-2 (largest 3.6e-2, step 35) at steps 26-49. The only cause is
  the division: gloo's AVG computes sum / 3, the reference sum * fl(1/3); with ``acc / 3`` in
  the reference FSDP2 is bitwise equal at 3 ranks as well. A one-ulp gradient difference thus
  grows chaotically to percent-level loss differences within 50 steps, so a loss tolerance is
  only sound over a few steps; bitwise equality is the check to make.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from reference import run_reference
from train_gpt import add_run_args, model_config

EXAMPLES = Path(__file__).resolve().parent
REPO = EXAMPLES.parents[1]
BACKENDS = ("fsdp2", "dbuf")


@dataclass
class BackendSummary:
    losses: list[list[float]]  # [step][rank]
    max_abs_diff: list[float]  # per step, over ranks, vs the reference
    max_rel_diff: list[float]
    bitwise_equal: bool
    step_time_median_s: float | None
    step_time_worst_s: float | None
    all_gather_bytes_per_step: int | None
    peak_unsharded_bytes: int | None


@contextlib.contextmanager
def running_dbufd(binary: Path, config: Path, workdir: Path) -> Iterator[Path]:
    """Starts dbufd on a socket in ``workdir``, yields the socket, stops it with SIGTERM."""
    socket, log_path = workdir / "dbufd.sock", workdir / "dbufd.log"
    with open(log_path, "wb") as log:
        daemon = subprocess.Popen(
            [str(binary), "--config", str(config), "--socket", str(socket), "--log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 10.0
        while not socket.exists():
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dbufd did not start:\n{log_path.read_text()}")
            time.sleep(0.05)
        yield socket
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        if log_path.stat().st_size:
            print(f"-- dbufd log ({log_path}) --\n{log_path.read_text()}", file=sys.stderr)


def run_backend(backend: str, args: argparse.Namespace, out_dir: Path, env: dict[str, str]) -> list[dict]:
    """Runs train_gpt.py under torchrun; returns the ranks' JSONs in rank order."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(args.nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
        str(EXAMPLES / "train_gpt.py"), "--backend", backend, "--out", str(out_dir),
        "--steps", str(args.steps), "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len),
        "--d-model", str(args.d_model), "--layers", str(args.layers), "--heads", str(args.heads),
        "--lr", repr(args.lr), "--weight-decay", repr(args.weight_decay), "--seed", str(args.seed),
        "--warmup-steps", str(args.warmup_steps),
    ]
    print(f"== {backend}: {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, start_new_session=True)
    try:
        rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        # torchrun starts its workers in sessions of their own: SIGTERM lets it stop them.
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        raise RuntimeError(f"{backend}: torchrun ran past --timeout {args.timeout}s") from None
    if rc != 0:
        raise RuntimeError(f"{backend}: torchrun exited {rc}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(args.nproc)]


def summarize(ranks: list[dict], reference: list[list[float]], warmup: int) -> BackendSummary:
    steps = len(reference)
    losses = [[ranks[r]["losses"][s] for r in range(len(ranks))] for s in range(steps)]
    abs_diff = [max(abs(x - y) for x, y in zip(losses[s], reference[s])) for s in range(steps)]
    rel_diff = [max(abs(x - y) / abs(y) for x, y in zip(losses[s], reference[s])) for s in range(steps)]
    slowest = [max(rank["step_times_s"][s] for rank in ranks) for s in range(warmup, steps)]
    gathered = [b for b in ranks[0]["all_gather_bytes"] if b is not None]
    peaks = [p for rank in ranks for p in rank["peak_unsharded_bytes"] if p is not None]
    return BackendSummary(
        losses=losses,
        max_abs_diff=abs_diff,
        max_rel_diff=rel_diff,
        bitwise_equal=losses == reference,
        step_time_median_s=statistics.median(slowest) if slowest else None,
        step_time_worst_s=max(slowest) if slowest else None,
        all_gather_bytes_per_step=max(gathered) if gathered else None,
        peak_unsharded_bytes=max(peaks) if peaks else None,
    )


def fmt(x: float | int | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def print_table(reference: list[list[float]], results: dict[str, BackendSummary]) -> None:
    names = list(results)
    head = f"{'step':>4} {'reference':>10}" + "".join(f" {n:>10}" for n in names)
    head += "".join(f" {n + ' |d|':>12} {n + ' rel':>11}" for n in names)
    print(head)
    for s, ref in enumerate(reference):
        row = f"{s:>4} {ref[0]:>10.6f}" + "".join(f" {results[n].losses[s][0]:>10.6f}" for n in names)
        row += "".join(f" {results[n].max_abs_diff[s]:>12.3e} {results[n].max_rel_diff[s]:>11.3e}" for n in names)
        print(row)
    print("(losses of rank 0; |d|, rel: largest over the ranks of the difference from the reference)")
    for n, r in results.items():
        print(f"{n}: bitwise equal to the reference: {r.bitwise_equal}; max |d| {max(r.max_abs_diff):.3e}, "
              f"max rel {max(r.max_rel_diff):.3e}; step time median {fmt(r.step_time_median_s, '.4f')} s, "
              f"worst {fmt(r.step_time_worst_s, '.4f')} s; all-gather {fmt(r.all_gather_bytes_per_step, ',')} B/step; "
              f"peak unsharded param+grad {fmt(r.peak_unsharded_bytes, ',')} B")
    if "fsdp2" in results and "dbuf" in results:
        base, ours = results["fsdp2"].step_time_median_s, results["dbuf"].step_time_median_s
        print(f"step time dbuf / fsdp2 (medians): {fmt(ours / base if base and ours else None, '.3f')}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(p)
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=["fsdp2"])
    p.add_argument("--nproc", type=int, default=4, help="ranks (torchrun --nproc-per-node)")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds each torchrun may take")
    p.add_argument("--dbufd", type=Path, default=Path(os.environ.get("DBUF_DAEMON", REPO / "build/bin/dbufd")))
    p.add_argument("--dbufd-config", type=Path, default=REPO / "config/dbufd.toml")
    p.add_argument("--expect-bitwise", nargs="*", choices=BACKENDS, default=[],
                   help="fail unless these backends' losses equal the reference's bitwise")
    p.add_argument("--out", type=Path, help="directory for summary.json and the runs (default: a new temp dir)")
    args = p.parse_args()
    torch.set_num_threads(1)
    out = args.out or Path(tempfile.mkdtemp(prefix="dbuf-compare-"))
    out.mkdir(parents=True, exist_ok=True)

    print(f"== reference: {args.steps} steps x {args.nproc} ranks", flush=True)
    reference = run_reference(
        model_config(args), steps=args.steps, world_size=args.nproc, micro_batch=args.micro_batch,
        lr=args.lr, weight_decay=args.weight_decay,
    )
    results: dict[str, BackendSummary] = {}
    for backend in args.backends:
        run_dir = out / backend
        try:
            if backend == "fsdp2":
                ranks = run_backend(backend, args, run_dir, {"CUDA_VISIBLE_DEVICES": ""})
            else:
                with tempfile.TemporaryDirectory(prefix="dbufd-") as tmp, \
                        running_dbufd(args.dbufd, args.dbufd_config, Path(tmp)) as socket:
                    ranks = run_backend(backend, args, run_dir, {"DBUF_SOCKET": str(socket)})
        except RuntimeError as e:
            print(f"compare: {e}", file=sys.stderr)
            return 1
        results[backend] = summarize(ranks, reference, args.warmup_steps)

    print_table(reference, results)
    base, ours = (results.get(n) for n in BACKENDS)
    ratio = (ours.step_time_median_s / base.step_time_median_s
             if base and ours and base.step_time_median_s and ours.step_time_median_s else None)
    summary = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "reference_losses": reference,
        "backends": {n: asdict(r) for n, r in results.items()},
        "step_time_ratio_dbuf_over_fsdp2": ratio,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {out / 'summary.json'}")
    failed = [n for n in args.expect_bitwise if not (n in results and results[n].bitwise_equal)]
    if failed:
        print(f"not bitwise equal to the reference: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
