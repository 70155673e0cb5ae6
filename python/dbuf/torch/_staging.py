"""Exact transfers of whole tensors through dbufd: the session's fp32 staging group.

A small fp32 -> fp32 group (Session.staging) moves every rank's local
elements of a unit's group to the ranks that want them whole (all-gathers),
or rank 0's whole tensors to every rank (broadcasts), in rounds of
``Session.STAGING_ELEMS`` words per rank. Full state dicts use it, and a
unit moving its parameters to new groups (a cast after fully_shard). Every
call is a collective: every rank makes it, in the same order.

Every dtype travels exactly: elements of up to 2 bytes as their values
(fp32 holds every bf16, fp16, fp8 and 8- or 16-bit integer), wider ones
(fp32, fp64, int32, int64) as their bits, one fp32 word per 4 bytes. dbufd
copies an fp32 -> fp32 group's words as they are, NaN payloads included.
"""

from __future__ import annotations

import torch

import dbuf

from ._ragged import rank_ranges
from ._session import Session


def words_per_element(dtype: torch.dtype) -> int:
    """The staging group's fp32 words one element of `dtype` takes."""
    return dtype.itemsize // 4 if dtype.itemsize >= 4 else 1


def to_words(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as 1-D fp32 words the staging group carries exactly (see the module's note)."""
    flat = tensor.detach().resolve_conj().reshape(-1)
    return flat.contiguous().view(torch.float32) if tensor.dtype.itemsize >= 4 else flat.float()


def from_words(words: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """to_words' inverse: 1-D elements of `dtype`."""
    return words.contiguous().view(dtype) if dtype.itemsize >= 4 else words.to(dtype)


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
    group's order (one dtype, the group's); each whole tensor comes back in
    its entry's dtype and shape, exactly.
    """
    per_tensor = [rank_ranges(group.plan, index) for index in range(len(group.plan.tensors))]
    world = group.plan.devices
    width = words_per_element(entries[0].local.dtype) if entries else 1
    slices = [[(begin * width, end * width) for begin, end in (ranges[rank] for ranges in per_tensor)]
              for rank in range(world)]
    payload_sizes = [sum(end - begin for begin, end in rank) for rank in slices]
    mine = group.rank
    local = [to_words(entry.local) for entry in entries]
    payload = torch.cat(local) if local else torch.empty(0, dtype=torch.float32, device=staging.shard.device)
    if payload.numel() != payload_sizes[mine]:
        raise dbuf.InternalError(f"group {group.name}: this rank holds {payload.numel()} elements, its plan says "
                                 f"{payload_sizes[mine]}")
    # fp32 whatever torch's default dtype: words are bits, not values
    received = ([torch.empty(size, dtype=torch.float32, device=staging.shard.device) for size in payload_sizes]
                if receives else [])
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
        whole.append(from_words(torch.cat(parts), entry.local.dtype).reshape(entry.sharded.shape))
    return whole
