"""dbuf.torch.auto_wrap: units chosen by the planner (diagnosis or budget), registered with a real dbufd."""

from __future__ import annotations

import torch
from torch import nn

import dbuf
import dbuf.torch as dt
from conftest import rank_mesh, run_threads


def session_of(daemon, rank: int, world: int) -> dt.Session:
    client = dbuf.Client(daemon.socket)
    client.attach("wrap", rank, world)
    return dt.Session(client, job="wrap", rank=rank, world_size=world, local_rank=rank, prefetch_depth=1,
                      mesh=rank_mesh(rank, world))


class Stack(nn.Module):
    """Blocks of one 64 x 32 matrix: two bands of rows:32 each, too few for 4 ranks alone."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(32, 64, bias=False) for _ in range(blocks))
        self.out = nn.Linear(64, 8)


def test_blocks_that_cannot_balance_alone_are_merged_as_the_diagnosis_says(daemon):
    world = 4

    def rank(r: int):
        torch.manual_seed(0)
        model = Stack(6)
        units = dt.auto_wrap(model, granularity="rows:32", session=session_of(daemon, r, world))
        return [(u.modules, round(u.inflation, 3), u.merged_because is not None) for u in units]

    chosen = run_threads(world, rank)
    assert all(c == chosen[0] for c in chosen)  # every rank chose the same units
    blocks = [modules for modules, _, _ in chosen[0][:-1]]
    # Alone: 2 bands for 4 ranks, 2x of N. Merged in pairs: 4 bands, 1x.
    assert blocks == [("blocks.0", "blocks.1"), ("blocks.2", "blocks.3"), ("blocks.4", "blocks.5")]
    assert all(inflation == 1.0 and merged for _, inflation, merged in chosen[0][:-1])
    assert chosen[0][-1][0] == ("",)


def test_max_merge_bounds_a_unit(daemon):
    def rank(r: int):
        torch.manual_seed(0)
        units = dt.auto_wrap(Stack(4), granularity="rows:32", max_merge=1, session=session_of(daemon, r, 4))
        return [(u.modules, u.inflation) for u in units[:-1]]

    for chosen in run_threads(4, rank):
        assert [m for m, _ in chosen] == [(f"blocks.{i}",) for i in range(4)]
        assert all(inflation == 2.0 for _, inflation in chosen)


def test_an_unsharded_budget_merges_with_the_smallest_buffer_that_balances(daemon):
    # fp32 parameters at 4 ranks: a block alone or a pair has S = one band,
    # 16 KiB unsharded (2x of N alone, 1x in pairs); four merged would be
    # 1x too, at 32 KiB. Within 1 MiB the smallest buffer within 5% is pairs.
    world = 4

    def rank(r: int):
        torch.manual_seed(0)
        units = dt.auto_wrap(
            Stack(6), granularity="rows:32", unsharded_budget=1 << 20, session=session_of(daemon, r, world)
        )
        return [(u.modules, round(u.inflation, 3), u.merged_because) for u in units]

    chosen = run_threads(world, rank)
    assert all(c == chosen[0] for c in chosen)
    blocks = chosen[0][:-1]
    assert [modules for modules, _, _ in blocks] == [
        ("blocks.0", "blocks.1"),
        ("blocks.2", "blocks.3"),
        ("blocks.4", "blocks.5"),
    ]
    assert all(inflation == 1.0 for _, inflation, _ in blocks)
    assert all(why is not None and "unsharded_budget=1048576" in why for _, _, why in blocks)
    assert chosen[0][-1][0] == ("",)


def test_a_budget_below_one_block_keeps_every_block_alone(daemon):
    def rank(r: int):
        torch.manual_seed(0)
        session = session_of(daemon, r, 4)
        units = dt.auto_wrap(Stack(4), granularity="rows:32", unsharded_budget=8 << 10, session=session)
        return [(u.modules, u.inflation, u.merged_because) for u in units[:-1]]

    for chosen in run_threads(4, rank):
        assert [m for m, _, _ in chosen] == [(f"blocks.{i}",) for i in range(4)]
        assert all(inflation == 2.0 and why is None for _, inflation, why in chosen)


def test_max_merge_still_bounds_a_unit_under_a_budget(daemon):
    def rank(r: int):
        torch.manual_seed(0)
        units = dt.auto_wrap(
            Stack(4), granularity="rows:32", unsharded_budget=1 << 20, max_merge=1, session=session_of(daemon, r, 4)
        )
        return [u.modules for u in units[:-1]]

    for chosen in run_threads(4, rank):
        assert chosen == [(f"blocks.{i}",) for i in range(4)]


def test_blocks_that_balance_stay_one_unit_each(daemon):
    def rank(r: int):
        torch.manual_seed(0)
        units = dt.auto_wrap(Stack(3), granularity="element", session=session_of(daemon, r, 2))
        return [u.modules for u in units]

    for chosen in run_threads(2, rank):
        assert chosen == [("blocks.0",), ("blocks.1",), ("blocks.2",), ("",)]


class TiedAcross(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def test_weights_tied_across_units_are_refused_at_the_first_forward(daemon):
    # Where FSDP2 refuses them (its lazy init), with its exception type.
    session = session_of(daemon, 0, 1)
    model = TiedAcross()
    dt.fully_shard(model.embed, session=session)
    dt.fully_shard(model, session=session)
    for _ in range(2):
        try:
            model(torch.zeros(2, dtype=torch.long))
        except ValueError as error:
            assert "head.weight" in str(error) and "shared" in str(error) and "fully_shard([" in str(error)
        else:
            raise AssertionError("a weight tied across two units was sharded twice")


def test_state_dicts_keep_parameters_no_unit_shards_and_persistent_buffers_only(daemon):
    def rank(r: int):
        torch.manual_seed(0)
        model = Stack(2)
        model.register_buffer("kept", torch.arange(3))
        model.register_buffer("scratch", torch.ones(2), persistent=False)
        ignored = set(model.out.parameters())
        dt.fully_shard(model, session=session_of(daemon, r, 2), ignored_params=ignored)
        full = dt.get_model_state_dict(model, full=True, rank0_only=False)
        sharded = dt.get_model_state_dict(model, full=False)
        return full, sharded, {n: p.detach().clone() for n, p in model.out.named_parameters()}

    for full, sharded, out in run_threads(2, rank):
        for state in (full, sharded):
            assert "kept" in state and "scratch" not in state
            assert torch.equal(state["out.weight"], out["weight"]) and torch.equal(state["out.bias"], out["bias"])
        assert isinstance(sharded["blocks.0.weight"], dt.LocalShard)
        assert full["blocks.0.weight"].shape == (64, 32)


def test_fsdp2_state_fields_dbuf_lacks_name_dbuf(daemon):
    # torch code reading FSDP2's internal state (pipelining's schedules, the memory tracker) learns why.
    model = Stack(2)
    dt.fully_shard(model, session=session_of(daemon, 0, 1))
    state = model._get_fsdp_state()
    assert state is dt.fully_shard.state(model)
    try:
        state._fsdp_param_group
    except AttributeError as error:
        assert "dbuf" in str(error) and "_fsdp_param_group" in str(error)
    else:
        raise AssertionError("a field of FSDP2's state read on a dbuf unit")
    assert not hasattr(state, "_fsdp_param_groups")
