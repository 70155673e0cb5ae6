"""dbuf.torch.fully_shard on a job across two "nodes": two real dbufd on loopback, joined by Gloo.

Four rank processes, two attached to each daemon as torchrun would start them
on two hosts (RANK, LOCAL_RANK, LOCAL_WORLD_SIZE) with $DBUF_STORE naming a
shared directory. Every loss of every rank and the final fp32 master
parameters must equal tests/ranks/tiny_model.reference() with the reduction
of a job across nodes (each node's ranks summed in order, then the nodes').
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from conftest import RANKS, run_ranks
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
    import dbuf

    client = dbuf.Client(two_nodes[0].socket, 10.0)
    with pytest.raises(dbuf.InvalidArgumentError, match="needs a store"):
        client.attach("nostore", 0, 4, local_world_size=2)
    client.close()
