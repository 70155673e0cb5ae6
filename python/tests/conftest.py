"""Fixtures of the dbuf package's tests: a real dbufd per test, and rank processes.

The daemon binary is $DBUF_DAEMON (make test sets it to the build's dbufd);
the package under test is the one installed in the running interpreter.
"""

from __future__ import annotations

import os
import socket as socket_module
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

from dbuf.testing import Daemon
from rank_launcher import START_VARIABLES, RankLauncher, start_key

HERE = Path(__file__).parent
RANKS = HERE / "ranks"


@pytest.fixture
def daemon():
    with Daemon(timeouts={"collective_ms": 5000, "register_ms": 5000}) as d:
        yield d


@pytest.fixture
def fast_daemon():
    """Short collective / registration timeouts, for the tests of timeouts."""
    with Daemon(timeouts={"collective_ms": 300, "register_ms": 300}) as d:
        yield d


def run_threads(world: int, body: Callable[[int], Any], timeout: float = 60.0) -> list[Any]:
    """body(rank) on `world` threads (each its own client); their results, or the first exception."""
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"a rank thread did not finish within {timeout} s")
    if errors:
        raise errors[0]
    return results


def rank_mesh(rank: int, world: int) -> DeviceMesh:
    """A 1-D mesh as rank `rank` of `world` sees it, without a process group (ranks simulated in one process)."""
    return DeviceMesh("cpu", torch.arange(world), _init_backend=False, _rank=rank)


def free_port() -> int:
    """A TCP port free on loopback now (torch.distributed's rendezvous, as torchrun picks one)."""
    with socket_module.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


_launchers: dict[tuple, RankLauncher] = {}
_launchers_lock = threading.Lock()


def _launcher(rank: int, env: dict[str, str]) -> RankLauncher:
    """The launcher of rank index `rank` for `env`'s start variables, started at its first use (rank_launcher.py)."""
    key = (rank, start_key(env))
    with _launchers_lock:
        launcher = _launchers.get(key)
        if launcher is None or not launcher.alive():  # (one that died is replaced)
            launcher_env = {name: value for name, value in os.environ.items() if name not in START_VARIABLES}
            launcher_env.update({name: env[name] for name in START_VARIABLES if name in env}, OMP_NUM_THREADS="1")
            launcher = _launchers[key] = RankLauncher(launcher_env)
        return launcher


@pytest.fixture(scope="session", autouse=True)
def _close_launchers():
    yield
    for launcher in _launchers.values():
        launcher.close()


def run_ranks(script: str, world: int, socket: str | list[str], *args: str, job: str = "job", timeout: float = 240.0,
              env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """tests/ranks/<script> as `world` rank processes with torchrun's environment; all must succeed.

    socket: the node's dbufd, or one per node (a job across nodes: world /
    len(socket) ranks on each, in rank order; `env` then names the store).
    The ranks are forked from launchers that imported torch already
    (rank_launcher.py), or with DBUF_TEST_FRESH_RANKS=1 started as new
    interpreters.
    """
    sockets = [socket] if isinstance(socket, str) else socket
    per_node = world // len(sockets)
    master_port = str(free_port())
    fresh = os.environ.get("DBUF_TEST_FRESH_RANKS", "") not in ("", "0")
    rank_envs = [dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_node),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=master_port, LOCAL_WORLD_SIZE=str(per_node), DBUF_JOB=job,
                      DBUF_SOCKET=sockets[rank // per_node], OMP_NUM_THREADS="1", **(env or {}))
                 for rank in range(world)]
    # Every launcher first: those not started yet import side by side rather than one after another.
    launchers = None if fresh else [_launcher(rank, rank_env) for rank, rank_env in enumerate(rank_envs)]
    procs = []
    with tempfile.TemporaryDirectory(prefix="dbuf-ranks-") as outputs:
        for rank, rank_env in enumerate(rank_envs):
            if launchers is None:
                procs.append(subprocess.Popen([sys.executable, str(RANKS / script), *args], env=rank_env,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            else:
                out = Path(outputs) / f"{rank}"
                procs.append(launchers[rank].spawn(str(RANKS / script), list(args), rank_env, out.with_suffix(".out"),
                                                   out.with_suffix(".err")))
        done = []
        for proc in procs:
            try:
                if fresh:
                    out, err = proc.communicate(timeout=timeout)
                else:
                    proc.wait(timeout)
                    out, err = proc.output()
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                for p in procs:
                    p.wait(30)  # reaped: no rank outlives its test
                raise
            done.append(subprocess.CompletedProcess([script, *args], proc.returncode, out, err))
    for rank, result in enumerate(done):
        assert result.returncode == 0, f"rank {rank} failed ({result.returncode}):\n{result.stderr}"
    return done
