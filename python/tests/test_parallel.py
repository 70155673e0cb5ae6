"""fully_shard with tensor and expert parallelism, side by side with FSDP2 running the same plan.

tests/ranks/trainer_parallel.py, 4 rank processes, on FSDP2 over gloo and
under dbuf's switch on a real dbufd (TP's and EP's own collectives run over
gloo on both):

* dp 2 x tp 2, a transformers Llama with the Megatron plan of torch's
  ``parallelize_module`` (and with sequence parallel norms, whose weights are
  Replicate DTensors with Partial gradients), fp32 and bf16;
* replicate 2 x dp 2 x tp 2 (8 ranks): HSDP beside TP;
* ep 2 x dp 2, a transformers Qwen3-MoE whose experts are ``Shard(0)`` over
  ep and sharded over dp, the rest sharded over all 4 ranks (torchtitan's
  layout: two dbuf jobs in each process, one forward and backward), or HSDP
  (replicated over ep, sharded over dp) in bf16 with whole experts per rank
  (torchtitan's ``shard_placement_fn`` Shard(0): each rank's RaggedShard
  blocks are whole experts).

Each step's loss and gradient norm must equal FSDP2's. With 2 dp ranks both
sum a reduce-scatter's two parts in the one order there is, so they are
equal bit for bit (measured); over 4 ranks (torchtitan's EP layout) gloo
sums in another order than dbufd (measured: 1e-7 relative); the tolerance
is test_trainers.py's, relative 1e-5 in fp32 and 1e-3 in bf16.
dbuf's all-gather bytes per step must not exceed FSDP2's at element
granularity: the planner pads a group once, FSDP2 pads every tensor.

Checkpoints: a DCP checkpoint saved at one layout is loaded at another (dp 2
x tp 2 -> dp 4, dp 4 -> dp 2 x tp 2, ep 2 x dp 2 -> dp 4 and -> the HSDP EP
layout, by dbuf and by FSDP2 either way), and the loaded parameters and AdamW states, gathered
whole, must equal the saved ones bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import run_ranks

pytest.importorskip("transformers")

WORLD, STEPS = 4, 3


def run(daemon, tmp_path: Path, name: str, backend: str, *flags: str, world: int = WORLD) -> dict:
    out = tmp_path / name
    env = {"DBUF_FSDP": "1" if backend == "dbuf" else "0"}
    run_ranks("trainer_parallel.py", world, daemon.socket, str(out), "--backend", backend, "--steps", str(STEPS),
              *flags, job=f"{tmp_path.name}-{name}", env=env, timeout=600)
    return torch.load(f"{out}.0", weights_only=False)


def assert_as_fsdp2(fsdp2: dict, dbuf: dict, flags: list[str]) -> None:
    print(f"{flags}: losses dbuf {dbuf['losses']} FSDP2 {fsdp2['losses']}; norms dbuf {dbuf['norms']} FSDP2 "
          f"{fsdp2['norms']}; all-gather bytes per step dbuf {dbuf['all_gather_bytes']} FSDP2 "
          f"{fsdp2['all_gather_bytes']}")
    assert len(dbuf["losses"]) == len(fsdp2["losses"]) == STEPS
    assert dbuf["losses"][0] == fsdp2["losses"][0], "the first loss (the same parameters gathered)"
    tol = 1e-3 if "bf16" in flags else 1e-5
    for what in ("losses", "norms"):
        for step, (got, want) in enumerate(zip(dbuf[what], fsdp2[what])):
            assert abs(got - want) <= tol * max(1.0, abs(want)), f"{what}[{step}]: dbuf {got}, FSDP2 {want}"


@pytest.mark.parametrize("flags", [
    ["--model", "llama", "--tp", "2"],
    ["--model", "llama", "--tp", "2", "--sp", "--mp", "bf16"],
    ["--model", "qwen3moe", "--ep", "2"],
    ["--model", "qwen3moe", "--ep", "2", "--ep-dense", "hsdp", "--mp", "bf16", "--whole-experts"],
], ids=["tp2", "tp2-sp-bf16", "ep2", "ep2-hsdp-bf16"])
def test_losses_as_fsdp2_with_the_same_plan(daemon, tmp_path, flags):
    fsdp2 = run(daemon, tmp_path, "fsdp2", "fsdp2", *flags)
    dbuf = run(daemon, tmp_path, "dbuf", "dbuf", *flags)
    assert_as_fsdp2(fsdp2, dbuf, flags)
    if "--whole-experts" in flags:
        # Whole experts: each of the unit's two expert tensors would need a cut inside it; one buffer has one
        # cut per pair of ranks, so the planner pads where FSDP2 splits each tensor in the middle.
        assert dbuf["experts_whole"] and all(dbuf["experts_whole"]), "every rank holds whole experts"
    else:
        assert 0 < dbuf["all_gather_bytes"][-1] <= fsdp2["all_gather_bytes"][-1]
    if "--tp" in flags:
        # dbuf's helpers that move tensors through its job (the dp ranks) refuse TP parameters, pointing to torch's.
        refusals = dbuf["refusals"]
        assert len(refusals) == 3, refusals
        assert "torch.nn.utils.clip_grad_norm_" in refusals[0]
        assert "torch.distributed.checkpoint.state_dict" in refusals[1]
        assert "Muon" in refusals[2] and "tensor / expert parallelism" in refusals[2]


def assert_same_state(loaded: dict, saved: dict, what: str) -> None:
    assert loaded["model"].keys() == saved["model"].keys(), what
    for name, value in saved["model"].items():
        assert torch.equal(loaded["model"][name], value), f"{what}: {name}"
    assert loaded["optim"].keys() == saved["optim"].keys(), what
    for name, states in saved["optim"].items():
        for state, value in states.items():
            assert torch.equal(loaded["optim"][name][state], value), f"{what}: {name} {state}"


@pytest.mark.parametrize("save, loads", [
    (("dbuf", "--tp", "2"), [("dbuf", "--tp", "1"), ("fsdp2", "--tp", "1")]),
    # tp 4: torch.chunk cuts the MLP's 90 rows 23, 23, 23, 21: each tp rank's dbuf job plans its own chunk.
    (("dbuf", "--tp", "1"), [("dbuf", "--tp", "2"), ("dbuf", "--tp", "4")]),
    (("fsdp2", "--tp", "2"), [("dbuf", "--tp", "2")]),
    (("dbuf", "--model", "qwen3moe", "--ep", "2"), [("dbuf", "--model", "qwen3moe"),
                                                   ("fsdp2", "--model", "qwen3moe"),
                                                   ("dbuf", "--model", "qwen3moe", "--ep", "2", "--ep-dense", "hsdp")]),
], ids=["dbuf-tp2", "dbuf-dp4", "fsdp2-tp2", "dbuf-ep2"])
def test_a_checkpoint_loads_at_other_degrees_bit_for_bit(daemon, tmp_path, save, loads):
    """DCP: saved after training at one layout, loaded (model and optimizer) at another, equal when gathered whole."""
    checkpoint = str(tmp_path / "checkpoint")
    saved = run(daemon, tmp_path, "save", save[0], *save[1:], "--save", checkpoint)["final"]
    for index, (backend, *flags) in enumerate(loads):
        loaded = run(daemon, tmp_path, f"load{index}", backend, *flags, "--load", checkpoint)["final"]
        assert_same_state(loaded, saved, f"saved by {save}, loaded by {backend} {flags}")


def test_hsdp_beside_tensor_parallelism(daemon, tmp_path):
    """8 ranks, (replicate 2, dp 2, tp 2): HSDP over the first two dims beside TP, as FSDP2; its checkpoint at dp 4.

    Each replica has a shard group per tp rank: 4 dbuf jobs of 2 ranks.
    """
    flags = ["--model", "llama", "--tp", "2", "--replicas", "2"]
    checkpoint = str(tmp_path / "checkpoint")
    fsdp2 = run(daemon, tmp_path, "fsdp2", "fsdp2", *flags, world=8)
    dbuf = run(daemon, tmp_path, "dbuf", "dbuf", *flags, "--save", checkpoint, world=8)
    assert_as_fsdp2(fsdp2, dbuf, flags)
    loaded = run(daemon, tmp_path, "load", "dbuf", "--tp", "1", "--load", checkpoint)["final"]
    assert_same_state(loaded, dbuf["final"], "saved by HSDP beside TP, loaded at dp 4")
