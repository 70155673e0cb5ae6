"""State dicts of a model sharded with dbuf.torch: full (whole fp32 tensors) or sharded (this rank's part).

Full state dicts move the exact master values through dbufd itself, by the
session's staging group (_staging.py): every rank's local elements all-gathered
to rank 0, or rank 0's whole tensors broadcast to every rank. Both are
collectives: every rank calls them, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ._fully_shard import units as units_of
from ._dtensor import RaggedDTensor
from ._ragged import ShardInfo
from ._staging import Staging, gather_whole, to_words, words_per_element
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


def _whole_through_the_job(units: list[Unit], what: str) -> None:
    """dbuf's own state dicts describe tensors as one job (its dp ranks) holds them whole: not across tensor /
    expert parallelism, nor across the several jobs of a process."""
    for unit in units:
        if unit.session is not units[0].session:
            raise NotImplementedError(
                f"dbuf.torch's {what} moves tensors through one dbuf job; unit {unit.label} is in job "
                f"{unit.session.job}, unit {units[0].label} in {units[0].session.job}: use "
                f"torch.distributed.checkpoint.state_dict's functions (full_state_dict=True) or DCP"
            )
        for entry in unit.entries:
            if entry.sharded.device_mesh.ndim > 1:
                raise NotImplementedError(
                    f"dbuf.torch's {what} moves tensors through the dbuf job (its dp ranks); {entry.fqn} is also "
                    f"sharded by tensor / expert parallelism ({entry.sharded.placements}): use "
                    f"torch.distributed.checkpoint.state_dict's functions (full_state_dict=True) or DCP"
                )


def _replicated(model: nn.Module) -> dict[str, torch.Tensor]:
    """What every rank holds whole: persistent buffers, and parameters no unit shards (ignored ones)."""
    out: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                out[dot + name] = buffer
        for name, param in module._parameters.items():
            if param is not None and not isinstance(param, RaggedDTensor):
                out.setdefault(dot + name, param)
    return out


def get_model_state_dict(model: nn.Module, *, full: bool = True, rank0_only: bool = True) -> dict:
    """The model's state: parameters (fp32 master values) and persistent buffers. Collective when ``full``.

    full: every parameter whole, with its original shape, as a plain tensor:
    on rank 0 (other ranks get an empty dict) or, with ``rank0_only=False``,
    on every rank. Not full: ``{fqn: LocalShard}`` with this rank's elements.
    Buffers and parameters no unit shards come from this rank's modules.
    """
    all_units = list(units_of(model))
    if not full:
        # A LocalShard says where its elements sit in the tensor dbuf's job holds: under tensor / expert
        # parallelism that is a chunk, which another rank's chunk of the same shape could not be told from.
        _whole_through_the_job(all_units, "sharded state dict")
        state: dict = {}
        for unit in all_units:
            for entry, name in _entry_names(model, unit):
                state[name] = LocalShard(entry.local.detach().clone(), entry.sharded.shard_info)
        state.update({k: v.detach().clone() for k, v in _replicated(model).items()})
        return state
    if not all_units:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    _whole_through_the_job(all_units, "full state dict")
    session = all_units[0].session
    receives = not rank0_only or session.rank == 0
    state = {}
    with Staging(session) as staging:
        for unit in all_units:
            for group in unit.groups:
                state.update(_gather_group(model, unit, group, staging, receives))
    if receives:
        state.update({k: v.detach().clone() for k, v in _replicated(model).items()})
    return state


def _gather_group(model: nn.Module, unit: Unit, group, staging: Staging, receives: bool) -> dict[str, torch.Tensor]:
    """Every rank's local elements of one group's tensors -> the whole tensors, named (where `receives`)."""
    named = sorted(((e, n) for e, n in _entry_names(model, unit) if e.group is group), key=lambda en: en[0].index)
    whole = gather_whole(group, [entry for entry, _ in named], staging, receives)
    return {name: tensor for (_, name), tensor in zip(named, whole)} if receives else {}


def set_model_state_dict(model: nn.Module, state_dict: dict, *, broadcast_from_rank0: bool = False) -> None:
    """Loads parameters and persistent buffers into the model's shards (and modules).

    ``state_dict`` may be full (whole tensors: each rank takes its elements)
    or sharded (LocalShards made on the same plan: each rank its own). With
    ``broadcast_from_rank0``, only rank 0's (full) dict counts (pass {} on
    the others): rank 0 checks it, then its tensors, buffers included, go to
    every rank through dbufd, exactly (collective). A dict rank 0 finds wrong raises on every rank, naming the problem
    on rank 0.
    """
    all_units = [u for u in units_of(model) if u.groups]
    if broadcast_from_rank0 and all_units:
        _broadcast_state(model, all_units, state_dict)
        return
    with torch.no_grad():
        for unit in all_units:
            for entry, name in _entry_names(model, unit):
                if name not in state_dict:
                    raise KeyError(f"state dict has no {name}")
                _load_entry(entry, name, state_dict[name])
        for name, tensor in _replicated(model).items():
            if name in state_dict:
                tensor.copy_(state_dict[name])


def _problem_with(model: nn.Module, units: list[Unit], state_dict: dict) -> str | None:
    """What is wrong with rank 0's dict for a broadcast load, if anything."""
    named = [(entry, name) for unit in units for entry, name in _entry_names(model, unit)]
    expected = {name: tuple(entry.sharded.shape) for entry, name in named}
    expected.update({name: tuple(t.shape) for name, t in _replicated(model).items()})
    for name, shape in expected.items():
        if name not in state_dict:
            return f"state dict has no {name}"
        value = state_dict[name]
        if tuple(value.shape) != shape:
            return f"{name}: shape {tuple(value.shape)} in the state dict, {shape} here"
    return None


def _broadcast_state(model: nn.Module, units: list[Unit], state_dict: dict) -> None:
    _whole_through_the_job(units, "broadcast of a full state dict")
    session = units[0].session
    replicated = _replicated(model)
    with Staging(session) as staging:
        # Rank 0 says first whether its dict is good: the other ranks must not
        # wait for tensors it will never send.
        problem = _problem_with(model, units, state_dict) if session.rank == 0 else None
        staging.unsharded[:1].fill_(0.0 if problem is None else 1.0)
        staging.broadcast_from_rank0()
        if staging.unsharded[0].item() != 0.0:
            raise ValueError(problem or "rank 0's state dict is not right for this model (rank 0 says why)")
        for unit in units:
            pieces = [
                _Piece(name, entry.local, *entry.sharded.element_range, entry.sharded.numel())
                for entry, name in _entry_names(model, unit)
            ]
            _broadcast_pieces(staging, pieces, state_dict)
        whole = [_Piece(name, t.view(-1), 0, t.numel(), t.numel()) for name, t in replicated.items()]
        _broadcast_pieces(staging, whole, state_dict)


@dataclass
class _Piece:
    """What a rank keeps of one tensor of a broadcast: elements [begin, end) of its `numel`, into `dest`."""

    name: str
    dest: torch.Tensor  # 1-D view of where they go
    begin: int
    end: int
    numel: int


def _broadcast_pieces(staging: Staging, pieces: list[_Piece], state_dict: dict) -> None:
    """Rank 0's whole tensors, one stream of staging words in rounds of the slot's size -> each rank's pieces.

    Each tensor travels in its dest's dtype, as words (_staging's to_words):
    exactly, whatever the dtype.
    """
    widths = [words_per_element(piece.dest.dtype) for piece in pieces]
    total = sum(piece.numel * width for piece, width in zip(pieces, widths))
    if total == 0:
        return
    is_root = staging.session.rank == 0
    stream = (torch.cat([to_words(state_dict[p.name].detach().to(p.dest.dtype)) for p in pieces])
              if is_root else None)
    capacity = staging.unsharded.numel()
    starts, position = [], 0
    for piece, width in zip(pieces, widths):
        starts.append(position)
        position += piece.numel * width
    # Where each piece's words land: its dest's bits (4 bytes and wider), or its values.
    targets = [p.dest.view(torch.float32) if p.dest.dtype.itemsize >= 4 else p.dest for p in pieces]
    with torch.no_grad():
        for lo in range(0, total, capacity):
            hi = min(lo + capacity, total)
            if is_root:
                staging.unsharded[: hi - lo].copy_(stream[lo:hi])
            staging.broadcast_from_rank0()
            for piece, width, start, target in zip(pieces, widths, starts, targets):
                a, b = max(start + piece.begin * width, lo), min(start + piece.end * width, hi)
                if a < b:
                    offset = a - start - piece.begin * width
                    target[offset : offset + b - a].copy_(staging.unsharded[a - lo : b - lo])


def _load_entry(entry: ParamEntry, name: str, value) -> None:
    info = entry.sharded.shard_info
    if isinstance(value, LocalShard):
        if (value.info.global_shape, value.info.begin, value.info.end) != (info.global_shape, info.begin, info.end):
            raise ValueError(
                f"{name}: this sharded state dict was made on another plan (elements "
                f"[{value.info.begin}, {value.info.end}) of {tuple(value.info.global_shape)}, this rank holds "
                f"[{info.begin}, {info.end}) of {tuple(info.global_shape)}): load a full state dict instead"
            )
        entry.local.copy_(value.local)
        return
    if tuple(value.shape) != tuple(entry.sharded.shape):
        raise ValueError(f"{name}: shape {tuple(value.shape)} in the state dict, {tuple(entry.sharded.shape)} here")
    entry.local.copy_(entry.sharded.local_part(value.detach()))

