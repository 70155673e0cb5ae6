"""The hooks of a dbuf.torch unit: what runs around its forward and backward.

Per unit (the order every rank follows, so the collectives match), around the
module's call (DBufModule.__call__, outside torch.compile):
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

import sys
import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_is_leaf, tree_map

from ._session import PassState, RootOrder
from ._unit import Unit

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
        if unit.routed_calls == 0 and not unit.unrouted_call:  # every call's backward through the unit is done
            unit.reduce_gradients()
        return (None, *grads)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, value)


class Hooks:
    """The hooks of one unit (see the module docstring).

    Iterations: a model's root is the first of its units whose forward ran
    with no other unit's forward around it (FSDP2's lazy root), for good; the
    units under it are its model's. Each model (each top-level module sharded,
    as in FSDP2) has its root; each top-level forward of a root starts an
    iteration of its model. The first iteration records the order its units
    enter and leave forward, which prefetching follows.
    """

    def __init__(self, unit: Unit) -> None:
        self.unit = unit
        self.passes: PassState = unit.session.passes
        # What DBufModule.__call__ runs: never traced by torch.compile (see there).
        self.eager_pre_forward = torch._dynamo.disable(self.pre_forward, recursive=True,
                                                       reason="dbuf.torch's FSDP hooks")
        self.eager_post_forward = torch._dynamo.disable(self.post_forward, recursive=True,
                                                        reason="dbuf.torch's FSDP hooks")

    # forward

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        unit, passes = self.unit, self.passes
        if _in_backward():
            return self._pre_recompute(args, kwargs)
        if passes.forwards_running == 0:
            _refuse_what_fsdp2_refuses_at_its_lazy_init(module, passes)
            if unit.root is None:
                _become_root(unit, passes)
            passes.running_root = unit.root
            if unit.root is unit:
                self._start_iteration()
        elif unit.root is None:
            # Called inside a model's forward without being under its root module (a unit the forward reaches
            # through an attribute of another object): that model's, its order and prefetching among its units.
            unit.root = passes.running_root
        first_call = not unit.forward_ran
        if not unit.inside:
            self._enter(first_call)
        passes.forwards_running += 1
        if unit.cast_forward_inputs:
            args, kwargs = _cast(args, unit.param_dtype), _cast(kwargs, unit.param_dtype)
        if torch.is_grad_enabled():
            args, kwargs = self._route_through_post_backward(args, kwargs)
        return args, kwargs

    # torch's register_fsdp_forward_method calls the state's hooks by these names.
    _pre_forward = pre_forward

    def _lazy_init(self) -> None:
        """FSDP2's state method, which trainers call to settle the root before running a method other than forward:
        this unit becomes its model's root unless it is one's already (FSDP2's errors where FSDP2 raises)."""
        if self.unit.root is None:
            _become_root(self.unit, self.passes)

    @property
    def _is_root(self) -> bool | None:
        """FSDP2's: None before the model's first forward (or _lazy_init), then whether this unit is its root."""
        return None if self.unit.root is None else self.unit.root is self.unit

    def __getattr__(self, name: str):
        """What FSDP2's state (``FSDPModule._get_fsdp_state()``) has and dbuf's has not: an error that says so.

        Only reached for names Hooks lacks: torch code reading FSDP2's
        internal state (pipelining's schedules, the FSDP2 memory tracker)
        learns that it runs on dbuf, not merely that an attribute is missing.
        Still an AttributeError, so that ``hasattr`` and ``getattr(..., default)``
        behave as for any object.
        """
        unit = self.__dict__.get("unit")
        if name.startswith("__") or unit is None:
            raise AttributeError(name)
        raise AttributeError(
            f"{name!r}: this FSDP state is dbuf.torch's (unit {unit.label!r}, backed by dbufd), which "
            f"keeps none of FSDP2's internal fields; code that reads FSDP2's state (torch's pipelining schedules, "
            f"the FSDP2 memory tracker) does not run on dbuf units"
        )

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
        unit, passes = self.unit, self.passes
        _begin_backward(passes)
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
        root, passes = self.unit, self.passes
        if passes.in_backward:
            _recover_from_an_unfinished_backward(passes)
        if root.order.forward:
            root.order.recorded = True  # the first iteration's
        for unit in passes.units:
            if unit.root is root:
                unit.forward_ran = False

    def _enter(self, first_call: bool) -> None:
        unit = self.unit
        unit.unshard()
        unit.use_unsharded()
        unit.inside = True
        unit.forward_ran = True
        if first_call and unit.root is not None:
            order = unit.root.order
            if not order.recorded and unit not in order.forward:
                order.forward.append(unit)
            self._prefetch(unit.forward_prefetch, order.forward)

    def post_forward(self, module: nn.Module, args: tuple, output: Any):
        # Runs when the forward raised too (then output is None and an
        # exception is being handled), so that a caught error leaves the unit
        # resharded and the counts right.
        unit, passes = self.unit, self.passes
        if unit.recomputing and _in_backward():
            return self._post_recompute(output)
        passes.forwards_running -= 1
        unit.modules_done.add(id(module))
        failed = sys.exc_info()[1] is not None and output is None
        grad = torch.is_grad_enabled()
        if grad and not failed:
            self._hook_outputs(output)
        if failed or len(unit.modules_done) == len(unit.modules):
            _leave(unit, failed)
        # (else a grouped unit whose other modules are still to run)
        if passes.forwards_running == 0:
            # The top-level call returns: a grouped unit some of whose modules
            # did not run in it (torchtitan's [norm, lm_head] with lm_head
            # applied by the loss) is done with this forward too.
            for pending in [u for u in passes.units if u.inside]:
                _leave(pending, failed)
            if failed:
                # No backward will come for a forward that raised: its
                # calls no longer count for the next backward's reductions.
                for routed in passes.pass_routes:
                    routed.routed_calls -= 1
            passes.pass_routes.clear()
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
        places = _top_level_grad_inputs(args, kwargs)
        if places is None:  # one may sit inside a container: pytree's walk finds it
            flat, spec = tree_flatten((args, kwargs))
            positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            if self._count_routed_call(positions, count_in_pass):
                routed = _PostBackward.apply(self.unit, *(flat[i] for i in positions))
                for i, tensor in zip(positions, routed):
                    flat[i] = tensor
                args, kwargs = spec.unflatten(flat)
            return args, kwargs
        if self._count_routed_call(places, count_in_pass):
            routed_args, routed_kwargs = list(args), dict(kwargs)
            inputs = [args[place] if isinstance(place, int) else kwargs[place] for place in places]
            for place, tensor in zip(places, _PostBackward.apply(self.unit, *inputs)):
                if isinstance(place, int):
                    routed_args[place] = tensor
                else:
                    routed_kwargs[place] = tensor
            args, kwargs = tuple(routed_args), routed_kwargs
        return args, kwargs

    def _count_routed_call(self, grad_inputs: list, count_in_pass: bool) -> bool:
        """Counts a forward call whose inputs (some) need gradients; False (nothing to route) when none does."""
        if not grad_inputs:
            # No gradient reaches this call's inputs, so nothing tells when its backward is done (a grouped
            # unit's embedding, tied to its output layer, runs its backward after the output's): the end of
            # backward reduces the unit.
            self.unit.unrouted_call = True
            return False
        self.unit.routed_calls += 1
        if count_in_pass:
            self.passes.pass_routes.append(self.unit)
        return True

    def _hook_outputs(self, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            tensors: Any = (output,)
        elif type(output) in (tuple, list) and all(_is_tensor_or_plain(value) for value in output):
            tensors = output
        else:
            tensors, _ = tree_flatten(output)
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(self._pre_backward)

    # backward

    def _pre_backward(self, grad: torch.Tensor) -> None:
        unit, passes = self.unit, self.passes
        task = torch._C._current_graph_task_id()
        if passes.in_backward and passes.backward_task != task and not unit.recomputing:
            # A new backward while the last one never reached its end: it raised.
            _recover_from_an_unfinished_backward(passes)
        # (A unit recomputed by reentrant checkpointing runs its backward in a task nested in the
        # one that began this backward: that one's end finishes both.)
        _begin_backward(passes)
        if unit.pre_backward_done:
            return
        unit.pre_backward_done = True
        unit.unshard()
        unit.use_unsharded()  # activation checkpointing recomputes with what the modules hold
        unit.prepare_gradients()
        order = unit.root.order.post_forward if unit.root is not None else []
        self._prefetch(unit.backward_prefetch, list(reversed(order)))

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


# Types torch's pytree treats as leaves that never hold a tensor (the inputs' walk skips them at once).
_PLAIN_LEAVES = (type(None), bool, int, float, str)


def _is_tensor_or_plain(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or type(value) in _PLAIN_LEAVES


def _holds_no_grad_tensor(value: Any) -> bool:
    """True where `value` holds no tensor that requires a gradient, as torch's pytree walks it; False where it
    may hold one (or is a container other than tuple, list or dict: pytree's own walk decides)."""
    kind = type(value)
    if kind in _PLAIN_LEAVES:
        return True
    if isinstance(value, torch.Tensor):
        return not value.requires_grad
    if kind is tuple or kind is list:
        return all(_holds_no_grad_tensor(item) for item in value)
    if kind is dict:
        return all(_holds_no_grad_tensor(item) for item in value.values())
    return tree_is_leaf(value)  # an object pytree does not descend into: nothing of it is routed


def _top_level_grad_inputs(args: tuple, kwargs: dict) -> list[int | str] | None:
    """The forward inputs that are tensors requiring a gradient, in pytree's order: positions in `args` and
    keys of `kwargs`. None where such a tensor may sit inside a container (then pytree's walk finds it).

    The hooks run on every unit's forward: walking the inputs as pytree does
    (a TreeSpec for the call's arguments, then rebuilt) cost transformers'
    decoder layers 0.2 ms a call, where their gradient-carrying input is a
    tensor argument.
    """
    found: list[int | str] = []
    for position, value in enumerate(args):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            found.append(position)
        elif not _holds_no_grad_tensor(value):
            return None
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor) and value.requires_grad:
            found.append(key)
        elif not _holds_no_grad_tensor(value):
            return None
    return found


def _refuse_what_fsdp2_refuses_at_its_lazy_init(root: nn.Module, passes: PassState) -> None:
    """A model's first forward: FSDP2's errors for a unit fully_shard could not take whole (ValueError) and for
    parameters still on the meta device (RuntimeError, naming the first such unit's, from the root)."""
    if root in passes.checked_roots:
        return
    units = _units_under(root)
    for unit in units:
        if unit.refusal is not None:
            raise ValueError(unit.refusal)
    names = {id(param): name for name, param in root.named_parameters(remove_duplicate=False)}
    for unit in units:
        on_meta = [names.get(id(entry.sharded), entry.fqn) for entry in unit.entries if entry.sharded.is_meta]
        if on_meta:
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, but the following were "
                f"still on meta device: {on_meta}\nFor example, call module.to_empty(device) to materialize to device "
                "and call module.reset_parameters() on each module to initialize values."
            )
    passes.checked_roots.add(root)


def _units_under(module: nn.Module) -> list[Unit]:
    """The units of `module` and its submodules, in module order, each once."""
    found: dict[int, Unit] = {}
    for sub in module.modules():
        unit = getattr(sub, "_dbuf_unit", None)
        if unit is not None:
            found.setdefault(id(unit), unit)
    return list(found.values())


def _become_root(unit: Unit, passes: PassState) -> None:
    """The unit's forward is its model's first at the top level: FSDP2's lazy root, its model the units under it.

    A unit under it that became a root before (its forward ran first, at the
    top level), and a root of several modules, are FSDP2's RuntimeErrors.
    """
    if len(unit.modules) > 1:
        raise RuntimeError(f"FSDP requires a single root module but got {tuple(unit.modules)}")
    (module,) = unit.modules
    under = [other for other in _units_under(module) if other is not unit]
    for other in under:
        if other.root is other:
            names = {id(sub): name for name, sub in module.named_modules()}
            raise RuntimeError(
                f"FSDP state has already been lazily initialized for {names.get(id(other.modules[0]), other.label)}\n"
                f"FSDP requires running forward through the root module first"
            )
    unit.root, unit.order = unit, RootOrder()
    passes.roots.append(unit)
    for other in under:
        other.root = unit


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
    """The unit's forward is over: resharded (sharded parameters back on the modules) unless it keeps them.

    A unit that keeps its parameters for backward keeps the unsharded ones on
    its modules until then (or until ``reshard()``), as FSDP2 does.
    """
    unit.modules_done = set()
    unit.inside = False
    order = unit.root.order if unit.root is not None else None
    if order is not None and not order.recorded and unit not in order.post_forward:
        order.post_forward.append(unit)
    if failed or not torch.is_grad_enabled() or _reshards_after_forward(unit):
        unit.reshard()


def _reshards_after_forward(unit: Unit) -> bool:
    if unit.reshard_after_forward is None:
        # FSDP2's heuristic: the root's parameters would be gathered again
        # at once for backward, so it keeps them.
        return unit.root is not unit
    return bool(unit.reshard_after_forward)


def _begin_backward(passes: PassState) -> None:
    """The first unit of a backward: the end-of-backward callback, once per backward (on the engine's graph task)."""
    if passes.in_backward:
        return
    passes.in_backward = True
    passes.backward_task = torch._C._current_graph_task_id()
    for root in passes.roots:
        root.order.recorded = root.order.recorded or bool(root.order.forward)
    torch.autograd.Variable._execution_engine.queue_callback(lambda: _end_of_backward(passes))


def _end_of_backward(passes: PassState) -> None:
    """Reduces what no post-backward reduced, waits, sets the sharded gradients, gives the slots back."""
    # Only the units this backward reached: the others' forwards still wait for a backward of their own
    # (torchtitan's chunked loss runs lm_head's backward per chunk before the decoder's).
    reached = [unit for unit in passes.units if unit.in_this_backward]
    # In backward's order where each model's first iteration recorded it; units made since, after those.
    recorded = [unit for root in passes.roots for unit in reversed(root.order.post_forward)]
    seen = set(recorded)
    order = [*recorded, *(u for u in reached if u not in seen)]
    steps = [
        *(unit.reduce_gradients for unit in order if unit.pre_backward_done),
        *(unit.finish_backward for unit in reached),
    ]
    try:
        _run_all(steps)
        _run_all([unit.reshard for unit in passes.units if unit.holds_slot and unit.reshard_after_backward])
        for session in passes.sessions():
            session.collect()
    finally:
        passes.in_backward, passes.backward_task = False, None


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (a forward now is a recompute)."""
    return torch._C._current_graph_task_id() != -1


def _recover_from_an_unfinished_backward(passes: PassState) -> None:
    """A backward raised before its end (its callback never ran): drop its gradients, give the slots back."""
    warnings.warn(
        "dbuf.torch: the previous backward did not finish (it raised); its gradients are dropped", stacklevel=3
    )
    reset_iteration(passes)


def reset_iteration(passes: PassState) -> None:
    """Every unit out of its forward / backward: gradients in flight dropped, slots given back, passes reset."""
    for unit in passes.units:
        if unit.inside:
            unit.inside = False
            unit.use_sharded()
    passes.forwards_running = 0
    passes.pass_routes.clear()
    try:
        _run_all([unit.abandon_backward for unit in passes.units])
    finally:
        passes.in_backward, passes.backward_task = False, None


