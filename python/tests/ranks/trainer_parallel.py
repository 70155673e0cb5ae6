"""One rank of a trainer with tensor or expert parallelism under FSDP2 (torchtitan's recipes), on FSDP2 or dbuf.

  trainer_parallel.py OUT.pt --backend dbuf|fsdp2 [--model llama|qwen3moe] [--tp N] [--sp] [--ep N] [--mp bf16]
                      [--steps N] [--save DIR] [--load DIR]

Tensor parallelism: a transformers Llama; with ``--tp N`` the world is a (dp, tp) mesh and each
decoder layer gets the Megatron plan through torch's ``parallelize_module``
on ``world_mesh["tp"]`` (q/k/v and gate/up ``ColwiseParallel``, o and down
``RowwiseParallel``; with ``--sp`` the norms ``SequenceParallel``, their
weights Replicate DTensors whose gradients come Partial, and the activations
sequence-sharded inside each block), then
``fully_shard`` on ``world_mesh["dp"]``, layers first, then the root: what
torchtitan's ``parallelize_llama`` does. Nothing names dbuf: ``--backend
dbuf`` runs under ``DBUF_FSDP=1``. ``--tp 1``: a 1-D dp mesh, no TP.

Expert parallelism: a transformers Qwen3-MoE; with ``--ep N`` the world is an
(ep, dp) mesh. Every rank trains on its own batch. Each layer's experts
(3-D tensors) are placed ``Shard(0)`` on ``world_mesh["ep"]``, each ep rank
computing its own experts for the tokens of the ep group (gathered, and the
outputs reduce-scattered back: the all-gather dispatcher), and sharded by
``fully_shard`` over ``world_mesh["dp"]`` with the gradient divided by the
world size (torchtitan's divide factor). The rest of the model is sharded
over every rank (the (ep, dp) mesh flattened: torchtitan's ``dp_shard``),
or with ``--ep-dense hsdp`` HSDP over the 2-D mesh (replicated over ep,
sharded over dp).

``--save DIR``: after training, the model and the optimizer saved with
torch.distributed.checkpoint (torch's ``get_state_dict``). ``--load DIR``: no
training; the model and optimizer built and sharded as above, loaded from DIR
(whatever degrees saved it). Writes OUT.pt.<rank>: every step's loss (summed
over the world's ranks) and gradient norm, the whole parameters and AdamW
states at the end (``final``), FSDP's all-gather bytes per step and the
most bytes of unsharded parameters held at once (see PeakUnsharded).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

VOCAB = 101

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--backend", choices=("dbuf", "fsdp2"), required=True)
p.add_argument("--model", choices=("llama", "qwen3moe"), default="llama")
p.add_argument("--tp", type=int, default=1)
p.add_argument("--ep", type=int, default=1)
p.add_argument("--ep-dense", choices=("shard", "hsdp"), default="shard",
               help="with --ep: the non-expert parameters sharded over every rank (torchtitan's) or HSDP")
p.add_argument("--sp", action="store_true", help="sequence parallel norms and activations (torchtitan's plan)")
p.add_argument("--replicas", type=int, default=1, help="with --tp: HSDP over a (replicate, dp, tp) mesh")
p.add_argument("--whole-experts", action="store_true", help="with --ep: shard_placement_fn Shard(0) for experts")
p.add_argument("--mp", choices=("fp32", "bf16"), default="fp32")
p.add_argument("--steps", type=int, default=3)
p.add_argument("--save", default=None)
p.add_argument("--load", default=None)
p.add_argument("--hidden", type=int, default=64)
p.add_argument("--intermediate", type=int, default=90, help="90: TP chunks of 45 rows, which 2 dp ranks split raggedly")
p.add_argument("--layers", type=int, default=2)
p.add_argument("--seq", type=int, default=8)
p.add_argument("--global-batch", type=int, default=8)
args = p.parse_args()

torch.set_num_threads(1)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if (os.environ.get("DBUF_FSDP") == "1") != (args.backend == "dbuf"):
    sys.exit(f"--backend {args.backend} with DBUF_FSDP={os.environ.get('DBUF_FSDP')}")


def make_model() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=args.intermediate,
                  num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                  tie_word_embeddings=False, use_cache=False)
    if args.model == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    config = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=30, num_experts=4, num_experts_per_tok=2,
                                         head_dim=args.hidden // 4)
    return transformers.Qwen3MoeForCausalLM(config)


class ExpertParallelExperts(torch.nn.Module):
    """A Qwen3-MoE layer's experts with expert parallelism: ``Shard(0)`` over the ep mesh (E / ep experts each).

    The ep group's tokens and routings are gathered, each rank applies its own
    experts to the tokens routed to them (transformers' loop), and the outputs
    are reduce-scattered back to the ranks the tokens came from: gradients
    flow back the same way, so a rank's expert gradients cover the group's tokens.
    """

    def __init__(self, experts: torch.nn.Module, ep_mesh) -> None:
        super().__init__()
        self.mesh, self.act_fn = ep_mesh, experts.act_fn
        self.gate_up_proj = torch.nn.Parameter(distribute_tensor(experts.gate_up_proj.data, ep_mesh, [Shard(0)]))
        self.down_proj = torch.nn.Parameter(distribute_tensor(experts.down_proj.data, ep_mesh, [Shard(0)]))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        group = self.mesh.get_group()
        hidden = funcol.all_gather_tensor_autograd(hidden, 0, group)
        weights = funcol.all_gather_tensor_autograd(top_k_weights, 0, group)
        index = funcol.all_gather_tensor(top_k_index, 0, group)
        gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()
        first = self.mesh.get_local_rank() * gate_up.shape[0]
        out = torch.zeros_like(hidden)
        for expert in range(gate_up.shape[0]):
            token, slot = torch.where(index == first + expert)
            if token.numel() == 0:
                continue
            gate, up = torch.nn.functional.linear(hidden[token], gate_up[expert]).chunk(2, dim=-1)
            routed = torch.nn.functional.linear(self.act_fn(gate) * up, down[expert])
            out = out.index_add(0, token, routed * weights[token, slot, None])
        return funcol.reduce_scatter_tensor_autograd(out, "sum", 0, group)


def layer_plan() -> dict:
    """The Megatron plan of one decoder layer (torchtitan's for Llama, in torch's parallel styles)."""
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1) if args.sp else Replicate()),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1) if args.sp else Replicate()),
    }
    if args.sp:
        plan.update({
            "input_layernorm": SequenceParallel(),
            "post_attention_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    return plan


def parallelize(model: torch.nn.Module, tp_mesh) -> None:
    for layer in model.model.layers:
        if args.sp:
            # Each block's activations sequence-sharded inside it (transformers computes the rotary
            # embedding and the mask from the whole sequence, outside the blocks): split on entry,
            # gathered on exit.
            parallelize_module(layer, tp_mesh, PrepareModuleInputOutput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_input=True,
                output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True))
        parallelize_module(layer, tp_mesh, layer_plan())


class PeakUnsharded:
    """The most bytes of unsharded parameters a rank held at once in a step.

    FSDP2's: each parameter group's all-gather output (its parameters, padded)
    counted from its unshard to its reshard. dbuf's: its slots' bytes (which
    hold parameters and gradients alike) halved: the parameters.
    """

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.peak = 0
        if args.backend == "fsdp2":
            from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

            unshard, reshard = FSDPParamGroup.unshard, FSDPParamGroup.reshard
            tracker = self

            def counted_unshard(group, *a, **k):
                result = unshard(group, *a, **k)
                gathered = group._all_gather_result
                if gathered is not None:
                    output = gathered.all_gather_output
                    tracker.live[id(group)] = output.numel() * output.element_size()
                    tracker.peak = max(tracker.peak, sum(tracker.live.values()))
                return result

            def counted_reshard(group, *a, **k):
                tracker.live.pop(id(group), None)
                return reshard(group, *a, **k)

            FSDPParamGroup.unshard, FSDPParamGroup.reshard = counted_unshard, counted_reshard

    def take(self) -> int:
        if args.backend == "dbuf":
            import dbuf.torch

            passes = dbuf.torch.default_session().passes  # over every job of the process (experts' and the rest's)
            taken = passes.peak_unsharded_bytes // 2
            passes.reset_peak()
            return taken
        taken, self.peak = self.peak, sum(self.live.values())
        return taken


class AllGatherBytes:
    """FSDP's all-gather bytes per step. FSDP2's: torch.distributed's all-gathers into one tensor counted
    (``all_gather_single`` in torch 2.15, which FSDP2 calls; TP's collectives are torch's functional ones
    and do not pass here); dbuf's from its own counts."""

    def __init__(self) -> None:
        self.bytes = 0
        for name in ("all_gather_single", "all_gather_into_tensor"):
            if hasattr(dist, name):
                setattr(dist, name, self._counted(getattr(dist, name)))

    def _counted(self, original):
        def counted(output, *a, **k):
            self.bytes += output.numel() * output.element_size()
            return original(output, *a, **k)

        return counted

    def take(self) -> int:
        if args.backend == "dbuf":
            import dbuf.torch

            taken = 0
            for session in dbuf.torch.sessions():  # (with expert parallelism, the experts' job and the rest's)
                taken += session.stats.all_gather_bytes
                session.reset_step_stats()
            return taken
        taken, self.bytes = self.bytes, 0
        return taken


dist.init_process_group("gloo")
if args.tp > 1 and args.ep > 1:
    sys.exit("--tp and --ep together: not in this script")
# The ranks that train on the same batch (tensor parallelism's), and which batch is this rank's.
batches = world // args.tp
batch_index = rank // args.tp
if args.tp > 1 and args.replicas > 1:
    world_mesh = init_device_mesh("cpu", (args.replicas, world // args.tp // args.replicas, args.tp),
                                  mesh_dim_names=("replicate", "dp", "tp"))
    dp_mesh = non_expert_mesh = world_mesh["replicate", "dp"]  # HSDP beside TP
elif args.tp > 1:
    world_mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_mesh = non_expert_mesh = world_mesh["dp"]
elif args.ep > 1:
    world_mesh = init_device_mesh("cpu", (args.ep, world // args.ep), mesh_dim_names=("ep", "dp"))
    dp_mesh = world_mesh["dp"]
    # torchtitan's: the non-expert parameters over every rank; or HSDP: replicated over ep, sharded over dp.
    non_expert_mesh = world_mesh._flatten("dp_shard") if args.ep_dense == "shard" else world_mesh
else:
    dp_mesh = non_expert_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
model = make_model()
if args.tp > 1:
    parallelize(model, world_mesh["tp"])
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.mp == "bf16" else None, reduce_dtype=torch.float32)
for layer in model.model.layers:
    if args.ep > 1:
        layer.mlp.experts = ExpertParallelExperts(layer.mlp.experts, world_mesh["ep"])
        # --whole-experts: shard_placement_fn Shard(0) (FSDP2's default made explicit; dbuf: blocks of one expert
        # each, which the planner never splits).
        placement_fn = (lambda param: Shard(0)) if args.whole_experts else None
        fully_shard(layer.mlp.experts, mesh=dp_mesh, mp_policy=policy, shard_placement_fn=placement_fn)
        # Each expert's gradient sums the ep group's tokens already: divided by the world, not the dp ranks.
        layer.mlp.experts.set_gradient_divide_factor(float(world))
        # FSDP2 divides with NCCL's PREMUL_SUM, which gloo lacks: sum, then divide (as torchtitan's script does).
        layer.mlp.experts.set_force_sum_reduction_for_comms(True)
    fully_shard(layer, mesh=non_expert_mesh, mp_policy=policy)
fully_shard(model, mesh=non_expert_mesh, mp_policy=policy)
assert isinstance(model, FSDPModule)
# foreach=False: FSDP2's parameters are DTensors of two meshes here (dp, and dp x tp), which torch's
# foreach kernels do not take in one list.
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
peak_unsharded = PeakUnsharded()
counter = AllGatherBytes()


def whole(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def gradient_norm() -> float:
    """The whole gradient's 2-norm, from each gradient gathered whole (the same arithmetic on both backends)."""
    total = torch.zeros((), dtype=torch.float64)
    for param in model.parameters():
        if param.grad is not None:
            total += whole(param.grad).double().pow(2).sum()
    return total.sqrt().item()


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (args.global_batch, args.seq), generator=g)
    share = args.global_batch // batches
    return tokens[batch_index * share : (batch_index + 1) * share]


def dbuf_refusals() -> list[str]:
    """dbuf's own helpers that work over the dbuf job (dp) only refuse TP parameters, saying what to use."""
    import dbuf.torch
    import dbuf.torch.optim

    messages = []
    for attempt in (lambda: dbuf.torch.clip_grad_norm_(model.parameters(), 1.0),
                    lambda: dbuf.torch.get_model_state_dict(model, full=True),
                    lambda: dbuf.torch.optim.Muon([p for p in model.parameters() if p.device_mesh.ndim > 1], lr=0.01)):
        try:
            attempt()
        except NotImplementedError as error:
            messages.append(str(error))
    return messages


result: dict = {"losses": [], "norms": [], "all_gather_bytes": [], "peak_unsharded_bytes": []}
if args.load:
    # The optimizer's states exist once it stepped: one step with zero gradients and no learning rate.
    for group in optimizer.param_groups:
        group["lr"], lr = 0.0, group["lr"]
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad()
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=args.load)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
else:
    peak_unsharded.take()
    counter.take()
    for step in range(args.steps):
        tokens = batch(step)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        result["norms"].append(gradient_norm())
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        result["losses"].append(total.item())
        result["peak_unsharded_bytes"].append(peak_unsharded.take())  # (dbuf's before its counts restart)
        result["all_gather_bytes"].append(counter.take())
    if args.backend == "dbuf" and args.tp > 1:
        result["refusals"] = dbuf_refusals()
    if args.backend == "dbuf" and args.whole_experts:
        # Each rank's elements of an expert tensor are whole experts (its RaggedShard blocks are experts).
        result["experts_whole"] = []
        for name, param in model.named_parameters():
            if ".experts." in name:
                expert = math.prod(param.shape[1:])  # one expert's elements
                result["experts_whole"].append(
                    param.placements[0].block_elems == expert and param.to_local().numel() % expert == 0)
    if args.save:
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=args.save)

full = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
result["final"] = {"model": {k: whole(v) for k, v in full[0].items()},
                   "optim": {k: {s: whole(v) for s, v in state.items()} for k, state in full[1]["state"].items()}}
torch.save(result, f"{args.out}.{rank}")
dist.barrier()
print("done", file=sys.stderr, flush=True)
sys.stdout.flush()
os._exit(0)  # torch 2.15's teardown abort with a DeviceMesh's gloo group (docs/python.md)
