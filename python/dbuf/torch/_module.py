"""``DBufModule``: what ``fully_shard`` mixes into a module's class, torch's ``FSDPModule`` on dbufd."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, UnshardHandle

from ._hooks import Hooks, reset_iteration
from ._unit import Unit


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
    _dbuf_hooks: Hooks
    # [FSDP<Orig>, DBufModule, FSDPModule, Orig, ...]: FSDPModule.__new__ builds Orig (container indexing).
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

    def _get_fsdp_state(self) -> Hooks:
        """The unit's hooks: torch's ``register_fsdp_forward_method`` calls their ``_pre_forward`` / ``_post_forward``."""
        return self._dbuf_hooks

    # ------------------------------------------------------------ unshard / reshard

    def unshard(self, async_op: bool = False):
        """Gathers the unit's parameters now (collective). With async_op, returns a handle to wait on.

        Once gathered (here, or at the handle's wait()), the unsharded
        parameters are the modules' until reshard(), as under FSDP2.
        """
        unit = self._dbuf_unit
        unit.start_gather(required=True)
        if async_op:
            return _UnshardHandle(unit)
        _gathered_on_the_modules(unit)
        return None

    def reshard(self) -> None:
        """The sharded parameters back on the modules; the unit's unsharded slot given back."""
        self._dbuf_unit.reshard()

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """dbufd's unsharded slots keep one address for the group's life: kept already, nothing to set."""

    def reset_iter_state(self) -> None:
        """After a forward or backward that raised: gradients of the failed iteration dropped, every unit resharded."""
        reset_iteration(self._dbuf_unit.session.passes)

    # ------------------------------------------------------------ backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward reduces nothing; the unsharded gradients are summed, in fp32, outside the slots.

        The parameters are resharded as usual and only the unsharded
        gradients are kept, as FSDP2 keeps them; the first backward with sync
        adds them to its own and reduce-scatters the sum.
        """
        for unit in units_of(self, recurse):
            unit.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP's sum across the replicas runs with every reduction; without replicas there is none to skip."""
        if not requires_all_reduce and self._dbuf_unit.replicas > 1:
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
        for unit in units_of(self, recurse):
            unit.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False: the unit keeps its slot (its gathered parameters) after backward, for the next forward."""
        for unit in units_of(self, recurse):
            unit.reshard_after_backward = reshard_after_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """FSDP2's hint that backward needs no gathered parameters (an embedding's): accepted, results unchanged.

        A unit's gradients land in its unsharded slot, so backward takes the
        slot all the same, and dbuf fills it: what FSDP2 saves by the hint
        (one all-gather of the unit per step) dbuf still spends.
        """
        if not isinstance(unshard_in_backward, bool):
            raise ValueError(f"unshard_in_backward should be a bool, got {type(unshard_in_backward)}")

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
        """True: parameters a backward did not reach get the reduced gradient too (zeros where no rank's
        backward reached them), as FSDP2 then reduce-scatters them; False (the default): they keep their .grad."""
        for unit in units_of(self, recurse):
            unit.reduce_unused_params = bool(reduce_scatter_unused_params)

    def set_custom_all_gather(self, comm: Any) -> None:
        raise NotImplementedError("dbufd runs the all-gather into the unit's slot; a custom one cannot replace it")

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        raise NotImplementedError("dbufd runs the reduce-scatter from the unit's slot; a custom one cannot replace it")

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """FSDP2's: ``hook(output)`` on this rank's reduced gradients of the unit (one flat tensor, changed in place),
        after HSDP's sum over the replicas where the unit has them: a trainer's own all-reduce over replica groups.
        ``stream``: where the hook runs (refused with native HSDP, as FSDP2 refuses it)."""
        unit = self._dbuf_unit
        if stream is not None and unit.replicas > 1:
            raise ValueError("stream cannot be set when using native HSDP")
        unit.reduction.all_reduce_hook, unit.reduction.all_reduce_hook_stream = hook, stream

    def set_post_optim_event(self, event: torch.Event) -> None:
        """GPU: the next all-gathers wait for `event` (the optimizer's step) instead of the whole current stream."""
        for session in self._dbuf_unit.session.passes.sessions():  # every job's prefetches
            session.post_optim_event = event

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

class _UnshardHandle(UnshardHandle):
    def __init__(self, unit: Unit) -> None:
        self._unit = unit

    def wait(self) -> None:
        _gathered_on_the_modules(self._unit)


def _gathered_on_the_modules(unit: Unit) -> None:
    unit.unshard()
    unit.use_unsharded()


def units_of(module: nn.Module, recurse: bool) -> list[Unit]:
    if not recurse:
        return [module._dbuf_unit]
    units: list[Unit] = []
    for sub in module.modules():
        unit = getattr(sub, "_dbuf_unit", None)
        if unit is not None and unit not in units:
            units.append(unit)
    return units


_dbuf_classes: dict[type, type] = {}


def _refuse_deepcopy(self, memo: dict) -> None:
    raise AssertionError("FSDP does not support deepcopy. Please use state dict for serialization.")


def mix_in(module: nn.Module) -> None:
    cls = type(module)
    if isinstance(module, DBufModule):
        return
    mixed = _dbuf_classes.get(cls)
    if mixed is None:
        # FSDP2's name (FSDP<Orig>) and its refusal of deepcopy (a copy would share the unit's dbufd memory).
        mixed = type(f"FSDP{cls.__name__}", (DBufModule, cls), {"__deepcopy__": _refuse_deepcopy})
        _dbuf_classes[cls] = mixed
    module.__class__ = mixed
