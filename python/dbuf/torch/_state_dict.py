"""State dicts of a model sharded with dbuf.torch: full (whole fp32 tensors) or sharded (this rank's part).

Full state dicts move the exact fp32 master values through dbufd itself: a
small fp32 -> fp32 staging group (Session.staging) all-gathers every rank's
local elements to rank 0, or broadcasts rank 0's whole tensors to every rank,
in rounds of ``Session.STAGING_ELEMS`` elements per rank. Both are
collectives: every rank calls them, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import dbuf

from ._fully_shard import units as units_of
from ._param import ShardInfo
from ._session import Session
from ._unit import ParamEntry, Unit


@dataclass
class LocalShard:
    """One parameter's entry of a sharded state dict: this rank's elements (a copy) and where they sit."""

    local: torch.Tensor
    info: ShardInfo


def _fqn_prefixes(model: nn.Module) -> dict[int, str]:
    """Each module's path in `model`, to name a unit's parameters from the model's root."""
    return {id(module): name for name, module in model.named_modules(remove_duplicate=False)}


def _entry_names(model: nn.Module, unit: Unit) -> list[tuple[ParamEntry, str]]:
    prefixes = _fqn_prefixes(model)
    named = []
    for entry in unit.entries:
        module, attr = entry.registrations[0]
        prefix = prefixes.get(id(module))
        if prefix is None:
            raise ValueError(f"unit {unit.label} is not part of this model")
        named.append((entry, f"{prefix}.{attr}" if prefix else attr))
    return named


def _rank_slices(unit: Unit) -> list[list[tuple[int, int]]]:
    """For every rank, its [begin, end) of each of the unit's tensors (the planner's slices)."""
    plan = unit.group.plan
    shard = plan.shard_elems
    slices = []
    for rank in range(plan.devices):
        lo, hi = rank * shard, (rank + 1) * shard
        mine = []
        for placed in plan.tensors:
            begin = max(placed.offset, lo) - placed.offset
            end = min(placed.offset + placed.numel, hi) - placed.offset
            mine.append((begin, end) if end > begin else (0, 0))
        slices.append(mine)
    return slices


class _Staging:
    """The session's staging group, with its slot held while in use.

    Its ops are ordered on the session's stream (GPU memory), like the copies
    in and out of it.
    """

    def __init__(self, session: Session) -> None:
        self.session = session
        self.group = session.staging()
        self.elems = Session.STAGING_ELEMS

    def __enter__(self) -> _Staging:
        self.session.make_room(None, required=True, label="a full state dict")
        self.group.acquire_slot()
        self.shard = self.group.shard_view(0).torch()
        self.unsharded = self.group.unsharded_view(0).torch()
        return self

    def all_gather(self) -> None:
        self.group.all_gather(stream=self.session.stream())

    def broadcast_from_rank0(self) -> None:
        self.group.broadcast(0, stream=self.session.stream())

    def __exit__(self, *exc: object) -> None:
        if self.session.device is None:
            self.group.reshard()
        else:
            self.group.reshard_on_stream(self.session.stream())


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: buffer for name, buffer in model.named_buffers()}


def get_model_state_dict(model: nn.Module, *, full: bool = True, rank0_only: bool = True) -> dict:
    """The model's state: parameters (fp32 master values) and buffers. Collective when ``full``.

    full: every parameter whole, with its original shape, as a plain tensor:
    on rank 0 (other ranks get an empty dict) or, with ``rank0_only=False``,
    on every rank. Not full: ``{fqn: LocalShard}`` with this rank's elements.
    Buffers (not sharded) come from this rank's modules.
    """
    all_units = list(units_of(model))
    if not full:
        state: dict = {}
        for unit in all_units:
            for entry, name in _entry_names(model, unit):
                state[name] = LocalShard(entry.sharded.detach().clone(), entry.sharded.shard_info)
        state.update({k: v.detach().clone() for k, v in _buffers(model).items()})
        return state
    if not all_units:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    session = all_units[0].session
    receives = not rank0_only or session.rank == 0
    state = {}
    with _Staging(session) as staging:
        for unit in all_units:
            if unit.group is not None:
                state.update(_gather_unit(model, unit, staging, receives))
    if receives:
        state.update({k: v.detach().clone() for k, v in _buffers(model).items()})
    return state


def _gather_unit(model: nn.Module, unit: Unit, staging: _Staging, receives: bool) -> dict[str, torch.Tensor]:
    """Every rank's local elements of the unit's tensors -> the whole tensors (where `receives`)."""
    slices = _rank_slices(unit)
    world = len(slices)
    payload_sizes = [sum(end - begin for begin, end in rank) for rank in slices]
    mine = unit.session.rank
    local = [entry.sharded.detach() for entry in unit.entries]
    payload = torch.cat(local) if local else torch.empty(0, device=staging.shard.device)
    if payload.numel() != payload_sizes[mine]:
        raise dbuf.InternalError(f"unit {unit.label}: this rank holds {payload.numel()} elements, its plan says "
                                 f"{payload_sizes[mine]}")
    received = [torch.empty(size, device=staging.shard.device) for size in payload_sizes] if receives else []
    rounds = -(-max(payload_sizes) // staging.elems) if max(payload_sizes) else 0
    for step in range(rounds):
        lo = step * staging.elems
        piece = payload[lo : lo + staging.elems]
        staging.shard[: piece.numel()].copy_(piece)
        staging.shard[piece.numel() :].zero_()
        staging.all_gather()
        if receives:
            for rank in range(world):
                take = min(staging.elems, max(payload_sizes[rank] - lo, 0))
                start = rank * staging.elems
                received[rank][lo : lo + take].copy_(staging.unsharded[start : start + take])
    if not receives:
        return {}
    out: dict[str, torch.Tensor] = {}
    cursors = [0] * world
    for index, (entry, name) in enumerate(_entry_names(model, unit)):
        parts = []
        for rank in range(world):
            begin, end = slices[rank][index]
            parts.append(received[rank][cursors[rank] : cursors[rank] + end - begin])
            cursors[rank] += end - begin
        out[name] = torch.cat(parts).reshape(entry.sharded.global_shape)
    return out


def set_model_state_dict(model: nn.Module, state_dict: dict, *, broadcast_from_rank0: bool = False) -> None:
    """Loads parameters and buffers into the model's shards (and modules).

    ``state_dict`` may be full (whole tensors: each rank takes its elements)
    or sharded (LocalShards made on the same plan: each rank its own). With
    ``broadcast_from_rank0``, only rank 0's (full) dict counts: its tensors go
    to every rank through dbufd (collective); floating-point buffers too,
    others must be in every rank's dict.
    """
    all_units = [u for u in units_of(model) if u.group is not None]
    if broadcast_from_rank0 and all_units:
        session = all_units[0].session
        with _Staging(session) as staging:
            for unit in all_units:
                _broadcast_unit(model, unit, staging, state_dict if session.rank == 0 else {})
        _broadcast_buffers(model, staging_session=session, state_dict=state_dict)
        return
    with torch.no_grad():
        for unit in all_units:
            for entry, name in _entry_names(model, unit):
                if name not in state_dict:
                    raise KeyError(f"state dict has no {name}")
                _load_entry(entry, name, state_dict[name])
        for name, buffer in _buffers(model).items():
            if name in state_dict:
                buffer.copy_(state_dict[name])


def _load_entry(entry: ParamEntry, name: str, value) -> None:
    info = entry.sharded.shard_info
    if isinstance(value, LocalShard):
        if (value.info.global_shape, value.info.begin, value.info.end) != (info.global_shape, info.begin, info.end):
            raise ValueError(
                f"{name}: this sharded state dict was made on another plan (elements "
                f"[{value.info.begin}, {value.info.end}) of {tuple(value.info.global_shape)}, this rank holds "
                f"[{info.begin}, {info.end}) of {tuple(info.global_shape)}): load a full state dict instead"
            )
        entry.sharded.copy_(value.local)
        return
    if tuple(value.shape) != tuple(info.global_shape):
        raise ValueError(f"{name}: shape {tuple(value.shape)} in the state dict, {tuple(info.global_shape)} here")
    entry.sharded.copy_(value.detach().reshape(-1)[info.begin : info.end])


def _broadcast_unit(model: nn.Module, unit: Unit, staging: _Staging, state_dict: dict) -> None:
    """Rank 0's whole tensors of the unit -> every rank's shards, in rounds of the staging slot's size."""
    named = _entry_names(model, unit)
    is_root = unit.session.rank == 0
    if is_root:
        for entry, name in named:
            if name not in state_dict:
                raise KeyError(f"state dict has no {name}")
            if tuple(state_dict[name].shape) != tuple(entry.sharded.global_shape):
                raise ValueError(f"{name}: shape {tuple(state_dict[name].shape)}, {tuple(entry.sharded.global_shape)} here")
        stream = torch.cat([state_dict[name].detach().reshape(-1).float() for _, name in named])
    total = sum(entry.sharded.global_shape.numel() for entry, _ in named)
    capacity = staging.unsharded.numel()
    # Where each tensor starts in the stream, and which of its elements this rank keeps.
    starts, position = [], 0
    for entry, _ in named:
        starts.append(position)
        position += entry.sharded.global_shape.numel()
    with torch.no_grad():
        for lo in range(0, total, capacity):
            hi = min(lo + capacity, total)
            if is_root:
                staging.unsharded[: hi - lo].copy_(stream[lo:hi])
            staging.broadcast_from_rank0()
            for (entry, _), start in zip(named, starts):
                begin, end = entry.sharded.element_range
                a, b = max(start + begin, lo), min(start + end, hi)
                if a < b:
                    entry.sharded.view(-1)[a - start - begin : b - start - begin].copy_(staging.unsharded[a - lo : b - lo])


def _broadcast_buffers(model: nn.Module, *, staging_session: Session, state_dict: dict) -> None:
    floating = [(n, b) for n, b in _buffers(model).items() if b.is_floating_point()]
    if floating:
        total = sum(b.numel() for _, b in floating)
        with _Staging(staging_session) as staging:
            capacity = staging.unsharded.numel()
            if total > capacity:
                raise ValueError(f"floating-point buffers of {total} elements exceed the staging slot ({capacity})")
            if staging_session.rank == 0:
                flat = torch.cat([state_dict[n].detach().reshape(-1).float() for n, _ in floating])
                staging.unsharded[:total].copy_(flat)
            staging.broadcast_from_rank0()
            offset = 0
            with torch.no_grad():
                for _, buffer in floating:
                    buffer.copy_(staging.unsharded[offset : offset + buffer.numel()].reshape(buffer.shape))
                    offset += buffer.numel()
    with torch.no_grad():
        for name, buffer in _buffers(model).items():
            if not buffer.is_floating_point():
                if name not in state_dict:
                    raise KeyError(f"{name} (not floating point) must be in every rank's state dict")
                buffer.copy_(state_dict[name])
