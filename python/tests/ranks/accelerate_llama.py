"""One rank of a transformers Llama prepared by accelerate 1.15's own FSDP2 function, on FSDP2 or dbuf.

  accelerate_llama.py OUT.pt --backend dbuf|fsdp2 [--steps N] [--mp bf16]

accelerate runs FSDP2 only on accelerators (on CPU its Accelerator falls back
to DDP), so this script calls what its ``prepare`` calls for FSDP2,
``fsdp2_prepare_model(accelerator, model)``, with an accelerator holding what
that function reads (its FSDP plugin: transformer-based auto wrap, CPU-RAM
efficient loading, so the model goes to the meta device, is sharded, and
rank 0's weights are broadcast and loaded with ``load_state_dict(assign=True)``),
then trains with ``set_requires_gradient_sync`` as its ``no_sync`` does.
Nothing names dbuf: ``--backend dbuf`` runs under ``DBUF_FSDP=1``. Writes
OUT.pt.<rank>: losses and gradient norms.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--backend", choices=("dbuf", "fsdp2"), required=True)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--mp", choices=("fp32", "bf16"), default="fp32")
args = p.parse_args()

torch.set_num_threads(1)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if (os.environ.get("DBUF_FSDP") == "1") != (args.backend == "dbuf"):
    sys.exit(f"--backend {args.backend} with DBUF_FSDP={os.environ.get('DBUF_FSDP')}")

import transformers  # noqa: E402
from accelerate.utils import FullyShardedDataParallelPlugin  # noqa: E402
from accelerate.utils.fsdp_utils import fsdp2_prepare_model  # noqa: E402

VOCAB = 101
dist.init_process_group("gloo")
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=44, intermediate_size=70, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=22,
                                  tie_word_embeddings=False, use_cache=False)
model = transformers.LlamaForCausalLM(config)
bf16 = args.mp == "bf16"
plugin = FullyShardedDataParallelPlugin(
    fsdp_version=2, cpu_ram_efficient_loading=True, auto_wrap_policy="transformer_based_wrap",
    transformer_cls_names_to_wrap=["LlamaDecoderLayer"], reshard_after_forward=True,
    mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
    else None)
accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None,
                              mixed_precision="bf16" if bf16 else "no", is_main_process=rank == 0,
                              device=torch.device("cpu"))
model = fsdp2_prepare_model(accelerator, model)
assert isinstance(model, FSDPModule) and isinstance(model.model.layers[0], FSDPModule)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

result: dict = {"losses": [], "norms": []}
for step in range(args.steps):
    for micro in range(2):
        model.set_requires_gradient_sync(micro == 1)  # accelerate's no_sync for FSDP2
        g = torch.Generator().manual_seed(100 * step + micro)
        tokens = torch.randint(0, VOCAB, (3 * world, 10), generator=g)[3 * rank : 3 * (rank + 1)]
        loss = model(input_ids=tokens, labels=tokens).loss / 2
        loss.backward()
        result["losses"].append(loss.item())
    result["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor().item())
    optimizer.step()
    optimizer.zero_grad()

torch.save(result, f"{args.out}.{rank}")
dist.barrier()
print("done", file=sys.stderr, flush=True)
sys.stdout.flush()
os._exit(0)  # torch 2.15's teardown abort with a DeviceMesh's gloo group (docs/python.md)
