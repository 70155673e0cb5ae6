"""RaggedShard and RaggedDTensor in one process: layouts, DCP's rectangles, and the operators they take or refuse.

Ranks are simulated with meshes that know their coordinate but have no
process group (conftest.rank_mesh); what needs a collective is tested by the
rank processes of test_checkpoint.py.
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard

from conftest import rank_mesh
from dbuf.torch import RaggedDTensor, RaggedShard, StridedRaggedShard, distribute_ragged, local_elements
from dbuf.torch._ragged import boxes_of

FAST_PATH = os.environ.get("DBUF_TORCH_FAST_PATH", "1") == "1"  # RaggedDTensor's torch-function fast path


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 3, 4), (4, 1, 3), (2, 0, 3)])
def test_boxes_cover_every_range_exactly_in_order(shape):
    numel = math.prod(shape)
    index = torch.arange(numel).reshape(shape)
    for begin, end in itertools.combinations_with_replacement(range(numel + 1), 2):
        boxes = boxes_of(shape, begin, end)
        flat = []
        for box in boxes:
            region = index[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
            assert region.reshape(-1)[0].item() == box.flat_begin if box.numel else True
            flat += region.reshape(-1).tolist()
        assert flat == list(range(begin, end)), (shape, begin, end, boxes)
        assert len(boxes) <= 2 * max(len(shape), 1) - 1 or end - begin == 0


def test_a_placement_is_its_ranks_blocks_in_rank_order():
    placement = RaggedShard(4, (2, 0, 3))  # 19 elements: blocks of 4, the last one of 3
    placement.check(19)
    assert [placement.rank_range(r, 19) for r in range(3)] == [(0, 8), (8, 8), (8, 19)]
    with pytest.raises(ValueError, match="5 blocks for a tensor of 24 elements"):
        placement.check(24)
    assert placement == RaggedShard(4, [2, 0, 3]) and placement != RaggedShard(2, (4, 0, 6))
    assert len({placement, RaggedShard(4, (2, 0, 3))}) == 1


def ranks_of(whole: torch.Tensor, placement: RaggedShard) -> list[RaggedDTensor]:
    return [distribute_ragged(whole, rank_mesh(r, placement.ranks), placement) for r in range(placement.ranks)]


def test_the_global_shape_is_what_code_reads_and_elementwise_operators_stay_local():
    whole = torch.randn(5, 6)
    placement = RaggedShard(6, (2, 3))  # rows:1 over 2 ranks
    for rank, param in enumerate(ranks_of(whole, placement)):
        param = torch.nn.Parameter(param)
        assert param.shape == (5, 6) and param.dim() == 2 and param.numel() == 30
        begin, end = placement.rank_range(rank, 30)
        assert torch.equal(local_elements(param), whole.reshape(-1)[begin:end])
        state = torch.zeros_like(param)
        torch._foreach_add_([state], [param], alpha=2.0)
        torch._foreach_mul_([state], 0.5)
        assert isinstance(state, RaggedDTensor) and torch.equal(local_elements(state), local_elements(param))
        half = param.detach().to(torch.bfloat16)
        assert half.dtype == torch.bfloat16 and half.placements == param.placements
        with torch.no_grad():
            param.copy_(whole * 3)  # a whole tensor: this rank's elements of it
        assert torch.equal(local_elements(param), (whole * 3).reshape(-1)[begin:end])


def test_operators_that_need_the_whole_tensor_are_refused_by_name():
    (param, _) = ranks_of(torch.randn(4, 4), RaggedShard(4, (1, 3)))
    with pytest.raises(NotImplementedError, match="aten.mm.*full_tensor"):
        param @ torch.randn(4, 4)
    with pytest.raises(NotImplementedError, match="aten.view"):
        param.view(16)
    with pytest.raises(ValueError, match="plain tensor of shape"):
        param + torch.randn(4, 4)
    other = ranks_of(torch.randn(4, 4), RaggedShard(4, (2, 2)))[0]
    with pytest.raises(ValueError, match="different layouts"):
        param + other
    with pytest.raises(ValueError, match="copying a plain tensor of shape"):
        param.detach().copy_(torch.randn(3, 3))


def test_dcp_chunks_are_views_of_the_local_elements():
    whole = torch.arange(24.0).reshape(2, 3, 4)
    for param in ranks_of(whole, RaggedShard(1, (5, 13, 6))):
        for chunk in param.__create_chunk_list__():
            index = type("Index", (), {"offset": chunk.offsets, "fqn": "w"})()
            view = param.__get_tensor_shard__(index)
            region = whole[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))]
            assert torch.equal(view, region)
            assert view.untyped_storage().data_ptr() == local_elements(param).untyped_storage().data_ptr()


def test_reset_parameters_and_shape_aware_code_read_the_global_shape():
    layer = torch.nn.Linear(6, 5)
    placement = RaggedShard(6, (3, 2))
    for name in ("weight", "bias"):
        whole = getattr(layer, name).detach()
        ragged = RaggedShard(1, (3, 2)) if name == "bias" else placement
        setattr(layer, name, torch.nn.Parameter(distribute_ragged(whole, rank_mesh(1, 2), ragged)))
    layer.reset_parameters()  # fan-in from the global shape, uniform_ on the local elements
    assert local_elements(layer.weight).abs().max() <= 1 / math.sqrt(6)
    decay = [p for p in layer.parameters() if p.dim() >= 2]
    assert len(decay) == 1 and decay[0] is layer.weight
    assert sum(p.numel() for p in layer.parameters()) == 6 * 5 + 5


def test_random_fills_draw_what_one_process_draws():
    # Every rank draws the whole tensor from the same generator state and keeps its elements.
    placement = RaggedShard(1, (7, 0, 13))
    torch.manual_seed(3)
    want = torch.empty(4, 5).normal_(0.0, 2.0)
    for param in ranks_of(torch.zeros(4, 5), placement):
        torch.manual_seed(3)
        param.normal_(0.0, 2.0)
        begin, end = param.element_range
        assert torch.equal(local_elements(param), want.reshape(-1)[begin:end])


def test_a_rank_holding_nothing_gives_the_identity_of_each_reduction():
    (_, empty) = ranks_of(torch.randn(6), RaggedShard(1, (6, 0)))
    assert local_elements(empty).numel() == 0
    for norm_type, identity in ((2.0, 0.0), (1.0, 0.0), (math.inf, 0.0), (-math.inf, math.inf)):
        norm = torch.linalg.vector_norm(empty, norm_type)
        assert norm.to_local().item() == identity, norm_type
    assert torch.linalg.vector_norm(empty, 2.0, keepdim=True).shape == (1,)
    (_, empty_ints) = ranks_of(torch.arange(6), RaggedShard(1, (6, 0)))
    assert empty_ints.max().to_local().item() == torch.iinfo(torch.int64).min


def test_a_functional_optimizer_step_returns_lists_of_ragged_tensors():
    whole = torch.randn(3, 4)
    (param, _) = ranks_of(whole, RaggedShard(4, (2, 1)))
    grad, m, v = (torch.ones_like(param) for _ in range(3))
    steps = [torch.tensor(1.0)]
    out = torch.ops.aten._fused_adamw([param], [grad], [m], [v], [], steps, lr=0.1, beta1=0.9, beta2=0.99,
                                     weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
    assert len(out) == 5 and all(isinstance(t, RaggedDTensor) for lists in out[:4] for t in lists)
    assert torch.equal(local_elements(param), whole.reshape(-1)[:8])  # functional: the operand unchanged


def test_a_tensor_of_no_elements_is_one_empty_chunk_of_rank_0():
    (first, second) = ranks_of(torch.zeros(0, 3), RaggedShard(3, (0, 0)))
    assert [tuple(c.sizes) for c in first.__create_chunk_list__()] == [(0, 3)]
    assert second.__create_chunk_list__() == []


def test_dcp_refuses_a_plain_dtensor_with_a_ragged_placement(tmp_path):
    # torch has no local shape for a placement it does not know: its generic path would save a fragment.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    mesh = rank_mesh(0, 1)
    plain = DTensor.from_local(torch.arange(6.0), mesh, [RaggedShard(1, (6,))], run_check=False,
                               shape=torch.Size([2, 3]), stride=(3, 1))
    assert not isinstance(plain, RaggedDTensor)
    # DCP wraps the planner's error (ours: ValueError) in its CheckpointException, per rank.
    with pytest.raises(BaseException) as raised:  # CheckpointException derives from BaseException
        dcp.save({"w": plain}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    errors = [raised.value, *getattr(raised.value, "failures", {}).values()]
    assert any("w is a plain DTensor with a RaggedShard placement" in str(e) for e in errors), errors
    assert not any((tmp_path / "ckpt").glob("*.distcp")), "nothing written"
    ragged = distribute_ragged(torch.arange(6.0).reshape(2, 3), mesh, RaggedShard(1, (6,)))
    dcp.save({"w": ragged}, checkpoint_id=tmp_path / "ok", no_dist=True)  # its own chunks: saved whole


def model_parallel_mesh(rank: int) -> DeviceMesh:
    """A (dp 2, tp 2) mesh as rank `rank` of 4 sees it (dp first, FSDP2's order), without a process group."""
    return DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp"), _init_backend=False,
                      _rank=rank)


@pytest.mark.parametrize("model_placement", [Shard(0), Shard(1), Replicate()], ids=str)
def test_with_tensor_parallelism_the_ranks_chunks_cover_the_tensor_and_dcp_places_them(model_placement):
    """RaggedShard cuts what tensor parallelism leaves a rank; DCP's rectangles sit at that chunk's offset."""
    whole = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)
    chunk_rows = {Shard(0): (4, 3), Shard(1): (7, 7), Replicate(): (7, 7)}[model_placement]
    covered = torch.zeros(7, 6)
    for rank in range(4):
        mesh = model_parallel_mesh(rank)
        dp_rank, tp_rank = divmod(rank, 2)
        numel = chunk_rows[tp_rank] * (3 if model_placement == Shard(1) else 6)
        blocks = -(-numel // 5)
        ragged = (StridedRaggedShard(5, (blocks - 1, 1), 2) if model_placement == Shard(0)
                  else RaggedShard(5, (blocks - 1, 1)))
        param = distribute_ragged(whole, mesh, (ragged, model_placement))
        assert param.shape == (7, 6) and param.placements == (ragged, model_placement)
        begin, end = ragged.rank_range(dp_rank, numel)
        assert param.to_local().numel() == end - begin
        for chunk in param.__create_chunk_list__():
            box = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
            index = type("Index", (), {"offset": chunk.offsets, "fqn": "w"})()
            assert torch.equal(param.__get_tensor_shard__(index), whole[box])
            covered[box] += 1
    # Every element written once per rank that holds it: twice where tensor parallelism replicates.
    assert torch.equal(covered, torch.full((7, 6), 2.0 if model_placement == Replicate() else 1.0))


def test_a_whole_tensor_reduction_is_partial_over_the_dims_that_shard_it():
    whole = torch.randn(4, 6)
    for model_placement, expected, blocks in ((Shard(1), "Shard", (2, 2)), (Replicate(), "Replicate", (4, 4))):
        param = distribute_ragged(whole, model_parallel_mesh(1), (RaggedShard(3, blocks), model_placement))
        norm = torch.linalg.vector_norm(param)
        assert norm.placements[0].is_partial()
        assert norm.placements[1].is_partial() == (expected == "Shard")


def test_a_2d_layout_takes_a_ragged_dp_dim_then_shard_or_replicate():
    mesh = model_parallel_mesh(0)
    whole = torch.zeros(4, 6)
    with pytest.raises(ValueError, match="one placement per other dimension"):
        distribute_ragged(whole, mesh, RaggedShard(6, (1, 1)))
    with pytest.raises(ValueError, match="one placement per other dimension"):
        distribute_ragged(whole, mesh, (Shard(0), RaggedShard(6, (1, 1))))
    with pytest.raises(ValueError, match="Shard\\(d\\) or Replicate\\(\\) only"):
        distribute_ragged(whole, mesh, (RaggedShard(6, (1, 1)), Partial()))
    with pytest.raises(ValueError, match="blocks for a tensor of 12 elements"):
        distribute_ragged(whole, mesh, (RaggedShard(6, (2, 2)), Shard(0)))  # the chunk is 2 x 6, not 4 x 6


@pytest.mark.parametrize("flags", [{"foreach": False}, {"foreach": True}, {"fused": True}])
def test_the_fast_path_steps_an_optimizer_as_torchs_dispatch_does(flags):
    """AdamW on RaggedShard parameters outside autograd (RaggedDTensor.__torch_function__'s fast path) against
    the same on the plain local tensors: the same bits, the same types, the wrappers' versions bumped."""
    wholes = [torch.randn(5, 6), torch.randn(7), torch.randn(3, 4)]
    placements = [RaggedShard(6, (2, 3)), RaggedShard(1, (4, 3)), RaggedShard(4, (3, 0))]
    ragged = [torch.nn.Parameter(ranks_of(w, p)[0]) for w, p in zip(wholes, placements)]
    plain = [torch.nn.Parameter(local_elements(p).clone()) for p in ragged]
    for mine, theirs in zip(ragged, plain):
        theirs.grad = torch.randn(theirs.shape)
        mine.grad = distribute_ragged(torch.zeros(mine.shape), mine.device_mesh, mine.placements)
        local_elements(mine.grad).copy_(theirs.grad)
    optimizers = [torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **flags) for params in (ragged, plain)]
    versions = [p._version for p in ragged]
    for _ in range(3):
        for optimizer in optimizers:
            optimizer.step()
    for mine, theirs in zip(ragged, plain):
        assert isinstance(mine, RaggedDTensor)
        assert torch.equal(local_elements(mine), theirs.detach()), flags
        for key in ("exp_avg", "exp_avg_sq"):
            state = optimizers[0].state[mine][key]
            assert isinstance(state, RaggedDTensor) and torch.equal(local_elements(state),
                                                                    optimizers[1].state[theirs][key])
    if FAST_PATH:  # (torch's own dispatch of _foreach_ and fused operators leaves the wrappers' versions)
        assert all(p._version > v for p, v in zip(ragged, versions)), "an in-place step left a wrapper's version"


def test_autograd_and_out_forms_keep_torchs_dispatch():
    """A call autograd records (an operand needs a gradient, grad mode on) and an out= form take torch's path."""
    (leaf, _) = ranks_of(torch.randn(4, 4), RaggedShard(4, (1, 3)))
    leaf = torch.nn.Parameter(leaf)
    out = (leaf * 2).sin()
    assert out.requires_grad and out.grad_fn is not None and isinstance(out, RaggedDTensor)
    saved = leaf.detach().clone().requires_grad_()
    product = saved * saved  # saves `saved` for backward
    with torch.no_grad():
        saved.mul_(2.0)  # through the fast path: the version must still say it changed
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        product.sum().backward()
    if FAST_PATH:
        saved = leaf.detach().clone().requires_grad_()
        product = saved * saved
        with torch.no_grad():
            torch._foreach_mul_([saved], 2.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            product.sum().backward()
    with torch.no_grad(), pytest.raises(ValueError, match="aten.mul.out"):  # named by __torch_dispatch__
        torch.mul(leaf, 2.0, out=torch.empty(4, 4))
    with torch.no_grad():  # an operator of several results, each on the layout, in its own dtype
        mantissa, exponent = leaf.frexp()
    assert isinstance(exponent, RaggedDTensor) and exponent.dtype == torch.int32
    assert torch.equal(local_elements(mantissa) * 2.0 ** local_elements(exponent), local_elements(leaf).detach())
