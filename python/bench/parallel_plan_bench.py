"""All-gather inflation of FSDP composed with TP and EP: dbuf's planner against FSDP2's and Megatron-FSDP's formulas.

  python bench/parallel_plan_bench.py [--dbuf-plan build/bin/dbuf-plan] [--models models] [--dp 64] [--granularity RULE]

For each bundled model (models/: Llama-3 8B / 70B,
Mixtral-8x7B, GPT-OSS 20B / 120B, DeepSeek-V3), runs ``dbuf-plan --tp T --ep E
--devices V --format json``: every unit as one rank holds it (the Megatron
plan's tp chunks; a unit's routed experts, one ep rank's, sharded over V / E
ranks, torchtitan's layout), planned by dbuf and laid out by FSDP2's and
Megatron-FSDP's formulas on the same tensors (planner/baselines.hpp; FSDP2's
experts on dim 1 where a rank would hold fewer experts than there are dp
ranks, as torchtitan's shard_placement_fn does). Prints
the whole model's all-gather volume over its elements (sum of V_unit * S
over N) for each, at tp 8 and ep 1 (dense models) or ep 8 to 64 (where ep
divides the experts and V), the worst unit's, and how many of the rule's
blocks each layout's cuts split (dbuf splits none; FSDP2's and Megatron's
formulas ignore the rule). Deterministic: no timing.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODELS = {
    "llama3-8b.json": (1,),
    "llama3-70b.json": (1,),
    "mixtral-8x7b.json": (8,),
    "gpt-oss-20b.json": (8, 16, 32),
    "gpt-oss-120b.json": (8, 16, 32, 64),
    "deepseek-v3.json": (8, 16, 32, 64),
}
LAYOUTS = (("dbuf", None), ("FSDP2", "fsdp2"), ("Megatron-FSDP", "megatron"))


def torchtitan_experts_shard(unit: dict, devices: int) -> int | None:
    """FSDP2's S for a unit of experts where torchtitan shards them on dim 1 (fewer experts than dp ranks)."""
    shapes = [tensor["shape"] for tensor in unit["tensors"]]
    if ".experts" not in unit["name"] or all(shape[0] >= devices for shape in shapes):
        return None
    return sum(-(-shape[1] // devices) * (math.prod(shape) // shape[1]) for shape in shapes)


def volumes(report: dict) -> dict[str, tuple[float, float, int]]:
    """(whole-model inflation, worst unit's, blocks its cuts split) per layout."""
    out = {}
    for label, key in LAYOUTS:
        total, worst, split = 0, 0.0, 0
        for unit in report["units"]:
            split += unit["split_blocks"] if key is None else unit["baselines"][key]["split_blocks"]
            devices = unit.get("devices", report["devices"])
            shard = unit["shard_elems"] if key is None else unit["baselines"][key]["shard_elems"]
            if key == "fsdp2":
                shard = torchtitan_experts_shard(unit, devices) or shard
            total += devices * shard
            worst = max(worst, devices * shard / unit["numel"])
        out[label] = (total / report["total"]["numel"], worst, split)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dbuf-plan", default=str(ROOT / "build" / "bin" / "dbuf-plan"))
    p.add_argument("--models", default=str(ROOT / "models"))
    p.add_argument("--dp", type=int, default=64, help="dp ranks sharing each dense unit (V)")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--granularity", default="element", help="dbuf-plan's default rule for 2D+ tensors")
    args = p.parse_args()
    print(f"tp {args.tp}, dp {args.dp} (experts over dp / ep), granularity {args.granularity}; all-gather volume / N, "
          f"whole model (worst unit)")
    print(f"{'model':<16} {'ep':>3}  " + "  ".join(f"{label:>30}" for label, _ in LAYOUTS) + "  dbuf/FSDP2 dbuf/Megatron")
    for name, eps in MODELS.items():
        path = Path(args.models) / name
        if not path.exists():
            print(f"{name}: not found in {args.models}")
            continue
        for ep in eps:
            if args.dp % ep:
                continue
            command = [args.dbuf_plan, "--model", str(path), "--devices", str(args.dp), "--tp", str(args.tp),
                       "--ep", str(ep), "--granularity", args.granularity, "--format", "json"]
            report = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
            figures = volumes(report)
            cells = "  ".join(f"{f'{whole:.4f}x ({worst:.3f}x) {split}':>30}" for whole, worst, split in figures.values())
            ours, fsdp2, megatron = (figures[label][0] for label, _ in LAYOUTS)
            print(f"{name.removesuffix('.json'):<16} {ep:>3}  {cells}  {ours / fsdp2:>10.4f} {ours / megatron:>13.4f}")


if __name__ == "__main__":
    main()
