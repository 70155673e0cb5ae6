"""One FSDP unit of dbuf.torch: a dbuf group holding some modules' parameters.

A unit owns, for each of its parameters:
  - the sharded parameter registered on the modules between forwards: a
    RaggedShard DTensor (_dtensor.py) of the tensor's global shape whose
    local elements are this rank's fp32 (master) elements, a view of the
    group's sharded region; its gradient the same over the sharded gradient
    region;
  - the unsharded parameter swapped in during forward: an ``nn.Parameter``
    over the whole tensor in the group's unsharded slot (the all-gather
    writes it), whose ``.grad`` is preset to the tensor's place in the slot's
    gradient region, so autograd accumulates the gradient straight into the
    memory the reduce-scatter reads. Under tensor / expert parallelism the
    group holds this rank's chunk of the tensor, the unsharded parameter is
    that chunk as the parallel plan's DTensor, and its DTensor gradient is
    copied into the slot before the reduce-scatter.
A group's slot keeps one address for the group's life, so these tensors are
made once; tensors autograd saved in forward see the parameters gathered again
in backward, as FSDP2's resized storages do.

Collectives are issued here and only in an order every rank follows (the
hooks of _fully_shard.py call them in the model's forward / backward order).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec

import dbuf

from ._dtensor import RaggedDTensor, local_elements, make_dtensor
from ._ragged import ragged_shard_of, rank_ranges
from ._session import RootOrder, Session
from ._staging import Staging, gather_whole


# The dtypes dbufd reduces: fp32, bf16 and fp16 (summed in fp32, cast to a param_dtype) and fp64 (summed in fp64,
# never cast). Parameters of the others are frozen, held and gathered as they are.
_REDUCED_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
_GATHERED_DTYPES = {
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int32: "int32",
    torch.int64: "int64",
}


def dbuf_dtype(dtype: torch.dtype) -> str:
    """dbufd's name of a dtype a unit's parameters may have."""
    name = _REDUCED_DTYPES.get(dtype) or _GATHERED_DTYPES.get(dtype)
    if name is None:
        raise TypeError(f"dbuf shards parameters of {', '.join(map(str, [*_REDUCED_DTYPES, *_GATHERED_DTYPES]))}, "
                        f"not {dtype}")
    return name


def _split_by_dtype(label: str, params: list) -> tuple[torch.dtype, list[torch.dtype]]:
    """The dtype of the unit's reduced group (its trainable parameters'), and the other dtypes, gathered only.

    As in FSDP2, the parameters that require a gradient share one dtype;
    frozen ones may have any (an fp8 or int8 base model under trainable
    adapters). dbufd reduces fp32, bf16, fp16 and fp64.
    """
    dtypes = list(dict.fromkeys(param.dtype for _, param, _ in params))
    trainable = list(dict.fromkeys(param.dtype for _, param, _ in params if param.requires_grad))
    if len(trainable) > 1:
        names = ", ".join(f"{fqn} ({param.dtype})" for fqn, param, _ in params if param.requires_grad)
        raise TypeError(f"unit {label}: the parameters that require a gradient must share one dtype, got {names}")
    reduced = trainable[0] if trainable else dtypes[0]
    for dtype in dtypes:
        dbuf_dtype(dtype)  # a dtype dbufd holds
    if trainable and reduced not in _REDUCED_DTYPES:
        names = ", ".join(fqn for fqn, param, _ in params if param.requires_grad)
        raise TypeError(f"unit {label}: dbufd reduces fp32, bf16, fp16 and fp64 gradients; {names} ({reduced}) "
                        f"require one (parameters of {reduced} may be sharded frozen, with requires_grad=False)")
    return reduced, [dtype for dtype in dtypes if dtype != reduced]


def _check_param_dtype(label: str, sharded_dtype: torch.dtype, param_dtype: torch.dtype) -> None:
    """A unit's group casts its shards to param_dtype for compute: never to or from fp64 (dbufd holds it as it is)."""
    if torch.float64 in (sharded_dtype, param_dtype) and sharded_dtype != param_dtype:
        raise TypeError(f"unit {label}: dbufd gathers and reduces fp64 parameters in fp64, not as {param_dtype} "
                        f"from {sharded_dtype} (a mixed precision param_dtype)")


@dataclass
class Reduction:
    """How a unit's gradients are reduced (FSDPModule's setters and the mixed precision policy).

    dbufd sums in fp32 (fp64 for fp64) in rank order. ``divide_factor``: the sum is divided by
    it (None: by the world size, dbufd's AVG); ``force_sum``: dbufd sums and
    the division runs afterwards, here, even for the average;
    ``reduce_dtype``: a dtype narrower than fp32 rounds the reduced gradient
    to it, the precision FSDP2 communicates it in. ``all_reduce_hook``:
    FSDPModule.set_all_reduce_hook's, called with this rank's reduced
    gradients of the unit (one flat tensor, changed in place), on
    ``all_reduce_hook_stream`` if given.
    """

    divide_factor: float | None = None
    force_sum: bool = False
    reduce_dtype: torch.dtype | None = None
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    all_reduce_hook_stream: Any = None

    def rounds(self) -> bool:
        return self.reduce_dtype is not None and self.reduce_dtype.itemsize < 4

    def divides_here(self) -> bool:
        return self.divide_factor is not None or self.force_sum

    def finishes_here(self, replicas: int) -> bool:
        """Whether this side changes the reduced gradients (so dbufd must not add them into earlier ones)."""
        return self.divides_here() or self.rounds() or replicas > 1 or self.all_reduce_hook is not None


@dataclass
class ParamEntry:
    """One parameter of a unit (a tensor of its group)."""

    fqn: str
    group: dbuf.Group  # the unit's group that holds it: its reduced one, or a group of another (frozen) dtype
    index: int  # its position in that group
    requires_grad: bool
    registrations: list[tuple[nn.Module, str]]  # every (module, attribute) that holds it
    sharded: RaggedDTensor  # the parameter between forwards (an nn.Parameter)
    local: torch.Tensor  # its local elements: this rank's part of the sharded region (1-D)
    shard_grad: torch.Tensor  # this rank's part of the fp32 sharded gradient (1-D)
    sharded_grad: RaggedDTensor  # shard_grad as the parameter's .grad
    # Tensor / expert parallelism's DTensor spec of the parameter given to fully_shard (its mesh, placements,
    # whole shape), or None: the group holds this rank's chunk of it, and the unsharded parameter is that
    # chunk as a DTensor of this spec, which the parallel plan's modules compute with.
    model_spec: DTensorSpec | None
    unsharded: nn.Parameter | None = None  # over the slot; made at the first unshard
    unsharded_grad: torch.Tensor | None = None
    unsharded_ptr: int = 0
    # Autograd accumulated a gradient into the unsharded parameter since its last reduction: a parameter
    # that backward did not reach keeps its sharded .grad as it was (None stays None), as in FSDP2.
    grad_reached: bool = False


class Unit:
    """A group and the state of its parameters through forward and backward."""

    def __init__(
        self,
        session: Session,
        modules: list[nn.Module],
        params: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
        *,
        granularity: str,
        tensor_granularity: dict[str, str],
        param_dtype: torch.dtype | None,
        reshard_after_forward: bool | None,
        output_dtype: torch.dtype | None,
        cast_forward_inputs: bool,
        label: str,
        reduction: Reduction | None = None,
        hsdp: bool = False,
        mesh: DeviceMesh | None = None,
    ) -> None:
        self.session = session
        self.mesh = mesh  # the 1-D mesh fully_shard was given, which its parameters live on (default: the session's)
        # HSDP (fully_shard's 2-D mesh): the gradients are summed over the session's replicas too. A unit on
        # the dp mesh alone (expert parallelism's experts beside HSDP's other units) reduces over dp only.
        self.replicas = session.replicas if hsdp else 1
        self.modules = modules
        self.label = label
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.output_dtype = output_dtype
        self.requires_gradient_sync = True
        self.reduction = reduction or Reduction()
        self.entries: list[ParamEntry] = []
        # The group of the parameters of the unit's reduced dtype (every trainable one), and one gather-only group
        # per other dtype of frozen parameters (see _split_by_dtype).
        self.group: dbuf.Group | None = None
        self.gathered_only: list[dbuf.Group] = []
        self.groups: list[dbuf.Group] = []  # the reduced group first, then the gather-only ones
        self.gathered_bytes = 0  # bytes of the unit's unsharded parameters, over its groups
        self.forward_prefetch: list[Unit] | None = None  # explicit, else the recorded order
        self.backward_prefetch: list[Unit] | None = None
        # The root unit of the model this unit's first forward ran in (itself for a root; None before): FSDP2's lazy
        # root. A root holds its model's RootOrder.
        self.root: Unit | None = None
        self.order: RootOrder | None = None
        self._reset_pass()
        self.gather_ops: list[dbuf.Op] = []
        self.gather_event: torch.cuda.Event | None = None  # GPU: where the gather's stream is after it
        self.reduce_op: dbuf.Op | None = None
        self.added_back: list[tuple[ParamEntry, torch.Tensor]] = []  # see reduce_gradients
        self.reduction_pending = False  # the reduce-scatter's result still to divide / round (wait_reduce)
        # Accumulating without sync: each parameter's unsharded gradient so far, in fp32, outside the slot.
        self.set_aside: dict[int, torch.Tensor] = {}
        self.releasable = False  # its gradients are reduced or set aside: the slot may go back
        self.refusal: str | None = None  # FSDP2's error at the first forward (a parameter another unit took)
        self.reduce_unused_params = False  # set_reduce_scatter_unused_params: unreached parameters get .grad too
        # Every rank makes its units in the same order: the unit's index names its groups alike on every rank
        # (and again when a persistent job's ranks attach again); a cast after fully_shard makes a new generation.
        self.index = len(session.units)
        self.generation = 0
        self.mp_param_dtype = param_dtype  # the mixed precision policy's (None: the parameters' own)
        self.granularity = granularity
        self.tensor_granularity = tensor_granularity
        if not params:
            self.param_dtype = param_dtype
            self.cast_forward_inputs = False
            return
        self.cast_forward_inputs = cast_forward_inputs and param_dtype is not None
        self._register_groups(params)
        self.use_sharded()

    # ------------------------------------------------------------ set-up

    def _register_groups(self, params, *, keep_daemon_values: bool | None = None) -> None:
        """The unit's groups for `params` (its reduced one, and one gather-only group per other dtype).

        The shards take the parameters' values, except on a session that
        attached again to a persistent job (``keep_daemon_values`` None: the
        session says), whose shards dbufd kept.
        """
        keep = self.session.client.reattached if keep_daemon_values is None else keep_daemon_values
        sharded_dtype, other_dtypes = _split_by_dtype(self.label, params)
        self.sharded_dtype = sharded_dtype
        self.param_dtype = self.mp_param_dtype if self.mp_param_dtype is not None else sharded_dtype
        _check_param_dtype(self.label, sharded_dtype, self.param_dtype)
        self.group = self._register([p for p in params if p[1].dtype == sharded_dtype], sharded_dtype,
                                    self.param_dtype, "", keep)
        self.gathered_only = [
            self._register([p for p in params if p[1].dtype == dtype], dtype, dtype, f"-{dbuf_dtype(dtype)}", keep)
            for dtype in other_dtypes
        ]
        self.groups = [self.group, *self.gathered_only]
        self.gathered_bytes = sum(
            group.plan.devices * group.plan.shard_elems * dtype.itemsize
            for group, dtype in zip(self.groups, [self.param_dtype, *other_dtypes])
        )
        position = {fqn: i for i, (fqn, _, _) in enumerate(params)}
        self.entries.sort(key=lambda entry: position[entry.fqn])  # fully_shard's order over the groups

    @property
    def reduces(self) -> bool:
        """Whether the unit's group reduces gradients (its dtype is one dbufd reduces)."""
        return self.group is not None and self.sharded_dtype in _REDUCED_DTYPES

    def _group_name(self, suffix: str) -> str:
        generation = f"~{self.generation}" if self.generation else ""
        return f"{self.index:04d}:{self.label}"[: 200 - len(suffix) - len(generation)] + suffix + generation

    def _register(self, params, sharded_dtype, unsharded_dtype, suffix, keep_daemon_values: bool) -> dbuf.Group:
        """One group of the unit, of one dtype: registered with dbufd, its parameters' entries made."""
        model_specs = [_model_parallel_spec(fqn, param) for fqn, param, _ in params]
        # The planner places what this rank holds of each tensor: its tensor / expert parallel chunk.
        specs = [
            dbuf.TensorSpec(fqn, tuple(_chunk_of(param).shape), granularity=self.tensor_granularity.get(fqn))
            for fqn, param, _ in params
        ]
        group = self.session.client.register_group(
            self._group_name(suffix),
            specs,
            granularity=self.granularity,
            sharded_dtype=dbuf_dtype(sharded_dtype),
            unsharded_dtype=dbuf_dtype(unsharded_dtype),
        )
        for index, (fqn, param, registrations) in enumerate(params):
            view = group.shard_view(index)
            local = view.torch()
            if not keep_daemon_values and param.device.type != "meta":
                with torch.no_grad():
                    local.copy_(_chunk_of(param).detach().reshape(-1)[view.begin : view.end])
            model_spec = model_specs[index]
            block = group.plan.tensors[index].granularity
            if model_spec is None:
                mesh = self.mesh if self.mesh is not None else self.session.mesh
                placements = ragged_shard_of(rank_ranges(group.plan, index), block)
            else:
                # FSDP2's layout: dp first, then the model's own dims; StridedRaggedShard where those cut dim 0.
                mesh = self.session.spmd_mesh(model_spec.mesh)
                split = model_spec.num_shards_map[0] if model_spec.ndim else 1
                placements = (ragged_shard_of(rank_ranges(group.plan, index), block, split),
                              *model_spec.placements)
            # A parameter on meta stays on meta, as FSDP2's, until to_empty or load_state_dict(assign=True)
            # materializes it (adopt_applied then points it at dbufd's memory, which holds it already).
            shown = torch.empty_like(local, device="meta") if param.is_meta else local
            sharded = nn.Parameter(
                RaggedDTensor.from_local(shown, mesh, placements, param.shape), requires_grad=param.requires_grad
            )
            sharded.fqn = fqn
            shard_grad = group.shard_grad_view(index).torch()
            entry = ParamEntry(
                fqn=fqn,
                group=group,
                index=index,
                requires_grad=param.requires_grad,
                registrations=registrations,
                sharded=sharded,
                local=local,
                shard_grad=shard_grad,
                sharded_grad=_grad_of(sharded, shard_grad, mesh, placements, param.shape),
                model_spec=model_spec,
            )
            self.entries.append(entry)
        return group

    def _reset_pass(self) -> None:
        """Per forward/backward pass flags."""
        self.forward_ran = False
        self.inside = False  # between the forward pre-hook and the forward hook
        self.modules_done: set[int] = set()
        self.routed_calls = 0  # forward calls since the last backward whose inputs need gradients
        self.unrouted_call = False  # a forward call whose inputs need none: the end of backward reduces
        self.pre_backward_done = False
        self.post_backward_done = False
        self.recomputing = False  # activation checkpointing ran its forward again in this backward
        self.grads_prepared = False
        self.reduced = False

    @property
    def in_this_backward(self) -> bool:
        """Whether the backward in progress reached this unit (its end finishes only those)."""
        return self.pre_backward_done or self.grads_prepared or self.reduced or self.recomputing

    def _bind_unsharded(self) -> None:
        """The unsharded parameters and gradients over the slot (made once: its address is stable)."""
        for entry in self.entries:
            view = entry.group.unsharded_view(entry.index)
            if entry.unsharded is not None and entry.unsharded_ptr == view.data_ptr:
                continue
            if entry.unsharded is not None and self.forward_ran:
                # Tensors autograd saved would point at the old place.
                raise dbuf.InternalError(
                    f"unit {self.label}: the unsharded slot moved between forward and backward"
                )
            # Made requiring a gradient so that the hook can be registered; use_unsharded sets what the
            # sharded parameter says. A gathered-only parameter (a frozen one of another dtype) never has one.
            reduced = entry.group is self.group
            entry.unsharded = nn.Parameter(_unsharded_value(view.torch(), entry.model_spec), requires_grad=reduced)
            if reduced:
                entry.unsharded.register_post_accumulate_grad_hook(_marks_reached(entry))
            entry.unsharded_ptr = view.data_ptr
            entry.unsharded_grad = entry.group.unsharded_grad_view(entry.index).torch()

    # ------------------------------------------------------------ parameters on the modules

    def use_unsharded(self) -> None:
        """The unsharded parameters on the modules, requiring a gradient where the sharded ones do now.

        As in FSDP2, ``requires_grad_`` on a sharded parameter (freezing or
        unfreezing after fully_shard) takes effect at the next gather.
        """
        for entry in self.entries:
            requires_grad = entry.sharded.requires_grad
            if requires_grad and entry.group is not self.group:
                raise TypeError(
                    f"unit {self.label}: {entry.fqn} ({entry.sharded.dtype}) requires a gradient now; it was frozen "
                    f"when fully_shard made the unit, which reduces its {self.sharded_dtype} parameters only"
                )
            if entry.unsharded.requires_grad != requires_grad:  # (entry.requires_grad follows it)
                entry.requires_grad = requires_grad
                entry.unsharded.requires_grad_(requires_grad)
            for module, name in entry.registrations:
                module._parameters[name] = entry.unsharded

    def use_sharded(self) -> None:
        for entry in self.entries:
            for module, name in entry.registrations:
                module._parameters[name] = entry.sharded

    def sharded_grads(self) -> list[torch.Tensor | None]:
        return [entry.sharded.grad for entry in self.entries]

    def adopt_applied(self, grads_before: list[torch.Tensor | None] | None = None) -> None:
        """The parameters the modules hold now back in dbufd's memory, their values kept.

        After ``nn.Module._apply`` (``to_empty``, ``.to``, ``.cpu``: a new
        DTensor swapped into each parameter, or a new one registered) or
        ``load_state_dict(assign=True)`` (new parameters registered): the values
        are copied into the unit's sharded region and the unit's parameters
        registered again, so the optimizer's references and the collectives
        keep one memory. Another dtype (``.to(torch.bfloat16)``) moves the
        parameters to groups of their new dtypes (_move_to_dtypes); another
        device is refused, after the parameters are restored.
        ``grads_before``: the sharded parameters' gradients before ``_apply``,
        kept.
        """
        cast = self._cast_dtypes()
        if cast:
            self._move_to_dtypes(cast, grads_before)
            return
        refused: list[str] = []
        with torch.no_grad():
            for position, entry in enumerate(self.entries):
                module, name = entry.registrations[0]
                held = module._parameters[name]
                if held is entry.unsharded or held.is_meta:
                    continue  # inside its forward, or not materialized (FSDP2's error at the first forward)
                local = self._elements_of(held, entry)
                if local.dtype != entry.local.dtype or local.device != entry.local.device:
                    refused.append(f"{entry.fqn} ({local.dtype} on {local.device})")
                elif local.data_ptr() != entry.local.data_ptr():
                    entry.local.copy_(local)
                if held is entry.sharded or entry.sharded.is_meta:
                    # Swapped in place, or materialized by a new parameter: the unit's own over the sharded region
                    self._point_at_shard(entry)
                if grads_before is not None:
                    before = grads_before[position]
                    entry.sharded.grad = entry.sharded_grad if before is entry.sharded_grad else before
        self.use_sharded()
        if refused:
            raise TypeError(
                f"unit {self.label}: dbufd keeps its parameters on {self.session.torch_device}; refused "
                f"{', '.join(refused)} (parameters left as they were)"
            )

    @staticmethod
    def _point_at_shard(entry: ParamEntry) -> None:
        """The sharded parameter object over its elements in dbufd's memory again (whatever _apply put in it)."""
        fresh = nn.Parameter(
            RaggedDTensor.from_local(entry.local, entry.sharded.device_mesh, entry.sharded.placements,
                                     entry.sharded.shape),
            requires_grad=entry.requires_grad,
        )
        torch.utils.swap_tensors(entry.sharded, fresh)
        entry.sharded.fqn = entry.fqn

    def _restore_after_cast(self) -> None:
        """A cast refused: the parameters as they were before it, in dbufd's memory, on the modules."""
        for entry in self.entries:
            if self._held(entry) is entry.sharded and entry.sharded.dtype != entry.local.dtype:
                self._point_at_shard(entry)
        self.use_sharded()

    def _held(self, entry: ParamEntry) -> torch.Tensor:
        module, name = entry.registrations[0]
        return module._parameters[name]

    def _cast_dtypes(self) -> dict[str, torch.dtype]:
        """The new dtype of each parameter ``_apply`` cast on the unit's device (by fqn); empty if none."""
        cast = {}
        for entry in self.entries:
            held = self._held(entry)
            if held is entry.unsharded or held.is_meta:
                continue
            if held.dtype != entry.local.dtype and held.device == entry.local.device:
                cast[entry.fqn] = held.dtype
        return cast

    def _move_to_dtypes(self, cast: dict[str, torch.dtype], grads_before: list | None) -> None:
        """``.to(dtype)`` after fully_shard, as FSDP2 allows: the parameters move to groups of their new dtypes.

        Collective (every rank casts its model): the values are gathered whole
        through dbufd, exactly, cast as ``.to`` casts them, and registered in
        new groups; the old groups are unregistered, and dbufd frees their
        memory. The modules keep their parameter objects (the user's
        references), each now a RaggedShard DTensor of the new dtype.
        """
        old_entries = self.entries
        dtypes = [cast.get(entry.fqn, entry.local.dtype) for entry in old_entries]
        problem = None
        if self.holds_slot or self.forward_ran or self.set_aside:
            problem = "between a forward and its backward, or with gradients accumulated without sync"
        elif grads_before is not None and any(grad is not None for grad in grads_before):
            problem = "with gradients held (zero_grad(set_to_none=True) first)"
        elif any(entry.model_spec is not None for entry in old_entries):
            problem = "under tensor / expert parallelism"
        if problem is not None:
            self._restore_after_cast()
            raise NotImplementedError(f"unit {self.label}: dbuf.torch changes its parameters' dtype after fully_shard "
                                      f"between steps, not {problem} (parameters left as they were)")
        try:
            sharded_dtype, _ = _split_by_dtype(self.label, [(e.fqn, _DtypeOf(d, e.requires_grad), None)
                                                            for e, d in zip(old_entries, dtypes)])
            _check_param_dtype(self.label, sharded_dtype, self.mp_param_dtype or sharded_dtype)
        except TypeError as refused:
            self._restore_after_cast()
            raise TypeError(f"{refused} (parameters left as they were)") from None
        with torch.no_grad(), Staging(self.session) as staging:
            whole: dict[str, torch.Tensor] = {}
            for group in self.groups:
                members = sorted((e for e in old_entries if e.group is group), key=lambda e: e.index)
                whole.update(zip((e.fqn for e in members), gather_whole(group, members, staging, receives=True)))
        for group in self.groups:
            group.unregister()
        self.entries, self.group, self.gathered_only, self.groups = [], None, [], []
        self.generation += 1
        self._register_groups(
            [(e.fqn, nn.Parameter(whole[e.fqn].to(d), requires_grad=e.requires_grad), e.registrations)
             for e, d in zip(old_entries, dtypes)],
            keep_daemon_values=False,
        )
        for old, entry in zip(old_entries, self.entries):  # both in fully_shard's order
            if self._held(old) is old.sharded:
                torch.utils.swap_tensors(old.sharded, entry.sharded)
                entry.sharded = old.sharded
                entry.sharded.fqn = entry.fqn
        self.use_sharded()

    @staticmethod
    def _elements_of(value: torch.Tensor, entry: ParamEntry) -> torch.Tensor:
        """This rank's elements of a value given for the parameter: its local ones, or a slice of it whole."""
        if isinstance(value, RaggedDTensor):
            local = value.to_local()
            if local.numel() != entry.local.numel():
                raise ValueError(f"{entry.fqn}: {local.numel()} local elements given, {entry.local.numel()} held")
            return local.reshape(-1)
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if tuple(value.shape) != tuple(entry.sharded.shape):
            raise ValueError(f"{entry.fqn}: shape {tuple(value.shape)} given, {tuple(entry.sharded.shape)} held")
        return entry.sharded.local_part(value)

    # ------------------------------------------------------------ unshard / reshard

    @property
    def unsharded_elems(self) -> int:
        """V*S: elements of the unsharded buffer of the unit's reduced group."""
        plan = self.group.plan
        return plan.devices * plan.shard_elems

    @property
    def slot_bytes(self) -> int:
        """Unsharded parameters and gradients of the unit's slots (gradients in the parameters' dtype)."""
        return 2 * self.gathered_bytes

    @property
    def holds_slot(self) -> bool:
        return self in self.session.slot_holders

    def start_gather(self, *, required: bool) -> bool:
        """Takes a slot and submits the all-gather (not waited for); False if no slot is free (prefetch)."""
        if self.group is None or self.holds_slot:
            return True
        if not self.session.make_room(self, required=required):
            return False
        self._acquire_slots(required)
        self.session.hold_slot(self)
        stats = self.session.stats
        self._bind_unsharded()
        # GPU memory: a prefetch runs on a stream of its own, so the compute
        # queued meanwhile does not wait for it; the stream that uses the
        # unit waits for its event instead (_wait_gather).
        stream = self.session.prefetch_stream() if not required else self.session.stream()
        self.gather_ops = [group.all_gather(async_op=True, stream=stream) for group in self.groups]
        if stream is not None:
            self.gather_event = torch.cuda.Event()
            self.gather_event.record(stream)
        stats.all_gathers += len(self.gather_ops)
        stats.all_gather_bytes += self.gathered_bytes
        return True

    def _acquire_slots(self, required: bool) -> None:
        """A slot for each of the unit's groups, or none (those taken are given back if one fails).

        The session's pool counts units (make_room decided there is room): a
        unit with gather-only groups holds more than one of dbufd's slots, so
        dbufd's pool may grow past prefetch_depth + 1 slots, within the
        tenant's quota, as it does for a required gather.
        """
        acquired = []
        try:
            for group in self.groups:
                group.acquire_slot(grow=required or len(self.groups) > 1)
                acquired.append(group)
        except BaseException:
            for group in acquired:
                group.reshard()
            raise

    def unshard(self) -> None:
        """The parameters gathered in the slot (waiting for a prefetch, or gathering now)."""
        self.start_gather(required=True)
        self._wait_gather()

    def _wait_gather(self) -> None:
        ops, self.gather_ops = self.gather_ops, []
        if not ops:
            return
        if self.session.device is None:
            for op in ops:
                op.wait()  # host ordering: the gathered parameters are there once it returns
            return
        # Stream-ordered: the using stream waits on the GPU; the host only
        # collects the result (a failure) later, without blocking now.
        event, self.gather_event = self.gather_event, None
        self.session.stream().wait_event(event)
        self.session.unwaited.extend(ops)

    def reshard(self) -> None:
        """The sharded parameters on the modules; the slot given back, once this unit's ops in flight are done."""
        self.use_sharded()
        if not self.holds_slot:
            return
        self._wait_gather()
        self.wait_reduce()
        for group in self.groups:
            if self.session.device is None:
                group.reshard()
            else:
                group.reshard_on_stream(self.session.stream())
        self.session.slot_holders.remove(self)
        self.releasable = False

    # ------------------------------------------------------------ gradients

    def prepare_gradients(self) -> None:
        """Before the unit's backward: its gradients will land in the slot's gradient region."""
        if self.grads_prepared or not self.reduces:
            return
        self.grads_prepared = True
        for entry in self.entries:
            if entry.group is not self.group:
                continue  # gathered only: never reduced
            entry.unsharded_grad.zero_()  # a frozen parameter's part too: the reduce-scatter reads the region
            if not entry.requires_grad:
                continue
            # A plain parameter's gradient accumulates in the slot; a tensor parallel one's arrives as a
            # DTensor of the plan's placements (or Partial), taken into the slot by _take_model_parallel_grads.
            entry.unsharded.grad = entry.unsharded_grad if entry.model_spec is None else None

    def reduce_gradients(self) -> None:
        """After the unit's backward: reduce-scatter into the fp32 sharded gradients, or set them aside (no sync)."""
        if self.post_backward_done or not self.grads_prepared:
            return
        self.post_backward_done = True
        self.grads_prepared = False
        self._take_model_parallel_grads()
        self.use_sharded()  # what activation checkpointing recomputed is done with the unsharded ones
        for entry in self.entries:
            if entry.unsharded is not None:
                entry.unsharded.grad = None  # the values are in the slot
        self.releasable = True
        if not self.requires_gradient_sync:
            self._set_aside_gradients()
            return
        residuals = self._take_back_set_aside()
        self._round_to_reduce_dtype()
        accumulate = self._stage_sharded_gradients()
        if accumulate and (self.sharded_dtype not in (torch.float32, torch.float64)
                           or self.reduction.finishes_here(self.replicas)):
            # dbufd adds only into sharded gradients of the dtype it sums in
            # (fp32; fp64 for fp64), and before any division or rounding
            # here: the reduction overwrites, and the gradients so far are
            # added back, in the parameters' own dtype, once it is done
            # (wait_reduce).
            self.added_back = [(e, e.shard_grad.clone()) for e in self.entries if e.requires_grad]
            accumulate = False
        op = dbuf.ReduceOp.SUM if self.reduction.divides_here() else dbuf.ReduceOp.AVG
        self.reduce_op = self.group.reduce_scatter(
            op=op, accumulate=accumulate, async_op=True, stream=self.session.stream()
        )
        if residuals:
            self._reduce_residuals(residuals, op)
        self.reduction_pending = True
        self.reduced = True
        self.session.stats.reduce_scatters += 1
        self.session.stats.reduce_scatter_bytes += self.unsharded_elems * self.param_dtype.itemsize

    def _round_to_reduce_dtype(self) -> None:
        """A reduce_dtype narrower than the gradients: each rank's gradient rounded to it before the reduction.

        FSDP2 casts each rank's gradient to reduce_dtype and reduce-scatters
        that; dbufd then sums the rounded values in fp32 (in rank order) and
        _finish_reduction rounds the result once more.
        """
        reduce_dtype = self.reduction.reduce_dtype
        if not self.reduction.rounds() or self.param_dtype.itemsize <= reduce_dtype.itemsize:
            return
        with torch.no_grad():
            for entry in self.entries:
                if entry.requires_grad:
                    entry.unsharded_grad.copy_(entry.unsharded_grad.to(reduce_dtype))

    def _take_model_parallel_grads(self) -> None:
        """Tensor / expert parallel parameters: their DTensor gradients into the slot's gradient region.

        A gradient of another placement than the parameter's (Partial, where
        the plan leaves the reduction over its ranks to the gradient) is
        redistributed to it first, as FSDP2 does: over the model's dims, by
        torch.
        """
        with torch.no_grad():
            for entry in self.entries:
                if entry.model_spec is None or not entry.requires_grad or entry.unsharded.grad is None:
                    continue
                grad, entry.unsharded.grad = entry.unsharded.grad, None
                if tuple(grad.placements) != tuple(entry.model_spec.placements):
                    grad = grad.redistribute(placements=entry.model_spec.placements)
                entry.unsharded_grad.copy_(grad.to_local().reshape(entry.unsharded_grad.shape))

    def _stage_sharded_gradients(self) -> bool:
        """Whether the reduce-scatter adds into the sharded gradients (some hold a gradient).

        Where it adds, every sharded gradient region must hold the parameter's
        gradient: zeros where .grad is None, the values of a .grad the user
        put elsewhere.
        """
        with_grad = [e for e in self.entries if e.requires_grad]
        accumulate = any(e.sharded.grad is not None for e in with_grad)
        if accumulate:
            with torch.no_grad():
                for entry in with_grad:
                    grad = entry.sharded.grad
                    if grad is None:
                        entry.shard_grad.zero_()
                    elif grad is not entry.sharded_grad:
                        entry.shard_grad.copy_(local_elements(grad))
        return accumulate

    def _set_aside_gradients(self) -> None:
        """No sync: this backward's unsharded gradients are added to those set aside (fp32, or fp64); the slot can go back.

        Unsharded gradients only are kept, the parameters are resharded, as
        FSDP2 keeps them (in fp32 where its reduce_dtype is fp32).
        """
        with torch.no_grad():
            for entry in self.entries:
                if not entry.requires_grad:
                    continue
                kept = self.set_aside.get(entry.index)
                if kept is None:
                    wide = torch.promote_types(entry.unsharded_grad.dtype, torch.float32)
                    self.set_aside[entry.index] = entry.unsharded_grad.to(wide, copy=True)
                else:
                    kept.add_(entry.unsharded_grad)

    def _take_back_set_aside(self) -> dict[int, torch.Tensor]:
        """The gradients set aside by backwards without sync, added to this one's in the slot before it is reduced.

        The sum is fp32 (fp64 for fp64); a slot of a narrower dtype holds it rounded, and what
        the rounding lost comes back (the residuals, fp32) for a second
        reduce-scatter (_reduce_residuals), so the micro-batches' sum is
        reduced to about 16 significant bits, near FSDP2's fp32 reduction.
        """
        set_aside, self.set_aside = self.set_aside, {}
        residuals: dict[int, torch.Tensor] = {}
        narrow = self.param_dtype != torch.float32 and self.sharded_dtype == torch.float32
        with torch.no_grad():
            for entry in self.entries:
                kept = set_aside.get(entry.index) if entry.group is self.group else None
                if kept is None:
                    continue
                total = kept.add_(entry.unsharded_grad)
                entry.unsharded_grad.copy_(total)
                if narrow:
                    residuals[entry.index] = total.sub_(entry.unsharded_grad)
        return residuals

    def _reduce_residuals(self, residuals: dict[int, torch.Tensor], op: dbuf.ReduceOp) -> None:
        """The second reduce-scatter of _take_back_set_aside: the rounding's residuals, added to the first's."""
        self.reduce_op.wait()
        with torch.no_grad():
            for entry in self.entries:
                if not entry.requires_grad:
                    continue
                residual = residuals.get(entry.index)
                if residual is None:
                    entry.unsharded_grad.zero_()
                else:
                    entry.unsharded_grad.copy_(residual)
        self.reduce_op = self.group.reduce_scatter(op=op, accumulate=True, async_op=True, stream=self.session.stream())
        self.session.stats.reduce_scatters += 1
        self.session.stats.reduce_scatter_bytes += self.unsharded_elems * self.param_dtype.itemsize

    def wait_reduce(self) -> None:
        if self.reduce_op is not None:
            op, self.reduce_op = self.reduce_op, None
            op.wait()
        if self.reduction_pending:
            self.reduction_pending = False
            self._finish_reduction()
        added_back, self.added_back = self.added_back, []
        with torch.no_grad():
            for entry, earlier in added_back:
                entry.shard_grad.add_(earlier)

    def _finish_reduction(self) -> None:
        """What dbufd's reduction over this job's ranks leaves to this side.

        HSDP: the sum over the replicas; then the division (by the divide
        factor, or the whole world's size after a forced sum, or the replicas'
        count after dbufd's average), then the rounding to a narrower
        reduce_dtype; then the all-reduce hook, which FSDP2 runs on its
        reduce-scatter's output (after HSDP's all-reduce): here on the finished
        reduction, so that a hook averaging over the trainer's own replica group
        (FSDP2's test of it) gives FSDP2's gradients.
        """
        reduction, replicas = self.reduction, self.replicas
        if reduction.divide_factor is not None:
            divisor = reduction.divide_factor
        elif reduction.force_sum:
            divisor = self.session.world_size * replicas
        elif replicas > 1:
            divisor = replicas
        else:
            divisor = None
        if divisor is None and not reduction.rounds() and reduction.all_reduce_hook is None:
            return
        grads = [entry.shard_grad for entry in self.entries if entry.requires_grad]
        with torch.no_grad():
            if replicas > 1:
                self.session.sum_over_replicas(grads)
            for grad in grads:
                if divisor is not None:
                    grad.div_(divisor)
                if reduction.rounds():
                    grad.copy_(grad.to(reduction.reduce_dtype))
            if reduction.all_reduce_hook is not None and grads:
                self._run_all_reduce_hook(grads)

    def _run_all_reduce_hook(self, grads: list[torch.Tensor]) -> None:
        """The hook on one flat tensor of the unit's reduced gradients (as FSDP2's reduce output), copied back."""
        flat = torch.cat(grads)
        stream = self.reduction.all_reduce_hook_stream
        with torch.get_device_module(flat.device.type).stream(stream) if stream is not None else nullcontext():
            self.reduction.all_reduce_hook(flat)
        for grad, part in zip(grads, flat.split([grad.numel() for grad in grads])):
            grad.copy_(part)

    def finish_backward(self) -> None:
        """End of backward: the reduction done, the sharded gradients on the sharded parameters."""
        try:
            self._finish_backward()
        finally:
            self._reset_pass()

    def _finish_backward(self) -> None:
        self.wait_reduce()
        self.use_sharded()
        for entry in self.entries:
            if entry.unsharded is not None and entry.unsharded.grad is not None:
                raise dbuf.InternalError(
                    f"unit {self.label}: a gradient of {entry.fqn} arrived after its reduce-scatter "
                    f"(is the parameter used by another unit's forward too?)"
                )
        if not self.reduced:
            return
        for entry in self.entries:
            if entry.requires_grad and (entry.grad_reached or self.reduce_unused_params):
                entry.grad_reached = False
                entry.sharded.grad = entry.sharded_grad
                _run_post_accumulate_grad_hooks(entry.sharded)

    def abandon_backward(self) -> None:
        """After a backward that raised: its gradients dropped, the slot given back, the pass reset.

        Gradients set aside by earlier backwards without sync are kept.
        """
        for entry in self.entries:
            if not self.set_aside:  # (else what earlier backwards without sync reached still counts)
                entry.grad_reached = False
            if entry.unsharded is not None:
                entry.unsharded.grad = None
        self.use_sharded()
        try:
            self.reshard()
        finally:
            self._reset_pass()

    # ------------------------------------------------------------ end

    def close(self) -> None:
        if self.holds_slot:
            self.session.slot_holders.remove(self)
        for group in self.groups:
            group.close()


@dataclass
class _DtypeOf:
    """What _split_by_dtype reads of a parameter: its dtype and whether it requires a gradient."""

    dtype: torch.dtype
    requires_grad: bool


def _marks_reached(entry: ParamEntry):
    """The unsharded parameter's post-accumulate-grad hook: backward reached it."""

    def hook(_param: torch.Tensor) -> None:
        entry.grad_reached = True

    return hook


def _run_post_accumulate_grad_hooks(param: nn.Parameter) -> None:
    """The hooks registered with ``register_post_accumulate_grad_hook`` on a sharded parameter, its gradient set.

    Autograd never accumulates into the sharded parameter (the unsharded one
    computes), so its hooks run here once the reduction is done, as FSDP2
    runs them after its reduce-scatter (optimizer-in-backward steps there).
    """
    for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
        hook(param)


def _model_parallel_spec(fqn: str, param: torch.Tensor) -> DTensorSpec | None:
    """The spec of a parameter tensor / expert parallelism made a DTensor (checked), or None for a plain one."""
    if not isinstance(param, DTensor):
        return None
    if isinstance(param, RaggedDTensor):
        raise dbuf.InternalError(f"{fqn} is a unit's parameter already")
    for placement in param.placements:
        if type(placement) not in (Shard, Replicate):
            raise NotImplementedError(
                f"fully_shard: {fqn} is a DTensor placed {param.placements}; dbuf shards tensor / expert "
                f"parallelism's Shard(d) and Replicate() placements"
            )
    return param._spec


def _grad_of(sharded: RaggedDTensor, shard_grad: torch.Tensor, mesh, placements, shape) -> RaggedDTensor:
    """The sharded gradient as a DTensor: on the parameter's own spec where the dtypes agree, so that the optimizer's
    operators on both find one layout at once (RaggedDTensor's fast path compares specs by identity)."""
    if shard_grad.dtype == sharded.dtype:
        return make_dtensor(RaggedDTensor, shard_grad, sharded._spec)
    return RaggedDTensor.from_local(shard_grad, mesh, placements, shape)


def _chunk_of(param: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a parameter: its tensor / expert parallel chunk, or the whole tensor."""
    return param.to_local() if isinstance(param, DTensor) else param


def _unsharded_value(chunk: torch.Tensor, model_spec: DTensorSpec | None) -> torch.Tensor:
    """The gathered parameter the modules compute with: the chunk in the slot, as the plan's DTensor where there is one."""
    if model_spec is None:
        return chunk
    return DTensor.from_local(chunk, model_spec.mesh, model_spec.placements, run_check=False,
                              shape=model_spec.shape, stride=model_spec.stride)
