"""The GPU path: CUDA views through DLPack on the session's GPU, ops ordered on torch's current stream,
and a short dbuf.torch training on one GPU. Skipped without a GPU (and without a CUDA build of dbuf)."""

from __future__ import annotations

import sys

import pytest
import torch

import dbuf
from dbuf.testing import Daemon

if not (dbuf.cuda_built and torch.cuda.is_available()):
    pytest.skip("needs an NVIDIA GPU and a CUDA build of dbuf", allow_module_level=True)

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent / "ranks"))
from conftest import RANKS, run_ranks, run_threads  # noqa: E402


@pytest.fixture
def gpu_daemon():
    # Two ranks share the GPU as dbufd's virtual ranks (one GPU is enough).
    with Daemon(daemon={"backend": "cuda", "virtual_ranks": 2}, timeouts={"collective_ms": 20000}) as d:
        yield d


def test_views_are_cuda_tensors_and_ops_follow_the_current_stream(gpu_daemon):
    def rank(r: int):
        client = dbuf.Client(gpu_daemon.socket)
        client.attach("gpu", r, 2, device=0)
        assert client.device == 0
        group = client.register_group("g", [dbuf.TensorSpec("w", (256, 256))])
        shard = group.shard_view(0)
        assert shard.device == 0 and shard.__dlpack_device__() == (2, 0)
        local = shard.torch()
        assert local.is_cuda and local.device.index == 0
        stream = torch.cuda.current_stream()
        local.fill_(float(r + 1))  # queued on the stream; the gather below is ordered after it
        group.acquire_slot()
        op = group.all_gather(async_op=True, stream=stream)
        full = group.unsharded_view(0).torch()
        total = full.float().sum()  # queued after the gather on the same stream
        op.wait()
        value = total.item()
        group.reshard()
        return value, shard.numel

    results = run_threads(2, rank)
    expected = sum((r + 1) * n for r, (_, n) in enumerate(results))
    assert all(value == expected for value, _ in results)


def test_training_on_one_gpu_equals_the_reference(gpu_daemon, tmp_path):
    from tiny_model import reference

    out = tmp_path / "run"
    run_ranks("train_tiny.py", 2, gpu_daemon.socket, str(out), "--steps", "2", job="gputrain",
              env={"PYTHONPATH": str(RANKS)})
    results = [torch.load(f"{out}.{rank}") for rank in range(2)]
    losses, _ = reference(2, 2)
    for rank, result in enumerate(results):
        # GPU kernels are not the CPU's: close, not bitwise.
        got = [row[0] for row in result["losses"]]
        want = [step[0][rank] for step in losses]
        assert got == pytest.approx(want, rel=2e-2)


def test_a_dcp_checkpoint_on_the_gpu_resumes_bit_for_bit(gpu_daemon, tmp_path):
    # RaggedShard DTensors over dbufd's GPU memory: saved by DCP at step 2, loaded by a fresh job,
    # which continues with the uninterrupted run's losses (the same kernels on the same GPU).
    pytest.importorskip("transformers")
    checkpoint = tmp_path / "ckpt"
    common = ["--backend", "dbuf", "--model", "llama", "--device", "cuda", "--steps", "4"]
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    run_ranks("checkpoint_hf.py", 2, gpu_daemon.socket, str(first), *common, "--save-at", "2",
              "--checkpoint", str(checkpoint), job="gpu-ckpt-1", timeout=600)
    run_ranks("checkpoint_hf.py", 2, gpu_daemon.socket, str(resumed), *common, "--start", "2",
              "--load", str(checkpoint), job="gpu-ckpt-2", timeout=600)
    for rank in range(2):
        want = torch.load(f"{first}.{rank}", weights_only=False)["losses"][2:]
        got = torch.load(f"{resumed}.{rank}", weights_only=False)["losses"]
        assert got == want, f"rank {rank}"


@pytest.mark.parametrize("flags", [["--ac", "full"], ["--ac", "selective", "--compile"]])
def test_a_trainer_written_for_fsdp2_on_the_gpu(gpu_daemon, tmp_path, flags):
    # torchtitan's pattern under dbuf's switch (DBUF_FSDP=1) on dbufd's GPU memory: activation
    # checkpointing recomputes the same kernels, so its losses equal the run without it bit for bit;
    # compiled blocks (other kernels) are close.
    pytest.importorskip("transformers")
    common = ["--backend", "dbuf", "--model", "llama", "--device", "cuda", "--steps", "3"]
    plain, checkpointed = tmp_path / "plain", tmp_path / "checkpointed"
    env = {"DBUF_FSDP": "1"}
    run_ranks("trainer_hf.py", 2, gpu_daemon.socket, str(plain), *common, job="gpu-plain", env=env, timeout=600)
    run_ranks("trainer_hf.py", 2, gpu_daemon.socket, str(checkpointed), *common, *flags, job="gpu-ac", env=env,
              timeout=600)
    want = torch.load(f"{plain}.0", weights_only=False)["losses"]
    got = torch.load(f"{checkpointed}.0", weights_only=False)["losses"]
    if "--compile" in flags:
        assert got == pytest.approx(want, rel=1e-3)
    else:
        assert got == want
