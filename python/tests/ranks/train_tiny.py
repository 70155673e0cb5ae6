"""One rank of a dbuf.torch training run of tests/ranks/tiny_model.py (the tests launch several).

  train_tiny.py OUT.pt [--steps N] [--micro-batches M] [--no-sync] [--tied] [--optimizer adamw|muon|adam8bit]
                [--granularity RULE] [--reshard-root] [--auto-wrap] [--prefetch-depth D]

Writes OUT.pt.<rank>: this rank's losses[step][micro], and on rank 0 the full
state dict gathered at the end; also a sharded state dict round trip check.
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
p.add_argument("--tied", action="store_true")
p.add_argument("--granularity", default=None, help="default: what --optimizer needs")
p.add_argument("--optimizer", choices=("adamw", "muon", "adam8bit"), default="adamw")
p.add_argument("--reshard-root", action="store_true")
p.add_argument("--auto-wrap", action="store_true")
p.add_argument("--prefetch-depth", type=int, default=2)
args = p.parse_args()
granularity = args.granularity or granularity_for(args.optimizer)

torch.set_num_threads(1)
session = dt.init(prefetch_depth=args.prefetch_depth)
model = make_model(tied=args.tied)
policy = dt.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
if args.auto_wrap:
    units = dt.auto_wrap(model, granularity=granularity, mp_policy=policy)
    assert [u.modules for u in units][-1] == ("",)
else:
    for block in model.blocks:
        dt.fully_shard(block, mp_policy=policy, granularity=granularity)
    dt.fully_shard(model, mp_policy=policy, granularity=granularity,
                   reshard_after_forward=True if args.reshard_root else None)
assert all(isinstance(p, dt.ShardedParameter) for p in model.parameters())
optimizer = make_optimizer(model, args.optimizer)

losses = []
for step in range(args.steps):
    row = []
    for micro in range(args.micro_batches):
        last = micro == args.micro_batches - 1
        if args.no_sync:
            model.set_requires_gradient_sync(last)
        x, y = (t.to(session.torch_device) for t in micro_batch(step, micro, session.rank, session.world_size))
        loss = loss_of(model, x, y)
        loss.backward()
        row.append(loss.item())
    optimizer.step()
    optimizer.zero_grad()
    losses.append(row)
    assert not session.slot_holders, "a unit kept its slot after the step"

full = dt.get_model_state_dict(model, full=True)
sharded = dt.get_model_state_dict(model, full=False)
# A sharded state dict loads back into the same plan, a full one into every rank.
with torch.no_grad():
    for p in model.parameters():
        p.zero_()
dt.set_model_state_dict(model, sharded)
again = dt.get_model_state_dict(model, full=True, rank0_only=False)
dt.set_model_state_dict(model, again)
if session.rank == 0:
    for name, value in full.items():
        assert torch.equal(value, again[name]), name
torch.save({"losses": losses, "state": full if session.rank == 0 else None}, f"{args.out}.{session.rank}")
dt.destroy()
print("done", file=sys.stderr)
