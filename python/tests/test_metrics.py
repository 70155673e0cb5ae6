"""dbufd's Prometheus endpoint ([metrics] listen) during real jobs: its text read by prometheus_client's parser,
and a real Prometheus server (Debian's `prometheus`) scraping it, asked through its HTTP API (PromQL)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import dbuf
from conftest import run_threads
from dbuf.testing import Daemon

SPECS = [dbuf.TensorSpec("w", (64, 32)), dbuf.TensorSpec("b", (32,))]
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


def scrape(url: str) -> dict[str, list]:
    """name -> samples, parsed by prometheus_client (which refuses malformed text)."""
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples: dict[str, list], name: str, **labels: str) -> float:
    matching = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matching) == 1, f"{name}{labels}: {matching} in {sorted(samples)}"
    return matching[0]


def attached_group(daemon: Daemon, job: str, rank: int, world: int) -> tuple[dbuf.Client, dbuf.Group]:
    client = dbuf.Client(daemon.socket, timeout=10.0)
    client.attach(job, rank, world)
    group = client.register_group("g", SPECS)
    group.acquire_slot()
    return client, group


@pytest.fixture
def metrics_daemon():
    with Daemon(log_level="info", metrics={"listen": "127.0.0.1:0"},
                timeouts={"collective_ms": 300, "register_ms": 5000}) as d:
        yield d


def test_the_endpoint_counts_a_jobs_ops_by_kind_and_result(metrics_daemon):
    url = metrics_daemon.metrics_url()
    world, gathers, scatters = 2, 7, 5

    def rank(r: int):
        client, group = attached_group(metrics_daemon, "counted", r, world)
        for _ in range(gathers):
            group.all_gather()
        for _ in range(scatters):
            group.reduce_scatter()
        client.barrier()
        if r == 0:  # rank 0 alone: a barrier that times out (300 ms)
            with pytest.raises(dbuf.TimeoutError):
                client.barrier()
        ranks.ready.wait(60)
        ranks.release.wait(60)

    ranks = Ranks(world)
    ranks.start(rank)
    ranks.wait_ready()
    try:
        samples = scrape(url)
    finally:
        ranks.join()
    job = {"tenant": "default", "dbuf_job": "counted"}
    assert value(samples, "dbuf_ops_total", **job, op="allGather", result="ok") == gathers
    assert value(samples, "dbuf_ops_total", **job, op="reduceScatter", result="ok") == scatters
    assert value(samples, "dbuf_ops_total", **job, op="barrier", result="ok") == 1
    assert value(samples, "dbuf_ops_total", **job, op="barrier", result="timeout") == 1
    # Histograms: every op observed once in each, cumulative buckets ending at the count.
    for name in ("dbuf_op_wait_seconds", "dbuf_op_run_seconds"):
        assert value(samples, name + "_count", **job, op="allGather") == gathers
        buckets = [s for s in samples[name + "_bucket"] if s.labels["op"] == "allGather"]
        counts = [s.value for s in sorted(buckets, key=lambda s: float(s.labels["le"]))]
        assert counts == sorted(counts) and counts[-1] == gathers
    # The timed-out barrier waited the collective timeout (300 ms) for rank 1.
    timed_out_wait = value(samples, "dbuf_op_wait_seconds_sum", **job, op="barrier")
    assert 0.25 <= timed_out_wait < 5, timed_out_wait
    group_bytes = value(samples, "dbuf_op_bytes_total", **job, op="allGather")
    assert group_bytes > 0 and group_bytes % gathers == 0
    assert value(samples, "dbuf_job_ranks", **job, state="attached") == world
    assert value(samples, "dbuf_job_memory_bytes", **job) > 0
    assert value(samples, "dbuf_tenant_memory_used_bytes", tenant="default") >= value(
        samples, "dbuf_job_memory_bytes", **job)
    assert value(samples, "dbuf_sessions", kind="rank") == world
    assert value(samples, "dbuf_loop_busy_seconds_total") > 0
    assert value(samples, "dbuf_build_info", backend="host") == 1


def test_a_rank_that_fills_its_rings_is_counted_once_per_filling():
    with Daemon(log_level="info", metrics={"listen": "127.0.0.1:0"}, rings={"entries": 16},
                timeouts={"collective_ms": 10000}) as daemon:
        url = daemon.metrics_url()
        clients = [dbuf.Client(daemon.socket, timeout=10.0) for _ in range(2)]
        run_threads(2, lambda r: clients[r].attach("ahead", r, 2))
        job = {"tenant": "default", "dbuf_job": "ahead"}
        for filling in (1, 2):
            # Rank 0 runs 16 barriers ahead of rank 1: its rings (16 entries) are full until rank 1 comes.
            ahead = [clients[0].barrier(async_op=True) for _ in range(16)]
            deadline = time.monotonic() + 10
            while value(scrape(url), "dbuf_job_queued_ops", **job) < 16:
                assert time.monotonic() < deadline, "rank 0's barriers did not all reach dbufd"
                time.sleep(0.01)
            for _ in range(16):
                clients[1].barrier()  # one at a time: rank 1's rings never fill
            for op in ahead:
                op.wait()
            samples = scrape(url)
            assert value(samples, "dbuf_job_ring_full_total", **job) == filling
            assert value(samples, "dbuf_ops_total", **job, op="barrier", result="ok") == 16 * filling
        for client in clients:
            client.detach()


def test_an_address_in_use_is_logged_and_dbufd_serves_on(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with Daemon(log_level="info", metrics={"listen": f"127.0.0.1:{port}"}) as daemon:
            client = dbuf.Client(daemon.socket, timeout=5.0)
            client.attach("alone", 0, 1)
            client.barrier()
            client.close()
            log = daemon.log_text()
            assert f"cannot serve metrics on 127.0.0.1:{port}" in log and "serving without metrics" in log, log
    finally:
        taken.close()


class Ranks:
    """run_threads(world, body) on a thread of its own, while the test looks at the daemon: each rank waits on
    `ready` once it has done its part, then for `release` (so the job stays, with its series). A rank's failure
    breaks `ready` at once."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.ready = threading.Barrier(world + 1)
        self.release = threading.Event()
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self, body) -> None:
        def guarded(r: int):
            try:
                return body(r)
            except BaseException:
                self.ready.abort()
                raise

        def run() -> None:
            try:
                run_threads(self.world, guarded, timeout=120)
            except BaseException as error:  # noqa: BLE001 - re-raised by join()
                self.error = error

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def wait_ready(self) -> None:
        try:
            self.ready.wait(60)
        except threading.BrokenBarrierError:
            self.join()
            raise

    def join(self) -> None:
        self.release.set()
        if self._thread is not None:
            self._thread.join(120)
        if self.error is not None:
            raise self.error


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """Debian's prometheus server scraping `target` every 0.5 s, with its storage in a temporary directory."""

    def __init__(self, target: str) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="prometheus-")
        root = Path(self._dir.name)
        parsed = urllib.parse.urlparse(target)
        (root / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 500ms\n  scrape_timeout: 400ms\n"
            "scrape_configs:\n  - job_name: dbufd\n"
            f"    metrics_path: {parsed.path}\n    static_configs:\n      - targets: ['{parsed.netloc}']\n")
        self.address = f"127.0.0.1:{free_port()}"
        self.log = root / "prometheus.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [PROMETHEUS, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'data'}",
                 f"--web.listen-address={self.address}"], stdout=log, stderr=subprocess.STDOUT)

    def query(self, promql: str) -> list:
        """The result vector of an instant query, [] while the server is not up yet."""
        url = f"http://{self.address}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                answer = json.load(response)
        except OSError:
            assert self.process.poll() is None, self.log.read_text()
            return []
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    def wait_for(self, promql: str, expected: float, timeout: float = 60.0) -> float:
        deadline = time.monotonic() + timeout
        seen = None
        while time.monotonic() < deadline:
            result = self.query(promql)
            if result:
                seen = float(result[0]["value"][1])
                if seen == expected:
                    return seen
            time.sleep(0.2)
        raise AssertionError(f"{promql}: {seen}, not {expected}, after {timeout} s\n" + self.log.read_text())

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._dir.cleanup()


def test_a_real_prometheus_scrapes_dbufd_and_promql_counts_the_ops_run(metrics_daemon):
    assert Path(PROMETHEUS).exists(), "Debian's prometheus is not installed (scripts/install-deps.sh installs it)"
    prometheus = Prometheus(metrics_daemon.metrics_url())
    world, steps = 2, 12

    def rank(r: int):
        client, group = attached_group(metrics_daemon, "scraped", r, world)
        for _ in range(steps):
            group.all_gather()
            group.reduce_scatter()
        ranks.ready.wait(60)
        ranks.release.wait(90)  # attached, so the job's series stay until Prometheus has seen them
        client.detach()

    ranks = Ranks(world)
    ranks.start(rank)
    try:
        ranks.wait_ready()
        assert prometheus.wait_for('up{job="dbufd"}', 1) == 1
        assert prometheus.wait_for('sum(dbuf_ops_total{dbuf_job="scraped"})', 2 * steps) == 2 * steps
        assert prometheus.wait_for('sum by (op) (dbuf_ops_total{dbuf_job="scraped",op="allGather",result="ok"})',
                                   steps) == steps
        assert prometheus.wait_for('dbuf_job_ranks{dbuf_job="scraped",state="attached"}', world) == world
        # The histograms are usable as such: a quantile of the run time, finite and positive.
        quantile = prometheus.query('histogram_quantile(0.9, sum by (le) (dbuf_op_run_seconds_bucket{'
                                    'dbuf_job="scraped",op="allGather"}))')
        assert quantile and 0 < float(quantile[0]["value"][1]) < 100, quantile
        # Prometheus parsed every sample it scraped.
        assert prometheus.wait_for('scrape_samples_post_metric_relabeling{job="dbufd"} > bool 50', 1) == 1
    finally:
        prometheus.close()
        ranks.join()
