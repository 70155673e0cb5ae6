"""dbuf.torch.fully_shard on a job across two "nodes": two real dbufd on loopback, joined by Gloo.

Four rank processes, two attached to each daemon as torchrun would start them
on two hosts (RANK, LOCAL_RANK, LOCAL_WORLD_SIZE) with $DBUF_STORE naming a
shared directory. Every loss of every rank and the final fp32 master
parameters must equal tests/ranks/tiny_model.reference() with the reduction
of a job across nodes (each node's ranks summed in order, then the nodes').
"""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

import dbuf

from conftest import RANKS, run_ranks, run_threads
from dbuf.testing import Daemon

sys.path.insert(0, str(RANKS))
from tiny_model import reference  # noqa: E402
from test_fully_shard import check_equal  # noqa: E402

STEPS = 3


@pytest.fixture
def two_nodes():
    with Daemon(cluster={"address": "127.0.0.1"}) as node0, Daemon(cluster={"address": "127.0.0.1"}) as node1:
        yield [node0, node1]


def test_training_across_two_nodes_equals_the_node_order_reference(two_nodes, tmp_path):
    torch.set_num_threads(1)
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    out = tmp_path / "run"
    run_ranks("train_tiny.py", 4, [node.socket for node in two_nodes], str(out), "--steps", str(STEPS),
              job="across", env={"PYTHONPATH": str(RANKS), "DBUF_STORE": f"file:{store}#run1"})
    results = [torch.load(f"{out}.{rank}") for rank in range(4)]
    check_equal(results, *reference(STEPS, 4, ranks_per_node=2))


def test_a_job_across_nodes_without_a_store_is_refused(two_nodes):
    client = dbuf.Client(two_nodes[0].socket, 10.0)
    with pytest.raises(dbuf.InvalidArgumentError, match="needs a store"):
        client.attach("nostore", 0, 4, local_world_size=2)
    client.close()


def test_a_rank_that_leaves_and_comes_back_rejoins_its_job_on_both_nodes(two_nodes, tmp_path):
    # One rank per daemon. Rank 1 leaves; rank 0's op fails naming it; rank 1
    # comes back (its shard as it left it), both retry a barrier until the
    # nodes have met again, and the job gathers exactly again.
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    specs = [dbuf.TensorSpec("w", (64,))]
    full = torch.arange(64, dtype=torch.float32)
    sockets = [node.socket for node in two_nodes]
    gone = threading.Barrier(2)
    back = threading.Barrier(2)

    def attach(r: int):
        client = dbuf.Client(sockets[r], 30.0)
        client.attach("phoenix", r, 2, local_rank=0, local_world_size=1, store=f"file:{store}#phoenix",
                      persistent=True)
        return client, client.register_group("g", specs, granularity="element")

    def gathered(group) -> torch.Tensor:
        group.unshard()
        out = group.unsharded_view(0).torch().clone()
        group.reshard()
        return out

    def rejoin(client) -> None:
        for _ in range(100):
            try:
                client.barrier()
                return
            except dbuf.Error:
                time.sleep(0.1)
        raise AssertionError("the nodes did not meet again")

    def rank(r: int):
        client, group = attach(r)
        view = group.shard_view(0)
        view.numpy()[:] = full[view.begin : view.end].numpy()
        first = gathered(group)
        if r == 1:
            client.close()
            gone.wait()
            back.wait()
            client, group = attach(1)
            assert client.reattached
        else:
            gone.wait()
            with pytest.raises(dbuf.ConflictError, match="rank 1 of job phoenix disconnected"):
                group.unshard()
            back.wait()
        rejoin(client)
        again = gathered(group)
        client.close()
        return first, again

    for first, again in run_threads(2, rank):
        assert torch.equal(first, full)
        assert torch.equal(again, full)


SPECS = [dbuf.TensorSpec("w", (6, 8)), dbuf.TensorSpec("b", (8,)), dbuf.TensorSpec("e", (4, 3, 8))]


def test_nodes_of_different_sizes_gather_and_reduce_in_node_order(tmp_path):
    # Three daemons holding 1, 2 and 1 of the job's 4 ranks.
    per_node = [1, 2, 1]
    first = [0, 1, 3]
    node_of = [0, 1, 1, 2]
    world = 4
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    torch.manual_seed(1)
    full = [torch.randn(s.shape) * 3 for s in SPECS]
    grads = [[torch.randn(s.shape).to(torch.bfloat16) for s in SPECS] for _ in range(world)]
    with Daemon(cluster={"address": "127.0.0.1"}) as a, Daemon(cluster={"address": "127.0.0.1"}) as b, \
            Daemon(cluster={"address": "127.0.0.1"}) as c:
        sockets = [a.socket, b.socket, c.socket]

        def rank(r: int):
            n = node_of[r]
            client = dbuf.Client(sockets[n], 30.0)
            client.attach("uneven", r, world, local_rank=r - first[n], local_world_size=per_node[n],
                          store=f"file:{store}#uneven")
            group = client.register_group("g", SPECS, granularity="rows:2")
            for i, tensor in enumerate(full):
                view = group.shard_view(i)
                view.numpy()[:] = tensor.reshape(-1)[view.begin : view.end].numpy()
            group.unshard()
            gathered = [group.unsharded_view(i).torch().clone() for i in range(len(SPECS))]
            for i, g in enumerate(grads[r]):
                group.unsharded_grad_view(i).torch().copy_(g)
            group.reduce_scatter(op=dbuf.ReduceOp.SUM)
            parts = [(group.shard_grad_view(i).begin, group.shard_grad_view(i).torch().clone())
                     for i in range(len(SPECS))]
            group.reshard()
            client.close()
            return gathered, parts

        results = run_threads(world, rank)
    for gathered, parts in results:
        for got, want in zip(gathered, full):
            assert torch.equal(got, want.to(torch.bfloat16))
        for i, (begin, got) in enumerate(parts):
            total = None
            for n in range(3):
                node = grads[first[n]][i].float()
                for r in range(first[n] + 1, first[n] + per_node[n]):
                    node = node + grads[r][i].float()
                total = node if total is None else total + node
            assert torch.equal(got, total.reshape(-1)[begin : begin + got.numel()]), f"tensor {i}"
