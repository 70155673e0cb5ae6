"""``dbuf.torch.fully_shard``: PyTorch FSDP2's ``fully_shard``, backed by dbufd groups.

Named and shaped after ``torch.distributed.fsdp.fully_shard`` wherever the
meaning is the same, so moving a training script over is a change of import.
Each call makes one unit = one dbuf group registered by every rank; the
daemon's planner places it (RaggedShard: no split blocks, minimal padding).

The hooks, per unit (the order every rank follows, so the collectives match):
  forward pre-hook   gather (or wait for the prefetch), swap the unsharded
                     parameters in, prefetch the next unit, cast inputs, and
                     route the inputs through a function whose backward marks
                     the end of this unit's backward;
  forward hook       swap the sharded parameters back, reshard (unless the
                     unit keeps its parameters for backward), hook the outputs;
  pre-backward       (the outputs' gradients are ready) gather again, point
                     the unsharded parameters' .grad into the slot, prefetch
                     the unit backward runs next;
  post-backward      reduce-scatter (avg, fp32) into the sharded gradients;
  end of backward    (a callback of the autograd engine) the units whose
                     post-backward did not run, the waits, the reshards, and
                     the sharded gradients set on the sharded parameters.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, overload

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from ._dtensor import RaggedDTensor
from ._session import Session, default_session
from ._unit import Unit

Granularity = str | Callable[[str, nn.Parameter], str | None]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's mixed precision policy, with the same fields.

    ``param_dtype``: dtype of the gathered parameters (the all-gather casts
    the fp32 shards to it) and of forward / backward; None keeps the
    parameters' dtype. ``reduce_dtype``: dbuf always reduces in fp32 (ranks
    summed in rank order), whatever this says; accepted for compatibility.
    ``output_dtype``: cast floating-point forward outputs to it.
    ``cast_forward_inputs``: cast floating-point forward inputs to param_dtype.
    A ``torch.distributed.fsdp.MixedPrecisionPolicy`` is accepted too.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


class DBufModule:
    """What ``fully_shard`` mixes into a module's class (like FSDP2's ``FSDPModule``)."""

    _dbuf_unit: Unit

    @property
    def dbuf_unit(self) -> Unit:
        return self._dbuf_unit

    def unshard(self, async_op: bool = False):
        """Gathers the unit's parameters now (collective). With async_op, returns a handle to wait on."""
        unit = self._dbuf_unit
        unit.start_gather(required=True)
        if async_op:
            return _UnshardHandle(unit)
        unit.unshard()
        return None

    def reshard(self) -> None:
        """Gives the unit's unsharded slot back."""
        self._dbuf_unit.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward keeps accumulating unsharded gradients in the slots, without communication.

        The slots stay held until a backward with sync reduces them, so the
        pool must hold every such unit (dbuf.torch.init(prefetch_depth=...)).
        Accumulation is in the gradients' dtype (param_dtype), as FSDP2 with
        reduce_dtype=None; with sync every micro-batch, dbuf accumulates the
        reduced gradients in fp32 instead.
        """
        for unit in _units_of(self, recurse):
            unit.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Whether forward gives the slot back (then backward gathers again), as fully_shard's argument."""
        for unit in _units_of(self, recurse):
            unit.reshard_after_forward = reshard_after_forward

    def set_modules_to_forward_prefetch(self, modules: list[DBufModule]) -> None:
        """Units to gather when this one's forward starts (default: the next one in the order recorded)."""
        self._dbuf_unit.forward_prefetch = [m._dbuf_unit for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[DBufModule]) -> None:
        """Units to gather when this one's backward starts (default: the next one backward runs)."""
        self._dbuf_unit.backward_prefetch = [m._dbuf_unit for m in modules]


class _UnshardHandle:
    def __init__(self, unit: Unit) -> None:
        self._unit = unit

    def wait(self) -> None:
        self._unit.unshard()


def _units_of(module: nn.Module, recurse: bool) -> list[Unit]:
    if not recurse:
        return [module._dbuf_unit]
    units: list[Unit] = []
    for sub in module.modules():
        unit = getattr(sub, "_dbuf_unit", None)
        if unit is not None and unit not in units:
            units.append(unit)
    return units


_dbuf_classes: dict[type, type] = {}


def _mix_in(module: nn.Module) -> None:
    cls = type(module)
    if isinstance(module, DBufModule):
        return
    mixed = _dbuf_classes.get(cls)
    if mixed is None:
        mixed = type(f"DBuf{cls.__name__}", (DBufModule, cls), {})
        _dbuf_classes[cls] = mixed
    module.__class__ = mixed


# ---------------------------------------------------------------- hooks


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once that call's backward through the unit is done."""

    @staticmethod
    def forward(ctx, unit: Unit, *inputs: torch.Tensor):  # type: ignore[override]
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        unit = ctx.unit
        unit.routed_calls -= 1
        if unit.routed_calls == 0:  # every call's backward through the unit is done
            unit.reduce_gradients()
        return (None, *grads)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, value)


class _Hooks:
    """The hooks of one unit (see the module docstring).

    Iterations: the root is the first unit whose forward ran with no other
    unit's forward around it (FSDP2's lazy root), for good; each top-level
    forward of the root starts an iteration. The first iteration records the
    order units enter and leave forward, which prefetching follows.
    """

    def __init__(self, unit: Unit) -> None:
        self.unit = unit
        self.session: Session = unit.session

    # forward

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        unit, session = self.unit, self.session
        if session.forwards_running == 0:
            if session.root is None:
                session.root = unit
            if unit is session.root:
                self._start_iteration()
        first_call = not unit.forward_ran
        if not unit.inside:
            self._enter(first_call)
        if unit.cast_forward_inputs:
            args, kwargs = _cast(args, unit.param_dtype), _cast(kwargs, unit.param_dtype)
        if torch.is_grad_enabled():
            args, kwargs = self._route_through_post_backward(args, kwargs)
        return args, kwargs

    def _start_iteration(self) -> None:
        session = self.session
        if session.in_backward:
            _recover_from_an_unfinished_backward(session)
        if session.forward_order:
            session.order_recorded = True  # the first iteration's
        for unit in session.units:
            unit.forward_ran = False

    def _enter(self, first_call: bool) -> None:
        unit, session = self.unit, self.session
        unit.inside = True
        unit.forward_ran = True
        session.forwards_running += 1
        unit.unshard()
        unit.use_unsharded()
        if first_call:
            if not session.order_recorded and unit not in session.forward_order:
                session.forward_order.append(unit)
            self._prefetch(unit.forward_prefetch, session.forward_order)

    def post_forward(self, module: nn.Module, args: tuple, output: Any):
        # Registered with always_call: runs when the forward raised too (then
        # output is None and an exception is being handled), so that a
        # caught error leaves the unit resharded and the counts right.
        unit, session = self.unit, self.session
        if not unit.inside:
            return output  # its pre-hook failed before entering
        unit.modules_done.add(id(module))
        failed = sys.exc_info()[1] is not None and output is None
        if len(unit.modules_done) < len(unit.modules) and not failed:
            return output  # a grouped unit: the others' forwards are still to come
        unit.modules_done = set()
        unit.inside = False
        session.forwards_running -= 1
        unit.use_sharded()
        if not session.order_recorded and unit not in session.post_forward_order:
            session.post_forward_order.append(unit)
        grad = torch.is_grad_enabled()
        if (failed or not grad or self._reshard_after_forward()) and not unit.holding_grads:
            unit.reshard()
        if grad and not failed:
            self._hook_outputs(output)
        if session.forwards_running == 0:
            if failed:
                # No backward will come for a forward that raised: its
                # calls no longer count for the next backward's reductions.
                for routed in session.pass_routes:
                    routed.routed_calls -= 1
            session.pass_routes.clear()
        if unit.output_dtype is not None and not failed:
            output = _cast(output, unit.output_dtype)
        return output

    def _reshard_after_forward(self) -> bool:
        value = self.unit.reshard_after_forward
        if value is None:
            # FSDP2's heuristic: the root's parameters would be gathered again
            # at once for backward, so it keeps them.
            return self.unit is not self.session.root
        return bool(value)

    def _route_through_post_backward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        flat, spec = tree_flatten((args, kwargs))
        positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not positions:
            return args, kwargs  # no gradient reaches this call's inputs: the end of backward reduces
        self.unit.routed_calls += 1
        self.session.pass_routes.append(self.unit)
        routed = _PostBackward.apply(self.unit, *(flat[i] for i in positions))
        for i, tensor in zip(positions, routed):
            flat[i] = tensor
        return spec.unflatten(flat)

    def _hook_outputs(self, output: Any) -> None:
        flat, _ = tree_flatten(output)
        for tensor in flat:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(self._pre_backward)

    # backward

    def _pre_backward(self, grad: torch.Tensor) -> None:
        unit, session = self.unit, self.session
        task = torch._C._current_graph_task_id()
        if session.backward_task != task:
            # The first unit of this backward (the engine's graph task): the
            # end-of-backward callback, once per backward.
            if session.in_backward:
                _recover_from_an_unfinished_backward(session)
            session.in_backward = True
            session.backward_task = task
            session.order_recorded = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if unit.pre_backward_done:
            return
        unit.pre_backward_done = True
        unit.unshard()
        unit.prepare_gradients()
        self._prefetch(unit.backward_prefetch, list(reversed(session.post_forward_order)))

    def _end_of_backward(self) -> None:
        session = self.session
        steps = [
            *(unit.reduce_gradients for unit in reversed(session.post_forward_order) if unit.pre_backward_done),
            *(unit.finish_backward for unit in session.units),
        ]
        try:
            _run_all(steps)
            _run_all([unit.reshard for unit in list(session.slot_holders) if not unit.holding_grads])
            session.collect()
        finally:
            session.in_backward = False
            session.backward_task = None

    def _prefetch(self, explicit: list[Unit] | None, order: list[Unit]) -> None:
        """Starts gathering the unit after this one in `order` (or the explicit ones), if a slot is free."""
        if explicit is not None:
            targets = explicit
        else:
            try:
                position = order.index(self.unit)
            except ValueError:
                return
            targets = order[position + 1 : position + 2]
        for target in targets:
            target.start_gather(required=False)


def _run_all(steps: list[Callable[[], None]]) -> None:
    """Runs every step even when some raise (each unit's state must be reset); raises the first error."""
    first: BaseException | None = None
    for step in steps:
        try:
            step()
        except BaseException as error:  # noqa: BLE001 - re-raised below
            first = first or error
    if first is not None:
        raise first


def _recover_from_an_unfinished_backward(session: Session) -> None:
    """A backward raised before its end (its callback never ran): drop its gradients, give the slots back."""
    warnings.warn(
        "dbuf.torch: the previous backward did not finish (it raised); its gradients are dropped", stacklevel=3
    )
    for unit in session.units:
        unit.abandon_backward()
    session.in_backward = False
    session.backward_task = None


# ---------------------------------------------------------------- fully_shard


def _managed_parameters(
    modules: list[nn.Module], ignored: set[nn.Parameter], session: Session
) -> list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]]:
    """The parameters a new unit of `modules` takes: not ignored, not already a unit's.

    Each comes with every (module, attribute) that holds it (tied weights),
    named by its first path from the first module. A parameter an earlier
    unit took, still held by a module here (weights tied across units), is
    an error, as in FSDP2: two units would keep two copies that drift apart.
    """
    found: dict[int, tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    for position, root in enumerate(modules):
        prefix = "" if len(modules) == 1 else f"{position}."
        for module_name, module in root.named_modules(remove_duplicate=False):
            for name, param in list(module._parameters.items()):
                if param is None or param in ignored:
                    continue
                if isinstance(param, RaggedDTensor):
                    continue  # a unit of a submodule has it
                fqn = prefix + (f"{module_name}.{name}" if module_name else name)
                taken_by = session.unit_holding(param)
                if taken_by is not None:
                    raise ValueError(
                        f"parameter {fqn} is shared with unit {taken_by.label}, which already shards it: put the "
                        f"modules that share it in one unit (fully_shard their common parent, or a list of them)"
                    )
                if id(param) in found:
                    found[id(param)][2].append((module, name))
                else:
                    found[id(param)] = (fqn, param, [(module, name)])
    return list(found.values())


def _label(modules: list[nn.Module]) -> str:
    return "+".join(type(m).__name__ for m in modules)


@overload
def fully_shard(module: nn.Module, **kwargs: Any) -> nn.Module: ...
@overload
def fully_shard(module: list[nn.Module], **kwargs: Any) -> list[nn.Module]: ...


def fully_shard(
    module,
    *,
    reshard_after_forward: bool | None = None,
    mp_policy: Any = MixedPrecisionPolicy(),
    granularity: Granularity = "element",
    ignored_params: set[nn.Parameter] | None = None,
    session: Session | None = None,
    mesh: Any = None,
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

    Args:
        module: a module, or a list of modules forming one unit (FSDP2's
            grouped form).
        reshard_after_forward: give the slot back after forward and gather
            again in backward (None: True except for the root unit, the first
            whose forward runs, as in FSDP2).
        mp_policy: a :class:`MixedPrecisionPolicy` (or FSDP2's).
        granularity: RaggedShard rule for the unit's 2D+ tensors ('element',
            'rows:R', 'block:RxC', 'matrix' or an element count), or a
            function (fqn, parameter) -> rule or None (the default rule) for
            each tensor's own.
        ignored_params: parameters to leave alone (not sharded).
        session: the dbuf.torch session (default: :func:`dbuf.torch.init`'s,
            made from torchrun's environment on first use).
        mesh: FSDP2's device mesh; only None is supported (the job is the mesh).

    Returns:
        The module (its class now also derives from :class:`DBufModule`), or the list.
    """
    if mesh is not None:
        raise NotImplementedError("dbuf.torch.fully_shard: the job's ranks are the mesh; pass mesh=None")
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard needs at least one module")
    for m in modules:
        if getattr(m, "_dbuf_unit", None) is not None:
            raise ValueError(f"{type(m).__name__} is already a dbuf unit")
    session = session if session is not None else default_session()
    params = _managed_parameters(modules, set(ignored_params or ()), session)
    rules: dict[str, str] = {}
    default_rule = granularity if isinstance(granularity, str) else "element"
    if callable(granularity):
        for fqn, param, _ in params:
            rule = granularity(fqn, param)
            if rule is not None:
                rules[fqn] = rule
    unit = Unit(
        session,
        modules,
        params,
        granularity=default_rule,
        tensor_granularity=rules,
        param_dtype=getattr(mp_policy, "param_dtype", None),
        reshard_after_forward=reshard_after_forward,
        output_dtype=getattr(mp_policy, "output_dtype", None),
        cast_forward_inputs=bool(getattr(mp_policy, "cast_forward_inputs", True)),
        label=_label(modules),
    )
    session.units.append(unit)
    for _, param, _ in params:
        session.claim(param, unit)
    hooks = _Hooks(unit)
    for m in modules:
        m._dbuf_unit = unit
        m.register_forward_pre_hook(hooks.pre_forward, prepend=True, with_kwargs=True)
        m.register_forward_hook(hooks.post_forward, always_call=True)
        _mix_in(m)
    return modules if isinstance(module, (list, tuple)) else module



def units(module: nn.Module) -> Iterable[Unit]:
    """The dbuf units under `module`, in the order they were made."""
    return _units_of(module, recurse=True)
