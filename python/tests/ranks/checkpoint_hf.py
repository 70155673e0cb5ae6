"""One rank of a Hugging Face model trained and checkpointed with PyTorch's own APIs, on dbuf.torch or FSDP2.

  checkpoint_hf.py OUT.pt --backend dbuf|fsdp2 --model llama|qwen3moe [--steps N] [--start K]
                   [--save-at K --checkpoint DIR] [--load DIR] [--granularity RULE] [--clip C]
                   [--optimizer adamw|adam8bit|muon] [--hidden H --layers L] [--device cuda]

Trains steps [start, N) of a tiny random-init transformers model (dims that
the world size does not divide) with AdamW, every rank's micro-batch its
slice of one global batch per step. ``--load`` restores model and optimizer
from a DCP checkpoint first (``get_state_dict`` / ``dcp.load`` /
``set_state_dict``, as torchtitan does); ``--save-at`` saves one after that
many steps (``dcp.save``). Only the import of ``fully_shard`` differs
between the backends.

Writes OUT.pt.<rank>: losses, each step's seconds (``step_s``), the total gradient norms torch's
``clip_grad_norm_`` returned (with ``--clip``) and the collectives torch issued for it
(``clip_collectives``, CommDebugMode's count), and on rank 0 the full model
and optimizer state dicts (``get_model_state_dict`` /
``get_optimizer_state_dict`` with ``full_state_dict``), after loading
(``loaded``), at the save (``saved``) and at the end (``final``); the seconds
the save and the load took (``save_s``, ``load_s``: get_state_dict, DCP, and
set_state_dict on load).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._pytree import tree_map
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

GLOBAL_BATCH, SEQ, VOCAB = 12, 10, 101

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--backend", choices=("dbuf", "fsdp2"), required=True)
p.add_argument("--model", choices=("llama", "qwen3moe"), required=True)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--start", type=int, default=0)
p.add_argument("--save-at", type=int, default=-1)
p.add_argument("--checkpoint", default=None)
p.add_argument("--load", default=None)
p.add_argument("--granularity", default="element")
p.add_argument("--clip", type=float, default=None)
p.add_argument("--async-save", action="store_true", help="dcp.async_save (staged in host memory) instead of dcp.save")
p.add_argument("--optimizer", choices=("adamw", "adam8bit", "muon"), default="adamw",
               help="dbuf.torch.optim's need a block rule: adam8bit rows:R, muon matrix")
p.add_argument("--device", default="cpu", help="cuda: the model and data on the current GPU (dbufd's cuda backend)")
p.add_argument("--hidden", type=int, default=44, help="hidden size (the benchmark's larger model)")
p.add_argument("--layers", type=int, default=2)
args = p.parse_args()

torch.set_num_threads(1)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def make_model() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=70 * args.hidden // 44,
                  num_hidden_layers=args.layers, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=args.hidden // 2, tie_word_embeddings=False)
    if args.model == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    config = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=28, num_experts=4, num_experts_per_tok=2)
    return transformers.Qwen3MoeForCausalLM(config)


model = make_model().to(args.device)
declared = {name: value.shape for name, value in model.state_dict().items()}
if args.backend == "dbuf":
    import dbuf.torch as dt

    dt.init()
    for layer in model.model.layers:
        dt.fully_shard(layer, granularity=args.granularity)
    dt.fully_shard(model, granularity=args.granularity)
else:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
if args.optimizer == "adamw":
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
elif args.optimizer == "adam8bit":
    from dbuf.torch.optim import Adam8bit

    optimizer = Adam8bit(model.parameters(), lr=1e-2, weight_decay=0.1)
else:
    from dbuf.torch.optim import Muon

    matrices = [p for name, p in model.named_parameters()
                if p.dim() == 2 and "embed" not in name and "lm_head" not in name]
    rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
    optimizer = Muon(matrices, lr=0.02, adamw_params=rest, adamw_lr=1e-2)

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_state() -> dict:
    """Whole tensors (rank 0 only): the model's and the optimizer's, keyed by parameter names."""
    state = {"model": get_model_state_dict(model, options=FULL),
             "optim": get_optimizer_state_dict(model, optimizer, options=FULL)}
    # Copies: some values (the optimizer's step counts) are the live tensors training goes on updating.
    return tree_map(lambda value: value.clone() if isinstance(value, torch.Tensor) else value, state)


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    share = GLOBAL_BATCH // world
    return tokens[rank * share : (rank + 1) * share].to(args.device)


result: dict = {"losses": [], "norms": [], "clip_collectives": [], "step_s": []}
if not args.load:
    # The full state dict gathered on rank 0 is the single-process model's state_dict() (what
    # save_pretrained writes): the same names, shapes and values.
    gathered = get_model_state_dict(model, options=FULL)
    if rank == 0:
        single = make_model().state_dict()
        assert gathered.keys() == single.keys(), sorted(set(gathered) ^ set(single))
        for name, value in single.items():
            assert torch.equal(gathered[name], value), f"{name}: gathered != one process's"

if args.load:
    started = time.perf_counter()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=args.load)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    result["load_s"] = time.perf_counter() - started
    result["loaded"] = full_state()

for step in range(args.start, args.steps):
    started = time.perf_counter()
    tokens = batch(step)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    if args.clip is not None:
        # The collectives torch issues for it (dbuf's norm is summed through dbufd: none).
        with CommDebugMode() as comms:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        result["clip_collectives"].append(comms.get_total_counts())
        result["norms"].append(norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item())
    optimizer.step()
    optimizer.zero_grad()
    result["losses"].append(loss.item())
    result["step_s"].append(time.perf_counter() - started)
    if step + 1 == args.save_at:
        started = time.perf_counter()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        if args.async_save:
            dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=args.checkpoint).result()
        else:
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=args.checkpoint)
        result["save_s"] = time.perf_counter() - started
        result["saved"] = full_state()

result["final"] = full_state()

# model.state_dict() holds DTensors of the shapes the module declared, as FSDP2's does.
local_state = model.state_dict()
assert {name: value.shape for name, value in local_state.items()} == declared
assert all(isinstance(value, DTensor) for value in local_state.values())

# Full state dicts load back (torch's set_model_state_dict / set_optimizer_state_dict): held by every
# rank, then broadcast from rank 0.
def copied(state):
    # torch replaces a given dict's values with the distributed tensors it loads.
    return tree_map(lambda value: value.clone() if isinstance(value, torch.Tensor) else value, state)


def same(a, b) -> bool:
    """Nested state dicts equal, tensors bit for bit (lists and tuples alike: param groups' betas)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def scramble() -> None:
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    value.zero_()


EVERYWHERE = StateDictOptions(full_state_dict=True)
whole = {"model": get_model_state_dict(model, options=EVERYWHERE),
         "optim": get_optimizer_state_dict(model, optimizer, options=EVERYWHERE)}
for options in (EVERYWHERE, StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)):
    scramble()
    given = copied(whole) if rank == 0 or not options.broadcast_from_rank0 else {"model": {}, "optim": {}}
    set_model_state_dict(model, given["model"], options=options)
    set_optimizer_state_dict(model, optimizer, given["optim"], options=options)
    again = {"model": get_model_state_dict(model, options=EVERYWHERE),
             "optim": get_optimizer_state_dict(model, optimizer, options=EVERYWHERE)}
    assert same(again, whole), f"a full state dict set back with {options}"
# Gradient norms of every type (torch.nn.utils.get_total_norm), after GradScaler's unscale_.
scaler = torch.amp.GradScaler(args.device)
tokens = batch(0)
scaler.scale(model(input_ids=tokens, labels=tokens).loss).backward()
scaler.unscale_(optimizer)
grads = [param.grad for param in model.parameters()]
result["norm_types"] = {
    str(norm_type): torch.nn.utils.get_total_norm(grads, norm_type).full_tensor().item()
    for norm_type in (1.0, 2.0, 3.5, math.inf)
}
optimizer.zero_grad()

# torch.nn.init on a parameter draws what one process draws (dbuf: every rank draws the whole tensor;
# trunc_normal_ resamples while any element is out of range: the same rounds on every rank).
if args.backend == "dbuf":
    weight = model.model.layers[0].self_attn.q_proj.weight
    torch.manual_seed(7)
    torch.nn.init.trunc_normal_(weight, std=0.02, a=-0.01, b=0.01)
    torch.manual_seed(7)
    want = torch.nn.init.trunc_normal_(torch.empty(weight.shape, device=args.device), std=0.02, a=-0.01, b=0.01)
    assert torch.equal(weight.full_tensor(), want), "trunc_normal_ on a RaggedShard parameter"

if rank != 0:
    for key in ("loaded", "saved", "final"):
        result.pop(key, None)
torch.save(result, f"{args.out}.{rank}")
if args.backend == "dbuf":
    dt.destroy()
else:
    dist.destroy_process_group()
print("done", file=sys.stderr, flush=True)
# Past this point only the interpreter's teardown runs, and torch 2.15 often aborts in it where a
# DTensor still holds a DeviceMesh whose gloo group ran a collective ("terminate called without an
# active exception"; FSDP2's and dbuf's alike, docs/python.md): the results are written, so the exit
# status says how the run went.
sys.stdout.flush()
os._exit(0)
