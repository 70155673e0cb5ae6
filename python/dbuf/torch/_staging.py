"""Exact transfers of whole tensors through dbufd: the session's fp32 staging group.

A small fp32 -> fp32 group (Session.staging) moves every rank's local
elements of a unit's group to the ranks that want them whole (all-gathers),
or rank 0's whole tensors to every rank (broadcasts), in rounds of
``Session.STAGING_ELEMS`` elements per rank. Full state dicts use it, and a
unit moving its parameters to new groups (a cast after fully_shard). Every
call is a collective: every rank makes it, in the same order.
"""

from __future__ import annotations

import torch

import dbuf

from ._ragged import rank_ranges
from ._session import Session

# Dtypes whose every value the fp32 staging slot carries exactly.
STAGED_EXACTLY = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8,
                  torch.uint8)


class Staging:
    """The session's staging group, with its slot held while in use.

    Its ops are ordered on the session's stream (GPU memory), like the copies
    in and out of it.
    """

    def __init__(self, session: Session) -> None:
        self.session = session
        self.group = session.staging()
        self.elems = Session.STAGING_ELEMS

    def __enter__(self) -> Staging:
        self.session.make_room(None, required=True)
        self.group.acquire_slot(grow=True)
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


def gather_whole(group: dbuf.Group, entries: list, staging: Staging, receives: bool) -> list[torch.Tensor]:
    """Every rank's local elements of a group's tensors -> the whole tensors (where `receives`; else []).

    `entries`: the unit's ParamEntry of every tensor of the group, in the
    group's order, their dtypes among STAGED_EXACTLY; each whole tensor comes
    back in its entry's dtype and shape.
    """
    per_tensor = [rank_ranges(group.plan, index) for index in range(len(group.plan.tensors))]
    world = group.plan.devices
    slices = [[ranges[rank] for ranges in per_tensor] for rank in range(world)]
    payload_sizes = [sum(end - begin for begin, end in rank) for rank in slices]
    mine = group.rank
    local = [entry.local.detach().float() for entry in entries]
    payload = torch.cat(local) if local else torch.empty(0, device=staging.shard.device)
    if payload.numel() != payload_sizes[mine]:
        raise dbuf.InternalError(f"group {group.name}: this rank holds {payload.numel()} elements, its plan says "
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
        return []
    whole = []
    cursors = [0] * world
    for entry in entries:
        parts = []
        for rank in range(world):
            begin, end = slices[rank][entry.index]
            parts.append(received[rank][cursors[rank] : cursors[rank] + end - begin])
            cursors[rank] += end - begin
        whole.append(torch.cat(parts).reshape(entry.sharded.shape).to(entry.local.dtype))
    return whole
