"""The planner from Python: the design brief's reference vectors, and a diagnosis where a unit cannot balance."""

from __future__ import annotations

import pytest

import dbuf


def test_toy_unit_matches_the_briefs_baselines():
    tensors = [dbuf.TensorSpec("A", (5, 4)), dbuf.TensorSpec("B", (3, 2)), dbuf.TensorSpec("C", (7,))]
    plan = dbuf.plan_unit(tensors, 4, dtype="bf16")
    baselines = dict(plan.baselines)
    assert (baselines["fsdp2"], baselines["fsdp1"], baselines["zero3"], baselines["megatron"]) == (12, 10, 9, 12)
    assert plan.numel == 33 and plan.split_blocks == 0
    assert plan.shard_elems >= plan.lower_bound_elems >= plan.ideal_elems == 9
    assert [t.name for t in plan.tensors] == ["A", "B", "C"]


def test_rows_granularity_never_splits_a_band():
    plan = dbuf.plan_unit([dbuf.TensorSpec("w", (96, 64))], 4, granularity="rows:32")
    (w,) = plan.tensors
    assert w.granularity == 32 * 64
    for rank in range(4):
        boundary = rank * plan.shard_elems
        if w.offset < boundary < w.offset + w.numel:
            assert (boundary - w.offset) % w.granularity == 0


def test_a_unit_too_coarse_for_its_ranks_is_diagnosed():
    layer = [(f"layer{i}", [dbuf.TensorSpec("w", (1024, 512))]) for i in range(8)]
    plans = dbuf.plan_model(layer, 256, granularity="rows:32")
    first = plans[0]
    assert first.inflation > 1.05 and first.diagnosis is not None
    assert first.diagnosis.forcing_tensors == ["w"]
    assert first.diagnosis.merge_units is None or first.diagnosis.merge_units > 1


def test_plan_merges_merges_layers_that_cannot_balance_alone_within_the_budget():
    # 32 bands of 32 rows per layer, 256 ranks: alone 8x of N; all 8 layers
    # merged fill every rank with one band (8 MiB of bf16 unsharded, like one
    # layer alone).
    layers = [(f"layer{i}", [dbuf.TensorSpec(f"layer{i}.w", (1024, 512))]) for i in range(8)]
    merged = dbuf.plan_merges(layers, 256, unsharded_budget=8 << 20, granularity="rows:32")
    assert isinstance(merged, dbuf.MergePlan)
    assert [(run.first, run.count) for run in merged.runs] == [(0, 8)]
    (run,) = merged.runs
    assert isinstance(run, dbuf.MergedRun) and run.name == "layer0..layer7" and not run.over_budget
    assert run.plan.shard_elems == run.shard_elems
    assert [t.name for t in run.plan.tensors] == [f"layer{i}.w" for i in range(8)]
    assert merged.within_target and merged.merges == 7
    assert merged.inflation == 1.0 and merged.unmerged_inflation == 8.0
    assert merged.peak_unsharded_bytes == run.unsharded_bytes == 8 << 20 == merged.unmerged_peak_unsharded_bytes
    # Below one layer's buffer nothing merges; every layer is kept, over the budget.
    tight = dbuf.plan_merges(layers, 256, unsharded_budget=4 << 20, granularity="rows:32")
    assert [run.count for run in tight.runs] == [1] * 8 and all(run.over_budget for run in tight.runs)
    assert not tight.within_target and tight.inflation == 8.0 and tight.over_budget_units == 8
    # max_run_units bounds a run: pairs at most, 4x.
    pairs = dbuf.plan_merges(layers, 256, unsharded_budget=8 << 20, granularity="rows:32", max_run_units=2)
    assert [run.count for run in pairs.runs] == [2] * 4 and pairs.inflation == 4.0
    with pytest.raises(dbuf.InvalidArgumentError, match="budget"):
        dbuf.plan_merges(layers, 256, unsharded_budget=0)
    with pytest.raises(dbuf.InvalidArgumentError, match="no units"):
        dbuf.plan_merges([], 256, unsharded_budget=1)


def test_bad_rules_and_shapes_raise():
    with pytest.raises(dbuf.InvalidArgumentError):
        dbuf.plan_unit([dbuf.TensorSpec("w", (4, 4))], 4, granularity="stripes:3")
    with pytest.raises(dbuf.InvalidArgumentError):
        dbuf.plan_unit([dbuf.TensorSpec("w", (4, -1))], 4)
    with pytest.raises(ValueError):
        dbuf.plan_unit([dbuf.TensorSpec("w", (4, 4))], 0)
