"""Trainers written for FSDP2 run on dbuf without an edit, side by side with FSDP2.

Each configuration runs tests/ranks/trainer_hf.py twice with 4 rank processes
(transformers models, dims 4 ranks do not divide): on FSDP2 over gloo, and
under dbuf's switch (``DBUF_FSDP=1``) on a real dbufd. The script speaks only
torch's FSDP2 API (``mesh=``, ``offload_policy=``, an ``FSDPModule`` check,
``set_requires_gradient_sync``), the way torchtitan and accelerate call it.

What must hold, per configuration:

* the first loss is bit for bit FSDP2's (the same parameters, gathered);
* every later loss and each step's gradient norm (torch's ``clip_grad_norm_``)
  within a tolerance of FSDP2's: gloo sums a reduce-scatter's ranks in
  another order than dbufd's rank order, so the fp32 parameters can differ
  in their last bits after a step. In fp32 that stays below 1e-5 (measured:
  at most 2.6e-7 relative over 3 steps). bf16 compute rounds the parameters
  to 8 bits, where such a difference now and then flips a rounding, and a
  MoE layer's top-k routing can then pick another expert for a token:
  relative 1e-3 (measured over the whole matrix: at most 4.3e-5, the norms
  of Llama in bf16 accumulating 4 micro-batches). Once a token goes to
  another expert the two runs train on different routings (Qwen3-MoE in bf16,
  sync every step: the third step's norms 1.6% apart, its loss 8.6e-5), so a
  MoE in bf16 is compared over its first two steps (1.0e-4 apart at most);
  docs/python.md has the figures;
* each unit gathered once per forward and once per backward, whatever
  activation checkpointing recomputes (dbuf's counts).

``make test`` runs a pairwise-covering subset of the matrix model x AC x
compile x precision x accumulation (every pair of values of any two factors
appears); ``make test-matrix`` (CTest label ``trainers_matrix``) runs all 48,
of which 6 (the MoE model compiled in bf16) FSDP2 cannot run on CPU.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import run_ranks

pytest.importorskip("transformers")

WORLD, STEPS, UNITS = 4, 3, 3  # two decoder layers and the root

FACTORS = {
    "model": ("llama", "qwen3moe"),
    "ac": ("none", "full", "selective"),
    "compile": (False, True),
    "mp": ("fp32", "bf16"),
    "accum": (1, 4),
}

# Every pair of values of any two factors appears in some row (test_pairwise_cover checks it).
PAIRWISE = [
    ("llama", "full", False, "fp32", 4),
    ("qwen3moe", "none", False, "fp32", 1),
    ("qwen3moe", "full", True, "fp32", 1),
    ("llama", "selective", True, "fp32", 1),
    ("qwen3moe", "selective", False, "bf16", 4),
    ("llama", "none", True, "bf16", 4),
    ("llama", "full", True, "bf16", 1),
]


def unsupported(row: tuple) -> str | None:
    """Why FSDP2 itself cannot run a configuration here, or None."""
    model, _, compiled, mp, _ = row
    if model == "qwen3moe" and compiled and mp == "bf16":
        return ("transformers' MoE layer in bf16 (grouped_mm, or the experts' loop its data-dependent shapes) "
                "does not compile with fullgraph on CPU under torch 2.15: FSDP2's run fails the same way")
    return None


FULL_MATRIX = list(itertools.product(*FACTORS.values()))

# The other activation checkpointing patterns trainers use, and torchtitan's meta-device init.
PATTERNS = ["full-reentrant", "hf", "hf-reentrant", "call", "call-reentrant"]


def configuration_id(row: tuple) -> str:
    model, ac, compiled, mp, accum = row
    return f"{model}-ac_{ac}-{'compile' if compiled else 'eager'}-{mp}-accum{accum}"


def run(daemon, tmp_path: Path, backend: str, flags: list[str], script: str) -> dict:
    out = tmp_path / backend
    env = {"DBUF_FSDP": "1" if backend == "dbuf" else "0"}
    run_ranks(script, WORLD, daemon.socket, str(out), "--backend", backend, "--steps", str(STEPS), *flags,
              job=f"{tmp_path.name}-{backend}", env=env, timeout=900)
    return torch.load(f"{out}.0", weights_only=False)


def assert_as_fsdp2(daemon, tmp_path: Path, flags: list[str], accum: int = 1, gathers: int | None = 2 * UNITS,
                    script: str = "trainer_hf.py") -> dict:
    """dbuf's losses and norms as FSDP2's; with `gathers`, dbuf's all-gathers per micro-batch. Returns dbuf's."""
    fsdp2, dbuf = run(daemon, tmp_path, "fsdp2", flags, script), run(daemon, tmp_path, "dbuf", flags, script)
    print(f"{flags}: losses dbuf {dbuf['losses']} FSDP2 {fsdp2['losses']}; norms dbuf {dbuf['norms']} "
          f"FSDP2 {fsdp2['norms']}")
    assert len(dbuf["losses"]) == len(fsdp2["losses"]) == STEPS * accum
    assert dbuf["losses"][0] == fsdp2["losses"][0], "the first loss (the same parameters gathered)"
    tol = 1e-3 if "bf16" in flags else 1e-5
    # A MoE in bf16: once a rounding flip sends a token to another expert, the runs train on different
    # routings (see the module docstring): its first two steps are compared.
    steps = 2 if "qwen3moe" in flags and "bf16" in flags else STEPS
    for what, per_step in (("losses", accum), ("norms", 1)):
        for step, (got, want) in enumerate(zip(dbuf[what][: steps * per_step], fsdp2[what][: steps * per_step])):
            assert abs(got - want) <= tol * max(1.0, abs(want)), f"{what}[{step}]: dbuf {got}, FSDP2 {want}"
    if gathers is not None:
        assert dbuf["all_gathers"] == [gathers * accum] * STEPS, "each unit gathered once per forward and backward"
    return dbuf


def flags_of(row: tuple) -> list[str]:
    model, ac, compiled, mp, accum = row
    return ["--model", model, "--ac", ac, "--mp", mp, "--accum", str(accum), *(["--compile"] if compiled else [])]


def test_pairwise_cover():
    """The subset make test runs covers every pair of values of any two factors."""
    names = list(FACTORS)
    for (i, a), (j, b) in itertools.combinations(enumerate(names), 2):
        want = set(itertools.product(FACTORS[a], FACTORS[b]))
        got = {(row[i], row[j]) for row in PAIRWISE}
        assert got == want, f"{a} x {b}: missing {sorted(want - got, key=str)}"
    assert not any(map(unsupported, PAIRWISE))


@pytest.mark.parametrize("row", PAIRWISE, ids=configuration_id)
def test_matrix_pairwise(daemon, tmp_path, row):
    assert_as_fsdp2(daemon, tmp_path, flags_of(row), accum=row[-1])


@pytest.mark.skipif(os.environ.get("DBUF_TRAINERS_MATRIX") != "all", reason="the whole matrix: make test-matrix")
@pytest.mark.parametrize("row", FULL_MATRIX, ids=configuration_id)
def test_matrix_all(daemon, tmp_path, row):
    if unsupported(row):
        pytest.skip(unsupported(row))
    assert_as_fsdp2(daemon, tmp_path, flags_of(row), accum=row[-1])


@pytest.mark.parametrize("ac", PATTERNS)
def test_activation_checkpointing_patterns(daemon, tmp_path, ac):
    assert_as_fsdp2(daemon, tmp_path, ["--model", "llama", "--ac", ac])


def test_whole_model_compile(daemon, tmp_path):
    """torch.compile of the whole model after fully_shard: dynamo runs the units' hooks eagerly, between graphs."""
    assert_as_fsdp2(daemon, tmp_path, ["--model", "llama", "--compile-model"])


def test_meta_device_init(daemon, tmp_path):
    """Meta device, fully_shard, to_empty, a full state dict loaded: the parameters stay dbufd's and train."""
    assert_as_fsdp2(daemon, tmp_path, ["--model", "llama", "--meta-init"])


def test_chunked_loss(daemon, tmp_path):
    """torchtitan's chunked loss: lm_head a unit used by one backward per chunk, then the decoder's backward.

    lm_head is gathered once for its chunks (it keeps its slot, as torchtitan
    asks). The decoder and lm_head are two roots, two models as FSDP2 sees
    them, each with its own order: a chunk's backward prefetches nothing of
    the decoder's (before roots were per model it gathered the decoder's root
    ahead, which that backward never reached: 3 gathers more per step).
    """
    assert_as_fsdp2(daemon, tmp_path, ["--model", "llama", "--chunked-loss", "3"], gathers=2 * UNITS + 1)


@pytest.mark.parametrize("ac", ["none", "full", "selective"])
def test_torchtitan(daemon, tmp_path, ac):
    """torchtitan 0.3's own functions (its Llama-3 debug model, AC, compile, apply_fsdp_to_decoder, chunked loss).

    Its init on the meta device, run on dbuf's parameters, gives what one
    process's init gives (FSDP2's DTensors on CPU draw per rank); both runs then
    load those values, and train alike.
    """
    pytest.importorskip("torchtitan")
    flags = ["--ac", ac, *(["--compile"] if ac == "selective" else [])]
    dbuf = assert_as_fsdp2(daemon, tmp_path, flags, gathers=None, script="torchtitan_llama3.py")
    assert dbuf["init_as_one_process"]


def test_hsdp(daemon, tmp_path):
    """HSDP: a 2-D (replicate 2, shard 2) mesh. Each replica's ranks are a dbuf job of their own, the
    sharded gradients summed over the replicas in replica order; FSDP2's losses, and what
    torch.distributed.checkpoint saves is the same model (each replica's shards written once)."""
    flags = ["--model", "llama", "--hsdp", "--accum", "2", "--mp", "bf16"]
    fsdp2 = run(daemon, tmp_path, "fsdp2", [*flags, "--save", str(tmp_path / "fsdp2.dcp")], "trainer_hf.py")
    dbuf = run(daemon, tmp_path, "dbuf", [*flags, "--save", str(tmp_path / "dbuf.dcp")], "trainer_hf.py")
    assert dbuf["replicas"] == 2
    assert dbuf["losses"][0] == fsdp2["losses"][0]
    for what in ("losses", "norms"):
        for got, want in zip(dbuf[what], fsdp2[what]):
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), f"{what}: dbuf {dbuf[what]}, FSDP2 {fsdp2[what]}"
    saved = {}
    for backend in ("fsdp2", "dbuf"):
        dcp_to_torch_save(tmp_path / f"{backend}.dcp", tmp_path / f"{backend}.pt")
        saved[backend] = torch.load(tmp_path / f"{backend}.pt", weights_only=False)["model"]
    assert saved["dbuf"].keys() == saved["fsdp2"].keys()
    for name, want in saved["fsdp2"].items():
        assert saved["dbuf"][name].shape == want.shape, name
        torch.testing.assert_close(saved["dbuf"][name], want, rtol=1e-4, atol=1e-5, msg=name)


def test_hsdp_root_without_mesh(daemon, tmp_path):
    """HSDP blocks, then the root sharded with no mesh: still HSDP's, its gradients summed over the replicas too,
    so the run is the one with the mesh passed. (FSDP2 would shard that root over the world's 1-D mesh, and
    torch's clip_grad_norm_ then refuses its parameters' two meshes.)"""
    flags = ["--model", "llama", "--hsdp"]
    with_mesh = run(daemon, tmp_path, "dbuf", flags, "trainer_hf.py")
    (tmp_path / "without").mkdir()
    without = run(daemon, tmp_path / "without", "dbuf", [*flags, "--root-without-mesh"], "trainer_hf.py")
    assert without["losses"] == with_mesh["losses"] and without["norms"] == with_mesh["norms"]


def test_fsdp_module_api(daemon, tmp_path):
    """Every method of torch's FSDPModule and argument of its fully_shard: each one's meaning or a clear refusal."""
    out = tmp_path / "api"
    run_ranks("fsdp_api.py", 2, daemon.socket, str(out), job="api", env={"DBUF_FSDP": "1"})
    assert torch.load(f"{out}.0") == torch.load(f"{out}.1") == [
        "every public method", "every argument", "refused arguments", "accepted arguments",
        "refused and accepted methods", "divide factor", "register_fsdp_forward_method", "reset_iter_state", "_apply"]


@pytest.mark.parametrize("mp", ["fp32", "bf16"])
def test_accelerate(daemon, tmp_path, mp):
    """accelerate 1.15's own fsdp2_prepare_model: its wrap policy, units and CPU-RAM efficient loading (the
    model on the meta device, rank 0's weights broadcast and assigned with load_state_dict(assign=True),
    which dbuf takes back into dbufd's memory), then accumulation with its no_sync."""
    pytest.importorskip("accelerate")
    assert_as_fsdp2(daemon, tmp_path, ["--mp", mp], accum=2, gathers=None, script="accelerate_llama.py")
