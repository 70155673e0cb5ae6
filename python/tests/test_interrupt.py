"""Ctrl-C interrupts a wait within 100 ms and leaves the session usable (or, mid-request, cleanly closed); the GIL is released while waiting."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import dbuf
from conftest import run_threads

CHILD = """
import sys, time
import dbuf
from conftest import run_threads
client = dbuf.Client(sys.argv[1], timeout=30.0)
client.attach("intr", 0, 2)
"""


def interrupt_child(daemon, body: str, after: str = "waiting") -> tuple[float, list[str]]:
    """Runs `body` in a child; sends SIGINT once it prints `after`; seconds from the signal to its next line."""
    child = subprocess.Popen([sys.executable, "-u", "-c", CHILD + textwrap.dedent(body), daemon.socket],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while True:
            line = child.stdout.readline().strip()
            assert line, f"child ended early: {child.stderr.read()}"
            lines.append(line)
            if line == after:
                break
        time.sleep(0.2)  # well inside the blocking call
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        first = child.stdout.readline().strip()
        elapsed = time.monotonic() - sent
        rest = child.stdout.read()  # what readline() buffered too (communicate() would miss it)
        child.wait(timeout=30)
        assert child.returncode == 0, child.stderr.read()
        return elapsed, [first, *rest.split()]
    finally:
        child.kill()


def test_ctrl_c_interrupts_an_op_wait_and_the_op_can_be_waited_again(daemon):
    body = """
        op = client.barrier(async_op=True)
        print("waiting")
        try:
            op.wait()
        except KeyboardInterrupt:
            print("interrupted")
        assert not op.done() and client.noop().sequence == 0   # still in flight; the session works
        other = dbuf.Client(sys.argv[1]); other.attach("intr", 1, 2); other.barrier()
        print("resumed", op.wait().sequence)
    """
    elapsed, lines = interrupt_child(daemon, body)
    assert lines[0] == "interrupted" and lines[1:] == ["resumed", "0"]
    assert elapsed < 0.1, f"{elapsed * 1000:.0f} ms from SIGINT to KeyboardInterrupt"


def test_ctrl_c_during_a_registration_closes_the_session_cleanly(daemon):
    body = """
        print("waiting")
        try:
            client.register_group("g", [dbuf.TensorSpec("w", (4, 4))])
        except KeyboardInterrupt:
            print("interrupted")
        try:
            client.noop()
        except dbuf.UnavailableError as error:
            print("closed")
        # The daemon reclaimed the session: rank 0 can attach again.
        again = dbuf.Client(sys.argv[1]); again.attach("intr", 0, 2); print("reattached")
    """
    elapsed, lines = interrupt_child(daemon, body)
    assert lines == ["interrupted", "closed", "reattached"]
    assert elapsed < 0.1, f"{elapsed * 1000:.0f} ms from SIGINT to KeyboardInterrupt"


def test_the_gil_is_released_while_waiting(daemon):
    client = dbuf.Client(daemon.socket)
    client.attach("gil", 0, 2)
    op = client.barrier(async_op=True)
    counted = 0
    stop = threading.Event()

    def count() -> None:
        nonlocal counted
        while not stop.is_set():
            counted += 1

    thread = threading.Thread(target=count)
    thread.start()
    started = time.monotonic()
    try:
        op.wait(timeout=0.3)
    except dbuf.TimeoutError:
        pass
    stop.set()
    thread.join()
    assert time.monotonic() - started >= 0.3
    assert counted > 10_000, "the other thread did not run while the main thread waited"
    other = dbuf.Client(daemon.socket)
    other.attach("gil", 1, 2)
    other.barrier()
    op.wait()


def test_a_signal_handler_calling_into_a_waiting_client_gets_an_error_not_a_hang(daemon):
    import gc
    import os

    client = dbuf.Client(daemon.socket)
    client.attach("reenter", 0, 2)
    seen: list[str] = []
    groups = []

    def handler(signum, frame):
        groups.clear()  # the client's group let go of inside the client's own wait
        gc.collect()
        try:
            client.noop()
        except RuntimeError as error:
            seen.append(str(error))

    other = dbuf.Client(daemon.socket)
    other.attach("reenter", 1, 2)
    groups.extend(run_threads(2, lambda r: (client, other)[r].register_group("g", [dbuf.TensorSpec("w", (4, 4))])))
    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        op = client.barrier(async_op=True)
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        try:
            op.wait(timeout=0.5)
        except dbuf.TimeoutError:
            pass
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert seen and "inside another call" in seen[0]
    assert not groups  # closed once the wait ended; the client is still fine
    other.barrier()
    op.wait()
    assert client.noop().sequence == 0


def test_a_signal_handler_closing_the_group_a_call_waits_on_defers_the_close(daemon):
    import os

    def attach(rank: int) -> dbuf.Client:
        client = dbuf.Client(daemon.socket)
        client.attach("close-inside", rank, 2)
        return client

    clients = [attach(0), attach(1)]
    groups = run_threads(2, lambda r: clients[r].register_group("g", [dbuf.TensorSpec("w", (64, 64))]))
    group = groups[0]
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: group.close())
    try:
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        try:
            group.unshard(timeout=0.5)  # rank 1 never gathers: waits in the all-gather
        except dbuf.TimeoutError:
            pass
    finally:
        signal.signal(signal.SIGUSR1, previous)
    try:
        group.unshard()
    except dbuf.InvalidArgumentError as error:
        assert "closed" in str(error)
    else:
        raise AssertionError("the group was not closed")
    assert clients[0].noop().sequence == 0
