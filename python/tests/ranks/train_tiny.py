"""One rank of a dbuf.torch training run of tests/ranks/tiny_model.py (the tests launch several).

  train_tiny.py OUT.pt [--steps N] [--micro-batches M] [--no-sync] [--two-forwards] [--tied]
                [--optimizer adamw|muon|adam8bit] [--granularity RULE] [--reshard-root] [--auto-wrap]
                [--blocks-only] [--kwargs-calls] [--bf16-model] [--clip C] [--prefetch-depth D]
                [--fail-forward-step K] [--fail-backward-step K]

Writes OUT.pt.<rank>: this rank's losses[step][micro] (None for a step whose
forward failed), and on rank 0 the full state dict gathered at the end. Also
checks state dict round trips: sharded, full on every rank, and rank 0's full
one broadcast (and a wrong one refused on every rank).
"""

from __future__ import annotations

import argparse
import sys

import torch

import dbuf.torch as dt
from tiny_model import granularity_for, loss_of, make_model, make_optimizer, micro_batch

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--steps", type=int, default=4)
p.add_argument("--micro-batches", type=int, default=1)
p.add_argument("--no-sync", action="store_true", help="accumulate micro-batches without sync")
p.add_argument("--two-forwards", action="store_true", help="one backward through two forwards per step")
p.add_argument("--tied", action="store_true")
p.add_argument("--granularity", default=None, help="default: what --optimizer needs")
p.add_argument("--optimizer", choices=("adamw", "muon", "adam8bit"), default="adamw")
p.add_argument("--reshard-root", action="store_true")
p.add_argument("--auto-wrap", action="store_true")
p.add_argument("--blocks-only", action="store_true", help="fully_shard the blocks only (the rest frozen)")
p.add_argument("--kwargs-calls", action="store_true", help="blocks get their input as a keyword")
p.add_argument("--bf16-model", action="store_true", help="bf16 parameters, no mixed precision")
p.add_argument("--clip", type=float, default=None)
p.add_argument("--prefetch-depth", type=int, default=2)
p.add_argument("--fail-forward-step", type=int, default=-1, help="a forward that raises (caught) at this step")
p.add_argument("--fail-backward-step", type=int, default=-1, help="a backward that raises (caught) at this step")
args = p.parse_args()
granularity = args.granularity or granularity_for(args.optimizer)

torch.set_num_threads(1)
session = dt.init(prefetch_depth=args.prefetch_depth)
model = make_model(tied=args.tied, kwargs_calls=args.kwargs_calls, freeze_outer=args.blocks_only)
if args.bf16_model:
    model = model.to(torch.bfloat16)
    policy = dt.MixedPrecisionPolicy()
else:
    policy = dt.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
if args.blocks_only:
    for outer in (model.embed, model.norm, model.head):
        outer.to(torch.bfloat16)  # frozen, no unit: computes in the blocks' dtype
if args.auto_wrap:
    units = dt.auto_wrap(model, granularity=granularity, mp_policy=policy)
    assert [u.modules for u in units][-1] == ("",)
else:
    for block in model.blocks:
        dt.fully_shard(block, mp_policy=policy, granularity=granularity)
    if not args.blocks_only:
        dt.fully_shard(model, mp_policy=policy, granularity=granularity,
                       reshard_after_forward=True if args.reshard_root else None)
assert all(isinstance(p, dt.RaggedDTensor) for p in model.parameters() if p.requires_grad)
optimizer = make_optimizer(model, args.optimizer)


class Injected(RuntimeError):
    pass


def fail_in_forward(module, inputs, output):
    raise Injected("forward")


def fail_in_backward(module, inputs, output):
    def raise_now(grad):
        raise Injected("backward")

    output.register_hook(raise_now)


def batch(step: int, micro: int):
    return [t.to(session.torch_device) for t in micro_batch(step, micro, session.rank, session.world_size)]


losses = []
for step in range(args.steps):
    row = []
    failure = None
    if step == args.fail_forward_step:
        failure = model.blocks[1].register_forward_hook(fail_in_forward)
    elif step == args.fail_backward_step:
        failure = model.blocks[1].register_forward_hook(fail_in_backward)
    try:
        for micro in range(1 if args.two_forwards else args.micro_batches):
            last = micro == args.micro_batches - 1
            if args.no_sync:
                model.set_requires_gradient_sync(last)
            loss = loss_of(model, *batch(step, micro))
            if args.two_forwards:
                loss = loss + loss_of(model, *batch(step, 1))
            row.append(loss.item())
            loss.backward()
        if args.clip is not None:
            dt.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
    except Injected:
        row = row or [None]  # the step's gradients are dropped; training goes on
    finally:
        if failure is not None:
            failure.remove()
    optimizer.zero_grad()
    losses.append(row)
    assert not session.slot_holders or step == args.fail_backward_step, "a unit kept its slot after the step"

with torch.no_grad():
    model.seen.add_((1 << 40) + 1)  # an int64 fp32 values would not hold: the state dicts carry it exactly
full = dt.get_model_state_dict(model, full=True)
sharded = dt.get_model_state_dict(model, full=False)
assert "seen" in sharded and "scratch" not in sharded  # persistent buffers only


def scramble() -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.seen.zero_()


# A sharded state dict loads back into the same plan, a full one into every rank, and rank 0's alone
# through a broadcast; a wrong one on rank 0 is refused on every rank.
scramble()
dt.set_model_state_dict(model, sharded)
again = dt.get_model_state_dict(model, full=True, rank0_only=False)
scramble()
dt.set_model_state_dict(model, again)
if session.rank == 0:
    for name, value in full.items():
        assert torch.equal(value, again[name]), name
scramble()
dt.set_model_state_dict(model, full if session.rank == 0 else {}, broadcast_from_rank0=True)
after = dt.get_model_state_dict(model, full=True, rank0_only=False)
for name, value in again.items():
    assert torch.equal(value, after[name]), f"broadcast load: {name}"
assert after["seen"].item() > (1 << 40), after["seen"]
wrong = {k: v for k, v in full.items() if k != "blocks.0.up.bias"} if session.rank == 0 else {}
try:
    dt.set_model_state_dict(model, wrong, broadcast_from_rank0=True)
except ValueError as error:
    assert session.rank != 0 or "blocks.0.up.bias" in str(error), error
else:
    raise AssertionError("a state dict without blocks.0.up.bias was loaded")
torch.save({"losses": losses, "state": full if session.rank == 0 else None}, f"{args.out}.{session.rank}")
dt.destroy()
print("done", file=sys.stderr)
