"""dbuf.torch.fully_shard on a job across two "nodes": two real dbufd on loopback, joined by Gloo.

Four rank processes, two attached to each daemon as torchrun would start them
on two hosts (RANK, LOCAL_RANK, LOCAL_WORLD_SIZE) with $DBUF_STORE naming a
shared directory. Every loss of every rank and the final fp32 master
parameters must equal tests/ranks/tiny_model.reference() with the reduction
of a job across nodes (each node's ranks summed in order, then the nodes').
"""

from __future__ import annotations

import sys

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
