"""A small decoder-like model and its data, shared by the rank scripts and the tests' single-process references."""

from __future__ import annotations

import copy

import torch
from torch import nn

VOCAB = 64


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Tiny(nn.Module):
    """kwargs_calls: blocks get their input as a keyword; freeze_outer: only the blocks train."""

    def __init__(self, d: int = 32, layers: int = 3, tied: bool = False, kwargs_calls: bool = False,
                 freeze_outer: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        if freeze_outer:
            for module in (self.embed, self.norm, self.head):
                module.requires_grad_(False)
        self.kwargs_calls = kwargs_calls
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))  # persistent: in state dicts
        self.register_buffer("scratch", torch.zeros(3), persistent=False)  # not in state dicts

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x=x) if self.kwargs_calls else block(x)
        return self.head(self.norm(x))


def make_model(seed: int = 0, **kwargs) -> Tiny:
    torch.manual_seed(seed)
    return Tiny(**kwargs)


def micro_batch(step: int, micro: int, rank: int, world: int, batch: int = 2, seq: int = 12):
    """Rank `rank`'s micro-batch `micro` of step `step`: the global batch is the ranks' in rank order."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, VOCAB, (world * batch, seq + 1), generator=g)
    mine = tokens[rank * batch : (rank + 1) * batch]
    return mine[:, :-1], mine[:, 1:]


def granularity_for(kind: str):
    """The RaggedShard rule each optimizer needs: Muon whole matrices, Adam8bit its blocks."""
    if kind == "muon":
        return "matrix"
    if kind == "adam8bit":
        return lambda fqn, param: "rows:4" if param.dim() > 1 else "rows:16"
    return "element"


def adam8bit_block(param: torch.Tensor) -> int:
    """The block granularity_for("adam8bit") gives a tensor (rows:4 of a 2D one, 16 of a vector)."""
    return 4 * param.shape[-1] if param.dim() > 1 else 16


def make_optimizer(model: nn.Module, kind: str = "adamw", lr: float = 1e-2) -> torch.optim.Optimizer:
    """The same optimizer over a sharded model (its RaggedShard DTensors) or a whole one."""
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr)
    from dbuf.torch.optim import Adam8bit, Muon

    if kind == "muon":
        matrices = [p for n, p in model.named_parameters() if n.startswith("blocks.") and n.endswith(".weight")
                    and ".norm." not in n]
        rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
        return Muon(matrices, lr=0.02, adamw_params=rest, adamw_lr=lr)
    if kind == "adam8bit":
        from dbuf.torch import RaggedDTensor

        groups = [{"params": [p], "block_elems": None if isinstance(p, RaggedDTensor) else adam8bit_block(p)}
                  for p in model.parameters()]
        return Adam8bit(groups, lr=lr)
    raise ValueError(kind)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))


def reference(steps: int, world: int, *, micro_batches: int = 1, sync_every_micro: bool = True,
              optimizer: str = "adamw", param_dtype: torch.dtype = torch.bfloat16,
              master_dtype: torch.dtype = torch.float32, two_forwards: bool = False, clip: float | None = None,
              skip_steps: tuple[int, ...] = (), ranks_per_node: int | None = None, **model_kwargs):
    """Single-process data parallelism with dbuf's casts and reduction order.

    Each rank's forward / backward runs on a copy of the master cast to
    param_dtype. sync_every_micro: every micro-batch's gradients are reduced
    (fp32 sum in rank order, times 1/world, then in the master's dtype) and
    the reductions added in the master's dtype; else each rank sums its
    micro-batches in fp32 and the sums are reduced once, as dbuf.torch does:
    rounded to param_dtype, and what the rounding lost, each reduced, added.
    two_forwards: each rank's loss is the sum over two micro-batches, one
    backward. clip: torch's clip_grad_norm_ on the reduced gradients.
    skip_steps: steps whose gradients are dropped (no update).
    ranks_per_node: a job across nodes of that many ranks each: the sum is
    each node's (ranks in order), then the nodes' in node order. Returns
    (losses[step][micro][rank], final master params).
    """
    master = make_model(**model_kwargs).to(master_dtype)
    step_with = make_optimizer(master, optimizer)
    losses = []
    for step in range(steps):
        step_losses = []
        reduced = None
        kept = [None] * world  # per-rank accumulated low-precision gradients (no sync)
        for micro in range(1 if two_forwards else micro_batches):
            per_rank = []
            row = []
            for rank in range(world):
                work = copy.deepcopy(master).to(param_dtype)
                loss = loss_of(work, *micro_batch(step, micro, rank, world))
                if two_forwards:
                    loss = loss + loss_of(work, *micro_batch(step, 1, rank, world))
                loss.backward()
                row.append(loss.item())
                grads = [p.grad for p in work.parameters() if p.requires_grad]
                if not sync_every_micro:
                    kept[rank] = ([g.float() for g in grads] if kept[rank] is None
                                  else [a + b for a, b in zip(kept[rank], grads)])
                per_rank.append(grads)
            step_losses.append(row)
            if sync_every_micro:
                now = [g.to(master_dtype) for g in _reduce(per_rank, world, ranks_per_node)]
                reduced = now if reduced is None else [a + b for a, b in zip(reduced, now)]
        if not sync_every_micro:
            # The fp32 sums reduced as two param_dtype parts (the rounded sum, then what rounding lost).
            high = [[g.to(param_dtype) for g in sums] for sums in kept]
            low = [[(g - h.float()).to(param_dtype) for g, h in zip(sums, highs)] for sums, highs in zip(kept, high)]
            reduced = [(a + b).to(master_dtype) for a, b in
                       zip(_reduce(high, world, ranks_per_node), _reduce(low, world, ranks_per_node))]
        losses.append(step_losses)
        if step in skip_steps:
            continue
        for param, grad in zip([p for p in master.parameters() if p.requires_grad], reduced):
            param.grad = grad
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        step_with.step()
        step_with.zero_grad()
    return losses, {name: p.detach().clone() for name, p in master.named_parameters()}


def _sum(per_rank):
    total = [g.float() for g in per_rank[0]]
    for grads in per_rank[1:]:
        total = [a + g.float() for a, g in zip(total, grads)]
    return total


def _reduce(per_rank, world: int, ranks_per_node: int | None = None):
    if ranks_per_node is None:
        total = _sum(per_rank)
    else:
        total = _sum([_sum(per_rank[n:n + ranks_per_node]) for n in range(0, world, ranks_per_node)])
    return [t * (1.0 / world) for t in total]
