"""An automatic wrap policy: which submodules become units, chosen with the planner.

The candidates are the repeated blocks of a model: the children of every
``nn.ModuleList`` / ``nn.Sequential`` (the outermost such lists; a transformer's
decoder layers), one unit each as a user would wrap them by hand. Each list is
planned as consecutive units at the job's world size (``dbuf.plan_model``);
where the planner's diagnosis says a block cannot get within 5% of ``N/V`` on
its own (coarse blocks at many ranks), it names how many consecutive blocks
merged would, and those become one unit (FSDP2's grouped ``fully_shard([...])``),
up to ``max_merge`` blocks. With ``unsharded_budget`` (bytes per rank of a
unit's unsharded buffer) the runs come from ``dbuf.plan_merges`` instead: the
consecutive blocks to merge so that the list's all-gather volume is within 5%
of ``N`` at the smallest unsharded buffer, or, where the budget does not allow
that, the least volume within it. The rest of the model's parameters form the
root unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

import dbuf

from ._fully_shard import Granularity, _session_for, fully_shard
from ._session import Session
from ._unit import Unit, dbuf_dtype


@dataclass(frozen=True)
class WrappedUnit:
    """A unit the policy chose: its modules' names, and its plan's all-gather volume against N."""

    modules: tuple[str, ...]
    inflation: float
    merged_because: str | None


def _block_lists(model: nn.Module) -> list[tuple[str, list[tuple[str, nn.Module]]]]:
    """The outermost ModuleLists / Sequentials with at least two children that hold parameters."""
    found: list[tuple[str, list[tuple[str, nn.Module]]]] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in taken):
            continue
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and module is not model:
            children = [
                (f"{name}.{child}", sub)
                for child, sub in module.named_children()
                if any(True for _ in sub.parameters())
            ]
            if len(children) >= 2:
                found.append((name, children))
                taken.append(name)
    return found


def _specs(module: nn.Module, granularity: Granularity) -> list[dbuf.TensorSpec]:
    specs = []
    for fqn, param in module.named_parameters():
        rule = granularity(fqn, param) if callable(granularity) else None
        specs.append(dbuf.TensorSpec(fqn, tuple(param.shape), granularity=rule))
    return specs


def _diagnosed_runs(plans: list[dbuf.UnitPlan], max_merge: int | None) -> list[tuple[int, int, str | None]]:
    """(first, count, why) from each block's diagnosis: merge as many as it names, up to max_merge."""
    runs: list[tuple[int, int, str | None]] = []
    i = 0
    while i < len(plans):
        diagnosis = plans[i].diagnosis
        count, reason = 1, None
        if diagnosis is not None and diagnosis.merge_units is not None and diagnosis.merge_units > 1:
            count = diagnosis.merge_units
            reason = (
                f"alone {plans[i].inflation:.3f}x of N (blocks of {', '.join(diagnosis.forcing_tensors)}); "
                f"{count} merged get within 5%"
            )
        count = min(count, len(plans) - i, max_merge or len(plans))
        runs.append((i, count, reason))
        i += count
    return runs


def _budgeted_runs(merges: dbuf.MergePlan, budget: int) -> list[tuple[int, int, str | None]]:
    """(first, count, why) of the runs plan_merges chose under the budget."""
    runs: list[tuple[int, int, str | None]] = []
    for run in merges.runs:
        reason = None
        if run.count > 1:
            reason = (
                f"{run.count} merged within unsharded_budget={budget} bytes ({run.unsharded_bytes} bytes unsharded): "
                f"the blocks {merges.unmerged_inflation:.3f}x of N one by one, {merges.inflation:.3f}x merged"
            )
        runs.append((run.first, run.count, reason))
    return runs


def auto_wrap(
    model: nn.Module,
    *,
    granularity: Granularity = "element",
    mp_policy: Any = None,
    max_merge: int | None = None,
    unsharded_budget: int | None = None,
    world_size: int | None = None,
    session: Session | None = None,
    **fully_shard_kwargs: Any,
) -> list[WrappedUnit]:
    """Applies ``fully_shard`` to the units the planner recommends, then to ``model`` (the root).

    Args:
        granularity: as for fully_shard (the rule the plans are made with).
        mp_policy: as for fully_shard (its param_dtype is the dtype planned).
        max_merge: most blocks one unit may hold (a bound on unsharded memory:
            a unit's slot holds its blocks' parameters and gradients).
        unsharded_budget: bytes per rank of a unit's unsharded buffer (V*S
            elements of the dtype planned). When given, the blocks to merge
            come from ``dbuf.plan_merges`` under this budget (within 5% of N
            at the smallest buffer where the budget allows, else the least
            volume) instead of each block's diagnosis; a block larger alone
            stays alone. max_merge still bounds a unit's blocks.
        world_size: ranks to plan for (default: the session's).
    Returns the units chosen, root last, with their all-gather inflation.
    """
    # The session of the mesh the units will be on (a dp slice's or HSDP's, not only the launch's).
    session = session if session is not None else _session_for(fully_shard_kwargs.get("mesh"), None)
    devices = world_size if world_size is not None else session.world_size
    default_rule = granularity if isinstance(granularity, str) else "element"
    kwargs = dict(fully_shard_kwargs, granularity=granularity, session=session)
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    param_dtype = getattr(mp_policy, "param_dtype", None)
    chosen: list[WrappedUnit] = []
    for _, blocks in _block_lists(model):
        dtype = param_dtype or next(blocks[0][1].parameters()).dtype
        units = [(name, _specs(block, granularity)) for name, block in blocks]
        if unsharded_budget is None:
            plans = dbuf.plan_model(units, devices, granularity=default_rule, dtype=dbuf_dtype(dtype))
            runs = _diagnosed_runs(plans, max_merge)
        else:
            merges = dbuf.plan_merges(
                units,
                devices,
                unsharded_budget=unsharded_budget,
                granularity=default_rule,
                dtype=dbuf_dtype(dtype),
                max_run_units=max_merge or 0,
            )
            runs = _budgeted_runs(merges, unsharded_budget)
        for first, count, reason in runs:
            group = blocks[first : first + count]
            modules = [module for _, module in group]
            fully_shard(modules if count > 1 else modules[0], **kwargs)
            chosen.append(WrappedUnit(tuple(name for name, _ in group), _inflation(session.units[-1]), reason))
    fully_shard(model, **kwargs)
    chosen.append(WrappedUnit(("",), _inflation(session.units[-1]), None))
    return chosen


def _inflation(unit: Unit) -> float:
    """V*S / N of the plan dbufd made for the unit (1 for a unit without parameters)."""
    if unit.group is None:
        return 1.0
    plan = unit.group.plan
    return plan.devices * plan.shard_elems / sum(t.numel for t in plan.tensors)
