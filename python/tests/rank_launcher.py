"""Rank processes forked from interpreters that imported torch and transformers already.

Most of the suite's time was imports: each rank process of a test is a new
interpreter, and importing torch and transformers costs about 5 CPU-seconds,
so a 4-rank launch spent 10 s of a 2-core machine before its first line ran.
Here a launcher imports them once, then forks a rank for each launch. The
rank is a process of its own as before: its environment, working directory,
argv, sys.path, stdout and stderr are set as ``python SCRIPT ARGS`` would set
them, and it exits through the interpreter's normal shutdown (atexit handlers
included). What an interpreter reads only when it starts is the launcher's:
there is one launcher per rank index (ranks keep distinct hash seeds, as
separate interpreters have) and per value of those variables
(``START_VARIABLES``), started with the rank's values. So with
``$DBUF_FSDP=1`` the launcher installs dbuf's switch before anything is
imported, as the package's ``dbuf-fsdp.pth`` does at an interpreter's start
(transformers binds ``fully_shard`` when it is imported); without it nothing
of dbuf is imported before the fork, and FSDP2's reference runs see torch
untouched.

``DBUF_TEST_FRESH_RANKS=1`` makes run_ranks start a new interpreter per rank
instead (conftest.py), as before.

Run as a script, this file is the launcher: it reads one JSON request per
line on stdin and answers one JSON line on stdout:
  {"spawn": {"script", "args", "env", "cwd", "stdout", "stderr"}} -> {"pid": PID}
  {"poll": PID} -> {"returncode": RC or null (still running)}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

# Imported before any fork (the point of the launcher); names the ranks' scripts use most.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "transformers",
)
PRELOAD_MODELS = ("LlamaForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM", "LlamaConfig")

# Read when an interpreter starts or when dbuf is imported (which the switch does at start): a launcher is
# started with the rank's values of these, and serves only ranks with the same.
START_VARIABLES = ("DBUF_FSDP", "DBUF_TORCH_FAST_PATH", "DBUF_TORCH_UNTESTED", "PYTHONHASHSEED", "PYTHONWARNINGS",
                   "PYTHONFAULTHANDLER", "PYTHONUNBUFFERED", "PYTHONDEVMODE", "PYTHONMALLOC")


def start_key(env: dict[str, str]) -> tuple[str | None, ...]:
    """What a launcher must share with a rank's environment to serve it."""
    return tuple(env.get(name) for name in START_VARIABLES)


class RankLauncher:
    """One launcher process: forks ranks on request (thread-safe)."""

    def __init__(self, env: dict[str, str]) -> None:
        self._lock = threading.Lock()
        self._proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      env=env, text=True)

    def alive(self) -> bool:
        return self._proc.poll() is None

    def _ask(self, request: dict) -> dict:
        with self._lock:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the rank launcher exited ({self._proc.returncode})")
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the rank launcher exited ({self._proc.wait()})")
        return json.loads(line)

    def spawn(self, script: str, args: list[str], env: dict[str, str], stdout: Path, stderr: Path) -> "ForkedRank":
        answer = self._ask({"spawn": {"script": script, "args": args, "env": env, "cwd": os.getcwd(),
                                      "stdout": str(stdout), "stderr": str(stderr)}})
        return ForkedRank(self, answer["pid"], stdout, stderr)

    def poll(self, pid: int) -> int | None:
        return self._ask({"poll": pid})["returncode"]

    def close(self) -> None:
        self._proc.stdin.close()  # the launcher ends at end of input
        self._proc.wait(timeout=30)


class ForkedRank:
    """A rank forked by a launcher: what run_ranks needs of a subprocess.Popen."""

    def __init__(self, launcher: RankLauncher, pid: int, stdout: Path, stderr: Path) -> None:
        self.launcher, self.pid, self.stdout_path, self.stderr_path = launcher, pid, stdout, stderr
        self.returncode: int | None = None

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.returncode is None:
            self.returncode = self.launcher.poll(self.pid)
            if self.returncode is None:
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
                time.sleep(0.02)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is not None:
            return  # reaped: the pid may be another process's by now
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass

    def output(self) -> tuple[str, str]:
        return self.stdout_path.read_text(errors="replace"), self.stderr_path.read_text(errors="replace")


# ------------------------------------------------------------------ the launcher process


_LAUNCHER_PYTHONPATH = os.environ.get("PYTHONPATH", "")


def _pythonpath(value: str) -> list[str]:
    return [entry for entry in value.split(os.pathsep) if entry]


def _preload() -> None:
    import importlib

    # What the package's dbuf-fsdp.pth does at an interpreter's start, before anything else is imported.
    if os.environ.get("DBUF_FSDP", "") not in ("", "0"):
        from dbuf.torch.switch import install_from_environment

        install_from_environment()
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            continue  # (transformers is optional): the rank imports what it needs itself
    transformers = sys.modules.get("transformers")
    for name in PRELOAD_MODELS:
        getattr(transformers, name, None)  # transformers imports a model's module when its name is read


def _become_rank(request: dict) -> None:
    """In the forked child: the process `python SCRIPT ARGS` with `env` would be; runs the script, then exits."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    # As an interpreter opens them: stderr line-buffered (its last lines survive a kill), stdout buffered
    # unless $PYTHONUNBUFFERED (a start variable: the launcher has the rank's value).
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stdin, /dev/null
    sys.stdout = open(1, "w", buffering=1 if unbuffered else -1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    if unbuffered:
        sys.stdout.reconfigure(write_through=True)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if os.environ.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    script = request["script"]
    sys.argv = [script, *request["args"]]
    # As the interpreter builds it: the script's folder, the rank's $PYTHONPATH, then the rest (the launcher's own
    # $PYTHONPATH out).
    rest = [entry for entry in sys.path[1:] if entry not in _pythonpath(_LAUNCHER_PYTHONPATH)]
    sys.path[:] = [str(Path(script).parent), *_pythonpath(os.environ.get("PYTHONPATH", "")), *rest]
    import runpy

    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        import traceback

        traceback.print_exc()
        sys.exit(1)
    sys.exit(0)


def _serve() -> None:
    _preload()
    requests = sys.stdin
    answers = sys.stdout
    children: dict[int, int | None] = {}
    for line in requests:
        request = json.loads(line)
        if "spawn" in request:
            pid = os.fork()
            if pid == 0:
                requests.close()
                _become_rank(request["spawn"])  # exits through SystemExit: never returns here
            children[pid] = None
            answer = {"pid": pid}
        else:
            pid = request["poll"]
            if children.get(pid) is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    children[pid] = os.waitstatus_to_exitcode(status)
            answer = {"returncode": children.get(pid)}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    _serve()
