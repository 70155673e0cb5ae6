"""dbuf.torch.fully_shard in real rank processes against a real dbufd, bit for bit against a single process.

Every scenario trains tests/ranks/tiny_model.py for a few steps on W rank
processes (tests/ranks/train_tiny.py) and compares each rank's every loss, and
the final fp32 master parameters gathered by a full state dict, with
tiny_model.reference(): the same global batch, the same casts (fp32 master ->
bf16), the same reduction (fp32, ranks in order, times 1/W). They must be
equal, not close: any difference means a gradient, a cast or a reduction that
is not the one documented.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conftest import RANKS, run_ranks

sys.path.insert(0, str(RANKS))
from tiny_model import reference  # noqa: E402

STEPS = 3


def train(daemon, tmp_path: Path, world: int, *flags: str, job: str) -> list[dict]:
    out = tmp_path / "run"
    run_ranks("train_tiny.py", world, daemon.socket, str(out), "--steps", str(STEPS), *flags, job=job,
              env={"PYTHONPATH": str(RANKS)})
    return [torch.load(f"{out}.{rank}") for rank in range(world)]


def check_equal(results: list[dict], want_losses, want_state, prefix: str = "") -> None:
    """Every loss of every rank, and the parameters named `prefix...` of the gathered state, equal."""
    for rank, result in enumerate(results):
        got = [[row[m] for m in range(len(row))] for row in result["losses"]]
        want = [[step[m][rank] for m in range(len(step))] for step in want_losses]
        assert got == want, f"rank {rank}: losses {got} != reference {want}"
    state = results[0]["state"]
    wanted = {name: value for name, value in want_state.items() if name.startswith(prefix)}
    assert wanted and set(wanted) <= set(state)
    for name, value in wanted.items():
        assert torch.equal(state[name], value), f"{name}: max diff {(state[name] - value).abs().max()}"


@pytest.fixture(autouse=True)
def one_thread():
    # The rank processes compute with one thread; so does the reference (CPU
    # reductions are blocked by thread count).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("world", [2, 3])
def test_training_equals_the_single_process_reference(daemon, tmp_path, world):
    results = train(daemon, tmp_path, world, job=f"plain{world}")
    check_equal(results, *reference(STEPS, world))


def test_granularity_rows_and_a_resharded_root(daemon, tmp_path):
    results = train(daemon, tmp_path, 2, "--granularity", "rows:4", "--reshard-root", "--prefetch-depth", "1",
                    job="rows")
    check_equal(results, *reference(STEPS, 2))


def test_tied_embeddings_live_in_one_unit(daemon, tmp_path):
    results = train(daemon, tmp_path, 2, "--tied", job="tied")
    check_equal(results, *reference(STEPS, 2, tied=True))


def test_gradient_accumulation_with_sync_adds_the_reductions_in_fp32(daemon, tmp_path):
    results = train(daemon, tmp_path, 2, "--micro-batches", "2", job="accumulate")
    check_equal(results, *reference(STEPS, 2, micro_batches=2))


def test_gradient_accumulation_without_sync_reduces_once(daemon, tmp_path):
    # The unsynced micro-batch sets the unsharded gradients aside and gives the slots back: the
    # default pool (3 slots) serves 5 units.
    results = train(daemon, tmp_path, 2, "--micro-batches", "2", "--no-sync", job="nosync")
    check_equal(results, *reference(STEPS, 2, micro_batches=2, sync_every_micro=False))


def test_auto_wrap_chooses_units_and_trains_the_same(daemon, tmp_path):
    results = train(daemon, tmp_path, 2, "--auto-wrap", job="auto")
    check_equal(results, *reference(STEPS, 2))


@pytest.mark.parametrize("kind", ["muon", "adam8bit"])
def test_optimizers_on_each_ranks_own_blocks_equal_one_process(daemon, tmp_path, kind):
    # Muon: granularity "matrix" puts every matrix whole on one rank, so its
    # Newton-Schulz runs there with no gather. Adam8bit: rows:4 blocks, so
    # each quantisation block lies on one rank. Both equal the single-process
    # optimizer on the whole parameters, bit for bit, after training through dbuf.
    results = train(daemon, tmp_path, 4, "--optimizer", kind, job=kind)
    check_equal(results, *reference(STEPS, 4, optimizer=kind))


def test_two_forwards_then_one_backward(daemon, tmp_path):
    # A unit's gradients are whole only once the backward of its first
    # forward is done, so each unit keeps its slot until then: 4 units, 5 slots.
    results = train(daemon, tmp_path, 2, "--two-forwards", "--prefetch-depth", "4", job="twice")
    check_equal(results, *reference(STEPS, 2, two_forwards=True))


def test_blocks_only_with_inputs_as_keywords_and_one_slot_of_prefetch(daemon, tmp_path):
    # No root unit: the first block is the root (FSDP2's lazy root); the
    # blocks take x=... so their inputs are routed from the keywords.
    results = train(daemon, tmp_path, 2, "--blocks-only", "--kwargs-calls", "--prefetch-depth", "1", job="blocks")
    check_equal(results, *reference(STEPS, 2, freeze_outer=True, kwargs_calls=True), prefix="blocks.")


def test_a_bf16_model_accumulates_in_bf16(daemon, tmp_path):
    # bf16 shards: dbufd adds only into fp32 sharded gradients, so dbuf.torch
    # adds the reductions itself, in bf16, as the reference does.
    results = train(daemon, tmp_path, 2, "--bf16-model", "--micro-batches", "2", job="bf16")
    check_equal(results, *reference(STEPS, 2, micro_batches=2, master_dtype=torch.bfloat16))


@pytest.mark.parametrize("flag", ["--fail-forward-step", "--fail-backward-step"])
def test_training_goes_on_after_a_forward_or_a_backward_that_raised(daemon, tmp_path, flag):
    results = train(daemon, tmp_path, 2, flag, "1", "--prefetch-depth", "1", job=flag.strip("-"))
    want_losses, want_state = reference(STEPS, 2, skip_steps=(1,))
    if flag == "--fail-forward-step":
        for step in want_losses[1]:
            step[:] = [None] * len(step)  # no loss: the forward raised
    check_equal(results, want_losses, want_state)


def test_clip_grad_norm_uses_the_whole_gradient(daemon, tmp_path):
    # The norm is summed over the ranks' shards in another order than one
    # process sums it: equal to fp32 rounding, not bit for bit.
    results = train(daemon, tmp_path, 2, "--clip", "0.5", job="clip")
    losses, state = reference(STEPS, 2, clip=0.5)
    for rank, result in enumerate(results):
        got = [row[0] for row in result["losses"]]
        assert got == pytest.approx([step[0][rank] for step in losses], rel=1e-5)
    for name, value in state.items():
        assert torch.allclose(results[0]["state"][name], value, rtol=1e-4, atol=1e-6), name


def test_the_inputs_routed_to_the_post_backward_are_those_pytree_finds():
    # A unit's forward routes its inputs that need a gradient through the
    # function whose backward runs its post-backward. The hooks look at the
    # top level themselves and leave anything nested to torch's pytree: both
    # must find the same tensors, in pytree's order.
    from collections import namedtuple

    from torch.utils._pytree import tree_flatten

    from dbuf.torch._hooks import _top_level_grad_inputs

    grad, plain = torch.ones(2, requires_grad=True), torch.ones(2)
    Pair = namedtuple("Pair", "first second")

    class Opaque:  # pytree does not look inside
        tensor = grad

    def pytree_finds(args, kwargs):
        flat, _ = tree_flatten((args, kwargs))
        return [id(t) for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]

    def top_level_finds(args, kwargs, places):
        return [id(args[p] if isinstance(p, int) else kwargs[p]) for p in places]

    top_level = [
        ((grad, plain, None, 3, "s"), {"mask": plain, "hidden": grad}, [0, "hidden"]),
        ((plain, (plain, plain), {"k": [plain, 1.5]}), {"cache": Opaque()}, []),
        ((), {"x": grad, "y": grad}, ["x", "y"]),
    ]
    for args, kwargs, places in top_level:
        assert _top_level_grad_inputs(args, kwargs) == places
        assert top_level_finds(args, kwargs, places) == pytree_finds(args, kwargs)
    nested = [
        (((grad,),), {}),
        ((), {"d": {"h": [plain, grad]}}),
        ((Pair(plain, plain),), {}),  # a pytree node other than tuple, list, dict: pytree decides
    ]
    for args, kwargs in nested:
        assert _top_level_grad_inputs(args, kwargs) is None
