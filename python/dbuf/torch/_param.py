"""The optimizer's view of a parameter sharded by dbuf (RaggedShard).

After ``dbuf.torch.fully_shard``, every parameter the module registers is a
:class:`ShardedParameter`: this rank's part of the fp32 master tensor, a 1-D
tensor living in dbufd's shared memory, with the whole tensor's shape and
which elements of it this rank holds. RaggedShard never splits a granularity
block between ranks, so the local elements are always ``local_units`` whole
blocks of ``unit_elems`` elements each (``matrix`` granularity: whole
matrices; ``rows:R``: R whole rows; ``element``: single elements).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardInfo:
    """Where a (possibly sharded) parameter's local elements sit in its tensor.

    ``begin``/``end`` index the flattened whole tensor; the local tensor holds
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
        """This rank holds the whole tensor."""
        return self.begin == 0 and self.end == self.global_shape.numel()


class ShardedParameter(torch.nn.Parameter):
    """This rank's part of a parameter: a 1-D fp32 tensor of dbufd's memory.

    Attributes (read-only): ``global_shape`` (the whole tensor's shape),
    ``element_range`` (``(begin, end)`` of the flattened whole tensor),
    ``unit_elems`` (elements per RaggedShard block), ``local_units`` (blocks
    held here), ``fqn`` (the parameter's name in the model). A rank that holds
    none of a tensor has an empty parameter (``numel() == 0``).
    """

    # Set by _make; a Parameter subclass cannot take extra __init__ arguments
    # through torch's __new__ machinery.
    _shard_info: ShardInfo
    fqn: str

    def __new__(cls, data: torch.Tensor, info: ShardInfo, fqn: str, requires_grad: bool = True):
        param = super().__new__(cls, data, requires_grad)
        param._shard_info = info
        param.fqn = fqn
        return param

    def __deepcopy__(self, memo):
        # A copy is plain memory of the process, no longer dbufd's: a Parameter.
        copied = torch.nn.Parameter(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
        memo[id(self)] = copied
        return copied

    def __reduce_ex__(self, protocol):
        # Pickling (torch.save) stores the local values as a plain Parameter.
        return (torch.nn.Parameter, (self.data.clone(), self.requires_grad))

    @property
    def shard_info(self) -> ShardInfo:
        return self._shard_info

    @property
    def global_shape(self) -> torch.Size:
        return self._shard_info.global_shape

    @property
    def element_range(self) -> tuple[int, int]:
        return (self._shard_info.begin, self._shard_info.end)

    @property
    def unit_elems(self) -> int:
        return self._shard_info.unit_elems

    @property
    def local_units(self) -> int:
        return self._shard_info.local_units

    def __repr__(self) -> str:
        begin, end = self.element_range
        return (
            f"ShardedParameter({self.fqn!r}, global_shape={tuple(self.global_shape)}, "
            f"elements=[{begin}, {end}), local_units={self.local_units}, dtype={self.dtype})"
        )


def shard_info(param: torch.Tensor, unit_elems: int | None = None) -> ShardInfo:
    """The ShardInfo of a ShardedParameter, or of a plain (whole) tensor.

    A plain tensor is its own whole tensor; ``unit_elems`` gives its block
    size (default: the whole tensor is one block), so optimizers written
    against ShardInfo run unchanged in a single process.
    """
    if isinstance(param, ShardedParameter):
        return param.shard_info
    numel = param.numel()
    unit = unit_elems if unit_elems is not None else max(numel, 1)
    return ShardInfo(param.shape, 0, numel, unit, -(-numel // unit) if numel else 0)
