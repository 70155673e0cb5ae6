"""`dbufctl trace JOB --chrome FILE` of a real run, read by Perfetto's own trace processor.

A real dbufd on a socket of its own, a real two-rank job (dbuf-mp-rank, the trainer that
tests/multiprocess drives): three all-gathers, then a fourth that rank 1 never submits (it times
out); while the job is attached, `dbufctl trace JOB --chrome FILE` and `dbufctl --json trace JOB`.
Perfetto's trace processor (chrome_trace_check.py) must read the file as the run was, and must
report each of a set of broken copies of it. A second job prefetches, as FSDP does (each rank
submits its next all-gather before the current one has run), through the Python client.

Environment (tests/trace/CMakeLists.txt): DBUF_DAEMON, DBUFCTL, DBUF_MP_RANK (this build's), DBUF_NODE.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import dbuf
from chrome_trace_check import check, perfetto_sql, rows
from dbuf.testing import Daemon

JOB = "trace-job"
OK_OPS = 3  # all-gathers both ranks run; then one that rank 1 never submits


class Rank:
    """A dbuf-mp-rank process: one command a line on stdin, one answer a line on stdout."""

    def __init__(self, exe: str):
        self.process = subprocess.Popen([exe], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def send(self, command: str) -> None:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def answer(self) -> str:
        line = self.process.stdout.readline()
        assert line, "dbuf-mp-rank ended"
        return line.rstrip("\n")

    def call(self, command: str) -> str:
        self.send(command)
        return self.answer()

    def begin(self, command: str) -> None:  # a collective: "begin X" now, the answer once every rank came
        self.send(command)
        assert self.answer() == "begin " + command.split()[0]

    def exit(self) -> None:
        self.send("exit")
        self.process.stdin.close()
        assert self.process.wait(timeout=30) == 0


def dbufctl(socket: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([os.environ["DBUFCTL"], "--socket", str(socket), *args],
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """The run's Chrome trace, its flight recorder (--json) and what dbufctl said."""
    dir_ = tmp_path_factory.mktemp("trace")
    socket = dir_ / "dbufd.sock"
    config = dir_ / "dbufd.toml"
    config.write_text(f'[daemon]\nsocket = "{socket}"\nlog_level = "info"\nmemory_limit = "1GiB"\n'
                      "[timeouts]\ncollective_ms = 1000\n")
    log = open(dir_ / "dbufd.log", "w")  # noqa: SIM115 (the daemon's stderr for the whole run)
    daemon = subprocess.Popen([os.environ["DBUF_DAEMON"], "--config", str(config), "--socket", str(socket)],
                              stderr=log)
    ranks = []
    try:
        deadline = time.monotonic() + 30
        while not socket.exists():
            assert daemon.poll() is None, (dir_ / "dbufd.log").read_text()
            assert time.monotonic() < deadline, "dbufd did not make its socket"
            time.sleep(0.05)
        ranks = [Rank(os.environ["DBUF_MP_RANK"]) for _ in range(2)]
        for number, rank in enumerate(ranks):
            assert rank.call(f"connect {socket}") == "ok connect"
            assert rank.call(f"attach {JOB} {number} 2") == "ok attach reattached=0"
        for rank in ranks:
            rank.begin("register g")
        for rank in ranks:
            assert rank.answer().startswith("ok register")
        for _ in range(OK_OPS):
            for rank in ranks:
                rank.begin("unshard g")
            for rank in ranks:
                assert rank.answer() == "ok unshard"
            for rank in ranks:
                assert rank.call("reshard g") == "ok reshard"
        ranks[0].begin("unshard g")  # rank 1 never comes
        timed_out = ranks[0].answer()
        assert timed_out.startswith("err unshard timeout"), timed_out

        # While the job is attached: its live flight recorder.
        chrome = dir_ / f"{JOB}.json"
        text = dbufctl(socket, "trace", JOB, "--chrome", str(chrome))
        assert text.returncode == 0, text.stderr
        recorder = dbufctl(socket, "--json", "trace", JOB)
        assert recorder.returncode == 0, recorder.stderr

        for rank in ranks:
            assert rank.call("detach") == "ok detach"
            rank.exit()
        ranks = []
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0, (dir_ / "dbufd.log").read_text()
        return {"chrome": chrome, "recorder": json.loads(recorder.stdout), "text": text.stdout, "dir": dir_}
    finally:
        for rank in ranks:
            rank.process.kill()
            rank.process.wait()
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        log.close()


def test_the_flight_recorder_has_what_the_run_did(run):
    ops = run["recorder"]["ops"]
    assert [op["sequence"] for op in ops] == list(range(OK_OPS + 1))
    assert [op["result"] for op in ops] == ["ok"] * OK_OPS + ["timeout"]
    assert {op["op"] for op in ops} == {"allGather"}
    assert [r["rank"] for r in ops[-1]["ranks"]] == [0, 1]
    assert ops[-1]["ranks"][1]["submitted_seconds"] is None  # rank 1 never submitted the last one
    assert f"wrote {run['chrome']}" in run["text"]


def test_perfetto_shows_a_track_per_rank_with_each_ops_wait_and_run(run):
    answer = perfetto_sql(run["chrome"], [
        "select t.name as thread, s.category, count(*) as n, min(s.dur) as min_dur from slice s "
        "join thread_track tt on s.track_id = tt.id join thread t using (utid) "
        "group by t.name, s.category order by t.name, s.category",
        "select count(*) as n from slice",
    ])
    assert answer["parse_error"] is None, answer
    per_track, total = (rows(q) for q in answer["queries"])
    # ops x phases: both ranks ran all 4 and waited for the 3 they both submitted; rank 0 also
    # waited for the last (its timeout), which rank 1 never submitted.
    assert {(r["thread"], r["category"]): r["n"] for r in per_track} == {
        ("rank 0", "run"): OK_OPS + 1, ("rank 0", "wait"): OK_OPS + 1,
        ("rank 1", "run"): OK_OPS + 1, ("rank 1", "wait"): OK_OPS,
    }
    assert total == [{"n": 4 * OK_OPS + 3}]  # no slice off the ranks' tracks
    assert all(r["min_dur"] >= 0 for r in per_track)


def test_perfetto_reads_the_trace_as_the_flight_recorder_says(run):
    assert check(run["chrome"], run["recorder"]) == []


def _events(run) -> dict:
    return json.loads(run["chrome"].read_text())


def _ops(document: dict, category: str) -> list[dict]:
    return [e for e in document["traceEvents"] if e.get("ph") == "X" and e.get("cat") == category]


def _negative_duration(document):
    _ops(document, "run")[1]["dur"] = -5.0


def _negative_timestamp(document):
    _ops(document, "wait")[0]["ts"] = -1.0


def _tid_zero(document):  # rank R on tid R, as dbufctl wrote it before: Perfetto puts tid 0 on the main thread
    for event in document["traceEvents"]:
        if "tid" in event:
            event["tid"] -= 1


def _overlapping_phases(document):  # a run that ends after its rank's next wait began
    runs = [e for e in _ops(document, "run") if e["tid"] == 1]
    waits = [e for e in _ops(document, "wait") if e["tid"] == 1]
    runs[0]["dur"] = waits[1]["ts"] - runs[0]["ts"] + 1.0


def _unnamed_rank(document):
    document["traceEvents"] = [e for e in document["traceEvents"]
                               if not (e.get("name") == "thread_name" and e.get("tid") == 2)]


def _lost_event(document):
    document["traceEvents"].remove(_ops(document, "wait")[2])


def _renamed_op(document):
    _ops(document, "run")[0]["name"] = "#0 reduceScatter g"


BROKEN = {
    # name: (how, a problem the check must report)
    "negative duration": (_negative_duration, "negative duration"),
    "negative timestamp": (_negative_timestamp, "Perfetto reported error trace_sorter_negative_timestamp_dropped"),
    "tid 0": (_tid_zero, "threads: ['rank 1'], want ['rank 0', 'rank 1']"),
    "overlapping phases": (_overlapping_phases, "Perfetto reported error slice_drop_overlapping_complete_event"),
    "unnamed rank": (_unnamed_rank, "threads: ['<unnamed tid 2>', 'rank 0']"),
    "lost event": (_lost_event, "missing: 'wait #"),
    "renamed op": (_renamed_op, "named '#0 reduceScatter g', want '#0 allGather g'"),
    "truncated": (lambda text: text[: len(text) // 2], "could not parse broken.json: JSON trace file is incomplete"),
    "bad json": (lambda text: text.replace('"ph":', '"ph"', 1), "could not parse broken.json: Failure parsing JSON"),
}


def test_a_prefetching_job_keeps_each_ranks_phases_in_sequence(tmp_path):
    """Rank 0 submits two all-gathers at once, rank 1 comes later: rank 0's second op waits queued behind
    the first. Its wait starts at the first op's end, so a rank's phases never overlap (Perfetto would
    drop them: slice_drop_overlapping_complete_event) and the check finds nothing."""
    import threading

    world, steps = 2, 4
    specs = [dbuf.TensorSpec("w", (32, 16))]
    ready = threading.Barrier(world + 1, timeout=60)
    release = threading.Event()
    errors: list[BaseException] = []

    def rank(r: int, daemon: Daemon) -> None:
        try:
            client = dbuf.Client(daemon.socket, timeout=10.0)
            client.attach("prefetch", r, world)
            groups = [client.register_group(name, specs) for name in ("a", "b")]
            for group in groups:
                group.acquire_slot()
            for _ in range(steps):
                if r == 1:
                    time.sleep(0.005)  # late: rank 0's two ops queue
                pending = [group.all_gather(async_op=True) for group in groups]
                for op in pending:
                    op.wait()
            ready.wait()
            release.wait(60)
            client.detach()
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)
            ready.abort()

    with Daemon(log_level="info") as daemon:
        threads = [threading.Thread(target=rank, args=(r, daemon), daemon=True) for r in range(world)]
        for t in threads:
            t.start()
        try:
            ready.wait()
            chrome = tmp_path / "prefetch.json"
            assert dbufctl(Path(daemon.socket), "trace", "prefetch", "--chrome", str(chrome)).returncode == 0
            answer = dbufctl(Path(daemon.socket), "--json", "trace", "prefetch")
            assert answer.returncode == 0, answer.stderr
        finally:
            release.set()
            for t in threads:
                t.join(60)
        assert not errors, errors
    recorder = json.loads(answer.stdout)
    ops = recorder["ops"]
    assert len(ops) == 2 * steps and all(op["result"] == "ok" for op in ops)
    # The pattern happened: rank 0 submitted an op before the previous one ended.
    assert any(later["ranks"][0]["submitted_seconds"] < earlier["end_seconds"]
               for earlier, later in zip(ops, ops[1:])), ops
    assert check(chrome, recorder) == []


@pytest.mark.parametrize("variant", BROKEN)
def test_perfetto_reports_a_broken_trace(run, variant, tmp_path):
    how, want = BROKEN[variant]
    if variant in ("truncated", "bad json"):  # broken as text
        text = how(run["chrome"].read_text())
    else:
        document = copy.deepcopy(_events(run))
        how(document)
        text = json.dumps(document)
    broken = tmp_path / "broken.json"
    broken.write_text(text)
    problems = check(broken, run["recorder"])
    assert any(want in problem for problem in problems), "\n".join(problems) or "no problem found"
