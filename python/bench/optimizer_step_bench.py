"""torch's AdamW on RaggedShard DTensors (dbuf.torch's parameters) against the same on plain tensors.

  python bench/optimizer_step_bench.py [--rounds 15] [--steps 10]

The example GPT's parameter shapes (python/examples/gpt_model.py, 3.3 M
parameters in 52 tensors) as this rank's local elements at 4 ranks, in one
process: plain 1-D tensors (what dbuf.torch's parameters were before they
became DTensors), RaggedDTensors over the same memory, and FSDP2's
``Shard(0)`` DTensors of the same rows, stepped alternately in rounds, with
AdamW single-tensor (``foreach=False``, the example's), ``foreach=True`` and
``fused=True``. Prints each variant's median and worst round and the ratios
RaggedShard / plain (the cost of the DTensor dispatch) and RaggedShard /
FSDP2's (the same optimizer on FSDP2's parameters).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from gpt_model import GPT, GPTConfig  # noqa: E402

from dbuf.torch import RaggedShard, RaggedDTensor  # noqa: E402

WORLD = 4


def local_parts(mesh) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Rank 0's elements of each parameter of the GPT at 4 ranks (rows:1 blocks): plain, as RaggedShard
    DTensors, and as FSDP2's Shard(0) DTensors of the same rows."""
    plain, ragged, fsdp2 = [], [], []
    for param in GPT(GPTConfig()).parameters():
        rows = param.shape[0]
        units = [rows // WORLD + (1 if r < rows % WORLD else 0) for r in range(WORLD)]
        block = param.numel() // rows
        local = param.detach().reshape(-1)[: units[0] * block].clone()
        plain.append(torch.nn.Parameter(local.clone()))
        # This process is rank 0 of a 1-rank mesh; the placement says 4 ranks, as the shapes do.
        placement = RaggedShard(block, (units[0],))
        whole_shape = (units[0] * block,) if param.dim() == 1 else (units[0], *param.shape[1:])
        ragged.append(torch.nn.Parameter(RaggedDTensor.from_local(local, mesh, placement, whole_shape)))
        rows_local = local.clone().reshape(whole_shape)
        fsdp2.append(torch.nn.Parameter(DTensor.from_local(rows_local, mesh, [Shard(0)], run_check=False)))
    return plain, ragged, fsdp2


def time_steps(params: list[torch.Tensor], steps: int, **options) -> float:
    for p in params:
        p.grad = torch.ones_like(p) * 1e-3
    optimizer = torch.optim.AdamW(params, lr=1e-3, **options)
    optimizer.step()  # states made
    started = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return (time.perf_counter() - started) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    variants = dict(zip(("plain", "RaggedShard", "FSDP2 Shard(0)"), local_parts(mesh)))
    for name, options in (("single-tensor", {"foreach": False}), ("foreach", {"foreach": True}),
                          ("fused", {"fused": True})):
        times: dict[str, list[float]] = {variant: [] for variant in variants}
        for _ in range(args.rounds):
            for variant, params in variants.items():
                times[variant].append(time_steps(params, args.steps, **options))
        median = {variant: statistics.median(t) for variant, t in times.items()}
        print(f"AdamW {name}: " + "; ".join(
            f"{variant} median {median[variant] * 1e3:.2f} ms (worst {max(times[variant]) * 1e3:.2f})"
            for variant in variants), flush=True)
        print(f"  RaggedShard / plain {median['RaggedShard'] / median['plain']:.2f}, RaggedShard / FSDP2's "
              f"{median['RaggedShard'] / median['FSDP2 Shard(0)']:.2f} (worst rounds "
              f"{max(times['RaggedShard']) / max(times['FSDP2 Shard(0)']):.2f})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
