"""RaggedShard: a DTensor placement for a tensor cut into whole blocks, any number of them per rank.

The tensor is read in row-major order as a sequence of blocks of
``block_elems`` elements each (the last one may be shorter); rank ``r`` holds
the ``local_units[r]`` blocks after those of ranks ``0 .. r-1``, as one
contiguous run of elements. That is exactly how dbufd's planner lays a
tensor into a group's DBuffer: the tensor sits at an offset of the global
buffer, each rank owns one contiguous shard of it, and no shard boundary
cuts a block (``block_elems`` is the tensor's granularity: 1 for
``element``, R rows for ``rows:R`` and ``block:RxC``, a whole matrix for
``matrix``). The semantics are veScale's ``RaggedShard(dims, local_units)``,
with the block given as an element count so that every granularity rule of
the planner is one.

This module is pure metadata plus the two collectives that move a whole
tensor to or from its ragged pieces; the tensor type lives in _dtensor.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement


@dataclass(frozen=True)
class ShardInfo:
    """Where one rank's local elements sit in the tensor RaggedShard cuts.

    That tensor is the whole one on a 1-D mesh, the rank's tensor / expert
    parallel chunk of it on a larger one (``global_shape`` is then the
    chunk's). ``begin``/``end`` index it flattened; the local tensor holds
    elements ``[begin, end)``, which are ``local_units`` whole blocks of
    ``unit_elems`` elements each (``begin`` is a multiple of ``unit_elems``;
    the last block of a tensor may be shorter when ``unit_elems`` does not
    divide its size).
    """

    global_shape: torch.Size
    begin: int
    end: int
    unit_elems: int
    local_units: int

    @property
    def numel(self) -> int:
        return self.end - self.begin

    @property
    def whole(self) -> bool:
        """This rank holds the whole of the tensor RaggedShard cuts (its chunk under tensor / expert parallelism)."""
        return self.begin == 0 and self.end == self.global_shape.numel()


class RaggedShard(Placement):
    """``RaggedShard(block_elems, local_units)``: rank r holds ``local_units[r]`` whole blocks, in rank order.

    ``local_units`` has one count per rank of the mesh dimension; their sum
    is the tensor's number of blocks, ``ceil(numel / block_elems)``.

    On a mesh of several dimensions (dp first, then tensor or expert
    parallelism: FSDP2's order) the other dimensions' placements apply first:
    RaggedShard cuts the local chunk they leave to a dp rank, read row-major,
    as it cuts a whole tensor on a 1-D mesh.
    """

    def __init__(self, block_elems: int, local_units: tuple[int, ...] | list[int]) -> None:
        super().__init__()
        block_elems, local_units = int(block_elems), tuple(int(u) for u in local_units)
        if block_elems < 1:
            raise ValueError(f"RaggedShard: block_elems must be at least 1, got {block_elems}")
        if not local_units or min(local_units) < 0:
            raise ValueError(f"RaggedShard: local_units must be one count >= 0 per rank, got {local_units}")
        self.block_elems = block_elems
        self.local_units = local_units

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is type(self)  # a StridedRaggedShard is another placement, whatever its blocks
            and self.block_elems == other.block_elems
            and self.local_units == other.local_units
        )

    def __hash__(self) -> int:
        return hash((RaggedShard, self.block_elems, self.local_units))

    def __repr__(self) -> str:
        return f"RaggedShard(block_elems={self.block_elems}, local_units={self.local_units})"

    __str__ = __repr__

    def __reduce__(self):
        # Pickling (copy.deepcopy, DCP's staging for async_save) rebuilds it from its fields; the
        # C++ base class has no state of its own to save.
        return (RaggedShard, (self.block_elems, self.local_units))

    def __fx_repr__(self) -> str:
        return repr(self)

    # ------------------------------------------------------------ layout

    @property
    def ranks(self) -> int:
        return len(self.local_units)

    def check(self, numel: int) -> None:
        """Raises unless the blocks cover a tensor of ``numel`` elements exactly."""
        blocks = -(-numel // self.block_elems)
        if sum(self.local_units) != blocks:
            raise ValueError(
                f"{self}: {sum(self.local_units)} blocks for a tensor of {numel} elements, which has {blocks} "
                f"blocks of {self.block_elems}"
            )

    def rank_range(self, rank: int, numel: int) -> tuple[int, int]:
        """Elements ``[begin, end)`` of the flattened tensor that ``rank`` holds."""
        begin = min(self.block_elems * sum(self.local_units[:rank]), numel)
        end = min(begin + self.block_elems * self.local_units[rank], numel)
        return begin, end

    def shard_info(self, rank: int, global_shape: torch.Size) -> ShardInfo:
        begin, end = self.rank_range(rank, global_shape.numel())
        return ShardInfo(torch.Size(global_shape), begin, end, self.block_elems, self.local_units[rank])

    def split(self, whole: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s elements of a whole tensor (a 1-D view)."""
        begin, end = self.rank_range(rank, whole.numel())
        return whole.reshape(-1)[begin:end]

    # ------------------------------------------------------------ collectives

    def gather(self, local: torch.Tensor, mesh: DeviceMesh, mesh_dim: int, global_shape: torch.Size) -> torch.Tensor:
        """Every rank's elements -> the whole tensor on every rank (collective over the mesh dimension).

        One all-gather of the pieces padded to the longest, over the mesh
        dimension's process group.
        """
        numel = global_shape.numel()
        sizes = [end - begin for begin, end in (self.rank_range(r, numel) for r in range(self.ranks))]
        longest = max(sizes) if sizes else 0
        padded = torch.zeros(longest, dtype=local.dtype, device=local.device)
        padded[: local.numel()].copy_(local.reshape(-1))
        pieces = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(pieces, padded, group=mesh.get_group(mesh_dim))
        whole = torch.cat([piece[:size] for piece, size in zip(pieces, sizes)])
        return whole.reshape(global_shape)


class StridedRaggedShard(RaggedShard):
    """RaggedShard of the local chunk of a tensor that a later mesh dimension shards along dim 0 first.

    On a (dp, tp) mesh a parameter that tensor parallelism placed ``Shard(0)``
    is cut into ``split_factor`` chunks of rows first (TP), and each chunk's
    elements are then cut into whole blocks over the dp ranks: in the whole
    tensor, a dp rank's elements repeat with the stride of a TP chunk. That
    is FSDP2's ``_StridedShard(0, split_factor)`` with ragged blocks; the
    layout of the local chunk is RaggedShard's exactly, so this class only
    carries the stride metadata (``split_factor``: the TP degree).
    """

    def __init__(self, block_elems: int, local_units: tuple[int, ...] | list[int], split_factor: int) -> None:
        super().__init__(block_elems, local_units)
        if int(split_factor) < 2:
            raise ValueError(f"StridedRaggedShard: split_factor must be at least 2, got {split_factor}")
        self.split_factor = int(split_factor)

    def __eq__(self, other: object) -> bool:
        return super().__eq__(other) and self.split_factor == other.split_factor

    def __hash__(self) -> int:
        return hash((StridedRaggedShard, self.block_elems, self.local_units, self.split_factor))

    def __repr__(self) -> str:
        return (
            f"StridedRaggedShard(block_elems={self.block_elems}, local_units={self.local_units}, "
            f"split_factor={self.split_factor})"
        )

    __str__ = __repr__

    def __reduce__(self):
        return (StridedRaggedShard, (self.block_elems, self.local_units, self.split_factor))


def rank_ranges(plan, index: int) -> list[tuple[int, int]]:
    """For every rank, the elements [begin, end) of tensor `index` it holds (the plan's shards)."""
    placed = plan.tensors[index]
    shard = plan.shard_elems
    ranges = []
    for rank in range(plan.devices):
        begin = max(placed.offset, rank * shard) - placed.offset
        end = min(placed.offset + placed.numel, (rank + 1) * shard) - placed.offset
        ranges.append((begin, end) if end > begin else (min(begin, placed.numel),) * 2)
    return ranges


def ragged_shard_of(rank_ranges: list[tuple[int, int]], block_elems: int, split_factor: int = 1) -> RaggedShard:
    """The placement of a tensor whose ranks hold these contiguous, rank-ordered element ranges.

    ``split_factor`` > 1: the tensor is the local chunk of one that a later
    mesh dimension cut into that many chunks along dim 0 (StridedRaggedShard).
    """
    units = [-(-(end - begin) // block_elems) for begin, end in rank_ranges]
    if split_factor > 1:
        return StridedRaggedShard(block_elems, units, split_factor)
    return RaggedShard(block_elems, units)


# ---------------------------------------------------------------- rectangular chunks


@dataclass(frozen=True)
class Box:
    """A rectangular part of a tensor: ``offsets`` and ``sizes`` per dimension, and where it starts flat."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_begin: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def boxes_of(shape: torch.Size | tuple[int, ...], begin: int, end: int) -> list[Box]:
    """Elements ``[begin, end)`` of a row-major tensor as the fewest rectangles, in order.

    A run of whole rows is one rectangle; a run that starts or ends inside a
    row adds a rectangle of that row's part, found the same way one
    dimension down (at most two per dimension). DCP stores tensors as
    rectangles, so this is how a ragged range is saved and loaded.
    """
    shape = tuple(shape)
    if end <= begin:
        return []
    if not shape:
        return [Box((), (), begin)]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    first_row, last_row = begin // inner, (end - 1) // inner
    if first_row == last_row and (begin % inner or end % inner):
        # Inside one row: that row's part, one dimension down.
        start = first_row * inner
        return [
            Box((first_row, *box.offsets), (1, *box.sizes), start + box.flat_begin)
            for box in boxes_of(shape[1:], begin - start, end - start)
        ]
    out: list[Box] = []
    whole_from = begin
    if begin % inner:
        whole_from = (first_row + 1) * inner
        out += boxes_of(shape, begin, whole_from)
    whole_to = end - end % inner
    if whole_to > whole_from:
        rows = (whole_to - whole_from) // inner
        out.append(Box((whole_from // inner, *([0] * (len(shape) - 1))), (rows, *shape[1:]), whole_from))
    if end % inner:
        out += boxes_of(shape, whole_to, end)
    return out
