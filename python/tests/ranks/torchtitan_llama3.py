"""One rank of torchtitan 0.3's Llama-3 debug model, prepared by torchtitan's own functions, on FSDP2 or dbuf.

  torchtitan_llama3.py OUT.pt --backend dbuf|fsdp2 [--ac none|full|selective] [--compile] [--steps N]

torchtitan's trainer needs CUDA (its meshes are built for the GPU), so this
script calls what its ``parallelize_llama`` calls, on a CPU mesh, in its
order: the debug model built on the meta device, ``ActivationCheckpointing``
(FullAC / SelectiveAC) ``.apply``, ``apply_compile``,
``apply_fsdp_to_decoder`` (its units, mixed precision and reshard policy),
then ``to_empty`` and ``init_states`` (torchtitan's init path), its
``ChunkedLossWrapper`` (lm_head per chunk, a backward each; lm_head grouped
with the final norm in one unit). Nothing names dbuf: ``--backend dbuf``
runs under ``DBUF_FSDP=1``. Writes OUT.pt.<rank>: losses and gradient norms.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate

SEQ, LOCAL_BATCH = 16, 2

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--backend", choices=("dbuf", "fsdp2"), required=True)
p.add_argument("--ac", choices=("none", "full", "selective"), default="none")
p.add_argument("--compile", action="store_true")
p.add_argument("--steps", type=int, default=3)
args = p.parse_args()

torch.set_num_threads(1)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if (os.environ.get("DBUF_FSDP") == "1") != (args.backend == "dbuf"):
    sys.exit(f"--backend {args.backend} with DBUF_FSDP={os.environ.get('DBUF_FSDP')}")

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss  # noqa: E402
from torchtitan.config import CompileConfig  # noqa: E402
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC  # noqa: E402
from torchtitan.distributed.compile import apply_compile  # noqa: E402
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402


class NoParallelism:
    """What apply_compile asks of torchtitan's ParallelDims: no tensor parallelism here."""

    tp_enabled = False


dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
config = model_registry("debugmodel").model
for layer in config.layers:
    # Causal SDPA for its flex attention, which has no backward on CPU (one document per sequence:
    # the same attention).
    layer.attention.inner_attention = ScaledDotProductAttention.Config()
with torch.device("meta"):
    model = config.build()
if args.ac == "full":
    FullAC(FullAC.Config()).apply(model)
elif args.ac == "selective":
    SelectiveAC(SelectiveAC.Config()).apply(model)
if args.compile:
    apply_compile(model, compile_config=CompileConfig(enable=True, backend="aot_eager"),
                  parallel_dims=NoParallelism())
apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False)
# apply_fsdp_to_decoder set every FSDP module's gradient divide factor to 1 (torchtitan's loss is a
# sum over the global batch's tokens, divided once by their count). FSDP2 divides with NCCL's
# PREMUL_SUM, which gloo lacks: sum, then divide.
for module in model.modules():
    if isinstance(module, FSDPModule):
        module.set_force_sum_reduction_for_comms(True)
assert isinstance(model, FSDPModule) and isinstance(model.lm_head, FSDPModule)
model.to_empty(device="cpu")
torch.manual_seed(0)
with torch.no_grad():
    model.init_states(buffer_device=torch.device("cpu"))
# The same model initialised in one process: what a rank's initialised parameters gather to is
# compared with it, then it is loaded (as torchtitan's checkpointer loads weights), so both backends
# train from the same values.
single = config.build()
torch.manual_seed(0)
with torch.no_grad():
    single.init_states(buffer_device=torch.device("cpu"))
pairs = list(zip(model.parameters(), single.parameters(), strict=True))
result: dict = {"losses": [], "norms": [],
                "init_as_one_process": all(torch.equal(mine.full_tensor(), one) for mine, one in pairs)}
with torch.no_grad():
    for mine, one in pairs:  # (torch's state-dict API does not take torchtitan's fused QKV names)
        mine.copy_(DTensor.from_local(one, mesh, [Replicate()], run_check=False))
model._skip_lm_head = True
loss_fn = ChunkedLossWrapper(ChunkedLossWrapper.Config(num_chunks=4, loss_fn=CrossEntropyLoss.Config()))
loss_fn.set_lm_head(model.lm_head)
optimizer = torch.optim.AdamW(model.parameters(), lr=8e-4, weight_decay=0.1)

for step in range(args.steps):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 2048, (LOCAL_BATCH * world, SEQ + 1), generator=g)
    mine = tokens[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]
    inputs, labels = mine[:, :-1], mine[:, 1:]
    global_tokens = torch.tensor(float(labels.numel() * world))
    positions = torch.arange(SEQ).expand(LOCAL_BATCH, SEQ)
    hidden = model(inputs, positions)
    loss, _ = loss_fn(hidden, labels, global_tokens, positions=positions)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    result["losses"].append(total.item())
    result["norms"].append(norm.full_tensor().item())

torch.save(result, f"{args.out}.{rank}")
dist.barrier()
print("done", file=sys.stderr, flush=True)
# torch 2.15's teardown abort with a DeviceMesh's gloo group (docs/python.md): the results are written.
sys.stdout.flush()
os._exit(0)
