"""dbuf.torch beside torch's FSDP2 where the two used to differ: each scenario against FSDP2 in the same ranks.

tests/ranks/side_by_side.py builds every model twice, shards one copy with
FSDP2's fully_shard and one with dbuf's, trains both on the same batches and
compares losses, which gradients exist and their values, and the parameters
(bit for bit on 2 ranks). tests/ranks/launchers.py runs some of the scenarios
in the launches torch's own tests use: torch.multiprocessing.spawn with ranks
given to init_process_group, and ranks as threads of one process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import RANKS, run_ranks


def test_on_two_ranks(daemon):
    """Unused parameters keep None gradients (or get zeros, set_reduce_scatter_unused_params(True));
    post-accumulate-grad hooks step an optimizer in backward; reshard_after_forward=False on 8 units at the
    default prefetch depth; tied embedding and output in one grouped unit with uneven shards; a parameter shared
    across units raises FSDP2's error at the first forward; frozen fp8, int8 and fp64 parameters beside trainable
    fp32 ones in each unit; model.to(torch.bfloat16) after fully_shard."""
    run_ranks("side_by_side.py", 2, daemon.socket, "unused", "unused-reduced", "hooks", "keep", "tied", "shared",
              "frozen-dtypes", "cast", job="fsdp2-2", env={"PYTHONPATH": str(RANKS)})


def test_roots_meta_device_and_meshes(daemon):
    """A root per model (a process training several keeps each one's root gathered after forward); a child run
    first raises FSDP2's error; meta-device init stays on meta until materialized, FSDP2's error before, then
    rank 0's weights assigned; a unit on a mesh made from the world's group beside the job's own; an all-reduce
    hook on each block's reduced gradients."""
    run_ranks("side_by_side.py", 2, daemon.socket, "roots", "meta", "from-group", "all-reduce-hook", job="fsdp2-roots",
              env={"PYTHONPATH": str(RANKS)})


def test_reshard_after_forward_as_a_group_size_on_four_ranks(daemon):
    run_ranks("side_by_side.py", 4, daemon.socket, "int", job="fsdp2-4", env={"PYTHONPATH": str(RANKS)})


@pytest.mark.parametrize("launch", ["spawn", "threads"])
def test_launches_other_than_torchrun(daemon, tmp_path, launch):
    """No torchrun variable, no job id: rank and world size from the process group, the job agreed in its store."""
    env = {name: value for name, value in os.environ.items()
           if name not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DBUF_JOB")}
    env.update(DBUF_SOCKET=daemon.socket, PYTHONPATH=str(RANKS), OMP_NUM_THREADS="1")
    args = [sys.executable, str(RANKS / "launchers.py"), launch] + ([str(tmp_path)] if launch == "spawn" else [])
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-6000:]
    assert "as FSDP2" in done.stdout
