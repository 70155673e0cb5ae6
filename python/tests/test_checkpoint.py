"""PyTorch's own checkpoint, state-dict and clipping APIs on dbuf.torch, side by side with FSDP2.

Hugging Face ``transformers`` models (a dense Llama and a Qwen3-MoE with 3-D
expert tensors, tiny random-init configs whose dimensions the world sizes do
not divide) trained by rank processes (tests/ranks/checkpoint_hf.py) on a real
dbufd and on FSDP2 over gloo, saved and loaded with
``torch.distributed.checkpoint`` and ``get_state_dict`` / ``set_state_dict``
exactly as torchtitan does. Every comparison of dbuf with dbuf is bit for bit:

* dbuf's losses agree with FSDP2's at every step (equal at the first; then to
  1e-5, as the gradient norms: gloo sums some elements in another order);
* a run resumed from a checkpoint continues with the uninterrupted run's
  losses and ends with its state;
* a checkpoint loads into another world size, another granularity, or the
  other backend with every parameter and AdamW state equal to what was saved
  (full state dicts gathered by ``get_model_state_dict`` /
  ``get_optimizer_state_dict`` with ``full_state_dict``);
* ``dcp_to_torch_save`` turns dbuf's checkpoint into one file equal to that;
* ``model.state_dict()`` holds DTensors of the declared shapes, and the full
  state dict gathered on rank 0 before training is the single-process model's
  ``state_dict()`` (checked in the rank script); ``dcp.async_save`` writes
  what ``dcp.save`` does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import run_ranks

pytest.importorskip("transformers")

STEPS, SAVE_AT = 4, 2


def run(daemon, tmp_path: Path, name: str, backend: str, model: str, world: int, *flags: str) -> list[dict]:
    out = tmp_path / name
    run_ranks("checkpoint_hf.py", world, daemon.socket, str(out), "--backend", backend, "--model", model, *flags,
              job=name, timeout=600)
    return [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(world)]


def assert_same_state(got: dict, want: dict, what: str) -> None:
    """Model and optimizer state dicts (nested dicts of tensors and numbers) equal, bit for bit."""
    def walk(a, b, path):
        if isinstance(b, dict):
            assert isinstance(a, dict) and set(a) == set(b), f"{what} {path}: keys {sorted(a)} != {sorted(b)}"
            for key in b:
                walk(a[key], b[key], f"{path}.{key}")
        elif isinstance(b, torch.Tensor):
            assert a.shape == b.shape and a.dtype == b.dtype, f"{what} {path}: {a.shape} {a.dtype} != {b.shape}"
            assert torch.equal(a, b), f"{what} {path}: max diff {(a.float() - b.float()).abs().max()}"
        elif isinstance(b, (list, tuple)):
            assert len(a) == len(b), f"{what} {path}"
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{path}[{i}]")
        else:
            assert a == b, f"{what} {path}: {a} != {b}"

    walk(got, want, "")


@pytest.fixture
def hf_daemon():
    from dbuf.testing import Daemon

    # Rank processes import transformers (seconds on a loaded machine) before they register.
    with Daemon(timeouts={"collective_ms": 60000, "register_ms": 60000}) as d:
        yield d


@pytest.mark.parametrize("model", ["llama", "qwen3moe"])
def test_dcp_round_trips_across_backends_world_sizes_and_granularities(hf_daemon, tmp_path, model):
    daemon = hf_daemon
    checkpoint = tmp_path / "dbuf-ckpt"
    fsdp2_checkpoint = tmp_path / "fsdp2-ckpt"
    clip = ("--clip", "1e3")  # measured, not scaling: FSDP2 sums the norm in another order (see below)
    # dbuf saves with dcp.async_save (staged in host memory), FSDP2 with dcp.save.
    dbuf = run(daemon, tmp_path, "dbuf4", "dbuf", model, 4, "--steps", str(STEPS), "--save-at", str(SAVE_AT),
               "--checkpoint", str(checkpoint), "--async-save", *clip)
    fsdp2 = run(daemon, tmp_path, "fsdp2-4", "fsdp2", model, 4, "--steps", str(STEPS), "--save-at", str(SAVE_AT),
                "--checkpoint", str(fsdp2_checkpoint), *clip)

    # Training: dbuf's losses and torch's clip_grad_norm_ (the global norm, on every rank) are FSDP2's.
    # The norms are summed over other partitions of the gradient (each rank's ragged range against
    # FSDP2's rows), so they agree to rounding; every rank gets the same one.
    # The first step's losses are equal; later ones to 1e-5: see the states below.
    for rank in range(4):
        assert dbuf[rank]["losses"][0] == fsdp2[rank]["losses"][0], f"rank {rank}"
        assert dbuf[rank]["losses"] == pytest.approx(fsdp2[rank]["losses"], rel=1e-5), f"rank {rank}"
        assert dbuf[rank]["norms"] == dbuf[0]["norms"], f"rank {rank}: every rank gets the global norm"
    assert dbuf[0]["norms"] == pytest.approx(fsdp2[0]["norms"], rel=1e-6)
    # dbuf's norm is summed over the ranks through dbufd, FSDP2's through torch's all-reduce.
    assert all(count == 0 for count in dbuf[0]["clip_collectives"]), dbuf[0]["clip_collectives"]
    assert all(count >= 1 for count in fsdp2[0]["clip_collectives"]), fsdp2[0]["clip_collectives"]
    # Every norm type (inf: a max over ranks some of which hold nothing of a tensor), after
    # GradScaler's unscale_ (found_inf agreed over the ranks).
    for rank in range(4):
        assert dbuf[rank]["norm_types"] == dbuf[0]["norm_types"], f"rank {rank}"
    for norm_type, value in dbuf[0]["norm_types"].items():
        assert value == pytest.approx(fsdp2[0]["norm_types"][norm_type], rel=1e-5), norm_type
    # The states are not compared with FSDP2's: gloo's reduce-scatter sums some elements in another
    # order than dbufd's rank order, and Adam turns a last-bit difference of a near-zero gradient
    # into up to 1e-6 of a weight after two steps (measured), which no fixed tolerance bounds.

    # The same job size resumes bit for bit: the uninterrupted run's losses and final state.
    resumed = run(daemon, tmp_path, "dbuf4-resumed", "dbuf", model, 4, "--steps", str(STEPS), "--start",
                  str(SAVE_AT), "--load", str(checkpoint), *clip)
    assert_same_state(resumed[0]["loaded"], dbuf[0]["saved"], "loaded at 4 ranks")
    for rank in range(4):
        assert resumed[rank]["losses"] == dbuf[rank]["losses"][SAVE_AT:], f"rank {rank}"
    assert_same_state(resumed[0]["final"], dbuf[0]["final"], "resumed at 4 ranks")

    # Resharding on load, every parameter and AdamW state: dbuf at 4 -> dbuf at 3 with another
    # granularity, dbuf at 4 -> FSDP2 at 2, FSDP2 at 4 -> dbuf at 3.
    # Both go on training with gradients clipped (scaled: the norms are above 0.5) by torch's
    # clip_grad_norm_: each rank scales by the global norm, so the two runs agree to rounding.
    scaled = ("--clip", "0.5")
    rows = run(daemon, tmp_path, "dbuf3-rows", "dbuf", model, 3, "--steps", str(STEPS), "--start", str(SAVE_AT),
               "--load", str(checkpoint), "--granularity", "rows:2", *scaled)
    assert_same_state(rows[0]["loaded"], dbuf[0]["saved"], "dbuf@4 -> dbuf@3 rows:2")
    to_fsdp2 = run(daemon, tmp_path, "fsdp2-2", "fsdp2", model, 2, "--steps", str(STEPS), "--start",
                   str(SAVE_AT), "--load", str(checkpoint), *scaled)
    assert_same_state(to_fsdp2[0]["loaded"], dbuf[0]["saved"], "dbuf@4 -> FSDP2@2")
    assert min(rows[0]["norms"]) > 0.5
    assert all(result["norms"] == rows[0]["norms"] for result in rows)
    assert rows[0]["norms"] == pytest.approx(to_fsdp2[0]["norms"], rel=1e-5)
    dbuf_mean = [sum(losses) / 3 for losses in zip(*(result["losses"] for result in rows))]
    fsdp2_mean = [sum(losses) / 2 for losses in zip(*(result["losses"] for result in to_fsdp2))]
    assert dbuf_mean == pytest.approx(fsdp2_mean, rel=1e-5)
    from_fsdp2 = run(daemon, tmp_path, "dbuf3-from-fsdp2", "dbuf", model, 3, "--steps", str(SAVE_AT), "--start",
                     str(SAVE_AT), "--load", str(fsdp2_checkpoint), "--granularity", "matrix")
    assert_same_state(from_fsdp2[0]["loaded"], fsdp2[0]["saved"], "FSDP2@4 -> dbuf@3 matrix")

    # One process: the checkpoint as one torch.save file holds the whole tensors.
    single = tmp_path / "single.pt"
    dcp_to_torch_save(checkpoint, single)
    whole = torch.load(single, weights_only=False)
    assert_same_state(whole["model"], dbuf[0]["saved"]["model"], "dcp_to_torch_save")


@pytest.mark.parametrize(("optimizer", "granularity"), [("adam8bit", "rows:2"), ("muon", "matrix")])
def test_dbufs_own_optimizers_checkpoint_their_states_through_dcp(hf_daemon, tmp_path, optimizer, granularity):
    # Adam8bit's codes (the parameter's layout) and per-block scales, Muon's momentum: RaggedShard
    # DTensors, saved whole; a resumed job continues bit for bit, another world size loads them
    # (the same rule, so the same blocks).
    checkpoint = tmp_path / "ckpt"
    flags = ("--optimizer", optimizer, "--granularity", granularity)
    first = run(hf_daemon, tmp_path, "first", "dbuf", "llama", 4, "--steps", str(STEPS), "--save-at", str(SAVE_AT),
                "--checkpoint", str(checkpoint), *flags)
    resumed = run(hf_daemon, tmp_path, "resumed", "dbuf", "llama", 4, "--steps", str(STEPS), "--start", str(SAVE_AT),
                  "--load", str(checkpoint), *flags)
    for rank in range(4):
        assert resumed[rank]["losses"] == first[rank]["losses"][SAVE_AT:], f"rank {rank}"
    assert_same_state(resumed[0]["final"], first[0]["final"], f"{optimizer} resumed")
    three = run(hf_daemon, tmp_path, "three", "dbuf", "llama", 3, "--steps", str(SAVE_AT), "--start", str(SAVE_AT),
                "--load", str(checkpoint), *flags)
    assert_same_state(three[0]["loaded"], first[0]["saved"], f"{optimizer} dbuf@4 -> dbuf@3")
