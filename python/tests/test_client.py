"""dbuf.Client and dbuf.Group against a real dbufd: attach, register, views, every collective."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import dbuf
from conftest import run_threads

SPECS = [dbuf.TensorSpec("w", (6, 8)), dbuf.TensorSpec("b", (8,)), dbuf.TensorSpec("e", (4, 3, 8))]


def attached(daemon, rank: int, world: int, job: str = "job", **options) -> dbuf.Client:
    client = dbuf.Client(daemon.socket, timeout=10.0)
    client.attach(job, rank, world, **options)
    return client


def test_connect_to_a_missing_daemon_is_unavailable(tmp_path):
    with pytest.raises(dbuf.UnavailableError) as caught:
        dbuf.Client(str(tmp_path / "nothing.sock"), timeout=1.0)
    assert isinstance(caught.value, ConnectionError)
    assert "cannot reach dbufd" in str(caught.value)


def test_plan_is_the_planners_and_views_cover_each_rank_part(daemon):
    world = 3

    def rank(r: int):
        client = attached(daemon, r, world)
        group = client.register_group("g", SPECS, granularity="rows:2")
        parts = [(group.shard_view(i).begin, group.shard_view(i).end) for i in range(len(SPECS))]
        return group.plan, parts, group.rank

    results = run_threads(world, rank)
    offline = dbuf.plan_unit(SPECS, world, granularity="rows:2", dtype="bf16")
    plan = results[0][0]
    assert plan.devices == world and plan.shard_elems == offline.shard_elems
    assert [t.offset for t in plan.tensors] == [t.offset for t in offline.tensors]
    for index, tensor in enumerate(plan.tensors):
        covered = sorted(parts[index] for _, parts, _ in results if parts[index][1] > parts[index][0])
        # The ranks' parts tile the tensor, each a whole number of granularity blocks.
        assert covered[0][0] == 0 and covered[-1][1] == tensor.numel
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
        assert all(begin % tensor.granularity == 0 for begin, _ in covered)
    assert sorted(rank for _, _, rank in results) == list(range(world))


def test_all_gather_casts_to_bf16_as_torch_does_and_views_are_zero_copy(daemon):
    world = 2
    torch.manual_seed(0)
    full = [torch.randn(s.shape) * 3 for s in SPECS]

    def rank(r: int):
        client = attached(daemon, r, world)
        group = client.register_group("g", SPECS)
        for i, tensor in enumerate(full):
            view = group.shard_view(i)
            array = view.numpy()
            array[:] = tensor.reshape(-1)[view.begin : view.end].numpy()
            # numpy and torch see the same memory.
            assert view.torch().data_ptr() == array.ctypes.data or view.numel == 0
        group.unshard()
        gathered = [group.unsharded_view(i).torch().clone() for i in range(len(SPECS))]
        group.reshard()
        return gathered

    for gathered in run_threads(world, rank):
        for got, want in zip(gathered, full):
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            assert torch.equal(got, want.to(torch.bfloat16))


@pytest.mark.parametrize("op,pre,post", [(dbuf.ReduceOp.SUM, 1.0, 1.0), (dbuf.ReduceOp.AVG, 2.0, 0.5)])
def test_reduce_scatter_sums_in_fp32_in_rank_order(daemon, op, pre, post):
    world = 3
    grads = [[torch.randn(s.shape).to(torch.bfloat16) for s in SPECS] for _ in range(world)]

    def rank(r: int):
        client = attached(daemon, r, world)
        group = client.register_group("g", SPECS, granularity="rows:2")
        group.acquire_slot()
        for i, g in enumerate(grads[r]):
            group.unsharded_grad_view(i).torch().copy_(g)
        result = group.reduce_scatter(op=op, pre_scale=pre, post_scale=post)
        assert isinstance(result, dbuf.OpResult)
        parts = [(group.shard_grad_view(i).begin, group.shard_grad_view(i).torch().clone()) for i in range(len(SPECS))]
        group.reshard()
        return parts

    factor = post / world if op == dbuf.ReduceOp.AVG else post
    for parts in run_threads(world, rank):
        for i, (begin, got) in enumerate(parts):
            acc = grads[0][i].float() * pre
            for r in range(1, world):
                acc = acc + grads[r][i].float() * pre
            want = (acc * torch.tensor(factor, dtype=torch.float32)).reshape(-1)[begin : begin + got.numel()]
            assert torch.equal(got, want), f"tensor {i}"


def test_all_reduce_broadcast_barrier_and_async_ops(daemon):
    world = 2

    def rank(r: int):
        client = attached(daemon, r, world)
        group = client.register_group("g", SPECS[:1])
        group.acquire_slot()
        grad = group.unsharded_grad_view(0).torch()
        grad.fill_(float(r + 1))
        op = group.all_reduce(op=dbuf.ReduceOp.SUM, async_op=True)
        assert isinstance(op, dbuf.Op)
        first = op.wait()
        assert op.done() and op.wait().sequence == first.sequence  # waiting again returns the same
        assert torch.all(grad == 3.0)
        params = group.unsharded_view(0).torch()
        params.fill_(float(10 + r))
        group.broadcast(1)
        assert torch.all(params == 11.0)
        barrier = client.barrier(async_op=True).wait()
        assert barrier.sequence > first.sequence
        assert client.noop().sequence == 0  # not a collective
        assert client.in_flight == 0
        group.reshard()
        assert not group.is_unsharded
        client.detach()
        return first.sequence

    assert len(set(run_threads(world, rank))) == 1  # the same op on every rank


def test_reattached_rank_finds_its_shards(daemon):
    client = attached(daemon, 0, 1, job="keep", persistent=True)
    assert not client.reattached
    group = client.register_group("g", SPECS[:1])
    group.shard_view(0).numpy()[:] = 7.0
    client.close()  # dies without a goodbye: the persistent job keeps its shards
    again = attached(daemon, 0, 1, job="keep", persistent=True)
    assert again.reattached
    group = again.register_group("g", SPECS[:1])
    assert np.all(group.shard_view(0).numpy() == 7.0)


def test_views_by_name_and_bad_indices(daemon):
    client = attached(daemon, 0, 1)
    group = client.register_group("g", SPECS)
    assert group.shard_view("b").name == "b" and group.shard_view(-1).name == "e"
    assert group.index("e") == 2
    with pytest.raises(IndexError):
        group.shard_view(3)
    with pytest.raises(KeyError):
        group.shard_view("nope")
    with pytest.raises(dbuf.InvalidArgumentError, match="not unsharded"):
        group.unsharded_view(0)
    group.acquire_slot()
    with pytest.raises(TypeError, match="NumPy has no bf16"):
        group.unsharded_view(0).numpy()
    bits = group.unsharded_view(0).numpy(bits=True)
    assert bits.dtype == np.uint16 and bits.shape == (6, 8)
    assert group.unsharded_view("e").torch().shape == (4, 3, 8)


def test_bad_arguments_raise_clear_errors(daemon):
    client = attached(daemon, 0, 1)
    with pytest.raises(ValueError, match="unknown dtype"):
        client.register_group("g", SPECS, sharded_dtype="fp33")
    with pytest.raises(dbuf.InvalidArgumentError):
        client.register_group("g", [dbuf.TensorSpec("w", (0, 4))])
    with pytest.raises(ValueError, match="timeout"):
        client.noop(timeout=-1.0)
    with pytest.raises(TypeError):
        client.register_group("g", ["not a spec"])
    group = client.register_group("ok", SPECS[:1])
    with pytest.raises(TypeError, match="stream"):
        group.all_gather(stream="fast")
    with pytest.raises(dbuf.InvalidArgumentError, match="GPU memory"):
        group.acquire_slot()
        group.reshard_on_stream(0)
    with pytest.raises(dbuf.InvalidArgumentError, match="already attached"):
        client.attach("job", 0, 1)


def test_closed_groups_and_clients_raise(daemon):
    client = attached(daemon, 0, 1)
    closed = client.register_group("closed", SPECS[:1])
    closed.close()
    with pytest.raises(dbuf.InvalidArgumentError, match="closed"):
        closed.unshard()
    group = client.register_group("g", SPECS[:1])
    client.close()
    with pytest.raises(dbuf.UnavailableError):
        client.noop()
    with pytest.raises(dbuf.UnavailableError):
        group.unshard()


def test_an_unregistered_group_raises_and_its_name_is_free_again(daemon):
    every_rank_unregistered = threading.Barrier(2)

    def rank(r: int):
        client = attached(daemon, r, 2)
        group = client.register_group("g", SPECS[:1])
        shard = group.shard_view(0).torch()
        shard.fill_(1.0)
        group.unshard()
        group.unregister()  # its slot given back on the way
        assert not shard.any(), "the view reads zeros"
        with pytest.raises(dbuf.InvalidArgumentError, match="unregistered"):
            group.unshard()
        with pytest.raises(dbuf.InvalidArgumentError, match="unregistered"):
            group.unregister()
        every_rank_unregistered.wait(30)  # (before that, the name is still the group's)
        again = client.register_group("g", SPECS)  # another spec under the name: a new group
        again.unshard()
        again.reshard()
        return len(again.plan.tensors)

    assert run_threads(2, rank) == [len(SPECS)] * 2


def test_a_rank_holding_none_of_a_tensor_gets_an_empty_view_into_its_shard(daemon):
    # 64 elements, then 2: on 2 ranks the small tensor lies on one rank only. The other rank's view of it is
    # empty and points into that rank's shard, as FSDP2's empty local shards are views of its padded storage.
    specs = [dbuf.TensorSpec("big", (8, 8)), dbuf.TensorSpec("small", (2,))]

    def rank(r: int):
        client = attached(daemon, r, 2)
        group = client.register_group("g", specs)
        views = [group.shard_view(i) for i in range(len(specs))]
        empty = [i for i, view in enumerate(views) if view.end == view.begin]
        held = [view.torch() for view in views if view.end > view.begin]
        start = min(tensor.data_ptr() for tensor in held)
        end = max(tensor.data_ptr() + tensor.numel() * tensor.element_size() for tensor in held)
        pointers = [views[i].torch().untyped_storage().data_ptr() for i in empty]
        return empty, pointers, (start, end)

    results = run_threads(2, rank)
    assert any(empty for empty, _, _ in results), "a layout with a rank holding none of a tensor"
    for empty, pointers, (start, end) in results:
        assert all(start <= pointer <= end for pointer in pointers), (pointers, start, end)
