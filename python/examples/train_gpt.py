"""Data-parallel training of the example GPT with FSDP2-style sharding: PyTorch FSDP2 or dbuf.

    torchrun --nproc-per-node 4 train_gpt.py --backend fsdp2 --steps 50 --out /tmp/run-fsdp2
    DBUF_SOCKET=/run/dbufd/dbufd.sock \\
    torchrun --nproc-per-node 4 train_gpt.py --backend dbuf --steps 50 --out /tmp/run-dbuf

The two backends differ only in where ``fully_shard`` and ``MixedPrecisionPolicy`` come from:
``torch.distributed.fsdp`` over a gloo process group, or ``dbuf.torch``, which reads rank, world
size, local rank and job id from torchrun's environment and the daemon's socket from
$DBUF_SOCKET and needs no process group. Everything else is the same user code: every rank builds
the same model from ``--seed``, ``fully_shard`` wraps each block and then the root with bf16
parameters and fp32 gradient reduction, AdamW runs on ``model.parameters()``, and each step is
this rank's micro-batch (text_data.batch) -> forward -> loss -> backward -> step -> zero_grad.
Runs on CPU (launch with OMP_NUM_THREADS=1; every rank also sets torch.set_num_threads(1)).

Each rank writes ``--out/rank<R>.json``: config, per-step micro-batch loss (Python float and its
float32 bits in hex), per-step wall time, and per-step all-gather bytes and peak unsharded
parameter+gradient bytes as the backend's meter (``make_meter``) reports them (null where it
reports none).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from gpt_model import GPT, GPTConfig, lm_loss, make_optimizer
from text_data import batch


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The options of a run that train_gpt.py and reference.py share."""
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--micro-batch", type=int, default=4, help="samples per rank per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0, help="seeds the initial weights and the data order")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("fsdp2", "dbuf"), required=True)
    add_run_args(p)
    p.add_argument("--warmup-steps", type=int, default=3, help="first steps left out of the timing summary")
    p.add_argument("--out", type=Path, required=True, help="directory for rank<R>.json")
    p.add_argument("--print-steps", action="store_true", help="rank 0 prints every step's loss and time")
    return p.parse_args()


def model_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(
        seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, seed=args.seed
    )


def float32_hex(x: float) -> str:
    """The IEEE float32 bits of ``x`` as 8 hex digits."""
    return f"{struct.unpack('<I', struct.pack('<f', x))[0]:08x}"


@dataclass
class StepFigures:
    """What a backend's meter reports for one step; None where the backend reports nothing."""

    all_gather_bytes: int | None
    peak_unsharded_bytes: int | None


class StepMeter(Protocol):
    def start_step(self) -> None: ...
    def end_step(self) -> StepFigures: ...


class Fsdp2Meter:
    """All-gather bytes and peak unsharded parameter+gradient bytes of FSDP2, per step.

    All-gather bytes: FSDP2 gathers each parameter group with one call of
    ``torch.distributed.all_gather_single(output, input, ...)`` (DefaultAllGather in
    torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, torch 2.15; older releases called
    ``all_gather_into_tensor``). The wrapper installed by ``fsdp2_meter`` adds the bytes of each
    call's output tensor, i.e. the unsharded (dim-0 padded) bf16 buffer the call fills; each rank
    receives (world-1)/world of it.

    Peak unsharded bytes: each FSDPParam of the model holds its unsharded parameter in
    ``all_gather_outputs`` (plus ``_unsharded_inner_tensors`` for tensor-subclass extensions),
    storages FSDP2 resizes to 0 on reshard, and its unsharded gradient in
    ``_unsharded_param.grad`` (bf16 here: FSDP2 defers the upcast to mp_policy.reduce_dtype to
    the reduce-scatter copy-in). ``sample`` sums the storage bytes of these tensors over all
    FSDPParams. It runs at FSDP2's own module hooks, wrapped on FSDPParamGroup: after
    pre_forward and pre_backward (unshard done, prefetches issued), before post_forward and
    post_backward (before reshard, with the group's gradients in place). The peak is the
    maximum of those samples in the step; FSDP2's transient flat all-gather and reduce-scatter
    buffers are not counted.
    """

    def __init__(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        self._fsdp_params = [
            fsdp_param
            for module in model.modules()
            if isinstance(module, FSDPModule)
            for group in module._get_fsdp_state()._fsdp_param_groups
            for fsdp_param in group.fsdp_params
        ]
        self._all_gather_bytes = 0
        self._peak_bytes = 0

    def count_all_gather(self, output_tensor: torch.Tensor) -> None:
        self._all_gather_bytes += output_tensor.numel() * output_tensor.element_size()

    def sample(self) -> None:
        resident = 0
        for fsdp_param in self._fsdp_params:
            tensors = [*fsdp_param.all_gather_outputs, *fsdp_param._unsharded_inner_tensors]
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None and unsharded.grad is not None:
                tensors.append(unsharded.grad)
            resident += sum(t.untyped_storage().nbytes() for t in tensors)
        self._peak_bytes = max(self._peak_bytes, resident)

    def start_step(self) -> None:
        self._all_gather_bytes = 0
        self._peak_bytes = 0

    def end_step(self) -> StepFigures:
        return StepFigures(self._all_gather_bytes, self._peak_bytes)


@contextlib.contextmanager
def fsdp2_meter(model: nn.Module) -> Iterator[Fsdp2Meter]:
    """Installs an Fsdp2Meter's wrappers on torch's functions for the duration of the block."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    meter = Fsdp2Meter(model)
    real_all_gather = dist.all_gather_single

    @functools.wraps(real_all_gather)
    def counting_all_gather(output_tensor: torch.Tensor, input_tensor: torch.Tensor, *a: Any, **kw: Any) -> Any:
        meter.count_all_gather(output_tensor)
        return real_all_gather(output_tensor, input_tensor, *a, **kw)

    def sampled(method: Callable[..., Any], *, before: bool) -> Callable[..., Any]:
        @functools.wraps(method)
        def wrapper(*a: Any, **kw: Any) -> Any:
            if before:
                meter.sample()
            result = method(*a, **kw)
            if not before:
                meter.sample()
            return result

        return wrapper

    hooks = {"pre_forward": False, "pre_backward": False, "post_forward": True, "post_backward": True}
    real_hooks = {name: getattr(FSDPParamGroup, name) for name in hooks}
    dist.all_gather_single = counting_all_gather
    for name, before in hooks.items():
        setattr(FSDPParamGroup, name, sampled(real_hooks[name], before=before))
    try:
        yield meter
    finally:
        dist.all_gather_single = real_all_gather
        for name, method in real_hooks.items():
            setattr(FSDPParamGroup, name, method)


class DbufMeter:
    """dbuf's own counts (dbuf.torch.Session.stats): the bytes of the unsharded buffers its
    all-gathers fill (V*S bf16 elements per unit and gather) and the peak bytes of the unsharded
    slots this rank holds (parameters + gradients), as FSDP2's are counted above."""

    def __init__(self) -> None:
        from dbuf.torch import default_session

        self._session = default_session()

    def start_step(self) -> None:
        self._session.reset_step_stats()

    def end_step(self) -> StepFigures:
        stats = self._session.stats
        return StepFigures(stats.all_gather_bytes, stats.peak_unsharded_bytes)


def make_meter(backend: str, model: nn.Module) -> contextlib.AbstractContextManager[StepMeter]:
    """The backend's meter, installed for the duration of the ``with`` block."""
    if backend == "fsdp2":
        return fsdp2_meter(model)
    return contextlib.nullcontext(DbufMeter())


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    if args.backend == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dist.init_process_group("gloo")
    else:
        from dbuf.torch import MixedPrecisionPolicy, fully_shard

    cfg = model_config(args)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=True, mp_policy=mp_policy)
    fully_shard(model, reshard_after_forward=True, mp_policy=mp_policy)
    optimizer = make_optimizer(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    losses: list[float] = []
    step_times: list[float] = []
    figures: list[StepFigures] = []
    with make_meter(args.backend, model) as meter:
        for step in range(args.steps):
            inputs, targets = batch(step, rank, world_size, args.micro_batch, args.seq_len, args.seed)
            meter.start_step()
            start = time.perf_counter()
            loss = lm_loss(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step_times.append(time.perf_counter() - start)
            figures.append(meter.end_step())
            losses.append(loss.item())
            if args.print_steps and rank == 0:
                print(f"step {step}: loss {losses[-1]:.4f} (rank 0's micro-batch), {step_times[-1] * 1000:.0f} ms",
                      flush=True)

    timed = step_times[args.warmup_steps :]
    result = {
        "backend": args.backend,
        "rank": rank,
        "world_size": world_size,
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "model": asdict(cfg),
            "n_params": n_params,
            "torch": torch.__version__,
        },
        "losses": losses,
        "loss_float32_hex": [float32_hex(x) for x in losses],
        "step_times_s": step_times,
        "step_time_median_s": statistics.median(timed) if timed else None,
        "step_time_max_s": max(timed) if timed else None,
        "all_gather_bytes": [f.all_gather_bytes for f in figures],
        "peak_unsharded_bytes": [f.peak_unsharded_bytes for f in figures],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(result, indent=1) + "\n")
    if rank == 0:
        median = result["step_time_median_s"]
        median_text = f"median step {median:.3f} s" if median is not None else "no timed step"
        print(f"{args.backend}: {args.steps} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
              f"{median_text}; wrote {args.out}/rank*.json")
    if args.backend == "fsdp2":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
