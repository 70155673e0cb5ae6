"""One rank of a trainer written for FSDP2, the way torchtitan and accelerate call it, on FSDP2 or on dbuf.

  trainer_hf.py OUT.pt --backend dbuf|fsdp2|replica --model llama|qwen3moe|gpt-oss [--ac none|full|full-reentrant|
                selective|hf|hf-reentrant|call] [--compile] [--mp bf16] [--accum N] [--steps N] [--meta-init]
                [--optim default|single|foreach|fused]

The script only speaks torch's FSDP2 API (``from torch.distributed.fsdp import
fully_shard, FSDPModule, MixedPrecisionPolicy, OffloadPolicy``); ``--backend
dbuf`` runs it under dbuf's switch (``$DBUF_FSDP=1``, which rank processes of
this test set, installs dbuf.torch in FSDP2's place at startup), so nothing
in it names dbuf. Activation checkpointing, in the patterns trainers use:

  full            torchtitan: ``checkpoint_wrapper`` (non-reentrant) around each block, then ``fully_shard``
  full-reentrant  the same with ``CheckpointImpl.REENTRANT``
  selective       torchtitan's op-level policy: save every other matmul, recompute the rest
  hf / hf-reentrant  transformers' ``activation_checkpointing_enable`` (checkpoints each layer's forward)
  call            ``torch.utils.checkpoint.checkpoint(block, ...)`` around the sharded block's call (its hooks
                  inside the checkpoint, so they run again in the recompute); call-reentrant the same, reentrant

``--compile``: each block ``.compile(fullgraph=True)`` before ``fully_shard``
(torchtitan's order); ``--compile-model``: the whole model compiled after it. ``--accum N``: N micro-batches per step, gradient sync on
the last only (``set_requires_gradient_sync``, accelerate's ``no_sync``).
``--meta-init``: the model made on the meta device, sharded, then
``to_empty`` and its weights loaded whole (torchtitan's path).
``--chunked-loss N``: torchtitan's chunked loss (lm_head its own unit).
``--backend replica``: the floor python/bench/step_floor_bench.py measures
against, each process training a replica of its own on its share of the
batch, with nothing sharded or communicated (bf16: mixed precision's own work
only, a bf16 copy of the model computing and its gradients added to the fp32
model's, which the optimizer steps). ``--optim``: AdamW as the trainer writes
it (``default``: torch picks, single-tensor on CPU), or its single-tensor,
foreach or fused path. ``--profile PATH``: rank 0's steps after the first two
under cProfile, its stats written there. Writes OUT.pt.<rank>: the losses of
every micro-batch, each step's gradient norm and seconds (and those of its
phases: forward and backward, clipping, the optimizer), dbuf's all-gathers per
step, and the peak resident memory the process added (``peak_rss_bytes``,
python/bench/trainer_bench.py's figure).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import os
import resource
import sys
import time
from collections import defaultdict
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

VOCAB = 101

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--backend", choices=("dbuf", "fsdp2", "replica"), required=True)
p.add_argument("--model", choices=("llama", "qwen3moe", "gpt-oss"), default="llama")
p.add_argument("--optim", choices=("default", "single", "foreach", "fused"), default="default")
p.add_argument("--profile", default=None, help="rank 0's steps after the first two under cProfile, its stats there")
p.add_argument("--ac", default="none", choices=("none", "full", "full-reentrant", "selective", "hf", "hf-reentrant",
                                                "call", "call-reentrant"))
p.add_argument("--compile", action="store_true")
p.add_argument("--compile-model", action="store_true", help="torch.compile of the whole model, after fully_shard")
p.add_argument("--mp", choices=("fp32", "bf16"), default="fp32")
p.add_argument("--accum", type=int, default=1)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--meta-init", action="store_true")
p.add_argument("--hsdp", action="store_true", help="a 2-D (replicate 2, shard world/2) mesh: HSDP")
p.add_argument("--root-without-mesh", action="store_true", help="fully_shard of the root passes no mesh")
p.add_argument("--device", default="cpu", help="cuda: model, data and mesh on the current GPU (dbufd's cuda backend)")
p.add_argument("--save", default=None, help="at the end, the model saved with torch.distributed.checkpoint there")
p.add_argument("--hidden", type=int, default=44, help="hidden size (the benchmark's larger model)")
p.add_argument("--layers", type=int, default=2)
p.add_argument("--seq", type=int, default=10)
p.add_argument("--global-batch", type=int, default=12)
p.add_argument("--chunked-loss", type=int, default=0,
               help="torchtitan's ChunkedLossWrapper: lm_head a unit of its own, a backward per sequence chunk")
args = p.parse_args()

torch.set_num_threads(1)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if (os.environ.get("DBUF_FSDP") == "1") != (args.backend == "dbuf"):
    sys.exit(f"--backend {args.backend} with DBUF_FSDP={os.environ.get('DBUF_FSDP')}")


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


RSS_AT_START = resident_bytes()


def scheduled_seconds() -> tuple[float, float]:
    """This thread's time on a CPU and its time runnable but waiting for one, so far (Linux's schedstat;
    NaN where the kernel keeps none)."""
    try:
        with open("/proc/thread-self/schedstat") as schedstat:
            on_cpu, waiting = schedstat.read().split()[:2]
    except OSError:
        return float("nan"), float("nan")
    return int(on_cpu) / 1e9, int(waiting) / 1e9


# step_floor_bench.py's breakdown: dbufd's CPU time, read by rank 0 around the steps.
DAEMON_PID = os.environ.get("DBUF_BENCH_DAEMON_PID") if rank == 0 else None


def daemon_cpu_seconds() -> float:
    with open(f"/proc/{DAEMON_PID}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def make_model() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=70 * args.hidden // 44,
                  num_hidden_layers=args.layers, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=args.hidden // 2, tie_word_embeddings=False,
                  use_cache=False)  # a KV cache would change what a checkpointed layer recomputes
    if args.model == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    # bf16: the experts' loop, as torch 2.15's CPU grouped_mm wants 16-byte strides these dims do not have
    # (FSDP2's run fails the same way).
    experts = {"experts_implementation": "eager"} if args.mp == "bf16" else {}
    if args.model == "gpt-oss":
        config = transformers.GptOssConfig(**{**common, "intermediate_size": 28}, num_local_experts=4,
                                           num_experts_per_tok=2, sliding_window=4, **experts)
        return transformers.GptOssForCausalLM(config)
    config = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=28, num_experts=4, num_experts_per_tok=2,
                                         **experts)
    return transformers.Qwen3MoeForCausalLM(config)


def selective_policy():
    """torchtitan's op-level selective checkpointing: keep every other matmul's output, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *op_args, **op_kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            counts[mode] += 1
            if counts[mode] % 2 == 1:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class CheckpointedCall(torch.nn.Module):
    """Checkpoints the whole call of a (sharded) block, its module hooks included."""

    def __init__(self, block: torch.nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.block, self.reentrant = block, reentrant

    def forward(self, *args, **kwargs):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(partial(self.block, **kwargs), *args, use_reentrant=self.reentrant)


def apply_ac(layers: torch.nn.ModuleList) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    for index, layer in enumerate(layers):
        if args.ac == "full":
            layers[index] = checkpoint_wrapper(layer, preserve_rng_state=False)
        elif args.ac == "full-reentrant":
            layers[index] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.REENTRANT)
        elif args.ac == "selective":
            layers[index] = checkpoint_wrapper(layer, context_fn=selective_policy, preserve_rng_state=False)


torch.manual_seed(0)
dist.init_process_group("gloo")
if args.hsdp:
    mesh = init_device_mesh(args.device, (2, world // 2), mesh_dim_names=("replicate", "shard"))
else:
    mesh = init_device_mesh(args.device, (world,))
if args.meta_init:
    with torch.device("meta"):
        model = make_model()
else:
    model = make_model().to(args.device)
layers = model.model.layers
if args.ac in ("hf", "hf-reentrant"):
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": args.ac == "hf-reentrant"})
apply_ac(layers)
if args.compile:
    for layer in layers:
        layer.compile(fullgraph=True)
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.mp == "bf16" else None, reduce_dtype=torch.float32)
# The chunked loss runs the decoder (torchtitan's forward without lm_head) and lm_head apart: each is a root.
roots = [model.model, model.lm_head] if args.chunked_loss else [model]
SHARDED = args.backend != "replica"
if SHARDED:
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=True, offload_policy=OffloadPolicy())
    for root in roots:
        fully_shard(root, mesh=None if args.root_without_mesh else mesh, mp_policy=policy, reshard_after_forward=True)
    assert all(isinstance(m, FSDPModule) for m in (*roots, *layers))
if args.ac.startswith("call"):
    for index, layer in enumerate(layers):
        layers[index] = CheckpointedCall(layer, reentrant=args.ac == "call-reentrant")
if args.compile_model:
    model.compile()
if args.meta_init:
    # torchtitan's path: real memory for the sharded parameters, then the weights loaded whole
    # (torch's full state dict API gives each rank its part).
    model.to_empty(device=args.device)
    reference = make_model().to(args.device)
    set_model_state_dict(model, reference.state_dict(), options=StateDictOptions(full_state_dict=True))
    with torch.no_grad():  # the buffers no state dict holds (rotary frequencies), made again
        for buffer, made in zip(model.buffers(), reference.buffers()):
            buffer.copy_(made)
# The replica floor in bf16: what mixed precision itself costs (see the docstring), with nothing sharded.
compute_copy = copy.deepcopy(model).to(torch.bfloat16) if not SHARDED and args.mp == "bf16" else None


def take_compute_grads() -> None:
    with torch.no_grad():
        for computing, master in zip(compute_copy.parameters(), model.parameters()):
            if computing.grad is None:
                continue
            if master.grad is None:
                master.grad = computing.grad.float()
            else:
                master.grad += computing.grad
            computing.grad = None


OPTIM_FLAGS = {"default": {}, "single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **OPTIM_FLAGS[args.optim])


def micro_batch(step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, VOCAB, (args.global_batch, args.seq), generator=g)
    share = args.global_batch // world
    return tokens[rank * share : (rank + 1) * share].to(args.device)


class DecoderBackward(torch.autograd.Function):
    """torchtitan's bridge: the loss whose backward sends the chunks' summed gradient into the decoder."""

    @staticmethod
    def forward(ctx, hidden, hidden_grad, loss):
        ctx.save_for_backward(hidden_grad)
        return loss.detach()

    @staticmethod
    def backward(ctx, grad_output):
        (hidden_grad,) = ctx.saved_tensors
        return hidden_grad * grad_output, None, None


def chunked_loss(tokens: torch.Tensor) -> torch.Tensor:
    """torchtitan 0.3's ChunkedLossWrapper call sequence: lm_head kept gathered over the chunks, each chunk's
    loss backward at once (gradient sync on the last chunk only), then the decoder's backward."""
    hidden = model.model(input_ids=tokens).last_hidden_state[:, :-1]
    labels = tokens[:, 1:]
    chunks = [c.detach().requires_grad_() for c in hidden.chunk(args.chunked_loss, dim=1)]
    label_chunks = labels.chunk(args.chunked_loss, dim=1)
    lm_head = model.lm_head
    lm_head.set_reshard_after_forward(False)
    lm_head.set_reshard_after_backward(False)
    lm_head.set_requires_gradient_sync(False, recurse=False)
    lm_head.unshard()
    hidden_grad = torch.zeros_like(hidden, dtype=torch.float32)
    total = hidden.new_zeros((), dtype=torch.float32)
    offset = 0
    for index, (chunk, chunk_labels) in enumerate(zip(chunks, label_chunks)):
        if index == len(chunks) - 1:
            lm_head.set_requires_gradient_sync(True, recurse=False)
        logits = lm_head(chunk).float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk_labels.flatten(), reduction="sum")
        loss = loss / labels.numel()
        total = total + loss.detach()
        loss.backward()
        hidden_grad[:, offset : offset + chunk.shape[1]] = chunk.grad
        offset += chunk.shape[1]
    lm_head.set_reshard_after_forward(True)
    lm_head.set_reshard_after_backward(True)
    lm_head.set_requires_gradient_sync(True, recurse=False)
    lm_head.reshard()
    return DecoderBackward.apply(hidden, hidden_grad.to(hidden.dtype), total)


result: dict = {"losses": [], "norms": [], "all_gathers": [], "step_s": [],
                "phase_s": {"forward and backward": [], "clip": [], "optimizer": []},
                "sched_s": {"on cpu": [], "waiting for a cpu": []}, "daemon_cpu_s": []}
profiler = cProfile.Profile() if args.profile and rank == 0 else None
for step in range(args.steps):
    if profiler is not None and step == 2:
        profiler.enable()
    started = time.perf_counter()
    scheduled_at_start = scheduled_seconds()
    if DAEMON_PID is not None:
        result["daemon_cpu_s"].append(daemon_cpu_seconds())  # (at each step's start, and once after the last)
    if args.backend == "dbuf":
        import dbuf.torch

        dbuf.torch.default_session().reset_step_stats()
    for micro in range(args.accum):
        last = micro == args.accum - 1
        if SHARDED:
            for root in roots:
                root.set_requires_gradient_sync(last)
        tokens = micro_batch(step, micro)
        if compute_copy is not None:
            with torch.no_grad():
                for computing, master in zip(compute_copy.parameters(), model.parameters()):
                    computing.copy_(master)
        if args.chunked_loss:
            loss = chunked_loss(tokens) / args.accum
        else:
            computing = compute_copy if compute_copy is not None else model
            loss = computing(input_ids=tokens, labels=tokens).loss / args.accum
        loss.backward()
        if compute_copy is not None:
            take_compute_grads()
        result["losses"].append(loss.item())
    backward_done = time.perf_counter()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    result["norms"].append((norm.full_tensor() if SHARDED else norm).item())
    clipped = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad()
    finished = time.perf_counter()
    for kind, now, before in zip(result["sched_s"], scheduled_seconds(), scheduled_at_start):
        result["sched_s"][kind].append(now - before)
    result["step_s"].append(finished - started)
    phases = (backward_done - started, clipped - backward_done, finished - clipped)
    for phase, seconds in zip(result["phase_s"], phases):
        result["phase_s"][phase].append(seconds)
    if args.backend == "dbuf":
        result["all_gathers"].append(dbuf.torch.default_session().stats.all_gathers)

if DAEMON_PID is not None:
    result["daemon_cpu_s"].append(daemon_cpu_seconds())
if profiler is not None:
    profiler.disable()
    profiler.dump_stats(args.profile)
# The most this process held resident, over what it held before making the model: parameters,
# gradients, optimizer state, activations, and (dbuf) the shared memory of dbufd's slots it touched.
result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - RSS_AT_START

if args.backend == "dbuf":
    result["replicas"] = dbuf.torch.default_session().replicas
if args.save:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=args.save)
torch.save(result, f"{args.out}.{rank}")
dist.barrier()
print("done", file=sys.stderr, flush=True)
# torch 2.15 often aborts in the interpreter's teardown where a DeviceMesh's gloo group ran a
# collective (docs/python.md): the results are written, so the exit status says how the run went.
sys.stdout.flush()
os._exit(0)
