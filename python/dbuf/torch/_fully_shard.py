"""``dbuf.torch.fully_shard``: PyTorch FSDP2's ``fully_shard``, backed by dbufd groups.

Named and shaped after ``torch.distributed.fsdp.fully_shard`` wherever the
meaning is the same (its every argument; the modules are ``FSDPModule`` s), so
a training script moves over by the switch of switch.py or a change of import.
Each call makes one unit = one dbuf group registered by every rank; the
daemon's planner places it (RaggedShard: no split blocks, minimal padding).
The unit's hooks are _hooks.py's; the module's methods _module.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, overload

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor, Shard

from ._dtensor import RaggedDTensor
from ._hooks import Hooks
from ._module import mix_in, units_of
from ._session import Session, default_session, init_replica, is_initialized, session_for_ranks
from ._unit import Reduction, Unit

Granularity = str | Callable[[str, nn.Parameter], str | None]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's mixed precision policy, with the same fields.

    ``param_dtype``: dtype of the gathered parameters (the all-gather casts
    the fp32 shards to it) and of forward / backward; None keeps the
    parameters' dtype. ``reduce_dtype``: dbuf reduces in fp32 (fp64 for fp64
    parameters; ranks summed in rank order), whatever this says; a
    narrower one rounds the reduced gradient to it.
    ``output_dtype``: cast floating-point forward outputs to it.
    ``cast_forward_inputs``: cast floating-point forward inputs to param_dtype.
    A ``torch.distributed.fsdp.MixedPrecisionPolicy`` is accepted too.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


def _managed_parameters(
    modules: list[nn.Module], ignored: set[nn.Parameter], session: Session
) -> tuple[list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]], str | None]:
    """The parameters a new unit of `modules` takes: not ignored, not already a unit's.

    Each comes with every (module, attribute) that holds it (tied weights),
    named by its first path from the first module. A parameter an earlier
    unit took, still held by a module here (weights tied across units), is
    an error, as in FSDP2 (two units would keep two copies that drift apart),
    raised where FSDP2 raises it: at the first forward (the new unit's
    ``refusal``; Hooks.pre_forward).
    """
    found: dict[int, tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    refusal = None
    for position, root in enumerate(modules):
        prefix = "" if len(modules) == 1 else f"{position}."
        for module_name, module in root.named_modules(remove_duplicate=False):
            for name, param in list(module._parameters.items()):
                if param is None or param in ignored:
                    continue
                if isinstance(param, RaggedDTensor):
                    continue  # a unit of a submodule has it
                fqn = prefix + (f"{module_name}.{name}" if module_name else name)
                _check_parameter(fqn, param)
                taken_by = session.unit_holding(param)
                if taken_by is not None:
                    refusal = refusal or (
                        f"Parameter '{fqn}' is shared with a parameter already managed by another FSDP group "
                        f"(dbuf unit {taken_by.label}). For shared/tied parameters, use fully_shard([module_a, "
                        f"module_b]) to place them in the same FSDP group."
                    )
                    continue
                if id(param) in found:
                    found[id(param)][2].append((module, name))
                else:
                    found[id(param)] = (fqn, param, [(module, name)])
    return list(found.values()), refusal


def _check_parameter(fqn: str, param: nn.Parameter) -> None:
    """What FSDP2 refuses of a parameter, with its exception types and words."""
    if param.dim() == 0:
        raise ValueError(f"fully_shard doesn't support scalar parameters. Change {fqn} to a 1D tensor with numel "
                         f"equal to 1.")
    local = param.to_local() if isinstance(param, DTensor) else param
    if not local.is_contiguous():
        raise NotImplementedError(
            f"FSDP does not support non-contiguous parameters yet: {fqn} of shape {tuple(param.shape)} and "
            f"strides {local.stride()} (dbuf.torch packs each tensor's elements in row-major order)"
        )


def _label(modules: list[nn.Module]) -> str:
    return "+".join(type(m).__name__ for m in modules)


@overload
def fully_shard(module: nn.Module, **kwargs: Any) -> nn.Module: ...
@overload
def fully_shard(module: list[nn.Module], **kwargs: Any) -> list[nn.Module]: ...


def fully_shard(
    module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: Any = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
    granularity: Granularity = "element",
    session: Session | None = None,
):
    """Shards ``module``'s parameters through dbufd: one unit = one dbuf group.

    Call it on submodules first (each transformer block, say), then on the
    root; every rank must make the same calls in the same order (each one is a
    collective registration). The module's parameters become
    :class:`~dbuf.torch.RaggedDTensor` s (DTensors of the module's shapes,
    placed ``RaggedShard`` on the job's mesh; their local elements are this
    rank's fp32 elements of each tensor, in dbufd's memory), which an optimizer built afterwards
    updates; forward and backward gather them into the unit's unsharded slot
    and reduce-scatter the gradients (avg over ranks, in fp32, ranks summed in
    rank order) into the sharded gradients.

    Takes every argument of torch 2.15's ``fully_shard`` (docs/python.md's
    parity table says what each does here), plus dbuf's own two.

    Args:
        module: a module, or a list of modules forming one unit (FSDP2's
            grouped form).
        mesh: a 1-D DeviceMesh: the job's ranks (None: the session's), or
            the dp dim of a mesh whose other dims tensor / expert parallelism
            placed the parameters on (its ranks a dbuf job of their own; the
            parameters' DTensors then live on the (dp, tp) mesh); or HSDP's
            2-D (replicate, shard) mesh.
        reshard_after_forward: give the slot back after forward and gather
            again in backward (None: True except for the root unit, the first
            whose forward runs, as in FSDP2). An int is FSDP2's group size to
            reshard to, a factor of the world size: the world size means True,
            1 False, another factor True on one node (dbufd gathers again from
            the node's memory) and False across nodes (nothing crosses nodes
            in backward).
        shard_placement_fn: FSDP2's per-parameter placement: ``Shard(d)`` keeps
            each slice along dim d whole on one rank (the RaggedShard rule of
            blocks of ``stride(d)`` elements); None the default rule.
        mp_policy: a :class:`MixedPrecisionPolicy` (or FSDP2's).
        offload_policy: FSDP2's ``OffloadPolicy()`` (the default);
            ``CPUOffloadPolicy`` where dbufd keeps the shards in host memory
            already (its host backend).
        ignored_params: parameters to leave alone (not sharded).
        dp_mesh_dims: FSDP2's data-parallel dims of a larger mesh: refused.
        granularity: RaggedShard rule for the unit's 2D+ tensors ('element',
            'rows:R', 'block:RxC', 'matrix' or an element count), or a
            function (fqn, parameter) -> rule or None (the default rule) for
            each tensor's own.
        session: the dbuf.torch session (default: :func:`dbuf.torch.init`'s,
            made from torchrun's environment on first use).

    Returns:
        The module (its class now also derives from :class:`DBufModule`, an
        ``FSDPModule``), or the list.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard needs at least one module")
    for m in modules:
        _check_module(m)
    if dp_mesh_dims is not None:
        raise NotImplementedError("dbuf.torch.fully_shard takes the dp dims as its mesh (world_mesh['dp'], or HSDP's "
                                  "2-D (replicate, shard) mesh); dp_mesh_dims is not supported")
    session = _session_for(mesh, session)
    _check_offload(session, offload_policy)
    reshard_after_forward = _reshard_after_forward_of(reshard_after_forward, session)
    params, refusal = _managed_parameters(modules, set(ignored_params or ()), session)
    default_rule = granularity if isinstance(granularity, str) else "element"
    # Under `with torch.device("meta")` (FSDP2 takes a model sharded inside it) the unit's own tensors are still
    # dbufd's: only the parameters made on meta stay on meta.
    with torch.device(session.torch_device):
        unit = Unit(
            session,
            modules,
            params,
            granularity=default_rule,
            tensor_granularity=_tensor_rules(params, granularity, shard_placement_fn),
            param_dtype=getattr(mp_policy, "param_dtype", None),
            reshard_after_forward=reshard_after_forward,
            output_dtype=getattr(mp_policy, "output_dtype", None),
            cast_forward_inputs=bool(getattr(mp_policy, "cast_forward_inputs", True)),
            label=_label(modules),
            reduction=Reduction(reduce_dtype=getattr(mp_policy, "reduce_dtype", None)),
            # A unit without a mesh on an HSDP session (the root after the blocks) is HSDP's too.
            hsdp=mesh.ndim == 2 if mesh is not None else session.replicas > 1,
            mesh=mesh if mesh is not None and mesh.ndim == 1 else None,
        )
    unit.refusal = refusal
    session.units.append(unit)
    session.passes.units.append(unit)
    for _, param, _ in params:
        session.claim(param, unit)
    hooks = Hooks(unit)
    for m in modules:
        m._dbuf_unit = unit
        m._dbuf_hooks = hooks
        # load_state_dict(assign=True) (accelerate's loading) registers new parameters: back into dbufd's memory.
        m.register_load_state_dict_post_hook(lambda module, incompatible_keys: unit.adopt_applied())
        mix_in(m)
    return modules if isinstance(module, (list, tuple)) else module


def _check_module(module: nn.Module) -> None:
    """What FSDP2 refuses to shard, refused with its exception types and words."""
    if getattr(module, "_dbuf_unit", None) is not None:
        raise AssertionError(
            f"Each distinct composable distributed API can only be applied to a module once. {type(module).__name__} "
            f"is a dbuf unit already"
        )
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward:
        raise ValueError(f"fully_shard does not support containers that do not implement forward: {module}")


def _state_of(module: nn.Module):
    """``fully_shard.state(module)``: the unit's state object (its hooks), one per fully_shard call, as FSDP2's."""
    return getattr(module, "_dbuf_hooks", None)


fully_shard.state = _state_of  # type: ignore[attr-defined]


def _session_for(mesh: DeviceMesh | None, session: Session | None) -> Session:
    """The session a unit on `mesh` belongs to, the mesh checked and adopted.

    None: the session's own mesh. 1-D: over the job's ranks, in order. 2-D:
    HSDP's (replicate, shard): the job is this replica's shard group; the
    first fully_shard on it makes the default session for that replica.
    """
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard's mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh is not None and mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh} (dbuf.torch: the job's ranks, the dp dim of "
            f"a mesh with tensor / expert parallel dims, or HSDP's 2-D (replicate, shard) mesh)"
        )
    if mesh is not None and mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise AssertionError("Please init the 2D mesh for HSDP with mesh_dim_names specified")
    if mesh is not None and mesh.ndim == 2:
        if session is None:
            replica = mesh.get_coordinate()[0]
            session = default_session() if is_initialized() else init_replica(replica, mesh.mesh[replica].tolist())
        session.adopt_hsdp_mesh(mesh)
        return session
    if session is None:
        # A mesh of other ranks than the default session's is another dbuf job (a dp slice beside TP / EP).
        session = default_session() if mesh is None else session_for_ranks(mesh.mesh.flatten().tolist())
    if mesh is not None:
        session.adopt_mesh(mesh)
    return session


def _check_offload(session: Session, offload_policy: OffloadPolicy | None) -> None:
    if offload_policy is None or type(offload_policy) is OffloadPolicy:
        return
    if isinstance(offload_policy, CPUOffloadPolicy) and session.device is None:
        return  # the host backend keeps shards, gradients and the optimizer's states in host memory already
    raise NotImplementedError(
        f"dbuf.torch.fully_shard: {type(offload_policy).__name__} is not supported with dbufd's "
        f"{'cuda' if session.device is not None else 'host'} backend (dbufd keeps the shards in the memory of its "
        f"backend: attach without a device for host memory)"
    )


def _reshard_after_forward_of(value: bool | int | None, session: Session) -> bool | None:
    """FSDP2's int form, the group size to reshard to after forward, as a bool.

    It must divide the world size (FSDP2's ValueError otherwise); the world
    size means True and 1 means False, as in FSDP2. Another factor asks
    FSDP2 to gather again in backward within a smaller group (a node), not
    across the job; dbufd re-gathers from its own memory, which on one node
    is that smaller group already: True. A job across nodes keeps the
    parameters instead (False), so that backward sends nothing between nodes.
    """
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise ValueError(
            f"reshard_after_forward should be a bool or an int representing the group size to reshard to, not "
            f"{value!r}"
        )
    world_size = session.world_size
    if value < 1 or value > world_size or world_size % value != 0:
        raise ValueError(f"If passing reshard_after_forward as an int, it should be a factor of {world_size}, not "
                         f"{value}")
    if value == world_size:
        return True
    if value == 1:
        return False
    return not session.across_nodes


def _tensor_rules(params, granularity: Granularity, shard_placement_fn) -> dict[str, str]:
    """Each tensor's own RaggedShard rule, from the granularity function or FSDP2's shard_placement_fn."""
    rules: dict[str, str] = {}
    for fqn, param, _ in params:
        rule = granularity(fqn, param) if callable(granularity) else None
        if rule is None and shard_placement_fn is not None:
            rule = _rule_of_placement(fqn, param, shard_placement_fn(param))
        if rule is not None:
            rules[fqn] = rule
    return rules


def _rule_of_placement(fqn: str, param: nn.Parameter, placement: Shard | None) -> str | None:
    """``Shard(d)``: blocks of stride(d) elements, so no slice along dim d is split between ranks.

    FSDP2 cuts dim d into equal chunks; RaggedShard keeps whole slices along it,
    which is what trainers ask Shard(d) for (whole rows, whole experts).
    """
    if placement is None:
        return None
    if not isinstance(placement, Shard):
        raise ValueError(f"shard_placement_fn returned {placement!r} for {fqn}; FSDP2 takes Shard(dim) or None")
    dim = placement.dim + param.dim() if placement.dim < 0 else placement.dim
    if not 0 <= dim < max(param.dim(), 1):
        raise AssertionError(f"Shard dim {placement.dim} is invalid for {param.dim()}D tensor: {param.shape} "
                             f"(shard_placement_fn's placement of {fqn})")
    # Of what this rank holds: tensor / expert parallelism's chunk where the parameter is their DTensor.
    shape = param.to_local().shape if isinstance(param, DTensor) else param.shape
    stride = math.prod(shape[dim + 1 :])
    return "element" if stride == 1 else str(stride)


def units(module: nn.Module) -> Iterable[Unit]:
    """The dbuf units under `module`, in the order they were made."""
    return units_of(module, recurse=True)
