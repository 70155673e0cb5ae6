"""dbuf.torch beside FSDP2 in launches other than torchrun's (test_fsdp2_parity.py).

  launchers.py spawn DIR      torch.multiprocessing.spawn: 2 processes, each giving its rank and the world
                              size to init_process_group (a file:// rendezvous in DIR), no torchrun variables
  launchers.py threads        ranks as threads of one process (torch's threaded process group, as torch's
                              own tests run them), twice: each time the ranks' sessions end with their group

Every rank runs side_by_side.py's scenarios; dbufd's socket comes from $DBUF_SOCKET, and no job id is
given: the ranks agree on one through their process group's store.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dbuf.torch as dt
import side_by_side

SCENARIOS = ["unused", "tied"]
WORLD = 2
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RUN_ID", "DBUF_JOB")


def spawned_rank(rank: int, rendezvous: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    side_by_side.run(SCENARIOS)
    assert dt.default_session().rank == rank and dt.default_session().world_size == WORLD
    dist.destroy_process_group()
    assert not dt.is_initialized(), "the session outlived its process group"


def spawn(directory: Path) -> None:
    mp.spawn(spawned_rank, args=(str(directory / "rendezvous"),), nprocs=WORLD, join=True)


def threads() -> None:
    from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg, _uninstall_threaded_pg

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    try:
        jobs = []
        for _ in range(2):  # a second "test" in the process: it must not meet the first one's sessions
            jobs.append(_threads_once(dist.HashStore()))
        assert jobs[0] != jobs[1], f"two process groups, one dbuf job {jobs[0]}"
    finally:
        _uninstall_threaded_pg()


def _threads_once(store) -> str:
    jobs: list[str | None] = [None] * WORLD
    errors: list[BaseException] = []

    def rank_thread(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=WORLD, store=store)
        try:
            side_by_side.run(SCENARIOS)
            session = dt.default_session()
            assert (session.rank, session.world_size) == (rank, WORLD)
            jobs[rank] = session.job
        except BaseException as error:  # noqa: BLE001 - raised by the main thread
            errors.append(error)
        finally:
            dist.destroy_process_group()
            if dt.is_initialized():
                errors.append(AssertionError(f"rank {rank}'s session outlived its process group"))

    ranks = [threading.Thread(target=rank_thread, args=(rank,)) for rank in range(WORLD)]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join(300)
    if errors:
        raise errors[0]
    assert jobs[0] == jobs[1] and jobs[0] is not None, jobs
    return jobs[0]


if __name__ == "__main__":
    for name in TORCHRUN_VARIABLES:
        os.environ.pop(name, None)
    if sys.argv[1] == "spawn":
        spawn(Path(sys.argv[2]))
    else:
        threads()
    print(f"{sys.argv[1]}: {' '.join(SCENARIOS)} as FSDP2")
