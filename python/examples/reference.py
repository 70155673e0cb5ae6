"""Single-process reference for a ``world_size``-rank data-parallel bf16/fp32 job of train_gpt.py.

It runs the same global batch with the same casts and the same gradient reduction order as
dbuf documents for its data-parallel step, so every per-rank micro-batch loss of a dbuf run of
train_gpt.py must equal this one bitwise. Per step:

1. the bf16 working model gets the fp32 master parameters cast to bf16 (round to nearest even);
2. for each rank r in order: forward rank r's micro-batch (text_data.batch), loss_r in fp32
   (gpt_model.lm_loss), backward -> bf16 gradients g_r;
3. each parameter's gradient is reduced in fp32 in rank order,
   ``acc = g_0.float(); acc = acc + g_1.float(); ...; grad = acc * (1.0 / world_size)``
   (dbuf's result = (post_scale / world) * sum_r (pre_scale * x_r) with pre = post = 1);
4. the same AdamW (gpt_model.make_optimizer) steps the fp32 master parameters.

    python reference.py --steps 50 --world-size 4 [--out losses.json]

prints the mean loss of the first and last step and fails unless it fell.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

from gpt_model import GPT, GPTConfig, lm_loss, make_optimizer
from text_data import batch
from train_gpt import add_run_args, float32_hex, model_config


def run_reference(
    cfg: GPTConfig, *, steps: int, world_size: int, micro_batch: int, lr: float, weight_decay: float
) -> list[list[float]]:
    """losses[step][rank] of the reference run; data order from ``cfg.seed``."""
    master = GPT(cfg)
    working = copy.deepcopy(master).to(torch.bfloat16)
    master_params, working_params = list(master.parameters()), list(working.parameters())
    optimizer = make_optimizer(master_params, lr=lr, weight_decay=weight_decay)
    losses: list[list[float]] = []
    for step in range(steps):
        with torch.no_grad():
            for w, m in zip(working_params, master_params):
                w.copy_(m.to(torch.bfloat16))
        acc: list[torch.Tensor] = []
        step_losses: list[float] = []
        for rank in range(world_size):
            inputs, targets = batch(step, rank, world_size, micro_batch, cfg.seq_len, cfg.seed)
            loss = lm_loss(working(inputs), targets)
            loss.backward()
            step_losses.append(loss.item())
            grads = [w.grad.float() for w in working_params]
            acc = grads if rank == 0 else [a + g for a, g in zip(acc, grads)]
            working.zero_grad(set_to_none=True)
        for m, a in zip(master_params, acc):
            m.grad = a * (1.0 / world_size)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_losses)
    return losses


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(p)
    p.add_argument("--world-size", type=int, default=4, help="ranks of the job this run stands for")
    p.add_argument("--out", type=Path, help="write losses[step][rank] (and float32 hex) as JSON here")
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = model_config(args)
    losses = run_reference(
        cfg,
        steps=args.steps,
        world_size=args.world_size,
        micro_batch=args.micro_batch,
        lr=args.lr,
        weight_decay=args.weight_decay,
    )
    if args.out:
        args.out.write_text(json.dumps({
            "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}},
            "losses": losses,
            "loss_float32_hex": [[float32_hex(x) for x in step] for step in losses],
        }, indent=1) + "\n")
    first, last = (sum(step) / len(step) for step in (losses[0], losses[-1]))
    print(f"reference: {args.steps} steps x {args.world_size} ranks, mean loss {first:.4f} -> {last:.4f}")
    if not last < first:
        print("reference: the loss did not fall", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
