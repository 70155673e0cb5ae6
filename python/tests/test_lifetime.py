"""No Python program can crash the process through a view: after reshard, close, detach or the daemon's death.

Each scenario runs in a child interpreter, so that a crash (SIGSEGV, SIGBUS,
an abort) is a failed test with its signal instead of a dead test run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap


PRELUDE = """
import gc, os, signal, sys
import numpy as np, torch
import dbuf
socket = sys.argv[1]
client = dbuf.Client(socket, timeout=5.0)
client.attach("life", 0, 1)
group = client.register_group("g", [dbuf.TensorSpec("w", (64, 64))])
shard = group.shard_view("w")
shard_np, shard_t = shard.numpy(), shard.torch()
shard_np[:] = 3.0
group.unshard()
full = group.unsharded_view("w").torch()
full_grad = group.unsharded_grad_view("w").torch()
assert torch.all(full == 3.0)
"""


def run_child(daemon, body: str) -> subprocess.CompletedProcess:
    code = PRELUDE + textwrap.dedent(body) + "\nprint('OK')\n"
    result = subprocess.run([sys.executable, "-c", code, daemon.socket], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"child died ({result.returncode}):\n{result.stderr}"
    assert result.stdout.strip().endswith("OK")
    return result


def test_unsharded_views_read_zeros_after_reshard_and_see_the_next_unshard(daemon):
    run_child(daemon, """
        group.reshard()
        assert torch.all(full == 0) and torch.all(full_grad == 0)
        full.fill_(5.0)                      # writes go nowhere
        group.unshard()
        assert torch.all(full == 3.0)        # the same tensor shows the slot again
    """)


def test_views_outlive_their_group_and_client(daemon):
    run_child(daemon, """
        group.close()
        assert torch.all(full == 0) and np.all(shard_np == 0)
        client.detach()
        del group, client, shard
        gc.collect()
        assert float(full.float().sum()) == 0.0 and float(shard_t.sum()) == 0.0
        shard_np[:] = 1.0                    # private zero pages: writable, harmless
        assert np.all(shard_np == 1.0)
    """)


def test_views_survive_detach_and_close(daemon):
    run_child(daemon, """
        client.detach()
        assert torch.all(full == 0) and np.all(shard_np == 0)
        try:
            group.unshard()
        except dbuf.UnavailableError:
            pass
        else:
            raise AssertionError("unshard after detach did not raise")
        late = group.shard_view("w")           # taken after detach: empty
        assert late.numel == 0 and late.numpy().size == 0
    """)


def test_a_dead_daemon_leaves_readable_views_and_raises_unavailable(daemon):
    run_child(daemon, """
        os.kill(int(sys.argv[2]), signal.SIGKILL)
        import time; time.sleep(0.2)
        assert torch.all(full == 3.0)        # the memory outlives dbufd while mapped here
        for call in (lambda: client.noop(), lambda: group.all_gather(), lambda: group.reshard()):
            try:
                call()
            except dbuf.UnavailableError:
                pass
            else:
                raise AssertionError("a call to a dead daemon did not raise")
        del group, client
        gc.collect()
        assert float(shard_t.sum()) in (0.0, 3.0 * 64 * 64)
    """.replace("sys.argv[2]", str(daemon.process.pid)))
