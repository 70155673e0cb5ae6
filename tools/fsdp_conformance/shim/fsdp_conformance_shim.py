"""Runs PyTorch's FSDP2 unit tests on CPU with gloo, unmodified: patches to PyTorch's test harness, and a pytest plugin.

tools/fsdp_conformance/run.py starts pytest with this folder on PYTHONPATH and ``FSDP_CONFORMANCE=1``; the folder's
``sitecustomize`` then calls :func:`install` at the start of the pytest process and of every rank process the harness
spawns (``MultiProcessTestCase`` starts ranks with multiprocessing's spawn method: fresh interpreters, which run
``sitecustomize`` too, so the patches hold there as well). No test is changed; the harness is:

* ``torch.testing._internal.common_distributed``: ``torch.cpu.device_count()`` is ``$FSDP_CONFORMANCE_DEVICES``
  (the tests size their world with ``torch.get_device_module(device_type).device_count()``); every
  ``skip_if_lt_x_gpu(n)`` acts as ``skip_if_lt_x_gpu(n, allow_cpu=True)`` unless ``$FSDP_CONFORMANCE_GPU_SKIPS=1``;
  a test whose world size is below 1 (one sized by ``torch.cuda.device_count()``) is skipped instead of passing
  without running; each rank gets torchrun's variables (below) before its test runs; DDP, the tests' reference
  (``replicate``), drops the ``device_ids=[rank]`` the tests give it for a module on CPU.
* ``torch.testing._internal.common_fsdp``: ``DEVICE_COUNT`` (FSDPTest's default world size) is that count too, and
  ``FSDPTest._run`` (which exits with a skip when there are fewer accelerators than ranks) is replaced by one that
  joins the default process group with gloo over the test's file store, as the original does on an accelerator.

The variables a rank gets: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` (none of them when ``$FSDP_CONFORMANCE_TORCHRUN_ENV=0``: the process group then says who the rank
is), and ``DBUF_JOB``, one id per test shared by its ranks (not when ``$FSDP_CONFORMANCE_DBUF_JOB=0``).

As a pytest plugin (``-p fsdp_conformance_shim``) it appends one JSON object a line to ``$FSDP_CONFORMANCE_RESULTS``:
the collected test ids, each test's start, each phase's report, and each file that fails to import, so that run.py
knows what ran even when it has to kill pytest at its timeout.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import zlib
from collections.abc import Callable
from types import ModuleType

_DISTRIBUTED = "torch.testing._internal.common_distributed"
_FSDP = "torch.testing._internal.common_fsdp"
_TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value in (None, "") else value == "1"


def _devices() -> int:
    return int(os.environ.get("FSDP_CONFORMANCE_DEVICES", "4"))


# ------------------------------------------------------------------ the harness patches


def _set_rank_environment(rank: int, world_size: int, file_name: str) -> None:
    """What a rank started by torchrun would see, plus the dbuf job id every rank of this test agrees on."""
    test_id = os.path.basename(file_name)  # the harness's store file: one per test, the same for all its ranks
    if _flag("FSDP_CONFORMANCE_TORCHRUN_ENV", True):
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(20000 + zlib.crc32(test_id.encode()) % 20000))
    else:
        for name in _TORCHRUN_VARIABLES:
            os.environ.pop(name, None)
    if _flag("FSDP_CONFORMANCE_DBUF_JOB", True):
        os.environ["DBUF_JOB"] = f"fsdp-conformance-{test_id}"


def _patch_common_distributed(module: ModuleType) -> None:
    import unittest

    import torch

    devices = _devices()
    torch.cpu.device_count = lambda: devices

    if not _flag("FSDP_CONFORMANCE_GPU_SKIPS", False):
        original_skip = module.skip_if_lt_x_gpu

        def skip_if_lt_x_gpu(x, *, allow_cpu=False):
            return original_skip(x, allow_cpu=True)

        module.skip_if_lt_x_gpu = skip_if_lt_x_gpu

    case = module.MultiProcessTestCase
    original_start = case._start_processes

    def _start_processes(self, proc) -> None:
        if int(self.world_size) < 1:
            raise unittest.SkipTest(f"world size {self.world_size} on CPU (sized by an accelerator's device count)")
        original_start(self, proc)

    case._start_processes = _start_processes

    original_run = case.__dict__["_run"].__func__

    def _run(cls, rank, test_name, file_name, parent_pipe, **kwargs):
        _set_rank_environment(rank, int(cls(test_name).world_size), file_name)
        original_run(cls, rank, test_name, file_name, parent_pipe, **kwargs)

    case._run = classmethod(_run)

    _patch_ddp_device_ids()


def _patch_ddp_device_ids() -> None:
    """DDP (the tests' reference, also under ``replicate``) takes ``device_ids`` only for accelerator modules; the
    tests pass ``device_ids=[self.rank]``: for a module on CPU they are dropped, as a CPU module needs."""
    from torch.nn.parallel import DistributedDataParallel

    original_init = DistributedDataParallel.__init__

    def __init__(self, module, device_ids=None, *args, **kwargs):
        if device_ids is not None and all(param.device.type == "cpu" for param in module.parameters()):
            device_ids = None
        original_init(self, module, device_ids, *args, **kwargs)

    DistributedDataParallel.__init__ = __init__


def _patch_common_fsdp(module: ModuleType) -> None:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.common_utils import set_rng_seed

    devices = _devices()
    module.DEVICE_COUNT = devices
    if hasattr(module, "FSDPTestContinuous"):
        module.FSDPTestContinuous.world_size = devices

    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        """FSDPTest._run on CPU: the original's steps, without its exit when accelerators are fewer than ranks."""
        self = cls(test_name)
        self.rank = rank
        self.file_name = file_name
        world_size = int(self.world_size)
        _set_rank_environment(rank, world_size, file_name)
        if kwargs.get("fake_pg", False):
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group(backend="fake", world_size=world_size, rank=rank, store=FakeStore())
        else:
            dist.init_process_group(init_method=self.init_method, backend="gloo", world_size=world_size, rank=rank)
        dist.barrier()
        torch._dynamo.reset()
        set_rng_seed()
        self.run_test(test_name, pipe)
        torch._dynamo.reset()
        dist.barrier()
        dist.destroy_process_group()

    module.FSDPTest._run = classmethod(_run)


_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    _DISTRIBUTED: _patch_common_distributed,
    _FSDP: _patch_common_fsdp,
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds the harness modules as the path finder does and patches each right after its code ran (before the
    module that imported it binds any of its names)."""

    def find_spec(self, fullname, path, target=None):
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        execute = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Patches the harness modules when they are imported (at once, those already imported); idempotent."""
    if any(isinstance(finder, _PatchAfterImport) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _PatchAfterImport())
    for name, patch in _PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])


# ------------------------------------------------------------------ the pytest plugin


def _emit(record: dict) -> None:
    path = os.environ.get("FSDP_CONFORMANCE_RESULTS")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")


def pytest_collection_finish(session) -> None:
    _emit({"event": "collected", "nodeids": [item.nodeid for item in session.items]})


def pytest_collectreport(report) -> None:
    if report.failed:  # a file that does not import: one error in place of its tests
        _emit({"event": "report", "nodeid": report.nodeid or "<collection>", "when": "collect", "outcome": "failed",
               "duration": 0.0, "message": report.longreprtext[-20000:]})


def pytest_runtest_logstart(nodeid, location) -> None:
    _emit({"event": "start", "nodeid": nodeid})


def pytest_runtest_logreport(report) -> None:
    record = {"event": "report", "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
              "duration": round(report.duration, 3)}
    if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        record["message"] = str(report.longrepr[2])
    elif report.outcome == "failed":
        record["message"] = report.longreprtext[-20000:]
    if getattr(report, "wasxfail", None) is not None:
        record["xfail"] = True
    _emit(record)
