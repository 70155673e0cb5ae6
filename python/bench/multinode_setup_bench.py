"""What a cached communicator saves a job across nodes: time from attach to its first op, and memory.

Starts N real dbufd on loopback (each a "node", [cluster] address 127.0.0.1)
and runs jobs of N x L ranks one after another: each rank attaches, then the
job's first collective (a barrier, which is a header exchange between the
daemons) completes. The first job over the daemons meets them through its
store and makes the Gloo communicator (connectFullMesh); every later job
finds it in the daemons' cache and only agrees on it through the store.
Printed per job, side by side in one run: attach -> first op (the slowest
rank, median and worst over the repeats), and each daemon's resident memory
and open file descriptors after the job (what a communicator costs, and that
later jobs add nothing).

    .venv/bin/python python/bench/multinode_setup_bench.py [--nodes 2] [--ranks-per-node 2] [--jobs 8]

$DBUF_DAEMON names the dbufd binary (build/bin/dbufd in a build tree).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import dbuf
from dbuf.testing import Daemon


def rss_and_fds(pid: int) -> tuple[int, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return rss_kib * 1024, len(list(Path(f"/proc/{pid}/fd").iterdir()))


def run_job(daemons: list[Daemon], job: str, per_node: int, store: str) -> float:
    """Seconds from the first attach to the end of the job's first op, on its slowest rank."""
    world = per_node * len(daemons)
    clients = [dbuf.Client(daemons[rank // per_node].socket, 60.0) for rank in range(world)]
    finished = [0.0] * world
    errors: list[BaseException] = []
    start = time.perf_counter()

    def rank_main(rank: int) -> None:
        try:
            clients[rank].attach(job, rank, world, local_rank=rank % per_node, local_world_size=per_node,
                                 store=store)
            clients[rank].barrier()
            finished[rank] = time.perf_counter()
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for client in clients:
        client.close()
    if errors:
        raise errors[0]
    return max(finished) - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=8, help="jobs after the first one")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dbuf-setup-") as scratch:
        store_dir = Path(scratch) / "store"
        store_dir.mkdir(mode=0o700)
        daemons = [Daemon(log_level="info", cluster={"address": "127.0.0.1"}) for _ in range(args.nodes)]
        try:
            before = [rss_and_fds(d.process.pid) for d in daemons]
            first = run_job(daemons, "job0", args.ranks_per_node, f"file:{store_dir}#job0")
            after_first = [rss_and_fds(d.process.pid) for d in daemons]
            later = []
            for j in range(1, args.jobs + 1):
                later.append(run_job(daemons, f"job{j}", args.ranks_per_node, f"file:{store_dir}#job{j}"))
            after_all = [rss_and_fds(d.process.pid) for d in daemons]
            logs = [Path(d.log).read_text() for d in daemons]
        finally:
            for daemon in daemons:
                daemon.stop()
    print(f"{args.nodes} nodes x {args.ranks_per_node} ranks, loopback, file store; attach -> first op "
          f"(slowest rank):")
    print(f"  first job (store rendezvous + new Gloo communicator): {first * 1e3:8.1f} ms")
    print(f"  later jobs (communicator from the daemons' cache):    median {statistics.median(later) * 1e3:8.1f} ms,"
          f" worst {max(later) * 1e3:8.1f} ms over {len(later)} jobs")
    print(f"  ratio cached / fresh: median {statistics.median(later) / first:.2f}, worst {max(later) / first:.2f}")
    for n in range(args.nodes):
        print(f"  node {n} dbufd: +{(after_first[n][0] - before[n][0]) / 2**20:6.2f} MiB RSS and "
              f"+{after_first[n][1] - before[n][1]} fds for the first job's communicator; "
              f"{(after_all[n][0] - after_first[n][0]) / 2**20:+6.2f} MiB and {after_all[n][1] - after_first[n][1]:+d} "
              f"fds over the {len(later)} later jobs")
    made = sum(log.count("(new)") for log in logs)
    reused = sum(log.count("(reused)") for log in logs)
    print(f"  daemon logs: {made} links made a communicator, {reused} reused one")


if __name__ == "__main__":
    main()
