"""What dbufd's per-op metrics and a scraping Prometheus cost a small collective, against a dbufd without them.

    DBUF_DAEMON=build/bin/dbufd python metrics_overhead.py --baseline OLD_DBUFD [--rounds 9] [--count 3000]

OLD_DBUFD is a build of an earlier revision (one before the metrics endpoint, with the same protocol).
Three daemons run side by side, each with its own 2-rank job (two threads, each its own client):
``baseline`` (OLD_DBUFD), ``metrics`` ($DBUF_DAEMON with [metrics] listen set, never scraped) and
``scraped`` ($DBUF_DAEMON, scraped over HTTP every 100 ms, 150x Prometheus's default rate, by a thread of
this process). Rounds alternate between them (this machine is shared and noisy); each round times `count`
barriers and `count` all-gathers of a 1 KiB group per rank. Prints microseconds per op for each, per
round, then the median and the worst ratio against the baseline.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import urllib.request

import dbuf
from dbuf.testing import Daemon

SPECS = [dbuf.TensorSpec("w", (16, 32))]  # 512 elements: 1 KiB of bf16 per rank's unsharded copy
WORLD = 2


class Job:
    """A 2-rank job on `daemon`, its ranks on threads that run one round when asked."""

    def __init__(self, daemon: Daemon, name: str) -> None:
        self.clients = [dbuf.Client(daemon.socket, timeout=30.0) for _ in range(WORLD)]
        self.groups: list = [None] * WORLD
        threads = [threading.Thread(target=self._attach, args=(r, name)) for r in range(WORLD)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _attach(self, rank: int, name: str) -> None:
        self.clients[rank].attach(name, rank, WORLD)
        self.groups[rank] = self.clients[rank].register_group("g", SPECS)
        self.groups[rank].acquire_slot()

    def round(self, count: int) -> tuple[float, float]:
        """Microseconds per barrier and per all-gather (rank 0's clock; the ranks run in lockstep)."""
        times: list[tuple[float, float]] = [(0.0, 0.0)] * WORLD

        def run(rank: int) -> None:
            client, group = self.clients[rank], self.groups[rank]
            start = time.perf_counter()
            for _ in range(count):
                client.barrier()
            middle = time.perf_counter()
            for _ in range(count):
                group.all_gather()
            end = time.perf_counter()
            times[rank] = ((middle - start) / count * 1e6, (end - middle) / count * 1e6)

        threads = [threading.Thread(target=run, args=(r,)) for r in range(WORLD)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return times[0]

    def close(self) -> None:
        for client in self.clients:
            client.detach()


def scrape_forever(url: str, stop: threading.Event, scrapes: list[int]) -> None:
    while not stop.wait(0.1):
        with urllib.request.urlopen(url, timeout=5) as response:
            response.read()
        scrapes[0] += 1


def start(executable: str, **sections) -> Daemon:
    os.environ["DBUF_DAEMON"] = executable
    return Daemon(log_level="info", **sections)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="dbufd of an earlier revision, without metrics")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--count", type=int, default=3000, help="barriers and all-gathers per round")
    args = p.parse_args()
    current = os.environ.get("DBUF_DAEMON", "")
    daemons = {
        "baseline": start(args.baseline),
        "metrics": start(current, metrics={"listen": "127.0.0.1:0"}),
        "scraped": start(current, metrics={"listen": "127.0.0.1:0"}),
    }
    jobs = {name: Job(daemon, name) for name, daemon in daemons.items()}
    stop, scrapes = threading.Event(), [0]
    scraper = threading.Thread(target=scrape_forever, args=(daemons["scraped"].metrics_url(), stop, scrapes),
                               daemon=True)
    scraper.start()
    try:
        for job in jobs.values():
            job.round(max(args.count // 10, 100))  # warm up
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in jobs}
        print(f"{'round':>5} " + " ".join(f"{name + ' barrier':>17} {name + ' allGather':>19}" for name in jobs))
        for round_ in range(args.rounds):
            order = list(jobs) if round_ % 2 == 0 else list(reversed(jobs))
            for name in order:
                results[name].append(jobs[name].round(args.count))
            print(f"{round_:>5} " + " ".join(f"{b:>17.2f} {g:>19.2f}" for b, g in (results[n][-1] for n in jobs)))
        print(f"(the scraped daemon was scraped {scrapes[0]} times)")
        for name in ("metrics", "scraped"):
            for index, op in enumerate(("barrier", "allGather")):
                ratios = [mine[index] / base[index] for mine, base in zip(results[name], results["baseline"])]
                print(f"{name:>8} {op:>9}: median {statistics.median(r[index] for r in results[name]):.2f} us vs "
                      f"baseline {statistics.median(r[index] for r in results['baseline']):.2f} us; ratio median "
                      f"{statistics.median(ratios):.3f}, worst {max(ratios):.3f}")
    finally:
        stop.set()
        scraper.join(5)
        for job in jobs.values():
            job.close()
        for daemon in daemons.values():
            daemon.close()


if __name__ == "__main__":
    main()
