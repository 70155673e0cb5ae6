#!/usr/bin/env python3
"""Runs PyTorch's own FSDP2 unit tests on CPU twice, with torch's fully_shard and with dbuf's, and compares.

The tests are the files of pytorch/pytorch's ``test/distributed/_composable/fsdp/`` (``test_fully_shard_*.py``)
in the version that matches the installed torch: take that folder from a checkout of PyTorch's repository at the
installed release's tag (v2.15.0), or copy its files into a folder outside this repository, and give the folder.
They need ``expecttest`` (``pip install expecttest``), which torch's test utilities import.

Each file runs in its own pytest process, unmodified, once per way:

* ``plain``: torch's FSDP2;
* ``dbuf``: ``DBUF_FSDP=1`` (python/dbuf/torch/switch.py puts dbuf's fully_shard in FSDP2's place in every process)
  against a dbufd this script starts for the file (``$DBUF_DAEMON``, else ``dbufd`` on PATH, else the build
  tree's build/bin/dbufd), its socket in ``DBUF_SOCKET``.

PyTorch's harness skips its multi-process tests without accelerators; shim/fsdp_conformance_shim.py (loaded through
shim/sitecustomize.py into pytest and into every rank process) makes them run on CPU with gloo and
``--world-size`` ranks, and gives each rank torchrun's variables (not with ``--no-torchrun-env``: the default
process group alone then tells dbuf the rank and world size) and a ``DBUF_JOB`` per test. See that module.

Prints per file the passed / failed / skipped / errors counts of each way; ``--details`` adds each test that passes
with torch and fails with dbuf, with the last line of its error; ``--json FILE`` writes every test's result.
Tests killed at the file's ``--timeout``, and tests not reached then, count as errors.

    .venv/bin/python tools/fsdp_conformance/run.py /path/to/fsdp-tests --details --json results.json
    .venv/bin/python tools/fsdp_conformance/run.py /path/to/fsdp-tests test_fully_shard_frozen.py -k per_group
    .venv/bin/python tools/fsdp_conformance/run.py /path/to/fsdp-tests --ways dbuf --baseline results.json \
        --only-passing
    .venv/bin/python tools/fsdp_conformance/run.py --report results.json more.json --details
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIM = HERE / "shim"
REPOSITORY = HERE.parent.parent
WAYS = ("plain", "dbuf")
OUTCOMES = ("passed", "failed", "skipped", "error")
FAILING = ("failed", "error")
# Variables of the caller's environment that would tell the ranks who they are or which dbuf job they join.
CLEARED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
           "TORCHELASTIC_RUN_ID", "DBUF_FSDP", "DBUF_SOCKET", "DBUF_JOB")


@dataclass
class TestResult:
    outcome: str  # one of OUTCOMES
    message: str = ""  # skip reason, or the last line of the error
    duration: float = 0.0
    report: str = ""  # the whole failure report (kept for --json)


@dataclass
class FileRun:
    way: str
    returncode: int | None
    seconds: float
    timed_out: bool = False
    note: str = ""  # what went wrong with the file as a whole
    log: str = ""
    tests: dict[str, TestResult] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(OUTCOMES, 0)
        for result in self.tests.values():
            counts[result.outcome] += 1
        return counts


# ------------------------------------------------------------------ the command line


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("test_dir", type=Path, nargs="?",
                        help="folder of PyTorch's test/distributed/_composable/fsdp/ files")
    parser.add_argument("files", nargs="*",
                        help="test files (names or glob patterns) in test_dir; default: test_*.py")
    parser.add_argument("-k", dest="keyword", help="pytest's -k expression, selecting tests in each file")
    parser.add_argument("--ways", default=",".join(WAYS), help="comma-separated ways to run: plain, dbuf")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a file may run per way (default 600)")
    parser.add_argument("--test-timeout", type=int, default=300,
                        help="seconds the harness gives one multi-process test before it kills the ranks")
    parser.add_argument("--world-size", type=int, default=4,
                        help="CPU 'devices': the ranks of a test sized by the device count (default 4)")
    parser.add_argument("--no-torchrun-env", action="store_true",
                        help="give ranks no RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT")
    parser.add_argument("--no-dbuf-job", action="store_true", help="give ranks no DBUF_JOB")
    parser.add_argument("--respect-gpu-skips", action="store_true",
                        help="run only tests marked skip_if_lt_x_gpu(..., allow_cpu=True) (or not marked)")
    parser.add_argument("--baseline", type=Path,
                        help="a --json file of an earlier run: the results of the ways not run now come from it")
    parser.add_argument("--only-passing", action="store_true",
                        help="run dbuf only on the tests that passed plain (this run's or --baseline's)")
    parser.add_argument("--details", action="store_true",
                        help="list each test that passes plain and fails on dbuf, with its last error line")
    parser.add_argument("--json", type=Path, help="write every test's result to this file")
    parser.add_argument("--report", type=Path, nargs="+", metavar="JSON",
                        help="run nothing: print the table (and --details) of these --json files, merged")
    parser.add_argument("--log-dir", type=Path, help="keep pytest's and dbufd's output here (default: a temp dir)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter to run pytest with")
    parser.add_argument("--daemon-option", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a dbufd setting (docs/configuration.md), e.g. timeouts.collective_ms=60000")
    args = parser.parse_args(argv)
    args.ways = [way.strip() for way in args.ways.split(",") if way.strip()]
    unknown = set(args.ways) - set(WAYS)
    if unknown or not args.ways:
        parser.error(f"--ways takes {', '.join(WAYS)}; got {args.ways}")
    if args.report:
        return args
    if args.test_dir is None or not args.test_dir.is_dir():
        parser.error(f"{args.test_dir} is not a folder")
    if args.only_passing and "plain" not in args.ways and args.baseline is None:
        parser.error("--only-passing needs the plain results: run the plain way too, or give --baseline")
    return args


def select_files(test_dir: Path, patterns: list[str]) -> list[str]:
    names = sorted(path.name for path in test_dir.glob("*.py"))
    if not patterns:
        return [name for name in names if name.startswith("test_")]
    chosen: list[str] = []
    for pattern in patterns:
        matched = fnmatch.filter(names, Path(pattern).name)
        if not matched:
            sys.exit(f"no file {pattern} in {test_dir}")
        chosen += [name for name in matched if name not in chosen]
    return chosen


def daemon_sections(options: list[str]) -> dict[str, dict[str, object]]:
    sections: dict[str, dict[str, object]] = {}
    for option in options:
        key, separator, raw = option.partition("=")
        section, dot, name = key.partition(".")
        if not (separator and dot and section and name):
            sys.exit(f"--daemon-option {option!r}: write SECTION.KEY=VALUE")
        value: object = raw
        if raw in ("true", "false"):
            value = raw == "true"
        else:
            with contextlib.suppress(ValueError):
                value = float(raw) if "." in raw else int(raw)
        sections.setdefault(section, {})[name] = value
    return sections


# ------------------------------------------------------------------ running one file


def rank_environment(args: argparse.Namespace, results: Path) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name not in CLEARED}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SHIM), os.environ.get("PYTHONPATH")]))
    env.update(
        FSDP_CONFORMANCE="1",
        FSDP_CONFORMANCE_RESULTS=str(results),
        FSDP_CONFORMANCE_DEVICES=str(args.world_size),
        FSDP_CONFORMANCE_TORCHRUN_ENV="0" if args.no_torchrun_env else "1",
        FSDP_CONFORMANCE_DBUF_JOB="0" if args.no_dbuf_job else "1",
        FSDP_CONFORMANCE_GPU_SKIPS="1" if args.respect_gpu_skips else "0",
        DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(args.test_timeout),
        PYTORCH_PRINT_REPRO_ON_FAILURE="0",
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
    )
    return env


def run_pytest(args: argparse.Namespace, targets: list[str], env: dict[str, str], log: Path,
               ) -> tuple[int | None, bool, float]:
    """pytest on the file's targets in its own process group; killed with its ranks at the timeout."""
    command = [args.python, "-m", "pytest", "-p", "fsdp_conformance_shim", "-p", "no:cacheprovider",
               "-o", "addopts=", "-W", "ignore::pytest.PytestAssertRewriteWarning", "-q", "--tb=long", *targets]
    if args.keyword:
        command += ["-k", args.keyword]
    started = time.monotonic()
    with open(log, "wb") as output:
        process = subprocess.Popen(command, cwd=args.test_dir, env=env, stdout=output, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            returncode = process.wait(args.timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            returncode, timed_out = None, True
        # The ranks of a test left behind (a hung or killed pytest) share its process group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return returncode, timed_out, time.monotonic() - started


def run_file(args: argparse.Namespace, way: str, file: str, targets: list[str], log_dir: Path) -> FileRun:
    stem = f"{Path(file).stem}.{way}"
    results, log = log_dir / f"{stem}.jsonl", log_dir / f"{stem}.log"
    results.unlink(missing_ok=True)
    env = rank_environment(args, results)
    daemon = None
    if way == "dbuf":
        from dbuf.testing import Daemon

        daemon = Daemon(**daemon_sections(args.daemon_option))
        env.update(DBUF_FSDP="1", DBUF_SOCKET=daemon.socket)
    try:
        returncode, timed_out, seconds = run_pytest(args, targets, env, log)
    finally:
        daemon_status = None
        if daemon is not None:
            daemon_status = daemon.process.poll()
            daemon.stop()
            shutil.copyfile(daemon.log, log_dir / f"{stem}.dbufd.log")
            daemon.close()
    run = FileRun(way, returncode, round(seconds, 1), timed_out, log=str(log))
    run.tests = read_results(results, args.timeout if timed_out else None)
    notes = []
    if daemon_status is not None:
        notes.append(f"dbufd exited with status {daemon_status} during the run")
    if timed_out:
        notes.append(f"killed after {args.timeout:g} s")
    elif not run.tests and returncode not in (0, 5):
        notes.append(f"pytest exited with {returncode}: {tail(log)}")
        run.tests[f"{file}::<pytest>"] = TestResult("error", notes[-1])
    run.note = "; ".join(notes)
    return run


def tail(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^E\s", line) or "Error" in line]
    return (errors or lines or [""])[-1].lstrip("E ").strip()


# ------------------------------------------------------------------ reading results


def read_results(path: Path, timeout: float | None) -> dict[str, TestResult]:
    """The tests' outcomes from the plugin's records; a test started and not finished, or not started, is an error."""
    collected: list[str] = []
    started: list[str] = []
    phases: dict[str, list[dict]] = {}
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(line)
                if record["event"] == "collected":
                    collected = record["nodeids"]
                elif record["event"] == "start":
                    started.append(record["nodeid"])
                else:
                    phases.setdefault(record["nodeid"], []).append(record)
    results: dict[str, TestResult] = {}
    for nodeid in dict.fromkeys([*collected, *started, *phases]):
        reports = phases.get(nodeid, [])
        if any(report["when"] == "call" for report in reports) or any(
                report["outcome"] != "passed" for report in reports):
            results[nodeid] = outcome_of(reports)
        elif nodeid in started:
            results[nodeid] = TestResult("error", f"still running when killed at the timeout ({timeout:g} s)"
                                         if timeout else "pytest ended while the test ran")
        else:
            results[nodeid] = TestResult("error", "not run: pytest was killed at the timeout" if timeout
                                         else "not run: pytest ended first")
    return results


def outcome_of(reports: list[dict]) -> TestResult:
    duration = round(sum(report["duration"] for report in reports), 2)
    for report in reports:
        if report["outcome"] == "failed":
            outcome = "failed" if report["when"] == "call" and not report.get("xfail") else "error"
            text = report.get("message", "")
            return TestResult(outcome, last_error_line(text), duration, text)
    for report in reports:
        if report["outcome"] == "skipped":
            return TestResult("skipped", report.get("message", ""), duration)
    return TestResult("passed", "", duration)


EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Failure|Exit|Interrupt|Timeout|Warning)(:.*)?$")
RANK_FAILED = re.compile(r"Process \d+ exited with error code \d+ and exception:")
BLOCK_END = re.compile(r"^(Traceback |During handling|The above exception|\s+File |Process \d+ |To execute this test)")
MESSAGE_CHARS = 240


def last_error_line(report: str) -> str:
    """The exception ending the first failing rank's traceback (else the report's last exception), on one line.

    pytest prefixes the exception's text with 'E' and a fixed indent; the harness puts each failed rank's
    traceback in it after 'Process N exited with error code 10 and exception:'. A message of several lines
    ('Tensor-likes are not close!' then the mismatch) is joined, up to MESSAGE_CHARS characters.
    """
    quoted = [line[1:] for line in report.splitlines() if line.startswith("E")]
    indent = min((len(line) - len(line.lstrip()) for line in quoted if line.strip()), default=0)
    lines = [line[indent:].rstrip() for line in quoted] or report.splitlines()
    starts = [index for index, line in enumerate(lines) if RANK_FAILED.search(line)]
    first, end = (starts[0] + 1, starts[1] if len(starts) > 1 else len(lines)) if starts else (0, len(lines))
    found = [index for index in range(first, end) if EXCEPTION_LINE.match(lines[index])]
    if not found and starts:
        found = [index for index, line in enumerate(lines) if EXCEPTION_LINE.match(line)]
        end = len(lines)
    if not found:
        return lines[-1] if lines else ""
    message = lines[found[-1]]
    for line in lines[found[-1] + 1:end]:
        if BLOCK_END.match(line) or len(message) >= MESSAGE_CHARS:
            break
        if line.strip():
            message += " " + line.strip()
    return message if len(message) <= MESSAGE_CHARS else message[:MESSAGE_CHARS - 3] + "..."


# ------------------------------------------------------------------ reporting


def load_baseline(path: Path) -> dict[str, dict[str, FileRun]]:
    data = json.loads(path.read_text())
    runs: dict[str, dict[str, FileRun]] = {}
    for file, ways in data["files"].items():
        for way, run in ways.items():
            tests = {nodeid: TestResult(**result) for nodeid, result in run.pop("tests").items()}
            for result in tests.values():
                if result.report:  # the report's error line as this version of the script finds it
                    result.message = last_error_line(result.report)
            runs.setdefault(file, {})[way] = FileRun(**run, tests=tests)
    return runs


def regressions(runs: dict[str, FileRun]) -> list[tuple[str, TestResult]]:
    """The tests that pass plain and fail (or error) on dbuf."""
    if "plain" not in runs or "dbuf" not in runs:
        return []
    plain, dbuf = runs["plain"].tests, runs["dbuf"].tests
    return [(nodeid, dbuf[nodeid]) for nodeid, result in plain.items()
            if result.outcome == "passed" and nodeid in dbuf and dbuf[nodeid].outcome in FAILING]


def print_table(all_runs: dict[str, dict[str, FileRun]], ways: list[str]) -> None:
    width = max([len("file"), *(len(file) for file in all_runs)])
    header = f"{'file':<{width}}" + "".join(f" | {way + ' P/F/S/E':>19}" for way in ways)
    if set(WAYS) <= set(ways):
        header += " | plain ok, dbuf not"
    print(header)
    print("-" * len(header))
    totals = {way: dict.fromkeys(OUTCOMES, 0) for way in ways}
    for file, runs in all_runs.items():
        row = f"{file:<{width}}"
        for way in ways:
            run = runs.get(way)
            if run is None:
                row += f" | {'-':>19}"
                continue
            counts = run.counts()
            for outcome in OUTCOMES:
                totals[way][outcome] += counts[outcome]
            mark = "*" if run.note else " "
            row += f" | {'/'.join(str(counts[outcome]) for outcome in OUTCOMES):>18}{mark}"
        if set(WAYS) <= set(ways):
            row += f" | {len(regressions(runs)):>18}"
        print(row)
    print("-" * len(header))
    total = f"{'total':<{width}}" + "".join(
        f" | {'/'.join(str(totals[way][outcome]) for outcome in OUTCOMES):>18} " for way in ways)
    if set(WAYS) <= set(ways):
        total += f" | {sum(len(regressions(runs)) for runs in all_runs.values()):>18}"
    print(total)
    notes = [(file, run) for file, runs in all_runs.items() for run in runs.values() if run.note]
    for file, run in notes:
        print(f"* {file} ({run.way}): {run.note}")


def print_details(all_runs: dict[str, dict[str, FileRun]]) -> None:
    found = [(nodeid, result) for runs in all_runs.values() for nodeid, result in regressions(runs)]
    print(f"\n{len(found)} tests pass with torch's FSDP2 and fail with dbuf:")
    for nodeid, result in found:
        print(f"  {nodeid} [{result.outcome}]\n      {result.message}")


def write_json(path: Path, args: argparse.Namespace, all_runs: dict[str, dict[str, FileRun]]) -> None:
    meta = {"test_dir": str(args.test_dir.resolve()), "keyword": args.keyword, "world_size": args.world_size,
            "torchrun_env": not args.no_torchrun_env, "dbuf_job": not args.no_dbuf_job,
            "respect_gpu_skips": args.respect_gpu_skips, "timeout": args.timeout}
    files = {file: {way: asdict(run) for way, run in runs.items()} for file, runs in all_runs.items()}
    path.write_text(json.dumps({"meta": meta, "files": files}, indent=1) + "\n")


# ------------------------------------------------------------------ main


def find_daemon_binary() -> None:
    """dbuf.testing finds dbufd through $DBUF_DAEMON or PATH; point it at the build tree's when neither has one."""
    built = REPOSITORY / "build" / "bin" / "dbufd"
    if not os.environ.get("DBUF_DAEMON") and shutil.which("dbufd") is None and built.exists():
        os.environ["DBUF_DAEMON"] = str(built)


def report(paths: list[Path], details: bool) -> int:
    all_runs: dict[str, dict[str, FileRun]] = {}
    for path in paths:
        for file, runs in load_baseline(path).items():
            all_runs.setdefault(file, {}).update(runs)
    print_table(all_runs, [way for way in WAYS if any(way in runs for runs in all_runs.values())])
    if details:
        print_details(all_runs)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    if args.report:
        return report(args.report, args.details)
    files = select_files(args.test_dir, args.files)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="fsdp-conformance-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    if "dbuf" in args.ways:
        find_daemon_binary()
    baseline = load_baseline(args.baseline) if args.baseline else {}
    shown_ways = [way for way in WAYS if way in args.ways or any(way in runs for runs in baseline.values())]
    all_runs: dict[str, dict[str, FileRun]] = {}
    for file in files:
        runs = {way: run for way, run in baseline.get(file, {}).items() if way not in args.ways}
        all_runs[file] = runs
        for way in args.ways:
            targets = [file]
            if way == "dbuf" and args.only_passing:
                plain = runs.get("plain")
                targets = [nodeid for nodeid, result in (plain.tests.items() if plain else [])
                           if result.outcome == "passed"]
                if not targets:
                    print(f"{file} ({way}): no test passed plain, not run", file=sys.stderr, flush=True)
                    continue
            runs[way] = run_file(args, way, file, targets, log_dir)
            counts = runs[way].counts()
            print(f"{file} ({way}): {runs[way].seconds:.0f} s, "
                  + ", ".join(f"{counts[outcome]} {outcome}" for outcome in OUTCOMES)
                  + (f" ({runs[way].note})" if runs[way].note else ""), file=sys.stderr, flush=True)
            if args.json:
                write_json(args.json, args, all_runs)
    print()
    print_table(all_runs, shown_ways)
    if args.details:
        print_details(all_runs)
    if args.json:
        write_json(args.json, args, all_runs)
    print(f"\nlogs: {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
