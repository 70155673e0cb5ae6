"""One rank of dbuf.torch against torch's FSDP2, side by side in one process, scenario by scenario.

  side_by_side.py SCENARIO [SCENARIO...]     (torchrun's environment; see test_fsdp2_parity.py)

Each scenario builds one model twice from one seed, shards one copy with
torch 2.15's ``fully_shard`` and the other with dbuf's (on one gloo process
group, one dbufd job), trains both on the same batches and checks that every
loss, every gradient's presence and every parameter are FSDP2's: bit for bit
on 2 ranks (two addends commute), within float rounding on more. The
functions here are also run by ranks that are threads (test_fsdp2_parity.py)
and ranks that ``torch.multiprocessing.spawn`` started with explicit ranks.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor

import dbuf.torch as dt

Shard = Callable[..., nn.Module]
#: torch's generator is the process's: ranks that are threads build their models one at a time.
_seeded = threading.Lock()


# ------------------------------------------------------------ models


class DoubleLinear(nn.Module):
    """torch's test model: two heads; a backward may reach one of them only."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin1(x).relu(), self.lin2(x).relu()


class TiedLM(nn.Module):
    """Embedding and output tied (one parameter), blocks between; vocab x dim not a multiple of the ranks."""

    def __init__(self, vocab: int = 13, dim: int = 5, blocks: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(blocks))
        self.output = nn.Linear(dim, vocab, bias=False)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.blocks:
            h = block(h)
        return self.output(h)


class FrozenBaseBlock(nn.Module):
    """A trainable fp32 adapter over frozen weights of other dtypes (an fp8 base, an int8 table, fp64 scales):
    one unit holds parameters of four dtypes."""

    def __init__(self, dim: int = 7) -> None:
        super().__init__()
        self.base = nn.Parameter((torch.randn(dim, dim) * 0.5).to(torch.float8_e4m3fn), requires_grad=False)
        self.codes = nn.Parameter(torch.randint(-100, 100, (dim,), dtype=torch.int8), requires_grad=False)
        self.scales = nn.Parameter(torch.rand(dim, dtype=torch.float64) + 0.5, requires_grad=False)
        self.adapter = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frozen = x @ self.base.float().t() * self.scales.float() + self.codes.float() / 100
        return torch.tanh(frozen + self.adapter(x))


def stack(units: int, dim: int = 7) -> nn.Sequential:
    return nn.Sequential(*(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(units)))


# ------------------------------------------------------------ checks


def world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def same(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit on 2 ranks; within rounding where more ranks' sums may be added in another order."""
    if world()[1] <= 2:
        assert torch.equal(got, want), f"{what}: max difference {(got - want).abs().max().item()}"
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7, msg=lambda m: f"{what}: {m}")


def same_parameters(what: str, dbuf_model: nn.Module, fsdp_model: nn.Module) -> None:
    """The trainable ones (frozen parameters' whole values show in the losses: gloo gathers no fp8)."""
    for (name, mine), (_, theirs) in zip(dbuf_model.named_parameters(), fsdp_model.named_parameters()):
        if theirs.requires_grad:
            same(f"{what}: {name}", mine.full_tensor(), theirs.full_tensor())


def same_gradients(what: str, dbuf_model: nn.Module, fsdp_model: nn.Module) -> None:
    """Which gradients exist, and their values."""
    for (name, mine), (_, theirs) in zip(dbuf_model.named_parameters(), fsdp_model.named_parameters()):
        assert (mine.grad is None) == (theirs.grad is None), (
            f"{what}: {name}.grad is {'None' if mine.grad is None else 'set'} on dbuf, "
            f"{'None' if theirs.grad is None else 'set'} on FSDP2"
        )
        if mine.grad is not None:
            same(f"{what}: {name}.grad", mine.grad.full_tensor(), theirs.grad.full_tensor())


def blocks_then_root(model: nn.Module, fully_shard: Shard) -> None:
    """Each block a unit, then the root (FSDP2's usual wrapping)."""
    for block in model:
        fully_shard(block)
    fully_shard(model)


def twins(build: Callable[[], nn.Module], shard: Callable[[nn.Module, Shard], None]) -> tuple[nn.Module, nn.Module]:
    """The model built twice from one seed: sharded by dbuf, and by FSDP2."""
    models = []
    for fully_shard in (dt.fully_shard, fsdp2_fully_shard):
        with _seeded:
            torch.manual_seed(0)
            model = build()
        shard(model, fully_shard)
        models.append(model)
    return models[0], models[1]


def batch(step: int, shape: tuple[int, ...], *, vocab: int | None = None) -> torch.Tensor:
    """This rank's batch of a step (another one on each rank)."""
    generator = torch.Generator().manual_seed(1000 * step + world()[0])
    if vocab is not None:
        return torch.randint(0, vocab, shape, generator=generator)
    return torch.randn(shape, generator=generator)


def train_side_by_side(dbuf_model, fsdp_model, loss_of, steps: int, what: str) -> None:
    """AdamW on both; every step's loss, gradients and parameters the same."""
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (dbuf_model, fsdp_model)]
    for step in range(steps):
        losses = [loss_of(model, step) for model in (dbuf_model, fsdp_model)]
        same(f"{what}: loss of step {step}", losses[0].detach(), losses[1].detach())
        for loss in losses:
            loss.backward()
        same_gradients(f"{what}: step {step}", dbuf_model, fsdp_model)
        for optimizer in optimizers:
            optimizer.step()
            if step < steps - 1:
                optimizer.zero_grad(set_to_none=True)
        same_parameters(f"{what}: after step {step}", dbuf_model, fsdp_model)


# ------------------------------------------------------------ scenarios


def unused_parameters(reduce_unused: bool = False) -> None:
    """A backward that reaches lin1 only: lin2's gradients stay None, so AdamW leaves lin2 alone (torch's autograd test).

    With `reduce_unused` (set_reduce_scatter_unused_params(True)) lin2 gets a
    reduced gradient instead: zeros, as FSDP2 then reduce-scatters them.
    """

    def shard(model, fully_shard):
        policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)  # FSDP2 wants one to reduce unused parameters
        fully_shard(model.heads, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        model.set_reduce_scatter_unused_params(reduce_unused)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = DoubleLinear(6)
            self.head = nn.Linear(6, 1)

        def forward(self, x, both):
            a, b = self.heads(x)
            return self.head(a + b if both else a).sum()

    dbuf_model, fsdp_model = twins(Model, shard)
    train_side_by_side(dbuf_model, fsdp_model, lambda m, step: m(batch(step, (4, 6)), step == 0), 4, "unused")
    assert (dbuf_model.heads.lin2.weight.grad is None) == (not reduce_unused)


def post_accumulate_grad_hooks() -> None:
    """Optimizer in backward: a per-parameter AdamW stepped by each sharded parameter's post-accumulate-grad hook."""

    dbuf_model, fsdp_model = twins(lambda: stack(3), blocks_then_root)
    fired = {}
    for name, model in (("dbuf", dbuf_model), ("fsdp2", fsdp_model)):
        optimizers = {p: torch.optim.AdamW([p], lr=1e-2) for p in model.parameters()}
        fired[name] = 0

        def step_in_backward(param, optimizers=optimizers, name=name):
            fired[name] += 1
            optimizers[param].step()
            optimizers[param].zero_grad(set_to_none=True)

        for param in model.parameters():
            param.register_post_accumulate_grad_hook(step_in_backward)
    for step in range(3):
        losses = [m(batch(step, (4, 7))).square().sum() for m in (dbuf_model, fsdp_model)]
        same(f"hooks: loss of step {step}", losses[0].detach(), losses[1].detach())
        for loss in losses:
            loss.backward()
        same_parameters(f"hooks: after step {step}", dbuf_model, fsdp_model)
    assert fired["dbuf"] == fired["fsdp2"] == 3 * len(list(dbuf_model.parameters())), fired


def keep_parameters_over_eight_units() -> None:
    """reshard_after_forward=False on 8 units at the default settings (more units than slots in the pool)."""

    def shard(model, fully_shard):
        for block in model:
            fully_shard(block, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)

    dbuf_model, fsdp_model = twins(lambda: stack(8), shard)
    train_side_by_side(dbuf_model, fsdp_model, lambda m, step: m(batch(step, (3, 7))).square().mean(), 3, "keep")


def reshard_to_a_smaller_group() -> None:
    """reshard_after_forward=2 (on 4 ranks): FSDP2's group size to reshard to after forward."""

    def shard(model, fully_shard):
        for block in model:
            fully_shard(block, reshard_after_forward=2)
        fully_shard(model)

    dbuf_model, fsdp_model = twins(lambda: stack(4), shard)
    train_side_by_side(dbuf_model, fsdp_model, lambda m, step: m(batch(step, (3, 7))).square().mean(), 3, "int")


def tied_embedding_and_output_in_one_unit() -> None:
    """fully_shard([tok_embeddings, output]) with the weight tied, shards uneven: gradients of both add up."""

    def shard(model, fully_shard):
        for block in model.blocks:
            fully_shard(block)
        fully_shard([model.tok_embeddings, model.output])
        fully_shard(model)

    dbuf_model, fsdp_model = twins(TiedLM, shard)
    assert dbuf_model.output.weight is dbuf_model.tok_embeddings.weight

    def loss_of(model, step):
        tokens = batch(step, (2, 6), vocab=13)
        return nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())

    train_side_by_side(dbuf_model, fsdp_model, loss_of, 4, "tied")


def frozen_parameters_of_other_dtypes() -> None:
    """fp8, int8 and fp64 frozen parameters beside trainable fp32 ones in each unit: gathered as they are, the
    adapters trained as FSDP2 trains them. A parameter of another dtype than the trainable ones refuses a
    gradient; a dtype dbufd does not hold is refused at fully_shard."""
    dbuf_model, fsdp_model = twins(lambda: nn.Sequential(*(FrozenBaseBlock() for _ in range(3))), blocks_then_root)
    trainable = [(n, p) for n, p in dbuf_model.named_parameters() if p.requires_grad]
    assert [n for n, _ in trainable] == [f"{b}.adapter.{w}" for b in range(3) for w in ("weight", "bias")], trainable
    for (name, mine), (_, theirs) in zip(dbuf_model.named_parameters(), fsdp_model.named_parameters()):
        assert mine.dtype == theirs.dtype and mine.to_local().dtype == theirs.dtype, name

    def loss_of(model, step):
        return model(batch(step, (4, 7))).square().mean()

    train_side_by_side(dbuf_model, fsdp_model, loss_of, 3, "frozen dtypes")

    error = raised(lambda: dt.fully_shard(nn.Linear(4, 4).to(torch.complex64)))
    assert isinstance(error, TypeError) and "not torch.complex64" in str(error), repr(error)

    dbuf_model[0].scales.requires_grad_(True)
    error = raised(lambda: dbuf_model(batch(0, (4, 7))))
    assert isinstance(error, TypeError) and "scales (torch.float64)" in str(error) and "frozen" in str(error), repr(error)


def cast_after_init() -> None:
    """model.to(dtype) after fully_shard, bf16 and fp64 (FSDP2's test casts to fp64): the parameters move to groups
    of the new dtype (the modules keep their parameter objects) and train as FSDP2's, fp64 gradients summed in
    fp64; a full state dict gathers them exactly. A cast to a dtype dbufd does not hold is refused with the
    parameters left as they were."""
    for dtype in (torch.bfloat16, torch.float64):

        def shard(model, fully_shard):
            blocks_then_root(model, fully_shard)
            objects = [id(p) for p in model.parameters()]
            model.to(dtype)
            assert [id(p) for p in model.parameters()] == objects

        dbuf_model, fsdp_model = twins(lambda: stack(3), shard)
        for name, param in dbuf_model.named_parameters():
            assert param.dtype == param.to_local().dtype == param._spec.tensor_meta.dtype == dtype, name

        def loss_of(model, step):
            return model(batch(step, (4, 7)).to(dtype)).float().square().mean()

        train_side_by_side(dbuf_model, fsdp_model, loss_of, 3, f"cast to {dtype}")
        for model in (dbuf_model, fsdp_model):  # gradient accumulation: the second backward adds to the first
            model.zero_grad(set_to_none=True)
            for step in (5, 6):
                loss_of(model, step).backward()
        same_gradients(f"cast to {dtype}: two backwards accumulated", dbuf_model, fsdp_model)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)  # as fp64 trainers often do: the staging words stay fp32
        try:
            full = dt.get_model_state_dict(dbuf_model, full=True, rank0_only=False)
        finally:
            torch.set_default_dtype(previous)
        for (name, theirs) in fsdp_model.named_parameters():
            assert full[name].dtype == dtype, name
            same(f"full state dict, {name}", full[name], theirs.full_tensor().detach())

    with _seeded:
        torch.manual_seed(0)
        fresh = stack(2)
    blocks_then_root(fresh, dt.fully_shard)
    before = [p.full_tensor().detach() for p in fresh.parameters()]
    error = raised(lambda: fresh.to(torch.complex64))
    assert isinstance(error, TypeError) and "not torch.complex64" in str(error), repr(error)
    for param, was in zip(fresh.parameters(), before):
        assert param.dtype == torch.float32 and torch.equal(param.full_tensor(), was)
    fresh(batch(9, (4, 7))).sum().backward()

    # fp64 is never cast: a bf16 param_dtype over fp64 parameters is refused, the unit left as it was.
    with _seeded:
        torch.manual_seed(0)
        mixed = stack(2)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    blocks_then_root(mixed, lambda module: dt.fully_shard(module, mp_policy=policy))
    error = raised(lambda: mixed.to(torch.float64))
    assert isinstance(error, TypeError) and "param_dtype" in str(error) and "left as they were" in str(error), error
    assert all(param.dtype == torch.float32 for param in mixed.parameters())
    mixed(batch(9, (4, 7))).float().sum().backward()


def parameter_shared_across_units() -> None:
    """Two units holding one parameter: each fully_shard call is taken; the first forward raises FSDP2's error."""
    errors = []
    for fully_shard in (fsdp2_fully_shard, dt.fully_shard):
        with _seeded:
            torch.manual_seed(0)
            model = stack(2)
        model[1][0].weight = model[0][0].weight
        fully_shard(model[0])
        fully_shard(model[1])
        fully_shard(model)
        errors.append(raised(lambda: model(batch(0, (2, 7))).sum().backward()))
    fsdp_error, dbuf_error = errors
    assert fsdp_error is not None, "FSDP2 trained a parameter shared across units"
    assert type(dbuf_error) is type(fsdp_error), f"dbuf raised {dbuf_error!r}, FSDP2 {fsdp_error!r}"


def roots_per_model() -> None:
    """Each model's first unit run at the top level is its root (FSDP2's lazy root), however many models a process
    trains: with the default reshard_after_forward a root keeps its parameters after forward, the others reshard.
    A child run at the top level before its model's root: FSDP2's RuntimeError at the root's first forward."""

    def shard(model, fully_shard):
        for block in model[:-1]:
            fully_shard(block)
        fully_shard(model)  # the root's own parameters: the last Linear

    def build():
        return nn.Sequential(*stack(2), nn.Linear(7, 7))

    for pair in range(2):  # the second pair in the same process: before, one process had one root for good
        dbuf_model, fsdp_model = twins(build, shard)
        for model in (dbuf_model, fsdp_model):
            model(batch(pair, (2, 7)))
        kept = [[not isinstance(p, DTensor) for p in m.parameters()] for m in (dbuf_model, fsdp_model)]
        assert kept[0] == kept[1] and any(kept[1]), f"pair {pair}: unsharded after forward: dbuf {kept[0]}, " \
                                                    f"FSDP2 {kept[1]}"
        for model in (dbuf_model, fsdp_model):
            model.reshard()
        train_side_by_side(dbuf_model, fsdp_model, lambda m, step: m(batch(step, (3, 7))).square().mean(), 2,
                           f"roots, pair {pair}")

    def child_first(fully_shard):
        model = build()
        shard(model, fully_shard)
        model[0](batch(0, (2, 7)))
        model(batch(0, (2, 7)))

    def child_lazy_init_first(fully_shard):  # trainers settle the root with the state's _lazy_init
        model = build()
        shard(model, fully_shard)
        fully_shard.state(model[0])._lazy_init()
        fully_shard.state(model)._lazy_init()

    def grouped_root(fully_shard):
        model = build()
        fully_shard([model[0], model[1]])
        fully_shard.state(model[0])._lazy_init()

    for case in (child_first, child_lazy_init_first, grouped_root):
        fsdp_error, dbuf_error = raised(lambda: case(fsdp2_fully_shard)), raised(lambda: case(dt.fully_shard))
        assert isinstance(fsdp_error, RuntimeError), fsdp_error
        first_lines = [str(error).split("\n")[0] for error in (dbuf_error, fsdp_error)]
        assert type(dbuf_error) is type(fsdp_error) and first_lines[0] == first_lines[1], \
            f"{case.__name__}: dbuf raised {dbuf_error!r}, FSDP2 {fsdp_error!r}"
    states = []
    for fully_shard in (fsdp2_fully_shard, dt.fully_shard):
        model = build()
        shard(model, fully_shard)
        before = fully_shard.state(model)._is_root
        fully_shard.state(model)._lazy_init()
        states.append([before, fully_shard.state(model)._is_root, fully_shard.state(model[0])._is_root])
    assert states[0] == states[1] == [None, True, False], states


def meta_device_init() -> None:
    """Built on the meta device (inside the device context, as torch's tests shard it): the parameters stay on meta
    until materialized, and a forward before raises FSDP2's error naming them; rank 0's full weights broadcast,
    distribute_tensor'd with each parameter's placements and assigned (accelerate's and torch's recipe): FSDP2's
    training."""

    with _seeded:
        torch.manual_seed(0)
        full = stack(3).state_dict()

    def on_meta(fully_shard):
        with torch.device("meta"):
            model = stack(3)
            blocks_then_root(model, fully_shard)
        assert all(p.is_meta for p in model.parameters()), "a parameter left the meta device at fully_shard"
        return model

    models, errors = [], []
    for fully_shard in (dt.fully_shard, fsdp2_fully_shard):
        # (A model whose first forward raised is not used again: FSDP2's is left half initialized.)
        errors.append(raised(lambda: on_meta(fully_shard)(batch(0, (2, 7)))))
        model = on_meta(fully_shard)
        sharded = {}
        for name, meta in model.state_dict().items():
            value = full[name].clone()
            dist.broadcast(value, src=0)
            # (Looked up now: dbuf.torch extends torch's distribute_tensor to RaggedShard when imported.)
            distribute = torch.distributed.tensor.distribute_tensor
            sharded[name] = nn.Parameter(distribute(value, meta.device_mesh, meta.placements))
        model.load_state_dict(sharded, assign=True)
        assert not any(p.is_meta for p in model.parameters())
        models.append(model)
    assert str(errors[0]) == str(errors[1]) and type(errors[0]) is type(errors[1]) is RuntimeError, errors
    train_side_by_side(*models, lambda m, step: m(batch(step, (3, 7))).square().mean(), 3, "meta")


def mesh_from_group() -> None:
    """A unit on ``DeviceMesh.from_group(world)`` beside units on the job's own mesh (another object, same ranks):
    its parameters live on the mesh it was given, as FSDP2's."""

    def shard(model, fully_shard):
        from_group = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        fully_shard(model[0], mesh=from_group)
        fully_shard(model[1])
        fully_shard(model)

    dbuf_model, fsdp_model = twins(lambda: stack(2), shard)
    assert dbuf_model[0][0].weight.device_mesh.mesh.tolist() == list(range(world()[1]))
    train_side_by_side(dbuf_model, fsdp_model, lambda m, step: m(batch(step, (3, 7))).square().mean(), 2, "from_group")


def all_reduce_hook() -> None:
    """set_all_reduce_hook: a hook that halves each unit's reduced gradients, called once per unit and backward."""

    dbuf_model, fsdp_model = twins(lambda: stack(3), blocks_then_root)
    calls = {"dbuf": 0, "fsdp2": 0}
    for name, model in (("dbuf", dbuf_model), ("fsdp2", fsdp_model)):
        def halve(output, name=name):
            calls[name] += 1
            output.mul_(0.5)

        for block in model:
            block.set_all_reduce_hook(halve)
    train_side_by_side(dbuf_model, fsdp_model, lambda m, step: m(batch(step, (3, 7))).square().mean(), 3, "hook")
    assert calls["dbuf"] == calls["fsdp2"] == 3 * 3, calls


def raised(call: Callable[[], object]) -> BaseException | None:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - compared by the caller
        return error
    return None


SCENARIOS = {
    "unused": unused_parameters,
    "unused-reduced": lambda: unused_parameters(reduce_unused=True),
    "hooks": post_accumulate_grad_hooks,
    "keep": keep_parameters_over_eight_units,
    "int": reshard_to_a_smaller_group,
    "tied": tied_embedding_and_output_in_one_unit,
    "shared": parameter_shared_across_units,
    "frozen-dtypes": frozen_parameters_of_other_dtypes,
    "cast": cast_after_init,
    "roots": roots_per_model,
    "meta": meta_device_init,
    "from-group": mesh_from_group,
    "all-reduce-hook": all_reduce_hook,
}


def run(names: list[str]) -> None:
    """The scenarios, in this rank (its default process group made already)."""
    for name in names:
        SCENARIOS[name]()


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    run(sys.argv[1:])
    print(f"rank {os.environ['RANK']}: {' '.join(sys.argv[1:])} as FSDP2")
    dist.destroy_process_group()
