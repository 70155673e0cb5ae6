"""What a Muon step costs in all-gather bytes: PyTorch FSDP2 (dim-0 shards) against dbuf (granularity "matrix").

    python muon_gather_bytes.py [--models ../../models] [--world 8 64 256]

Newton-Schulz needs each weight matrix whole. Under FSDP2 every rank holds
ceil(d0/V) rows of each matrix, so each rank must all-gather every split
matrix's momentum-updated gradient (fp32) before it can orthogonalize
(dbuf.torch.optim.fsdp2_muon_gather_bytes counts exactly that). Under dbuf
with granularity="matrix" every matrix lies whole on one rank: 0 bytes. The
decoder layers' 2D+ tensors of each model file are counted (embeddings and
the LM head take AdamW in the usual Muon recipe), and 3D expert tensors are
left out, as FSDP2 keeps each expert whole already.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dbuf.torch.optim import fsdp2_muon_gather_bytes


def matrix_shapes(model_file: Path) -> list[tuple[int, ...]]:
    units = json.loads(model_file.read_text())["fsdp_units"]
    by_name = {unit["name"]: unit for unit in units}
    shapes = []
    for unit in units:
        if unit["name"] in ("embed", "final"):
            continue
        tensors = unit["tensors"] if "tensors" in unit else by_name[unit["like"]]["tensors"]  # "like": a copy
        shapes.extend(tuple(t["shape"]) for t in tensors if len(t["shape"]) >= 2)
    return shapes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=Path, default=Path(__file__).resolve().parents[2] / "models")
    p.add_argument("--world", type=int, nargs="+", default=[8, 64, 256])
    args = p.parse_args()
    print(f"{'model':<16} {'ranks':>6} {'matrices':>9} {'FSDP2 GB/rank/step':>19} {'dbuf':>6}")
    for model_file in sorted(args.models.glob("*.json")):
        shapes = matrix_shapes(model_file)
        for world in args.world:
            gathered = fsdp2_muon_gather_bytes(shapes, world)
            print(f"{model_file.stem:<16} {world:>6} {len(shapes):>9} {gathered.per_rank / 1e9:>19.2f} {0:>6}")


if __name__ == "__main__":
    main()
