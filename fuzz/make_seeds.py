#!/usr/bin/env python3
"""Regenerates the seed corpora under fuzz/corpus/ (run from anywhere, after
scripts/fuzz.sh has built build-fuzz/):

  fuzz_protocol, fuzz_ring, fuzz_node, fuzz_group, fuzz_admin: the harness's own `--write-seeds DIR`
                                       (valid encodings made by the code itself)
  fuzz_config                          config/*.toml, config/examples/*.toml,
                                       a few small configs and sizes
  fuzz_model                           models/*.json shrunk to their first units,
                                       and small models using every rule kind
"""
import json
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fuzz" / "corpus"
BIN = ROOT / "build-fuzz" / "bin"


def fresh(name):
    d = CORPUS / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    return d


def harness_seeds(name):
    exe = BIN / name
    if not exe.exists():
        sys.exit(f"{exe} is not built: run scripts/fuzz.sh first")
    subprocess.run([str(exe), "--write-seeds", str(fresh(name))], check=True)


def config_seeds():
    d = fresh("fuzz_config")
    for path in sorted((ROOT / "config").glob("**/*.toml")):
        shutil.copy(path, d / path.name)
    small = {
        "tenants.toml": '[[tenants]]\nname = "a"\nuids = [1000, 1001]\ngids = [50]\n'
                        'memory_quota = "8GiB"\nmax_jobs = 4\n',
        "cluster.toml": '[cluster]\naddress = "10.0.0.1"\nstore_hosts = ["redis1:6379"]\n',
        "metrics.toml": '[metrics]\nlisten = "[::1]:0"\n',
        "typo.toml": '[rings]\nentires = 1024\nbusy_poll_us = -1\n',
        "bad-syntax.toml": '[daemon\nsocket = "/run/x.sock"\n',
        "size-gib": "16GiB",
        "size-space": "64 KiB",
        "size-bytes": "18446744073709551615",
        "size-tb": "2TB",
    }
    for name, text in small.items():
        (d / name).write_text(text)


def shrink(model, units):
    """The model's name and its first `units` units (with any "like" units
    among them kept only if what they copy is kept)."""
    kept = []
    names = set()
    for unit in model["fsdp_units"]:
        if len(kept) == units:
            break
        if "like" in unit and unit["like"] not in names:
            continue
        kept.append(unit)
        names.add(unit["name"])
    return {"model": model["model"], "fsdp_units": kept}


def model_seeds():
    d = fresh("fuzz_model")
    for path in sorted((ROOT / "models").glob("*.json")):
        model = json.loads(path.read_text())
        out = shrink(model, 3)
        # Experts-heavy units are large: keep at most 24 tensors of a unit.
        for unit in out["fsdp_units"]:
            if "tensors" in unit:
                unit["tensors"] = unit["tensors"][:24]
        (d / path.name).write_text(json.dumps(out, separators=(",", ":")))
    small = {
        "rules.json": {"model": "rules", "fsdp_units": [{"name": "u", "tensors": [
            {"name": "u.a", "shape": [64, 32], "dtype": "bf16", "granularity": "rows:8"},
            {"name": "u.b", "shape": [4, 16, 16], "dtype": "bf16", "granularity": "block:4x4"},
            {"name": "u.c", "shape": [48], "dtype": "bf16", "granularity": "element"},
            {"name": "u.d", "shape": [12, 12], "dtype": "bf16", "granularity": "matrix"},
            {"name": "u.e", "shape": [100], "dtype": "bf16", "granularity": 10},
            {"name": "u.f", "shape": [8, 8], "dtype": "bf16", "tp_dim": 1},
            {"name": "u.buf", "shape": [8], "dtype": "fp32", "trainable": False}]}]},
        "like.json": {"model": "like", "fsdp_units": [
            {"name": "layers.0", "tensors": [{"name": "layers.0.w", "shape": [16, 8], "dtype": "fp32"},
                                             {"name": "layers.0.b", "shape": [16], "dtype": "fp32"}]},
            {"name": "layers.1", "like": "layers.0"}, {"name": "layers.2", "like": "layers.1"}]},
        "fp8.json": {"fsdp_units": [{"name": "e", "tensors": [
            {"name": "e.w", "shape": [7, 13], "dtype": "e4m3", "granularity": "rows:3"}]}]},
        "bad-shape.json": {"fsdp_units": [{"name": "x", "tensors": [{"name": "x.w", "shape": [0, -1]}]}]},
    }
    for name, model in small.items():
        (d / name).write_text(json.dumps(model))


if __name__ == "__main__":
    for harness in ("fuzz_protocol", "fuzz_ring", "fuzz_node", "fuzz_group", "fuzz_admin"):
        harness_seeds(harness)
    config_seeds()
    model_seeds()
    for d in sorted(CORPUS.iterdir()):
        files = list(d.iterdir())
        print(f"{d.name}: {len(files)} files, {sum(f.stat().st_size for f in files)} bytes")
