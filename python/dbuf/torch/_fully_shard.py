"""``dbuf.torch.fully_shard``: PyTorch FSDP2's ``fully_shard``, backed by dbufd groups.

Named and shaped after ``torch.distributed.fsdp.fully_shard`` wherever the
meaning is the same (its every argument; the modules are ``FSDPModule`` s), so
a training script moves over by the switch of switch.py or a change of import.
Each call makes one unit = one dbuf group registered by every rank; the
daemon's planner places it (RaggedShard: no split blocks, minimal padding).

The hooks, per unit (the order every rank follows, so the collectives match),
run around the module's call (DBufModule.__call__, outside torch.compile):
  forward pre-hook   gather (or wait for the prefetch), swap the unsharded
                     parameters in, prefetch the next unit, cast inputs, and
                     route the inputs through a function whose backward marks
                     the end of this unit's backward;
  forward hook       hook the outputs; once the unit's forward is over, swap
                     the sharded parameters back and reshard (unless the unit
                     keeps its parameters for backward);
  pre-backward       (the outputs' gradients are ready) gather again, put the
                     unsharded parameters on the modules (activation
                     checkpointing recomputes with them), point their .grad
                     into the slot, prefetch the unit backward runs next;
  recompute          a forward inside backward (activation checkpointing):
                     uses the unit's gathered parameters (see _pre_recompute);
  post-backward      reduce-scatter (avg, fp32) into the sharded gradients, or
                     set the unsharded ones aside (no sync);
  end of backward    (a callback of the autograd engine) for the units this
                     backward reached: those whose post-backward did not run,
                     the waits, the reshards, and the sharded gradients set on
                     the sharded parameters.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, overload

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy
from torch.distributed.tensor import Shard
from torch.utils._pytree import tree_flatten, tree_map

from ._dtensor import RaggedDTensor
from ._session import Session, default_session, init_replica, is_initialized
from ._unit import Reduction, Unit

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


class DBufModule(FSDPModule):
    """What ``fully_shard`` mixes into a module's class: torch's ``FSDPModule``, on dbufd.

    ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` holds, so code that
    looks for FSDP2's modules finds dbuf's. Every public method of torch
    2.15's ``FSDPModule`` is here with its meaning, or raises
    ``NotImplementedError`` saying what dbuf cannot do (docs/python.md, the
    parity table); the comm tuning knobs that only choose FSDP2's buffers and
    streams are accepted and change nothing, since dbufd owns those.
    """

    _dbuf_unit: Unit
    _dbuf_hooks: _Hooks
    # [DBuf<Orig>, DBufModule, FSDPModule, Orig, ...]: FSDPModule.__new__ builds Orig (container indexing).
    _orig_cls_mro_index = 3

    @property
    def dbuf_unit(self) -> Unit:
        return self._dbuf_unit

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The unit's hooks around the module's call, outside what torch.compile compiles of it.

        ``block.compile()`` compiles the module's ``_call_impl`` (its registered
        hooks included) and torch.compile of a whole model traces into each
        module's call: the hooks' collectives and parameter swaps are not graph
        operations, so they run here, eagerly (dynamo breaks the graph at them),
        as FSDP2's hooks do. Like a forward pre-hook registered first and a
        forward hook with ``always_call``, around every other hook.
        """
        hooks = self._dbuf_hooks
        args, kwargs = hooks.eager_pre_forward(self, args, kwargs)
        try:
            output = super().__call__(*args, **kwargs)
        except BaseException:
            hooks.eager_post_forward(self, args, None)  # sees the exception being handled
            raise
        return hooks.eager_post_forward(self, args, output)

    def _get_fsdp_state(self) -> _Hooks:
        """The unit's hooks: torch's ``register_fsdp_forward_method`` calls their ``_pre_forward`` / ``_post_forward``."""
        return self._dbuf_hooks

    # ------------------------------------------------------------ unshard / reshard

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

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """dbufd's unsharded slots keep one address for the group's life: kept already, nothing to set."""

    def reset_iter_state(self) -> None:
        """After a forward or backward that raised: gradients of the failed iteration dropped, every unit resharded."""
        _reset_iteration(self._dbuf_unit.session)

    # ------------------------------------------------------------ backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward reduces nothing; the unsharded gradients are summed, in fp32, outside the slots.

        The parameters are resharded as usual and only the unsharded
        gradients are kept, as FSDP2 keeps them; the first backward with sync
        adds them to its own and reduce-scatters the sum.
        """
        for unit in _units_of(self, recurse):
            unit.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP's sum across the replicas runs with every reduction; without replicas there is none to skip."""
        if not requires_all_reduce and self._dbuf_unit.session.replicas > 1:
            raise NotImplementedError(
                "dbuf.torch sums across HSDP's replicas with every reduce-scatter; to accumulate without "
                "communication use set_requires_gradient_sync(False)"
            )

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Every dbuf backward waits for its reductions at its end already: nothing to change."""

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        if enabled:
            raise NotImplementedError(
                "dbuf.torch finalizes every backward itself (an autograd engine callback at its end); several "
                "backward calls into one unit reduce-scatter and accumulate each call's gradients instead"
            )

    def finalize_backward(self, *, async_op: bool = False):
        raise NotImplementedError("dbuf.torch finalizes every backward itself (see set_manual_backward_finalization)")

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Whether forward gives the slot back (then backward gathers again), as fully_shard's argument."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for unit in _units_of(self, recurse):
            unit.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False: the unit keeps its slot (its gathered parameters) after backward, for the next forward."""
        for unit in _units_of(self, recurse):
            unit.reshard_after_backward = reshard_after_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        if not unshard_in_backward:
            raise NotImplementedError(
                "dbuf.torch: a unit's gradients land in its unsharded slot, which backward takes by gathering; "
                "skipping the gather in backward is not supported"
            )

    def set_modules_to_forward_prefetch(self, modules: list[DBufModule]) -> None:
        """Units to gather when this one's forward starts (default: the next one in the order recorded)."""
        self._dbuf_unit.forward_prefetch = [m._dbuf_unit for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[DBufModule]) -> None:
        """Units to gather when this one's backward starts (default: the next one backward runs)."""
        self._dbuf_unit.backward_prefetch = [m._dbuf_unit for m in modules]

    # ------------------------------------------------------------ gradient reduction

    def set_gradient_divide_factor(self, factor: float) -> None:
        """The reduced gradient is the ranks' sum divided by `factor` (default: the world size, the average)."""
        if not factor > 0:
            raise ValueError(f"the gradient divide factor must be positive, got {factor}")
        self._dbuf_unit.reduction.divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """The former name of :meth:`set_gradient_divide_factor`."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated, use set_gradient_divide_factor",
                      FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """True: dbufd sums and the division by the factor (or the world size) runs after it, here."""
        self._dbuf_unit.reduction.force_sum = bool(enable)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """dbuf reduce-scatters every parameter of a unit (zeros where a rank's backward gave it none): always
        the behaviour of True."""

    def set_custom_all_gather(self, comm: Any) -> None:
        raise NotImplementedError("dbufd runs the all-gather into the unit's slot; a custom one cannot replace it")

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        raise NotImplementedError("dbufd runs the reduce-scatter from the unit's slot; a custom one cannot replace it")

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        raise NotImplementedError("dbuf.torch has no all-reduce after its reduce-scatter to hook (a 1-D job)")

    def set_post_optim_event(self, event: torch.Event) -> None:
        """GPU: the next all-gathers wait for `event` (the optimizer's step) instead of the whole current stream."""
        self._dbuf_unit.session.post_optim_event = event

    # Knobs choosing FSDP2's own staging buffers, streams and groups: dbufd owns those; accepted, nothing to set.
    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """dbufd owns the reduce-scatter's buffers: nothing to set."""

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """dbufd runs its collectives on its own communicators: nothing to set."""

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """dbufd's slots are its own memory: nothing to set."""

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """dbufd's slots are its own memory: nothing to set."""

    # ------------------------------------------------------------ module conversions

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``to_empty`` / ``.to`` / ``.cpu``: the parameters stay in dbufd's memory (Unit.adopt_applied)."""
        unit = self._dbuf_unit
        if unit.inside:
            raise RuntimeError(f"unit {unit.label}: {type(self).__name__} converted during its own forward")
        grads = unit.sharded_grads()
        converted = super(FSDPModule, self)._apply(fn, recurse)  # the module's own, not FSDP2's
        unit.adopt_applied(grads)
        return converted

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
        # What DBufModule.__call__ runs: never traced by torch.compile (see there).
        self.eager_pre_forward = torch._dynamo.disable(self.pre_forward, recursive=True,
                                                       reason="dbuf.torch's FSDP hooks")
        self.eager_post_forward = torch._dynamo.disable(self.post_forward, recursive=True,
                                                        reason="dbuf.torch's FSDP hooks")

    # forward

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        unit, session = self.unit, self.session
        if _in_backward():
            return self._pre_recompute(args, kwargs)
        if session.forwards_running == 0:
            if session.root is None:
                session.root = unit
            if unit is session.root:
                self._start_iteration()
        first_call = not unit.forward_ran
        if not unit.inside:
            self._enter(first_call)
        session.forwards_running += 1
        if unit.cast_forward_inputs:
            args, kwargs = _cast(args, unit.param_dtype), _cast(kwargs, unit.param_dtype)
        if torch.is_grad_enabled():
            args, kwargs = self._route_through_post_backward(args, kwargs)
        return args, kwargs

    # torch's register_fsdp_forward_method calls the state's hooks by these names.
    _pre_forward = pre_forward

    def _pre_recompute(self, args: tuple, kwargs: dict):
        """The unit's forward run again inside backward: activation checkpointing's recompute.

        The recompute must see the gathered parameters: they are gathered
        once for the unit's backward (here, or by its pre-backward hook
        already) and stay on the modules until its gradients are reduced.
        Non-reentrant checkpointing recomputes after the unit's pre-backward
        (its outputs' gradients are there): the recomputed graph only yields
        saved tensors, so nothing is routed or hooked. Reentrant
        checkpointing ran the forward without grad and now runs a backward of
        its own through this recompute: the unit's backward happens there,
        routed and hooked as a forward would be.
        """
        unit, session = self.unit, self.session
        _begin_backward(session)
        reentrant = not unit.pre_backward_done and torch.is_grad_enabled()
        unit.recomputing = True
        unit.unshard()
        unit.use_unsharded()
        unit.prepare_gradients()
        if unit.cast_forward_inputs:
            args, kwargs = _cast(args, unit.param_dtype), _cast(kwargs, unit.param_dtype)
        if reentrant:
            args, kwargs = self._route_through_post_backward(args, kwargs, count_in_pass=False)
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
        unit.unshard()
        unit.use_unsharded()
        unit.inside = True
        unit.forward_ran = True
        if first_call:
            if not session.order_recorded and unit not in session.forward_order:
                session.forward_order.append(unit)
            self._prefetch(unit.forward_prefetch, session.forward_order)

    def post_forward(self, module: nn.Module, args: tuple, output: Any):
        # Runs when the forward raised too (then output is None and an
        # exception is being handled), so that a caught error leaves the unit
        # resharded and the counts right.
        unit, session = self.unit, self.session
        if unit.recomputing and _in_backward():
            return self._post_recompute(output)
        session.forwards_running -= 1
        unit.modules_done.add(id(module))
        failed = sys.exc_info()[1] is not None and output is None
        grad = torch.is_grad_enabled()
        if grad and not failed:
            self._hook_outputs(output)
        if failed or len(unit.modules_done) == len(unit.modules):
            _leave(unit, failed)
        # (else a grouped unit whose other modules are still to run)
        if session.forwards_running == 0:
            # The top-level call returns: a grouped unit some of whose modules
            # did not run in it (torchtitan's [norm, lm_head] with lm_head
            # applied by the loss) is done with this forward too.
            for pending in [u for u in session.units if u.inside]:
                _leave(pending, failed)
            if failed:
                # No backward will come for a forward that raised: its
                # calls no longer count for the next backward's reductions.
                for routed in session.pass_routes:
                    routed.routed_calls -= 1
            session.pass_routes.clear()
        if unit.output_dtype is not None and not failed:
            output = _cast(output, unit.output_dtype)
        return output

    _post_forward = post_forward

    def _post_recompute(self, output: Any):
        """After a recompute (see _pre_recompute); also when checkpointing stopped it early by raising."""
        unit = self.unit
        failed = sys.exc_info()[1] is not None and output is None
        if failed:
            return output
        if not unit.pre_backward_done and torch.is_grad_enabled():
            self._hook_outputs(output)  # reentrant: its own backward follows
        if unit.output_dtype is not None:
            output = _cast(output, unit.output_dtype)
        return output

    def _route_through_post_backward(
        self, args: tuple, kwargs: dict, *, count_in_pass: bool = True
    ) -> tuple[tuple, dict]:
        flat, spec = tree_flatten((args, kwargs))
        positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not positions:
            return args, kwargs  # no gradient reaches this call's inputs: the end of backward reduces
        self.unit.routed_calls += 1
        if count_in_pass:
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
        if session.in_backward and session.backward_task != task and not unit.recomputing:
            # A new backward while the last one never reached its end: it raised.
            _recover_from_an_unfinished_backward(session)
        # (A unit recomputed by reentrant checkpointing runs its backward in a task nested in the
        # one that began this backward: that one's end finishes both.)
        _begin_backward(session)
        if unit.pre_backward_done:
            return
        unit.pre_backward_done = True
        unit.unshard()
        unit.use_unsharded()  # activation checkpointing recomputes with what the modules hold
        unit.prepare_gradients()
        self._prefetch(unit.backward_prefetch, list(reversed(session.post_forward_order)))

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


def _leave(unit: Unit, failed: bool) -> None:
    """The unit's forward is over: sharded parameters back on the modules, the slot given back unless kept."""
    session = unit.session
    unit.modules_done = set()
    unit.inside = False
    unit.use_sharded()
    if not session.order_recorded and unit not in session.post_forward_order:
        session.post_forward_order.append(unit)
    if failed or not torch.is_grad_enabled() or _reshards_after_forward(unit):
        unit.reshard()


def _reshards_after_forward(unit: Unit) -> bool:
    if unit.reshard_after_forward is None:
        # FSDP2's heuristic: the root's parameters would be gathered again
        # at once for backward, so it keeps them.
        return unit is not unit.session.root
    return bool(unit.reshard_after_forward)


def _begin_backward(session: Session) -> None:
    """The first unit of a backward: the end-of-backward callback, once per backward (on the engine's graph task)."""
    if session.in_backward:
        return
    session.in_backward = True
    session.backward_task = torch._C._current_graph_task_id()
    session.order_recorded = True
    torch.autograd.Variable._execution_engine.queue_callback(lambda: _end_of_backward(session))


def _end_of_backward(session: Session) -> None:
    """Reduces what no post-backward reduced, waits, sets the sharded gradients, gives the slots back."""
    # Only the units this backward reached: the others' forwards still wait for a backward of their own
    # (torchtitan's chunked loss runs lm_head's backward per chunk before the decoder's).
    reached = [unit for unit in session.units if unit.in_this_backward]
    # In backward's order where the first iteration recorded it; units made since, after those.
    order = [*reversed(session.post_forward_order), *(u for u in reached if u not in session.post_forward_order)]
    steps = [
        *(unit.reduce_gradients for unit in order if unit.pre_backward_done),
        *(unit.finish_backward for unit in reached),
    ]
    try:
        _run_all(steps)
        _run_all([unit.reshard for unit in list(session.slot_holders) if unit.reshard_after_backward])
        session.collect()
    finally:
        session.in_backward, session.backward_task = False, None


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (a forward now is a recompute)."""
    return torch._C._current_graph_task_id() != -1


def _recover_from_an_unfinished_backward(session: Session) -> None:
    """A backward raised before its end (its callback never ran): drop its gradients, give the slots back."""
    warnings.warn(
        "dbuf.torch: the previous backward did not finish (it raised); its gradients are dropped", stacklevel=3
    )
    _reset_iteration(session)


def _reset_iteration(session: Session) -> None:
    """Every unit out of its forward / backward: gradients in flight dropped, slots given back, passes reset."""
    for unit in session.units:
        if unit.inside:
            unit.inside = False
            unit.use_sharded()
    session.forwards_running = 0
    session.pass_routes.clear()
    try:
        _run_all([unit.abandon_backward for unit in session.units])
    finally:
        session.in_backward, session.backward_task = False, None


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
        mesh: a 1-D DeviceMesh over the job's ranks (None: the session's).
            The parameters' DTensors live on it.
        reshard_after_forward: give the slot back after forward and gather
            again in backward (None: True except for the root unit, the first
            whose forward runs, as in FSDP2). An int is FSDP2's group size to
            reshard to: the world size means True, 1 means False, others are
            refused (dbufd gathers over the whole job).
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
        if getattr(m, "_dbuf_unit", None) is not None:
            raise ValueError(f"{type(m).__name__} is already a dbuf unit")
    if dp_mesh_dims is not None:
        raise NotImplementedError("dbuf.torch.fully_shard shards over a 1-D mesh of the job's ranks; dp_mesh_dims "
                                  "(data-parallel dims of a larger mesh) is not supported")
    session = _session_for(mesh, session)
    _check_offload(session, offload_policy)
    reshard_after_forward = _reshard_after_forward_of(reshard_after_forward, session.world_size)
    params = _managed_parameters(modules, set(ignored_params or ()), session)
    default_rule = granularity if isinstance(granularity, str) else "element"
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
    )
    session.units.append(unit)
    for _, param, _ in params:
        session.claim(param, unit)
    hooks = _Hooks(unit)
    for m in modules:
        m._dbuf_unit = unit
        m._dbuf_hooks = hooks
        _mix_in(m)
    return modules if isinstance(module, (list, tuple)) else module


def _session_for(mesh: DeviceMesh | None, session: Session | None) -> Session:
    """The session a unit on `mesh` belongs to, the mesh checked and adopted.

    None: the session's own mesh. 1-D: over the job's ranks, in order. 2-D:
    HSDP's (replicate, shard): the job is this replica's shard group; the
    first fully_shard on it makes the default session for that replica.
    """
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard's mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh is not None and mesh.ndim == 2:
        if session is None:
            replica, shard = mesh.get_coordinate()
            replicas, shards = mesh.shape
            session = default_session() if is_initialized() else init_replica(replica, replicas, shard, shards)
        session.adopt_hsdp_mesh(mesh)
        return session
    session = session if session is not None else default_session()
    if mesh is None:
        return session
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"dbuf.torch.fully_shard takes a 1-D mesh over the job's ranks or HSDP's 2-D (replicate, shard) mesh; "
            f"got a {mesh.ndim}-D mesh {tuple(mesh.shape)} (TP / EP meshes are not supported yet)"
        )
    ranks = mesh.mesh.flatten().tolist()
    if ranks != list(range(session.world_size)) or mesh.get_local_rank() != session.rank:
        raise ValueError(
            f"fully_shard's mesh must hold the dbuf job's ranks 0..{session.world_size - 1} in order (this is "
            f"rank {session.rank}); got ranks {ranks}"
        )
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


def _reshard_after_forward_of(value: bool | int | None, world_size: int) -> bool | None:
    """FSDP2's int form (the group size to reshard to): world size = True, 1 = False, others refused."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise ValueError(f"reshard_after_forward should be a bool or an int, not {value!r}")
    if value == world_size:
        return True
    if value == 1:
        return False
    raise NotImplementedError(
        f"reshard_after_forward={value}: dbufd gathers over the whole job ({world_size} ranks) and cannot keep a "
        f"copy resharded to {value} ranks after forward; pass True (reshard to {world_size}) or False (keep)"
    )


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
        raise ValueError(f"shard_placement_fn returned {placement!r} for {fqn}, a {param.dim()}-D tensor")
    stride = math.prod(param.shape[dim + 1 :])
    return "element" if stride == 1 else str(stride)


def units(module: nn.Module) -> Iterable[Unit]:
    """The dbuf units under `module`, in the order they were made."""
    return _units_of(module, recurse=True)
