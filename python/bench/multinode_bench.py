"""Jobs across nodes: dbuf's all-gather / reduce-scatter against torch.distributed (gloo), over shaped links.

    python multinode_bench.py [--quick] [--warmup 3] [--iters 5] [--layouts 2,4] [--sizes 16,64] [--rates 1,10]

As root (it makes network namespaces; otherwise it says why and exits 0).
$DBUF_DAEMON names dbufd (else dbufd on PATH). Two "nodes", each a network
namespace with a veth eth0 (10.231.0.1, 10.231.0.2) whose peer sits in a
bridge in a third namespace, as tests/multinode does; every node's egress is
shaped with ``tc qdisc ... tbf rate R burst 256kb latency 50ms``. Node n's
dbufd and its rank processes run in namespace n (ranks are contiguous: rank r
is on node r // L).

Cases: 2 nodes x 2 and x 4 ranks, 16 and 64 MiB fp32 shard per rank, links of
1 and 10 Gbit/s (--quick: 2 x 2, 16 MiB, 1 Gbit/s). In each case, in the same
run and alternating op by op (which system goes first alternates too):

- dbuf: rank processes attached to their node's dbufd, one group of one 1-D
  tensor of world * S elements (fp32 shards of S elements, bf16 unsharded):
  ``all_gather`` (fp32 shard -> bf16 parameters, the cast fused) and
  ``reduce_scatter(AVG)`` (bf16 gradients -> fp32 shard; dbufd sums each
  node's ranks locally and sends fp32 node partials).
- gloo: torch.distributed over gloo, one process per rank in the same
  namespaces, doing what FSDP2 does on CPU with MixedPrecisionPolicy(bf16,
  reduce_dtype=fp32): cast the fp32 shard to bf16 + all_gather_into_tensor
  (bf16), and cast the bf16 gradients to fp32 + reduce_scatter_tensor(AVG,
  fp32). The casts are in the times (dbuf fuses them); the time of gloo's
  collective alone is printed too ("inner", where dbuf's is dbufd's run time
  of the op). Also, for reference, reduce_scatter_tensor in bf16 (FSDP2 with
  reduce_dtype=bf16; gloo reduces bf16). gloo's bf16 gradients are its
  all-gather's output buffer (one buffer of W * S less per rank).

A case whose memory (both systems' rank processes and dbufd's, estimated from
measurements here) does not fit in MemAvailable less 2 GiB runs the systems
one after the other instead, at each rate (which goes first alternates from
rate to rate), and says so: 2 x 4 ranks at 64 MiB needs about 26 GiB for
both, 18 GiB for gloo alone. A case where one system alone does not fit is
left out, saying so.

Each timed op follows a barrier of its system; its time is the maximum over
the ranks of the time from the barrier's end to the op's end (as the rank
sees it: the call of a dbuf op returns when the op completed). Medians and
worst of the timed iterations are printed. Bytes on the wire: eth0's tx_bytes
and rx_bytes in each node's namespace (``ip netns exec NS cat
/sys/class/net/eth0/statistics/...``) around each timed op (the barrier's
few bytes included), the larger node's, against the minimum a node must
receive: (W - L) * S elements, bf16 for the all-gather, fp32 for the
reduce-scatter (what dbuf and FSDP2's fp32 reduction send). Line rate used:
tx bytes * 8 / (rate * op time). Each result is checked once against its exact
value (integer-valued data) after the warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NODES = 2
MIB = 1 << 20
TIMEOUT_S = 300.0  # one reply from a rank process


def address(node: int) -> str:
    return f"10.231.0.{node + 1}"


class BenchError(RuntimeError):
    pass


# ------------------------------------------------------------------ namespaces


class Namespaces:
    """One network namespace per node (veth eth0, 10.231.0.n+1/24) and one holding the bridge br0."""

    def __init__(self, nodes: int) -> None:
        self.ip = shutil.which("ip") or "/usr/sbin/ip"
        self.prefix = f"dbm{os.getpid() % 100000}"
        self.bridge = self.prefix + "br"
        self.nodes = [f"{self.prefix}n{n}" for n in range(nodes)]
        self.made: list[str] = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        self._run("netns", "add", self.bridge)
        self.made.append(self.bridge)
        self._run("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        self._run("-n", self.bridge, "link", "set", "br0", "up")
        for n, ns in enumerate(self.nodes):
            peer = f"v{n}"
            self._run("netns", "add", ns)
            self.made.append(ns)
            self._run("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", peer, "netns", self.bridge)
            self._run("-n", ns, "addr", "add", address(n) + "/24", "dev", "eth0")
            self._run("-n", ns, "link", "set", "eth0", "up")
            self._run("-n", ns, "link", "set", "lo", "up")
            self._run("-n", self.bridge, "link", "set", peer, "master", "br0")
            self._run("-n", self.bridge, "link", "set", peer, "up")

    def _run(self, *args: str) -> str:
        done = subprocess.run([self.ip, *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise BenchError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout

    def launcher(self, node: int) -> list[str]:
        return [self.ip, "netns", "exec", self.nodes[node]]

    def shape(self, gbit: int) -> None:
        """Egress of every node's eth0: a token bucket of `gbit` Gbit/s."""
        for node in range(len(self.nodes)):
            tc = [*self.launcher(node), "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", f"{gbit}gbit",
                  "burst", "256kb", "latency", "50ms"]
            done = subprocess.run(tc, capture_output=True, text=True)
            if done.returncode != 0:
                raise BenchError(f"{' '.join(tc)} failed: {done.stderr.strip()}")

    def counters(self) -> list[tuple[int, int]]:
        """(tx_bytes, rx_bytes) of each node's eth0."""
        result = []
        for node in range(len(self.nodes)):
            stats = "/sys/class/net/eth0/statistics/"
            out = subprocess.run([*self.launcher(node), "cat", stats + "tx_bytes", stats + "rx_bytes"],
                                 capture_output=True, text=True, check=True).stdout.split()
            result.append((int(out[0]), int(out[1])))
        return result

    def close(self) -> None:
        for ns in reversed(self.made):
            subprocess.run([self.ip, "netns", "del", ns], capture_output=True)
        self.made.clear()


def cannot_run() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"iproute2's {tool} is not installed"
    return None


# ------------------------------------------------------------------ rank processes


class Worker:
    """A rank process (this file with --worker) in a node's namespace, driven by JSON lines on its stdin/stdout."""

    def __init__(self, launcher: list[str], spec: dict[str, Any], log: Path) -> None:
        self.log = log
        self.spec = spec
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0")
        with open(log, "wb") as err:
            self.proc = subprocess.Popen([*launcher, sys.executable, __file__, "--worker", json.dumps(spec)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env,
                                         start_new_session=True)
        self._buffer = b""

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"cmd": command}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise BenchError(self.failure("exited")) from None

    def recv(self, timeout: float = TIMEOUT_S) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(self.failure(f"gave no answer within {timeout:.0f} s"))
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    self.proc.wait()
                    raise BenchError(self.failure(f"exited with status {self.proc.returncode}"))
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        reply = json.loads(line)
        if "error" in reply:
            raise BenchError(self.failure("failed: " + reply["error"]))
        return reply

    def failure(self, what: str) -> str:
        tail = self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""
        return f"{self.spec['system']} rank {self.spec['rank']} {what}; its log ({self.log}):\n{tail}"


def stop_workers(workers: list[Worker], graceful: bool) -> None:
    """graceful: ask each to detach and exit (30 s for all); else, or after that, SIGKILL."""
    if graceful:
        for w in workers:
            try:
                if w.proc.poll() is None:
                    w.send("quit")
            except (BenchError, OSError):
                pass
        deadline = time.monotonic() + 30
        for w in workers:
            try:
                w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for w in workers:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait()


def ask(workers: list[Worker], command: str) -> list[dict[str, Any]]:
    for w in workers:
        w.send(command)
    return [w.recv() for w in workers]


# The data: exact in bf16 and in every sum, so each result has one right value.
# Parameters: element i of the unsharded tensor is (i % 16) + i // S (a sum of 8 of them is exact in bf16).
# Gradients of rank r: element i is ((i % 32) + 3 r) % 32.


def worker_main(spec: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(1)
    world, shard = spec["world"], spec["shard_elems"]
    rank = spec["rank"]
    lanes = torch.arange(16, dtype=torch.float32)
    tiles = [(torch.arange(32) + 3 * r) % 32 for r in range(world)]
    tile_avg = torch.stack(tiles).to(torch.float32).sum(0) / world

    def fill_shard(view: torch.Tensor, begin: int) -> None:
        view.view(-1, 16)[:] = lanes + begin // shard

    def fill_grad(view: torch.Tensor) -> None:
        view.view(-1, 32)[:] = tiles[rank].to(view.dtype)

    def gathered_ok(full: torch.Tensor) -> bool:
        rows = full.view(world, shard // 16, 16)
        return all(torch.equal(rows[w], (lanes + w).to(full.dtype).expand(shard // 16, 16)) for w in range(world))

    def reduced_ok(out: torch.Tensor) -> bool:
        return torch.equal(out.view(-1, 32), tile_avg.to(out.dtype).expand(shard // 32, 32))

    def reply(**fields: Any) -> None:
        sys.stdout.write(json.dumps(fields) + "\n")
        sys.stdout.flush()

    if spec["system"] == "dbuf":
        import dbuf

        client = dbuf.Client(spec["socket"], 300.0)
        client.attach(spec["job"], rank, world, local_rank=rank % spec["local"], local_world_size=spec["local"],
                      store=spec["store"])
        group = client.register_group("params", [dbuf.TensorSpec("w", (world * shard,))], granularity="element",
                                      sharded_dtype="fp32", unsharded_dtype="bf16")
        view = group.shard_view("w")
        if group.plan.shard_elems != shard or view.begin != rank * shard:
            raise RuntimeError(f"plan: S={group.plan.shard_elems}, begin {view.begin}; wanted S={shard}")
        group.acquire_slot()
        fill_shard(view.torch(), view.begin)
        fill_grad(group.unsharded_grad_view("w").torch())

        def barrier() -> None:
            client.barrier()

        def op(name: str) -> dict[str, float]:
            start = time.perf_counter()
            if name == "ag":
                result = group.all_gather()
            else:
                result = group.reduce_scatter(op=dbuf.ReduceOp.AVG)
            return {"t": time.perf_counter() - start, "daemon": result.run_ns / 1e9}

        def check() -> bool:
            return gathered_ok(group.unsharded_view("w").torch()) and reduced_ok(group.shard_grad_view("w").torch())

        def close() -> None:
            group.reshard()
            client.detach()
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{address(0)}:{spec['port']}", rank=rank,
                                world_size=world)
        shard32 = torch.empty(shard)
        fill_shard(shard32, rank * shard)
        shard16 = torch.empty(shard, dtype=torch.bfloat16)
        # The bf16 gradients are the all-gather's output (one buffer of world * S less per rank): each rank's
        # gradients are then the same, the gathered parameters, and their average is this rank's shard.
        full16 = torch.empty(world * shard, dtype=torch.bfloat16)
        for w in range(world):
            fill_shard(full16[w * shard:(w + 1) * shard], w * shard)
        grad16 = full16
        grad32 = torch.empty(world * shard)
        out32 = torch.empty(shard)
        out16 = torch.empty(shard, dtype=torch.bfloat16)

        def barrier() -> None:
            dist.barrier()

        def op(name: str) -> dict[str, float]:
            start = time.perf_counter()
            if name == "ag":
                shard16.copy_(shard32)
                cast = time.perf_counter()
                dist.all_gather_into_tensor(full16, shard16)
            elif name == "rs":
                grad32.copy_(grad16)
                cast = time.perf_counter()
                dist.reduce_scatter_tensor(out32, grad32, op=dist.ReduceOp.AVG)
            else:  # rs16
                cast = start
                dist.reduce_scatter_tensor(out16, grad16, op=dist.ReduceOp.AVG)
            end = time.perf_counter()
            return {"t": end - start, "comm": end - cast}

        def check() -> bool:
            return gathered_ok(full16) and torch.equal(out32, shard32) and torch.equal(out16, shard16)

        def close() -> None:
            dist.destroy_process_group()

    reply(ready=True)
    for line in sys.stdin:
        command = json.loads(line)["cmd"]
        try:
            if command == "quit":
                close()
                reply(bye=True)
                return
            if command == "memory":
                status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
                reply(**{k: int(status[k].split()[0]) // 1024 for k in ("VmHWM", "RssAnon", "RssShmem")})
                continue
            if command == "check":
                reply(ok=check())
            else:
                barrier()
                reply(**op(command))
        except Exception as error:  # noqa: BLE001 - the controller prints it
            reply(error=f"{type(error).__name__}: {error}")
            return


# ------------------------------------------------------------------ the controller


OPS = {  # op -> (systems, bytes per element on the wire at the minimum)
    "ag": (("dbuf", "gloo"), 2),
    "rs": (("dbuf", "gloo"), 4),
    "rs16": (("gloo",), 2),
}
LABEL = {"ag": "all-gather", "rs": "reduce-scatter", "rs16": "rs bf16 ref"}


def tcp_rate(ns: Namespaces, megabytes: int = 64) -> float:
    """One TCP stream node 1 -> node 0 over the shaped link: Gbit/s."""
    sink = ("import socket,sys,time\n"
            "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind(('0.0.0.0',29399));"
            "s.listen();print('up',flush=True);c,_=s.accept();n=0;t=None\n"
            "while True:\n d=c.recv(1<<20)\n if t is None:t=time.perf_counter()\n if not d:break\n n+=len(d)\n"
            "print(n*8/(time.perf_counter()-t)/1e9)")
    source = (f"import socket;s=socket.create_connection(('{address(0)}',29399));b=bytes(1<<20)\n"
              f"for _ in range({megabytes}): s.sendall(b)\ns.close()")
    receiver = subprocess.Popen([*ns.launcher(0), sys.executable, "-c", sink], stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout is not None
        receiver.stdout.readline()
        subprocess.run([*ns.launcher(1), sys.executable, "-c", source], check=True, timeout=120)
        out, _ = receiver.communicate(timeout=60)
        return float(out.strip())
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()


def start_workers(ns: Namespaces, daemons: list[Any], store: str, tmp: Path, job: str, system: str, world: int,
                  local: int, shard: int, port: int) -> list[Worker]:
    """One system's rank processes for a case, each in its node's namespace, once they are ready."""
    workers = []
    try:
        for rank in range(world):
            spec = {"system": system, "rank": rank, "world": world, "local": local, "shard_elems": shard,
                    "socket": daemons[rank // local].socket, "job": job, "store": f"{store}#{job}", "port": port}
            workers.append(Worker(ns.launcher(rank // local), spec, tmp / f"{job}-{system}-{rank}.log"))
        for w in workers:
            w.recv()
    except BaseException:
        stop_workers(workers, graceful=False)
        raise
    return workers


def measure(ns: Namespaces, workers: dict[str, list[Worker]], job: str, gbit: int, warmup: int, iters: int,
            samples: dict[tuple[str, str], list[dict[str, float]]]) -> None:
    """warmup + iters iterations of every op on the systems in `workers`, alternating op by op (which goes
    first alternates too); the results are checked after the warm-up; timed samples go to `samples`."""
    for it in range(warmup + iters):
        if it == warmup:
            for system in workers:
                if not all(r["ok"] for r in ask(workers[system], "check")):
                    raise BenchError(f"{system}: wrong results in {job} at {gbit} Gbit/s")
        order = ("dbuf", "gloo") if it % 2 == 0 else ("gloo", "dbuf")
        for op, (systems, _) in OPS.items():
            for system in (s for s in order if s in systems and s in workers):
                before = ns.counters()
                replies = ask(workers[system], op)
                after = ns.counters()
                if it < warmup:
                    continue
                tx = max(a[0] - b[0] for a, b in zip(after, before))
                rx = max(a[1] - b[1] for a, b in zip(after, before))
                samples.setdefault((op, system), []).append({
                    "t": max(r["t"] for r in replies),
                    "comm": max(r["comm"] if "comm" in r else r["daemon"] for r in replies),
                    "tx": tx, "rx": rx})


def run_case(ns: Namespaces, daemons: list[Any], store: str, tmp: Path, nodes: int, local: int, shard_mib: int,
             rates: list[int], warmup: int, iters: int, port: int, together: bool) -> list[dict[str, Any]]:
    """One layout and size at every rate. together: both systems' ranks at once, alternating op by op;
    else (their memory together does not fit) one system at a time, at each rate the two one after the
    other (which goes first alternates from rate to rate)."""
    world = nodes * local
    shard = shard_mib * MIB // 4
    job = f"{ns.prefix}-{nodes}x{local}-{shard_mib}"
    results = []

    def case(gbit: int, samples: dict[tuple[str, str], list[dict[str, float]]]) -> dict[str, Any]:
        return {"layout": f"{nodes}x{local}", "world": world, "local": local, "shard_mib": shard_mib,
                "gbit": gbit, "samples": samples, "together": together}

    if not together:
        for n, gbit in enumerate(rates):
            ns.shape(gbit)
            samples: dict[tuple[str, str], list[dict[str, float]]] = {}
            for system in (("dbuf", "gloo") if n % 2 == 0 else ("gloo", "dbuf")):
                workers = {system: start_workers(ns, daemons, store, tmp, f"{job}-{gbit}g-{system}", system, world,
                                                 local, shard, port)}
                port += 1
                try:
                    measure(ns, workers, job, gbit, warmup, iters, samples)
                    print_memory(daemons, {system: ask(workers[system], "memory")})
                except BaseException:
                    stop_workers(workers[system], graceful=False)
                    raise
                stop_workers(workers[system], graceful=True)
            results.append(case(gbit, samples))
            print_case(results[-1], shard)
        return results
    workers: dict[str, list[Worker]] = {}
    try:
        for system in ("dbuf", "gloo"):
            workers[system] = start_workers(ns, daemons, store, tmp, job, system, world, local, shard, port)
        for gbit in rates:
            ns.shape(gbit)
            samples = {}
            measure(ns, workers, job, gbit, warmup, iters, samples)
            results.append(case(gbit, samples))
            print_case(results[-1], shard)
        print_memory(daemons, {system: ask(workers[system], "memory") for system in workers})
    except BaseException:
        stop_workers([w for ws in workers.values() for w in ws], graceful=False)
        raise
    stop_workers([w for ws in workers.values() for w in ws], graceful=True)
    return results


def print_memory(daemons: list[Any], ranks: dict[str, list[dict[str, int]]]) -> None:
    """Peak resident memory of the rank processes (MiB, the most of any rank) and dbufd's now."""
    daemon_mib = []
    for daemon in daemons:
        lines = Path(f"/proc/{daemon.process.pid}/status").read_text().splitlines()
        status = dict(line.split(":", 1) for line in lines)
        daemon_mib.append(sum(int(status[k].split()[0]) for k in ("RssAnon", "RssShmem")) // 1024)
    parts = []
    if "gloo" in ranks:
        g = ranks["gloo"]
        parts.append(f"gloo rank peak RSS {max(r['VmHWM'] for r in g)} MiB (anonymous now"
                     f" {max(r['RssAnon'] for r in g)})")
    if "dbuf" in ranks:
        d = ranks["dbuf"]
        parts.append(f"dbuf rank peak RSS {max(r['VmHWM'] for r in d)} MiB (anonymous now"
                     f" {max(r['RssAnon'] for r in d)}, the rest dbufd's shared memory)")
    print(f"  memory: {'; '.join(parts)}; dbufd per node {max(daemon_mib)} MiB")


def memory_needed_mib(world: int, shard_mib: int) -> dict[str, int]:
    """Each system's rank processes' memory for a case (dbuf's with dbufd's), as measured here (MiB, roughly).

    A gloo rank: ~300 + its buffers (3 S + 1.5 W S: fp32 and bf16 shard and output, bf16 gathered
    parameters, fp32 gradients) + gloo's reduce-scatter temporaries (~2 W S). A dbuf rank: ~300; dbufd: per
    rank its fp32 shard and gradient (2 S) and its slot (bf16 parameters and gradients, W S).
    """
    gloo = world * (300 + 3 * shard_mib + 3.5 * world * shard_mib)
    dbuf = world * (300 + 2 * shard_mib + world * shard_mib) + 200
    return {"gloo": int(gloo), "dbuf": int(dbuf)}


def memory_available_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    return 1 << 30


def summarize(samples: list[dict[str, float]], min_bytes: int, gbit: int) -> dict[str, float]:
    times = [s["t"] for s in samples]
    wire = statistics.median(max(s["tx"], s["rx"]) for s in samples)
    return {
        "median": statistics.median(times), "worst": max(times),
        "comm": statistics.median(s["comm"] for s in samples),
        "wire": wire, "wire_over_min": wire / min_bytes,
        "line": statistics.median(s["tx"] * 8 / (gbit * 1e9 * s["t"]) for s in samples),
    }


def case_stats(case: dict[str, Any], shard: int) -> dict[tuple[str, str], dict[str, float]]:
    out = {}
    for (op, system), samples in case["samples"].items():
        min_bytes = (case["world"] - case["local"]) * shard * OPS[op][1]
        out[(op, system)] = summarize(samples, min_bytes, case["gbit"]) | {"min": min_bytes}
    return out


def print_case(case: dict[str, Any], shard: int) -> None:
    stats = case_stats(case, shard)
    print(f"\n{case['layout']} ranks, {case['shard_mib']} MiB fp32 shard per rank, {case['gbit']} Gbit/s links"
          + ("" if case["together"] else " (the systems one after the other)"))
    print(f"  {'op':<15}{'system':<7}{'median ms':>10}{'worst ms':>10}{'(inner ms)':>11}"
          f"{'dbuf/gloo':>10}{'worst/worst':>12}{'MiB/node':>10}{'min MiB':>9}{'x min':>7}{'line':>7}")
    for op in OPS:
        for system in OPS[op][0]:
            s = stats[(op, system)]
            ratio = worst = ""
            if system == "dbuf":
                g = stats[(op, "gloo")]
                ratio, worst = f"{s['median'] / g['median']:.2f}", f"{s['worst'] / g['worst']:.2f}"
            comm = f"({s['comm'] * 1e3:.0f})" if op != "rs16" else ""
            print(f"  {LABEL[op]:<15}{system:<7}{s['median'] * 1e3:>10.1f}{s['worst'] * 1e3:>10.1f}{comm:>11}"
                  f"{ratio:>10}{worst:>12}{s['wire'] / MIB:>10.1f}{s['min'] / MIB:>9.1f}{s['wire_over_min']:>7.2f}"
                  f"{s['line'] * 100:>6.0f}%")
    sys.stdout.flush()


def print_summary(cases: list[dict[str, Any]]) -> None:
    print("\nSummary (dbuf/gloo: time ratio, median of iterations and worst against worst; x min: bytes per node"
          " on the wire over the minimum; line: share of the link rate used; *: the systems one after the other)")
    print(f"{'case':<20}{'AG dbuf/gloo':>13}{'worst':>7}{'RS dbuf/gloo':>13}{'worst':>7}"
          f"{'AG x min d/g':>14}{'RS x min d/g':>14}{'AG line d/g':>13}{'RS line d/g':>13}")
    for case in cases:
        stats = case_stats(case, case["shard_mib"] * MIB // 4)
        name = f"{case['layout']} {case['shard_mib']}MiB {case['gbit']}G" + ("" if case["together"] else " *")
        row = f"{name:<20}"
        for op in ("ag", "rs"):
            d, g = stats[(op, "dbuf")], stats[(op, "gloo")]
            row += f"{d['median'] / g['median']:>13.2f}{d['worst'] / g['worst']:>7.2f}"
        for key in ("wire_over_min", "line"):
            for op in ("ag", "rs"):
                d, g = stats[(op, "dbuf")], stats[(op, "gloo")]
                cell = (f"{d[key]:.2f}/{g[key]:.2f}" if key == "wire_over_min"
                        else f"{d[key] * 100:.0f}%/{g[key] * 100:.0f}%")
                row += f"{cell:>14}" if key == "wire_over_min" else f"{cell:>13}"
        print(row)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="only 2 x 2 ranks, 16 MiB, 1 Gbit/s")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--layouts", help="ranks per node, e.g. 2,4 (instead of the default matrix)")
    p.add_argument("--sizes", help="MiB of fp32 shard per rank, e.g. 16,64")
    p.add_argument("--rates", help="link rates in Gbit/s, e.g. 1,10")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker_main(json.loads(args.worker))
        return 0
    why = cannot_run()
    if why:
        print(f"multinode_bench: skipped: {why}")
        return 0
    from dbuf.testing import Daemon

    def values(option: str | None, default: list[int], quick: int) -> list[int]:
        if option:
            return [int(v) for v in option.split(",")]
        return [quick] if args.quick else default

    layouts = values(args.layouts, [2, 4], 2)
    sizes = values(args.sizes, [16, 64], 16)
    rates = values(args.rates, [1, 10], 1)
    print(f"dbuf vs torch.distributed gloo across {NODES} nodes (network namespaces, veth + bridge, egress tbf"
          f" burst 256kb latency 50ms); {args.warmup} warm-up + {args.iters} timed iterations per op, alternating")
    print("dtypes: fp32 shard, bf16 parameters and gradients; all-gather fp32 -> bf16 (bf16 on the wire),"
          " reduce-scatter bf16 -> fp32 AVG (fp32 on the wire: dbuf's node partials, gloo's fp32 reduction);"
          " gloo times include FSDP2's casts; (inner ms): gloo's collective alone, dbufd's run time of the op"
          " (OpResult.run_ns); 'rs bf16 ref' is gloo reduce-scattering bf16 (FSDP2 reduce_dtype=bf16), for"
          " reference")
    started = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    ns: Namespaces | None = None
    daemons: list[Any] = []
    cases: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="dbuf-multinode-bench-") as tmp_name:
        tmp = Path(tmp_name)
        store_dir = tmp / "store"
        store_dir.mkdir(mode=0o700)
        try:
            try:
                ns = Namespaces(NODES)
                ns.shape(1)
            except BenchError as error:
                print(f"multinode_bench: skipped: network namespaces are not available here: {error}")
                return 0
            for node in range(NODES):
                daemons.append(Daemon(launcher=ns.launcher(node), log_level="info", cluster={"address": address(node)},
                                      timeouts={"collective_ms": 120000, "register_ms": 120000}))
            for gbit in rates:
                ns.shape(gbit)
                print(f"one TCP stream node 1 -> node 0 at {gbit} Gbit/s: {tcp_rate(ns):.2f} Gbit/s")
            port = 29400
            for local in layouts:
                for shard_mib in sizes:
                    need, room = memory_needed_mib(NODES * local, shard_mib), memory_available_mib() - 2048
                    together = sum(need.values()) <= room
                    if not together and max(need.values()) > room:
                        print(f"\nleft out: {NODES}x{local} ranks at {shard_mib} MiB: gloo needs about"
                              f" {need['gloo'] / 1024:.0f} GiB and dbuf {need['dbuf'] / 1024:.0f} GiB, more than the"
                              f" {room / 1024:.0f} GiB available (less 2)")
                        continue
                    if not together:
                        print(f"\n{NODES}x{local} ranks at {shard_mib} MiB: the systems one after the other (gloo"
                              f" needs about {need['gloo'] / 1024:.0f} GiB, dbuf {need['dbuf'] / 1024:.0f} GiB;"
                              f" {room / 1024:.0f} GiB available, less 2)")
                    cases += run_case(ns, daemons, f"file:{store_dir}", tmp, NODES, local, shard_mib, rates,
                                      args.warmup, args.iters, port, together)
                    port += 8
            print_summary(cases)
            print(f"\ntotal {time.monotonic() - started:.0f} s")
            return 0
        except KeyboardInterrupt:
            print("\nmultinode_bench: interrupted (namespaces, daemons and ranks removed)", file=sys.stderr)
            return 130
        except BenchError as error:
            print(f"\nmultinode_bench: FAILED: {error}", file=sys.stderr)
            for node, daemon in enumerate(daemons):
                print(f"--- dbufd of node {node} ({daemon.log}):\n{daemon.log_text()[-6000:]}", file=sys.stderr)
            return 1
        finally:
            for daemon in daemons:
                daemon.close()
            if ns is not None:
                ns.close()


if __name__ == "__main__":
    sys.exit(main())
