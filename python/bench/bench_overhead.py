"""Python overhead of a dbuf op: a no-op round trip through the session's rings from Python vs from C++.

    python bench_overhead.py [--rounds 15] [--count 20000]

Both loops run in this process against the same dbufd and client, alternated
round by round (this machine is shared and noisy): ``client.noop()`` in a
Python loop, and the same submit + wait in a C++ loop (dbuf._dbuf._noop_loop_cpp).
Prints per round the microseconds per op of both and their difference, then the
median and the worst difference. Goal: under 2 us more from Python.
"""

from __future__ import annotations

import argparse
import statistics
import time

import dbuf
from dbuf.testing import Daemon


def python_loop(client: dbuf.Client, count: int) -> float:
    noop = client.noop
    start = time.perf_counter()
    for _ in range(count):
        noop()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--count", type=int, default=20000, help="round trips per loop and round")
    args = p.parse_args()
    with Daemon() as daemon:
        client = dbuf.Client(daemon.socket)
        client.attach("overhead", 0, 1)
        python_loop(client, 2000)  # warm up both paths
        dbuf._dbuf._noop_loop_cpp(client, 2000)
        rows = []
        print(f"{'round':>5} {'C++ us/op':>10} {'Python us/op':>13} {'extra us':>9}")
        for round_ in range(args.rounds):
            cpp = dbuf._dbuf._noop_loop_cpp(client, args.count) / args.count * 1e6
            py = python_loop(client, args.count) / args.count * 1e6
            rows.append((cpp, py))
            print(f"{round_:>5} {cpp:>10.3f} {py:>13.3f} {py - cpp:>9.3f}")
        extra = [py - cpp for cpp, py in rows]
        print(f"median: C++ {statistics.median(c for c, _ in rows):.3f} us, Python {statistics.median(p for _, p in rows):.3f} us,"
              f" extra {statistics.median(extra):.3f} us; worst extra {max(extra):.3f} us (goal < 2 us)")
        client.detach()


if __name__ == "__main__":
    main()
