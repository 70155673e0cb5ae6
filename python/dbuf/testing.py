"""A real dbufd for tests, examples and benchmarks: started on a private socket, stopped after.

::

    from dbuf.testing import Daemon
    with Daemon(timeouts={"collective_ms": 2000}) as daemon:
        client = dbuf.Client(daemon.socket)

The binary is ``$DBUF_DAEMON``, else ``dbufd`` on ``PATH``. Keyword arguments
are sections of dbufd's TOML configuration (``docs/configuration.md``);
everything else keeps its default.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any


def find_daemon() -> str:
    """The dbufd binary to run: $DBUF_DAEMON, else dbufd on PATH."""
    explicit = os.environ.get("DBUF_DAEMON")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise FileNotFoundError(f"$DBUF_DAEMON={explicit} is not an executable")
        return explicit
    found = shutil.which("dbufd")
    if found is None:
        raise FileNotFoundError("no dbufd: set $DBUF_DAEMON to its path (build/bin/dbufd in a build tree)")
    return found


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"cannot write {value!r} into dbufd's configuration")


def _toml(sections: dict[str, dict[str, Any]]) -> str:
    lines: list[str] = []
    for section, keys in sections.items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in keys.items())
    return "\n".join(lines) + "\n"


class Daemon:
    """dbufd in a child process with a socket in a fresh temporary directory.

    ``socket`` is its path; ``log`` the path of its log (stderr). ``stop()``
    sends SIGTERM and waits; ``kill()`` sends SIGKILL (a daemon's death).
    ``launcher``: a prefix to dbufd's command line, a program that runs its
    arguments in place of itself, e.g. ``["ip", "netns", "exec", "ns0"]`` to
    run the daemon in a network namespace (the process stopped and killed is
    then the launcher's, which must be dbufd's after it execs).
    """

    def __init__(self, *, log_level: str = "warn", start_timeout: float = 10.0, launcher: list[str] | None = None,
                 **sections: dict[str, Any]) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="dbufd-")
        root = Path(self._dir.name)
        self.socket = str(root / "dbufd.sock")
        self.log = str(root / "dbufd.log")
        config = root / "dbufd.toml"
        config.write_text(_toml(sections))
        command = [*(launcher or []), find_daemon(), "--config", str(config), "--socket", self.socket,
                   "--log-level", log_level]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + start_timeout
        # dbufd renames its socket into place once it listens: the file is the signal.
        while not os.path.exists(self.socket):
            if self.process.poll() is not None or time.monotonic() > deadline:
                output = Path(self.log).read_text(errors="replace")
                self.stop()
                raise RuntimeError(f"dbufd did not start ({' '.join(command)}):\n{output}")
            time.sleep(0.01)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then wait; returns the exit status (SIGKILL if it does not exit in time)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL: the daemon dies without a goodbye."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def log_text(self) -> str:
        return Path(self.log).read_text(errors="replace")

    def metrics_url(self, timeout: float = 10.0) -> str:
        """The Prometheus endpoint's URL (``metrics={"listen": ...}``; port 0: the one it took), as dbufd logs it
        at level info: start the daemon with ``log_level="info"`` (or lower)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if found := re.search(r"metrics on (http://\S+)", self.log_text()):
                return found.group(1)
            time.sleep(0.05)
        raise RuntimeError("dbufd logged no metrics URL (log level info? [metrics] listen?):\n" + self.log_text())

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
