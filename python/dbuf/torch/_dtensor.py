"""RaggedDTensor: a DTensor whose placement is RaggedShard, as dbuf.torch's parameters and gradients are.

``fully_shard`` turns every parameter into a :class:`RaggedDTensor`: a
``torch.distributed.tensor.DTensor`` of the module's global shape and dtype,
on the job's 1-D ``DeviceMesh``, with ``placements == (RaggedShard(...),)``,
or, for a parameter tensor / expert parallelism placed already, on the (dp,
tp) mesh with ``(RaggedShard(...), Shard(d) or Replicate())``: RaggedShard
then cuts the chunk the other dims leave this rank. ``to_local()`` is this
rank's elements (1-D), zero-copy in dbufd's memory.
So ``shape``, ``ndim``, ``numel()`` and ``isinstance(p, DTensor)`` are what
code written for FSDP2 expects.

torch's DTensor has no sharding rules for a placement it does not know, so
this subclass runs the operators on RaggedShard operands itself
(``__torch_dispatch__``), in three kinds:

* elementwise operators (torch's pointwise tag, the ``_foreach_`` and fused
  optimizer kernels, copies, casts, fills, ``*_like`` factories, random
  fills): every RaggedShard operand must have the same layout; the operator
  runs on the local elements and the result keeps the layout. Scalars and
  0-dim tensors (an optimizer's step count) may join; a plain tensor of more
  dimensions may not (it would broadcast against the local elements), except
  as the source of ``copy_`` with the whole tensor's shape, which copies this
  rank's elements of it (``load_state_dict`` of a full state dict);
* whole-tensor reductions that torch's gradient clipping uses (``_foreach_norm``,
  ``linalg_vector_norm``, ``sum``, ``max`` / ``min``): the local result,
  returned as a DTensor with a Partial placement, exactly as FSDP2's
  ``Shard(0)`` parameters give, so that torch's own redistribution sums (or
  takes the max of) the ranks' parts when the value is used (a p-norm's
  sum over a dbuf job's ranks goes through dbufd: see ``_JobNormPartial``);
* anything else (views, matmuls, indexing) raises ``NotImplementedError``
  naming the operator: call ``full_tensor()`` or ``to_local()``.

``full_tensor()`` and ``redistribute()`` (to ``Replicate()``, ``Shard(d)`` or
another RaggedShard) gather through the mesh's process group. Distributed
checkpointing (DCP) stores a rank's ragged range as the rectangles that
cover it (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``); each is a view of the local elements, so saving
and loading copy nothing more than DCP's own I/O.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor._ops._math_ops import _NormPartial

from . import _patch
from ._ragged import Box, RaggedShard, ShardInfo, boxes_of

aten = torch.ops.aten


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


def mesh_rank(mesh: DeviceMesh) -> int:
    """This process's place on the mesh's first (dp) dimension (from its coordinate: no process group asked)."""
    return mesh.get_coordinate()[0]


def _placements_of(placements: RaggedShard | Sequence[Placement], mesh: DeviceMesh) -> tuple[Placement, ...]:
    """A RaggedShard on the dp dimension (first), then the other dimensions' placements (tensor / expert parallel)."""
    placements = (placements,) if isinstance(placements, RaggedShard) else tuple(placements)
    if len(placements) != mesh.ndim or not isinstance(placements[0], RaggedShard):
        raise ValueError(
            f"a RaggedShard DTensor on a {mesh.ndim}-D mesh takes a RaggedShard on its first dimension and one "
            f"placement per other dimension, got {placements}"
        )
    for placement in placements[1:]:
        if not isinstance(placement, (Shard, Replicate)):
            raise ValueError(f"dbuf.torch: {placement} beside RaggedShard (tensor / expert parallelism's Shard(d) "
                             f"or Replicate() only)")
    return placements


# ------------------------------------------------------------ torch's private DTensor constructor

# DTensor(local, spec) and DTensorSpec are torch's internals (DTensor.from_local checks and redistributes,
# which a RaggedShard local tensor must not be): these two functions are the only callers, so a change of
# their signatures in a torch release is mended here (_torch_version.py says which releases are tested).


def make_spec(mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int], stride: Sequence[int],
              dtype: torch.dtype) -> DTensorSpec:
    """torch's DTensorSpec of a tensor of `shape`, `stride` and `dtype` placed on `mesh`."""
    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype))


def make_dtensor(cls: type[DTensor], local: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool = False):
    """A DTensor (or RaggedDTensor) of this rank's `local` tensor and `spec`, unchecked.

    torch's own constructor (``DTensor.__new__``), without ``DTensor.__init__``,
    which does nothing but costs the decorators around it (torch.compile's and
    export's) at every result of an optimizer's step.
    """
    return _DTENSOR_NEW(cls, local, spec, requires_grad=requires_grad)


_DTENSOR_NEW = DTensor.__new__


def ragged_spec(
    mesh: DeviceMesh, placements: RaggedShard | Sequence[Placement], shape: torch.Size, dtype: torch.dtype
) -> DTensorSpec:
    shape = torch.Size(shape)
    return make_spec(mesh, _placements_of(placements, mesh), shape, _contiguous_stride(shape), dtype)


def _chunk(mesh: DeviceMesh, placements: tuple[Placement, ...], shape: torch.Size) -> tuple[torch.Size, tuple[int, ...]]:
    """The shape and offset of the chunk of a tensor the other mesh dimensions leave this rank (RaggedShard cuts it).

    On a 1-D mesh: the whole tensor. With tensor / expert parallelism: what
    that parallelism's placements give this rank, as torch computes it.
    """
    if mesh.ndim == 1:
        return shape, (0,) * len(shape)
    # The coordinate is part of the key: meshes compare equal across ranks.
    return _model_parallel_chunk(mesh, tuple(mesh.get_coordinate()), placements[1:], shape)


@functools.lru_cache(maxsize=4096)
def _model_parallel_chunk(mesh: DeviceMesh, coordinate: tuple[int, ...], placements: tuple[Placement, ...],
                          shape: torch.Size) -> tuple[torch.Size, tuple[int, ...]]:
    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, (Replicate(), *placements))
    return torch.Size(local_shape), tuple(offset)


def _model_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh of the dimensions after dp (tensor / expert parallelism's), as torch's submesh."""
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("dbuf.torch: a RaggedShard DTensor on several mesh dimensions needs a mesh with named dims")
    return mesh[names[1:]] if len(names) > 2 else mesh[names[1]]


def spmd_mesh(dp_mesh: DeviceMesh, model_mesh: DeviceMesh) -> DeviceMesh:
    """The (dp, tp...) mesh of a parameter that tensor / expert parallelism placed on `model_mesh` (FSDP2's)."""
    return DeviceMesh._concatenate([dp_mesh, model_mesh])


def local_part(whole: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """This rank's elements (1-D) of a whole tensor of the spec's global shape: its chunk, then its ragged range."""
    ragged: RaggedShard = spec.placements[0]  # type: ignore[assignment]
    shape, offset = _chunk(spec.mesh, tuple(spec.placements), spec.shape)
    if spec.mesh.ndim > 1:
        whole = whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
    return ragged.split(whole.reshape(shape), mesh_rank(spec.mesh))


class RaggedDTensor(DTensor):
    """A DTensor whose first placement is RaggedShard (see the module docstring); ``to_local()`` is this rank's
    elements, 1-D.

    Made by ``fully_shard`` (parameters, gradients) and by operators on them
    (optimizer states). :meth:`from_local` makes one from local elements.
    """

    @staticmethod
    def from_local(  # type: ignore[override]
        local: torch.Tensor,
        mesh: DeviceMesh,
        placements: RaggedShard | Sequence[Placement],
        shape: torch.Size | tuple[int, ...],
        *,
        requires_grad: bool = False,
    ) -> RaggedDTensor:
        """Wraps this rank's elements (1-D, no copy) as the RaggedShard DTensor of global ``shape``.

        ``placements``: a RaggedShard (1-D mesh), or one placement per mesh
        dimension: RaggedShard on the first (dp), tensor / expert
        parallelism's on the others (see RaggedShard).
        """
        spec = ragged_spec(mesh, placements, shape, local.dtype)
        ragged: RaggedShard = spec.placements[0]  # type: ignore[assignment]
        chunk, _ = _chunk(mesh, tuple(spec.placements), spec.shape)
        ragged.check(chunk.numel())
        begin, end = ragged.rank_range(mesh_rank(mesh), chunk.numel())
        if local.dim() != 1 or local.numel() != end - begin:
            raise ValueError(
                f"{ragged}: this rank holds elements [{begin}, {end}) of {tuple(chunk)}, got a local tensor "
                f"of shape {tuple(local.shape)}"
            )
        return make_dtensor(RaggedDTensor, local, spec, requires_grad=requires_grad)

    # ------------------------------------------------------------ layout

    @property
    def ragged(self) -> RaggedShard:
        return self._spec.placements[0]  # type: ignore[return-value]

    @property
    def chunk_shape(self) -> torch.Size:
        """The tensor RaggedShard cuts: the whole one, or this rank's tensor / expert parallel chunk of it."""
        return _chunk(self._spec.mesh, tuple(self._spec.placements), self.shape)[0]

    @property
    def chunk_offset(self) -> tuple[int, ...]:
        """Where that chunk starts in the whole tensor, per dimension."""
        return _chunk(self._spec.mesh, tuple(self._spec.placements), self.shape)[1]

    @property
    def shard_info(self) -> ShardInfo:
        """This rank's elements of the chunk (the whole tensor on a 1-D mesh): begin, end, block size, blocks held."""
        return self.ragged.shard_info(mesh_rank(self._spec.mesh), self.chunk_shape)

    @property
    def global_shape(self) -> torch.Size:
        return self.shape

    @property
    def element_range(self) -> tuple[int, int]:
        """This rank's elements [begin, end) of the chunk, flattened (of the whole tensor on a 1-D mesh)."""
        info = self.shard_info
        return info.begin, info.end

    def local_part(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's elements (1-D view where it can be) of a whole tensor of this one's shape."""
        return local_part(whole, self._spec)

    @property
    def unit_elems(self) -> int:
        return self.ragged.block_elems

    @property
    def local_units(self) -> int:
        return self.shard_info.local_units

    def __repr__(self) -> str:  # type: ignore[override]
        begin, end = self.element_range
        name = getattr(self, "fqn", None)
        named = f"{name!r}, " if name else ""
        return (
            f"RaggedDTensor({named}shape={tuple(self.shape)}, dtype={self.dtype}, {self.ragged}, "
            f"local elements [{begin}, {end}))"
        )

    def __deepcopy__(self, memo: dict) -> RaggedDTensor:
        # A copy is this process's memory, no longer dbufd's; still a DTensor of the same layout.
        copied = make_dtensor(RaggedDTensor, self._local_tensor.detach().clone(), self._spec,
                              requires_grad=self.requires_grad)
        memo[id(self)] = copied
        return copied

    # ------------------------------------------------------------ gather / split

    def full_tensor(self, *, grad_placements: Any = None) -> torch.Tensor:  # type: ignore[override]
        """The whole tensor on every rank (collective over the mesh, differentiable).

        The chunk gathered over dp (RaggedShard), then, with tensor / expert
        parallelism, the chunks gathered as torch's DTensor gathers them.
        """
        chunk = _GatherRagged.apply(self)
        mesh = self._spec.mesh
        if mesh.ndim == 1:
            return chunk
        model = DTensor.from_local(chunk, _model_parallel_mesh(mesh), self._spec.placements[1:], run_check=False,
                                   shape=self.shape, stride=self.stride())
        return model.full_tensor()

    def redistribute(  # type: ignore[override]
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Any = None,
        *,
        async_op: bool = False,
        forward_dtype: torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
    ) -> DTensor:
        """To ``Replicate()``, ``Shard(d)`` or another RaggedShard (collective: every rank gathers the whole)."""
        mesh = device_mesh if device_mesh is not None else self.device_mesh
        if mesh != self.device_mesh:
            raise NotImplementedError("dbuf.torch: a RaggedShard DTensor redistributes on its own mesh only")
        target = tuple(placements) if placements is not None else self.placements
        if len(target) != mesh.ndim:
            raise ValueError(f"dbuf.torch: {len(target)} placements for a {mesh.ndim}-D mesh")
        source = self if forward_dtype is None else self.to(forward_dtype)
        if target == tuple(self.placements):
            return source
        whole = source.full_tensor()
        if all(isinstance(p, Replicate) for p in target):
            return DTensor.from_local(whole, mesh, target, run_check=False)
        if isinstance(target[0], RaggedShard):
            return distribute_ragged(whole, mesh, target)
        if all(isinstance(p, (Shard, Replicate)) for p in target):
            return distribute_tensor(whole, mesh, target, src_data_rank=None)
        raise NotImplementedError(f"dbuf.torch: redistributing a RaggedShard DTensor to {target}")

    # ------------------------------------------------------------ distributed checkpoint (DCP)

    def _boxes(self) -> list[Box]:
        """This rank's elements as rectangles of its chunk (offsets in the chunk, see _global_offsets)."""
        chunk = self.chunk_shape
        if chunk.numel() == 0:
            # No elements, but DCP must still know the tensor: dp rank 0 writes one empty chunk.
            mine = mesh_rank(self.device_mesh) == 0
            return [Box((0,) * self.dim(), tuple(chunk), 0)] if mine else []
        begin, end = self.element_range
        return boxes_of(chunk, begin, end)

    def _global_offsets(self, box: Box) -> torch.Size:
        """A rectangle of the chunk, placed in the whole tensor (tensor / expert parallelism's offset added)."""
        return torch.Size(o + c for o, c in zip(box.offsets, self.chunk_offset))

    def _box_view(self, box: Box) -> torch.Tensor:
        begin, _ = self.element_range
        start = box.flat_begin - begin
        return self._local_tensor[start : start + box.numel].view(box.sizes)

    def __create_write_items__(self, fqn: str, object: Any) -> list:  # noqa: A002 - DCP's name
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        properties = TensorProperties.create_from_tensor(self._local_tensor)
        return [
            WriteItem(
                index=MetadataIndex(fqn, self._global_offsets(box)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=self._global_offsets(box), sizes=torch.Size(box.sizes)),
                    properties=properties,
                    size=self.size(),
                ),
            )
            for box in self._boxes()
        ]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [
            ChunkStorageMetadata(offsets=self._global_offsets(box), sizes=torch.Size(box.sizes))
            for box in self._boxes()
        ]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        offsets = tuple(index.offset) if index.offset is not None else None
        for box in self._boxes():
            if tuple(self._global_offsets(box)) == offsets:
                return self._box_view(box)
        raise ValueError(f"{index.fqn}: this rank holds no chunk of it at offsets {offsets}")

    # ------------------------------------------------------------ operators

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        handler = _HANDLERS.get(func)  # one lookup per call: an optimizer step makes hundreds
        if handler is None:
            handler = _HANDLERS[func] = _handler_of(func)
        return handler(func, args, kwargs or {})

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        """Elementwise operators outside autograd (an optimizer's step) on the local elements at once.

        The same operators would reach __torch_dispatch__ through torch's
        dispatcher (autograd, the wrapper's dispatch keys) at several times the
        cost of the operator on these small local tensors; here they skip it.
        Anything else, and any call that autograd records, takes torch's usual
        path (DTensor's: no torch function, straight to the dispatcher).
        """
        written = _FAST_PATH.get(func, _UNDECIDED)
        if written is _UNDECIDED:
            written = _FAST_PATH[func] = _fast_path_of(func)
        if written is None or (kwargs and "out" in kwargs) or (torch.is_grad_enabled() and _any_requires_grad(args)):
            return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})
        result = _local_call(func, args, kwargs)
        if result is _NOT_SIMPLE and written:
            # In place (a _foreach_ or fused optimizer operator on lists): what it returns is what it wrote.
            out = _elementwise(func, args, kwargs or {}, wrap=False)
            result = None if out is None else args[written[0]]
        elif result is _NOT_SIMPLE:
            result = _elementwise(func, args, kwargs or {})
        for position in written:  # as the dispatcher would: the wrappers' versions count the write
            if position < len(args):
                torch.autograd.graph.increment_version(args[position])
        return result


# ---------------------------------------------------------------- elementwise operators

_ELEMENTWISE = {
    aten.detach.default,
    aten.alias.default,
    aten.clone.default,
    aten.copy_.default,
    aten._to_copy.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.fill_.Scalar,
    aten.fill_.Tensor,
    aten.zero_.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.new_ones.default,
    aten.new_full.default,
}
_FUSED_OPTIMIZERS = ("_fused_adam", "_fused_adamw", "_fused_sgd", "_fused_adagrad")


_FOREACH_REDUCTIONS = {"_foreach_norm", "_foreach_max"}
_SHAPE_TAKING = {aten.new_zeros.default, aten.new_empty.default, aten.new_ones.default, aten.new_full.default}


_RANDOM_FILLS = {aten.uniform_.default, aten.normal_.default, aten.bernoulli_.float, aten.exponential_.default,
                 aten.log_normal_.default, aten.geometric_.default, aten.cauchy_.default,
                 *(getattr(aten.random_, name) for name in aten.random_.overloads())}
_RANDOM_LIKE = {aten.rand_like.default, aten.randn_like.default}


def _handler_of(func):
    """How __torch_dispatch__ runs ``func`` on RaggedShard operands (decided once per operator)."""
    if func in _REDUCTIONS:
        return _REDUCTIONS[func]
    if func is aten.copy_.default:
        return _copy
    if func in _RANDOM_FILLS:
        return _random_fill
    if func in _RANDOM_LIKE:
        return _random_like
    if func is aten._amp_foreach_non_finite_check_and_unscale_.default:
        return _unscale
    if func in _SHAPE_TAKING:
        return _new_like
    name = func._schema.name.split("::")[-1]
    if (
        func in _ELEMENTWISE
        or torch.Tag.pointwise in func.tags
        or (name.startswith("_foreach_") and name not in _FOREACH_REDUCTIONS)
        or name.startswith(_FUSED_OPTIMIZERS)
    ):
        return _elementwise
    return _refuse


_HANDLERS: dict = {}


# ---------------------------------------------------------------- the torch-function fast path

_FAST_PATH: dict = {}  # Python-level function -> positions of the arguments it writes, or None: not fast
_UNDECIDED = object()


def _fast_path_of(func) -> tuple[int, ...] | None:
    """Whether ``func`` (a Tensor method or torch function) is an elementwise operator __torch_dispatch__ runs
    locally, decided once from its aten overloads: the positions of the arguments it writes, else None.

    Every overload that takes tensors (not TorchScript's scalar ones, not the
    ``out=`` forms, which the call then refuses) must be elementwise and write
    the same arguments; never copy_, whose source may be a whole tensor.
    """
    name = getattr(func, "__name__", None)
    packet = getattr(aten, name, None) if isinstance(name, str) and name != "copy_" else None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return None
    written: set[tuple[int, ...]] = set()
    for overload in (getattr(packet, o) for o in packet.overloads()):
        arguments = overload._schema.arguments
        first = arguments[0].type if arguments else None
        takes_tensors = isinstance(first, torch.TensorType) or (
            isinstance(first, torch.ListType) and isinstance(first.getElementType(), torch.TensorType))
        if not takes_tensors or any(argument.is_out for argument in arguments):
            continue
        if _handler_of(overload) is not _elementwise:
            return None
        written.add(tuple(i for i, argument in enumerate(arguments)
                          if argument.alias_info is not None and argument.alias_info.is_write))
    return written.pop() if len(written) == 1 else None


_NOT_SIMPLE = object()
_SCALARS = (int, float, bool)


def _local_call(func, args, kwargs):
    """The common call of an optimizer step, done with no other work: a RaggedShard DTensor, then scalars or
    RaggedShard DTensors of the very same spec (optimizer states made from the parameter); else _NOT_SIMPLE."""
    first = args[0] if args else None
    if type(first) is not RaggedDTensor:
        return _NOT_SIMPLE
    spec = first._spec
    local = [first._local_tensor]
    for value in args[1:]:
        kind = type(value)
        if kind is RaggedDTensor and value._spec is spec:
            local.append(value._local_tensor)
        elif kind in _SCALARS:
            local.append(value)
        else:
            return _NOT_SIMPLE
    if kwargs and any(type(value) not in _SCALARS for value in kwargs.values()):
        return _NOT_SIMPLE
    out = func(*local, **kwargs) if kwargs else func(*local)
    if out is local[0]:
        return first  # in place
    if isinstance(out, (tuple, list)):  # several results (frexp)
        return type(out)(_wrap_local(value, spec) for value in out)
    return _wrap_local(out, spec)


def _wrap_local(value, spec: DTensorSpec):
    """A result on the local elements as a RaggedDTensor of the operands' layout (in its own dtype)."""
    if not isinstance(value, torch.Tensor):
        return value
    meta = spec.tensor_meta
    if value.dtype != meta.dtype:
        spec = make_spec(spec.mesh, spec.placements, meta.shape, meta.stride, value.dtype)
    return make_dtensor(RaggedDTensor, value, spec)


def _any_requires_grad(args) -> bool:
    for value in args:
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return True
        elif isinstance(value, (list, tuple)):
            if any(isinstance(item, torch.Tensor) and item.requires_grad for item in value):
                return True
    return False


def _refuse(func, args, kwargs):
    raise NotImplementedError(
        f"dbuf.torch: {func} on a RaggedShard DTensor (a parameter, gradient or optimizer state of "
        f"dbuf.torch.fully_shard): its operators run elementwise on this rank's elements only; use "
        f".full_tensor() for the whole tensor or .to_local() for this rank's elements"
    )


def _copy(func, args, kwargs):
    source = args[1]
    if not isinstance(source, DTensor):
        return _copy_from_whole(args[0], source)
    if not isinstance(source, RaggedDTensor) and all(p.is_replicate() for p in source.placements):
        return _copy_from_whole(args[0], source.to_local())  # every rank holds it whole
    return _elementwise(func, args, kwargs)


def _random_fill(func, args, kwargs):
    """``uniform_`` and the other random fills: the whole tensor drawn, this rank's elements kept.

    Every rank draws the same whole tensor from the same generator state, as
    one process would, so a seeded init (``reset_parameters()``,
    ``torch.nn.init``) gives the single-process values on every layout, and
    the ranks' generators stay in step.
    """
    tensor = args[0]
    whole = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor._local_tensor.device)
    func(whole, *args[1:], **kwargs)
    tensor._local_tensor.copy_(tensor.local_part(whole))
    return tensor


def _random_like(func, args, kwargs):
    tensor = args[0]
    kwargs = dict(kwargs, device=tensor._local_tensor.device)
    kwargs.pop("memory_format", None)
    whole = func(torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor._local_tensor.device), *args[1:],
                 **kwargs)
    return distribute_ragged(whole, tensor.device_mesh, tensor.placements)


def _unscale(func, args, kwargs):
    """GradScaler's unscale: on the local elements, then ``found_inf`` is the ranks' maximum (all skip alike)."""
    grads, found_inf = args[0], args[1]
    meshes = list(dict.fromkeys(g.device_mesh for g in grads if isinstance(g, RaggedDTensor)))
    _elementwise(func, args, kwargs)
    for mesh in meshes:  # (dp) and (dp, tp) meshes under tensor parallelism: MAX over each is MAX over all
        _all_reduce_over_mesh(found_inf, dist.ReduceOp.MAX, mesh)


def _all_reduce_over_mesh(tensor: torch.Tensor, op, mesh: DeviceMesh) -> None:
    """Every rank of the mesh gets the reduction (dimension by dimension: each has its own group)."""
    for dim in range(mesh.ndim):
        dist.all_reduce(tensor, op=op, group=mesh.get_group(dim))


def _new_like(func, args, kwargs):
    """``new_zeros`` and the like: with the operand's own shape, the same layout; with another, Replicate.

    Another shape has no ragged layout to inherit; as DTensor does for a
    sharded operand, the new tensor is whole on every rank (a Replicate
    DTensor on the same mesh), which init code fills identically everywhere
    and then copies into the parameter (each rank keeping its elements).
    """
    lead = args[0]
    if tuple(args[1]) != tuple(lead.shape):
        whole = func(lead._local_tensor, *args[1:], **kwargs)
        return DTensor.from_local(whole, lead.device_mesh, [Replicate()] * lead.device_mesh.ndim, run_check=False)
    return _elementwise(func, (lead, [lead._local_tensor.numel()], *args[2:]), kwargs)


def _elementwise(func, args, kwargs, *, wrap: bool = True):
    # Runs for every operator of an optimizer step, so one plain pass over
    # the arguments (and one level of lists, as operators take them).
    operands = _Operands(func)
    out = func(*[operands.local(value) for value in args],
               **{key: operands.local(value) for key, value in kwargs.items()})
    return operands.wrap(out) if wrap else out


class _Operands:
    """One operator call's RaggedShard operands: their local elements, and the layout results take.

    The layout is one spec, or for a _foreach_ operator one per list
    position; RaggedShard operands that meet elementwise must share it.
    """

    __slots__ = ("func", "spec", "list_specs", "in_place", "plain")

    def __init__(self, func) -> None:
        self.func = func
        self.spec: DTensorSpec | None = None
        self.list_specs: list[DTensorSpec | None] | None = None
        self.in_place: dict[int, RaggedDTensor] = {}  # local tensor -> its DTensor (a result may be an operand)
        self.plain: set[int] = set()  # plain (0-dim) tensors passed: returned as they are where mutated

    def local(self, value):
        kind = type(value)
        if kind is RaggedDTensor:
            self._meet(value._spec)
            self.in_place[id(value._local_tensor)] = value
            return value._local_tensor
        if kind is list or kind is tuple:
            return self._local_list(value)
        if isinstance(value, DTensor):
            return _replicated_value(self.func, value)
        if isinstance(value, torch.Tensor):
            if value.dim() > 0:
                raise ValueError(
                    f"dbuf.torch: {self.func} mixes a RaggedShard DTensor with a plain tensor of shape "
                    f"{tuple(value.shape)}; make it a DTensor of the same layout (or a 0-dim tensor)"
                )
            self.plain.add(id(value))
        return value

    def _local_list(self, values):
        specs = self.list_specs
        first = specs is None
        if first:
            specs = [None] * len(values)
        local = []
        for position, value in enumerate(values):
            if type(value) is RaggedDTensor:
                spec = specs[position] if position < len(specs) else None
                if first or spec is None:
                    specs[position] = value._spec
                elif spec is not value._spec:
                    _check_same_layout(self.func, spec, value._spec)
                local.append(value._local_tensor)
            else:
                local.append(self.local(value))
        if first and any(spec is not None for spec in specs):
            self.list_specs = specs
        return type(values)(local)

    def _meet(self, spec: DTensorSpec) -> None:
        if self.spec is None:
            self.spec = spec
        elif self.spec is not spec:
            _check_same_layout(self.func, self.spec, spec)

    def wrap(self, out):
        if isinstance(out, (list, tuple)):
            if out and isinstance(out[0], (list, tuple)):
                return type(out)(self.wrap(inner) for inner in out)  # a functional optimizer's lists
            specs = self.list_specs if self.list_specs is not None else [self.spec] * len(out)
            return type(out)(self._wrap_one(value, spec) for value, spec in zip(out, specs))
        return self._wrap_one(out, self.spec)

    def _wrap_one(self, value, spec: DTensorSpec | None):
        if not isinstance(value, torch.Tensor):
            return value
        operand = self.in_place.get(id(value))
        if operand is not None:
            return operand  # an in-place operator's result is its operand
        if spec is None or id(value) in self.plain:
            return value
        return _wrap_local(value, spec)


def _check_same_layout(func, spec: DTensorSpec | None, other: DTensorSpec) -> None:
    if spec is None or spec is other or (
        spec.placements == other.placements and spec.shape == other.shape and spec.mesh == other.mesh
    ):
        return
    raise ValueError(
        f"dbuf.torch: {func} on RaggedShard DTensors of different layouts ({spec.placements[0]} of "
        f"{tuple(spec.shape)} and {other.placements[0]} of {tuple(other.shape)}): redistribute one first"
    )


def _replicated_value(func, value: DTensor) -> torch.Tensor:
    """A DTensor operand of another placement: its value on this rank (gathered where it is Partial)."""
    if value.dim() > 0:
        raise ValueError(
            f"dbuf.torch: {func} mixes a RaggedShard DTensor with a {value.placements} DTensor of shape "
            f"{tuple(value.shape)}; redistribute it to the RaggedShard layout first"
        )
    if all(isinstance(p, Replicate) for p in value.placements):
        return value._local_tensor
    return value.full_tensor()


def _copy_from_whole(dest: RaggedDTensor, source: torch.Tensor) -> RaggedDTensor:
    """``dest.copy_(whole)``: this rank's elements of a plain tensor of the global shape."""
    if tuple(source.shape) != tuple(dest.shape):
        raise ValueError(
            f"dbuf.torch: copying a plain tensor of shape {tuple(source.shape)} into a RaggedShard DTensor of "
            f"shape {tuple(dest.shape)}"
        )
    dest._local_tensor.copy_(dest.local_part(source))
    return dest


# ---------------------------------------------------------------- reductions


# How a small fp32 sum over the ranks of a 1-D mesh goes through dbufd: set by _session (which
# knows the jobs), None where the mesh is no dbuf job's. Called on every rank of the mesh alike.
JobSum = Callable[[DeviceMesh, torch.Tensor], "torch.Tensor | None"]
_job_sum: JobSum | None = None


def set_job_sum(job_sum: JobSum) -> None:
    global _job_sum
    _job_sum = job_sum


class _JobNormPartial(_NormPartial):
    """torch's partial p-norm, its ranks' sum through dbufd where the mesh is a dbuf job's.

    torch's ``clip_grad_norm_`` on dbuf's gradients reduces one such value
    per step. Through gloo its all-reduce takes a dozen thread wake-ups
    across the processes (one per ring step, each on a core that the ranks'
    own compute may hold: 8-13 ms measured with 4 ranks on 2 cores); through
    dbufd each rank submits once and is woken once. Equal to torch's
    ``_NormPartial`` of the same p (its sharding rules apply unchanged), and
    no dataclass of its own: it keeps _NormPartial's constructor, equality and hash.
    """

    def _reduce_value(self, tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
        summed = None
        if _job_sum is not None and mesh.ndim == 1 and tensor.dtype == torch.float32:
            summed = _job_sum(mesh, self._pre_reduce_transform(tensor))
        if summed is None:
            return super()._reduce_value(tensor, mesh, mesh_dim)
        return self._post_reduce_transform(summed)


def _partial_for(norm_type: float):
    if norm_type == math.inf:
        return Partial("max")
    if norm_type == -math.inf:
        return Partial("min")
    if norm_type == 0:
        return Partial("sum")
    return _JobNormPartial(norm_type)


# The specs of scalar partial results, by (mesh, placements, dtype): gradient clipping asks for one
# norm per parameter each step, and making a DTensorSpec costs more than the norm of a small shard.
_SCALAR_SPECS: dict[tuple, DTensorSpec] = {}
_SCALAR_SPECS_KEPT = 64  # meshes come and go in a long process: the cache starts over past this


def _as_partial(local: torch.Tensor, of: RaggedDTensor, placement) -> DTensor:
    """A rank's part of a whole-tensor reduction of `of`: Partial over dp and over the dims that shard it.

    A dimension that replicates the tensor (tensor parallelism's Replicate())
    gives every rank of it the same part: Replicate there.
    """
    placements = (placement, *(placement if isinstance(p, Shard) else Replicate() for p in of.placements[1:]))
    if local.dim() != 0:
        return make_dtensor(DTensor, local, make_spec(of.device_mesh, placements, local.shape, local.stride(),
                                                      local.dtype))
    key = (of.device_mesh, placements, local.dtype)
    spec = _SCALAR_SPECS.get(key)
    if spec is None:
        if len(_SCALAR_SPECS) >= _SCALAR_SPECS_KEPT:
            _SCALAR_SPECS.clear()
        spec = _SCALAR_SPECS[key] = make_spec(of.device_mesh, placements, (), (), local.dtype)
    return make_dtensor(DTensor, local, spec)


def _local_norm(tensor: RaggedDTensor, norm_type: float, dtype) -> torch.Tensor:
    """This rank's part of a p-norm; on a rank that holds nothing, the identity of the ranks' reduction."""
    local = tensor._local_tensor
    if local.numel() == 0:
        # vector_norm of nothing raises for inf and negative p; the ranks' reduction then ignores it.
        identity = math.inf if norm_type < 0 else 0.0
        return torch.full((), identity, dtype=dtype or local.dtype, device=local.device)
    return torch.linalg.vector_norm(local, norm_type, dtype=dtype)


def _whole_tensor_dims(tensor: RaggedDTensor, dim) -> bool:
    if dim is None:
        return True
    dims = [dim] if isinstance(dim, int) else list(dim)
    return not dims or sorted(d % max(tensor.dim(), 1) for d in dims) == list(range(tensor.dim()))


def _reduce_norm(func, args, kwargs):
    tensor = args[0]
    norm_type = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    if not _whole_tensor_dims(tensor, dim):
        raise NotImplementedError("dbuf.torch: a norm over some dimensions of a RaggedShard DTensor")
    local = _local_norm(tensor, norm_type, kwargs.get("dtype"))
    if keepdim:
        local = local.reshape((1,) * tensor.dim())
    return _as_partial(local, tensor, _partial_for(norm_type))


def _reduce_foreach_norm(func, args, kwargs):
    tensors = args[0]
    norm_type = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    out = []
    for tensor in tensors:
        if not isinstance(tensor, RaggedDTensor):
            raise ValueError("dbuf.torch: _foreach_norm over RaggedShard DTensors and other tensors at once")
        out.append(_as_partial(_local_norm(tensor, norm_type, dtype), tensor, _partial_for(norm_type)))
    return out


def _identity_of(kind: str, dtype: torch.dtype):
    """What a rank that holds nothing contributes to the ranks' max or min."""
    if dtype == torch.bool:
        return kind == "min"
    if dtype.is_floating_point:
        return -math.inf if kind == "max" else math.inf
    info = torch.iinfo(dtype)
    return info.min if kind == "max" else info.max


def _whole_tensor_operand(kind: str, args, kwargs) -> RaggedDTensor:
    """The operand of a reduction over the whole tensor; one over some dimensions is refused."""
    if len(args) > 1 or kwargs:
        raise NotImplementedError(f"dbuf.torch: {kind} over some dimensions of a RaggedShard DTensor")
    return args[0]


def _reduce_extreme(kind: str):
    def reduce(func, args, kwargs):
        tensor = _whole_tensor_operand(kind, args, kwargs)
        local = tensor._local_tensor
        if local.numel() == 0:
            value = torch.full((), _identity_of(kind, local.dtype), dtype=local.dtype, device=local.device)
        else:
            value = local.max() if kind == "max" else local.min()
        return _as_partial(value, tensor, Partial(kind))

    return reduce


def _reduce_any_all(kind: str):
    """``any()`` / ``all()`` of the whole tensor, on every rank (a loop's condition must agree)."""

    def reduce(func, args, kwargs):
        tensor = _whole_tensor_operand(kind, args, kwargs)
        local = tensor._local_tensor
        mine = bool(local.any()) if kind == "any" else bool(local.all())
        flag = torch.tensor([int(mine)], dtype=torch.int32, device=local.device)
        op = dist.ReduceOp.MAX if kind == "any" else dist.ReduceOp.MIN
        _all_reduce_over_mesh(flag, op, tensor.device_mesh)
        return torch.tensor(bool(flag.item()), device=local.device)

    return reduce


def _reduce_sum(func, args, kwargs):
    tensor = args[0]
    if len(args) > 1 and args[1] is not None and not isinstance(args[1], torch.dtype):
        raise NotImplementedError("dbuf.torch: a sum over some dimensions of a RaggedShard DTensor")
    local = tensor._local_tensor.sum(dtype=kwargs.get("dtype"))
    return _as_partial(local, tensor, Partial("sum"))


_REDUCTIONS = {
    aten.linalg_vector_norm.default: _reduce_norm,
    aten._foreach_norm.Scalar: _reduce_foreach_norm,
    aten.max.default: _reduce_extreme("max"),
    aten.min.default: _reduce_extreme("min"),
    aten.sum.default: _reduce_sum,
    aten.any.default: _reduce_any_all("any"),
    aten.all.default: _reduce_any_all("all"),
}



# ---------------------------------------------------------------- gather, distribute


class _GatherRagged(torch.autograd.Function):
    """RaggedShard -> the chunk it cuts (the whole tensor on a 1-D mesh) on every dp rank; backward takes this
    rank's elements of the gradient."""

    @staticmethod
    def forward(ctx, tensor: RaggedDTensor) -> torch.Tensor:  # type: ignore[override]
        ctx.spec = tensor._spec
        mesh = tensor.device_mesh
        return tensor.ragged.gather(tensor._local_tensor, mesh, 0, tensor.chunk_shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        spec: DTensorSpec = ctx.spec
        placement: RaggedShard = spec.placements[0]  # type: ignore[assignment]
        local = placement.split(grad, mesh_rank(spec.mesh)).contiguous()  # grad: the chunk's
        meta = spec.tensor_meta
        return make_dtensor(RaggedDTensor, local, make_spec(spec.mesh, spec.placements, meta.shape, meta.stride,
                                                            meta.dtype))


def distribute_ragged(
    whole: torch.Tensor, mesh: DeviceMesh, placements: RaggedShard | Sequence[Placement]
) -> RaggedDTensor:
    """A whole tensor (the same on every rank) -> its RaggedShard DTensor.

    This rank's elements, copied; no communication. ``placements``: a
    RaggedShard, or one per mesh dimension (see RaggedDTensor.from_local).
    """
    if isinstance(whole, DTensor):
        whole = whole.full_tensor()
    spec = ragged_spec(mesh, placements, whole.shape, whole.dtype)
    chunk, _ = _chunk(mesh, tuple(spec.placements), spec.shape)
    spec.placements[0].check(chunk.numel())  # type: ignore[attr-defined]
    local = local_part(whole.detach(), spec).clone()
    return RaggedDTensor.from_local(local, mesh, spec.placements, whole.shape)


def local_elements(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's elements of a RaggedShard DTensor (1-D, no copy); a plain tensor itself."""
    return tensor._local_tensor if isinstance(tensor, RaggedDTensor) else tensor


def shard_info(param: torch.Tensor, unit_elems: int | None = None) -> ShardInfo:
    """The ShardInfo of a RaggedShard DTensor, or of a plain (whole) tensor.

    A plain tensor is its own whole tensor; ``unit_elems`` gives its block
    size (default: the whole tensor is one block), so optimizers written
    against ShardInfo run unchanged in a single process.
    """
    if isinstance(param, RaggedDTensor):
        return param.shard_info
    numel = param.numel()
    unit = unit_elems if unit_elems is not None else max(numel, 1)
    return ShardInfo(param.shape, 0, numel, unit, -(-numel // unit) if numel else 0)


def _register_for_foreach() -> None:
    """torch's optimizers and clipping take their foreach paths only for the exact types listed (as DTensor is)."""
    from torch.optim.optimizer import _foreach_supported_types as optim_types
    from torch.utils._foreach_utils import _foreach_supported_types as util_types

    for types in (optim_types, util_types):
        if RaggedDTensor not in types:
            types.append(RaggedDTensor)


def _is_ragged(placements: Any) -> bool:
    return isinstance(placements, (list, tuple)) and len(placements) >= 1 and isinstance(placements[0], RaggedShard)


def _teach_full_state_dict_loading() -> None:
    """torch's set_{model,optimizer}_state_dict with full_state_dict: RaggedShard DTensors take their elements.

    Both paths of ``torch.distributed._state_dict_utils`` (every rank holds
    the full dict: ``distribute_tensor``; rank 0 broadcasts it:
    ``_distribute_tensors``) compute a rectangular slice per rank from the
    placements, which a ragged range is not. Their wrappers (_patch.wrap)
    hand the RaggedShard DTensors to :func:`distribute_ragged` (or copy this
    rank's elements into the existing one) and everything else to torch's
    own function. ``torch.distributed.tensor.distribute_tensor`` is the same
    wrapper, for code that distributes a full state dict itself with the
    placements of the model's parameters (accelerate's
    fsdp2_load_full_state_dict) and looks it up at call time.
    """
    import torch.distributed._state_dict_utils as utils
    import torch.distributed.tensor as tensor_api

    def distribute_tensor_or_ragged(distribute):
        def distribute_tensor(tensor, device_mesh=None, placements=None, **kwargs):
            if _is_ragged(placements):
                return distribute_ragged(tensor, device_mesh, placements)  # checks the element count
            return distribute(tensor, device_mesh, placements, **kwargs)

        return distribute_tensor

    def distribute_tensors_or_ragged(distribute_many):
        def distribute_tensors(local_state_dict, keys, device, pg=None):
            others = []
            for key in keys:
                entry = local_state_dict.get(key)
                if isinstance(entry, tuple) and isinstance(entry[0], RaggedDTensor):
                    local_state_dict[key] = _take_whole(key, *entry)
                else:
                    others.append(key)
            distribute_many(local_state_dict, others, device, pg)

        return distribute_tensors

    _patch.wrap([utils, tensor_api], "distribute_tensor", distribute_tensor_or_ragged)
    _patch.wrap([utils], "_distribute_tensors", distribute_tensors_or_ragged)


def _take_whole(key: str, local: RaggedDTensor, whole: torch.Tensor) -> RaggedDTensor:
    """A full state dict's tensor into a RaggedShard parameter: its elements copied (a new one where it is on meta)."""
    if tuple(whole.shape) != tuple(local.shape):
        raise ValueError(f"{key}: shape {tuple(whole.shape)} in the state dict, {tuple(local.shape)} here")
    if local.is_meta:
        return distribute_ragged(whole.to(local.dtype), local.device_mesh, local.placements)
    local._local_tensor.copy_(local.local_part(whole))
    return local


_register_for_foreach()


def _without_fast_path_if_asked() -> None:
    """``$DBUF_TORCH_FAST_PATH=0``: every operator on RaggedShard DTensors through torch's dispatcher, as before
    the fast path (a diagnostic, and python/bench/step_floor_bench.py's measure of what the fast path saves)."""
    value = os.environ.get("DBUF_TORCH_FAST_PATH", "1")
    if value not in ("0", "1"):
        raise ValueError(f"$DBUF_TORCH_FAST_PATH={value!r}: 1 (the default) or 0")
    if value == "0":
        RaggedDTensor.__torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]


_without_fast_path_if_asked()


def _refuse_ragged_fragments_in_checkpoints() -> None:
    """DCP's generic path for a plain DTensor given a RaggedShard placement by hand raises, naming the tensor.

    torch computes no local shape for a placement it does not know, so that
    path would describe a fragment as the tensor's chunk. RaggedDTensor's own
    chunk protocol never goes there; anything else with a RaggedShard
    placement is refused before a byte is written.
    """
    import torch.distributed.checkpoint.planner_helpers as helpers

    def write_items_or_refuse(write_items):
        def create_write_items_for_dtensor(fqn, tensor):
            if not isinstance(tensor, RaggedDTensor) and any(isinstance(p, RaggedShard) for p in tensor.placements):
                raise ValueError(
                    f"torch.distributed.checkpoint: {fqn} is a plain DTensor with a RaggedShard placement, which "
                    f"DCP cannot save whole; make it with RaggedDTensor.from_local or dbuf.torch.distribute_ragged"
                )
            return write_items(fqn, tensor)

        return create_write_items_for_dtensor

    _patch.wrap([helpers], "_create_write_items_for_dtensor", write_items_or_refuse)


_teach_full_state_dict_loading()
_refuse_ragged_fragments_in_checkpoints()
