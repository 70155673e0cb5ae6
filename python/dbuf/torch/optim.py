"""Optimizers that use RaggedShard's guarantee: no block is ever split between ranks.

Both optimizers are ordinary :class:`torch.optim.Optimizer` subclasses written
against :func:`dbuf.torch._param.shard_info`, so one class runs unchanged on a
single process's whole parameters and on each rank's RaggedShard DTensor parameters
(this rank's whole blocks of the fp32 master tensor, 1-D).

* :class:`Muon` -- with ``granularity="matrix"`` every weight matrix (each
  expert of a 3-D ``[E, M, K]`` tensor) lives whole on one rank, so the
  Newton-Schulz orthogonalisation runs on each rank's own matrices with no
  communication at all. Non-matrix parameters go to an inner AdamW.
* :class:`Adam8bit` -- AdamW whose two moments are stored as 8-bit codes with
  one fp32 scale per quantisation block; the blocks are the parameter's
  RaggedShard blocks, so each rank holds exactly the state a single process
  would hold for those blocks.

Bit-for-bit equality between the sharded and the single-process run.
Every value a rank computes must be computed from the same inputs by the same
operations as in a single process. So:

* Elementwise work uses only single-rounding IEEE operations (``+ - * /``,
  ``sqrt``, ``round``, ``abs``, ``copysign``, ``max``, casts), one kernel per
  operation. These give the correctly rounded result whether an element
  falls into a SIMD body or a scalar tail, and whatever the thread split, so
  the result does not depend on the tensor's length or where a slice starts.
  Fused kernels are avoided on purpose: ``lerp``, ``addcmul``, ``addcdiv``
  and ``add(..., alpha=a)`` can use an FMA in a vector path and a separate
  multiply and add in a scalar path (whether they do depends on the build
  and backend), which would make an element's rounding depend on where it
  sits in the local or the whole tensor. (On x86 with torch 2.15 we measured
  no such difference, even for torch's foreach/fused AdamW; the rule keeps
  the guarantee from resting on that.)
* Reductions run over one block (absmax: exact in any order) or one matrix
  (the Frobenius norm and matmuls of Newton-Schulz), never over a whole
  tensor: each matrix is orthogonalised on its own, as a fresh contiguous
  tensor of the same shape, in both runs (no batching over a rank's experts,
  whose batch size would differ between a rank and the single process).
"""

from __future__ import annotations

import math
from typing import Iterable, NamedTuple, Sequence

import torch
from torch.optim import Optimizer

from ._dtensor import RaggedDTensor, local_elements, mesh_rank, shard_info
from ._ragged import RaggedShard, ShardInfo

__all__ = [
    "Adam8bit",
    "DEFAULT_BLOCK_ELEMS",
    "GatherBytes",
    "Muon",
    "NS_COEFFICIENTS",
    "fsdp2_muon_gather_bytes",
    "muon_matrix_shape",
    "newton_schulz",
]

#: Quintic Newton-Schulz coefficients (a, b, c) of the Muon reference.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

#: Quantisation block of a plain tensor when ``block_elems`` is not given
#: (the block size of Dettmers et al.'s block-wise 8-bit optimizers).
DEFAULT_BLOCK_ELEMS = 2048


def _name(p: torch.Tensor, index: int) -> str:
    return repr(getattr(p, "fqn", None) or f"params[{index}]")


def _as_groups(params, **flags) -> list[dict]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        raise TypeError("params should be an iterable of tensors or dicts, not a tensor")
    params = list(params)
    if not params:
        return []
    if isinstance(params[0], dict):
        groups = [dict(g) for g in params]
    else:
        groups = [{"params": params}]
    for g in groups:
        for k, v in flags.items():
            g.setdefault(k, v)
    return groups


# --------------------------------------------------------------------- Muon


def muon_matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The matrix Muon orthogonalises for a parameter of ``shape``.

    2-D ``[M, K]``: one ``M x K`` matrix. 3-D ``[E, M, K]``: ``E`` matrices of
    ``M x K`` (experts; RaggedShard's ``matrix`` granularity). 4-D and more
    (convolutions): one ``shape[0] x prod(shape[1:])`` matrix, as the
    reference flattens conv filters.
    """
    shape = tuple(shape)
    if len(shape) < 2:
        raise ValueError(f"a {len(shape)}-D tensor is not a matrix")
    if len(shape) <= 3:
        return shape[-2], shape[-1]
    return shape[0], math.prod(shape[1:])


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximately orthogonalise one 2-D matrix (``U S V^T -> U S' V^T``).

    The quintic Newton-Schulz iteration of Muon, in bfloat16: work on ``g`` or
    its transpose, whichever is wide (so ``X X^T`` is the small Gram matrix),
    divide by the Frobenius norm (+eps) so the spectral norm is at most 1,
    then ``steps`` times ``A = X X^T; X = a X + (b A + (c A) A) X`` with
    ``(a, b, c) = (3.4445, -4.7750, 2.0315)``, in the reference's order of
    bf16 operations (on one matrix it gives the reference's bits). The
    coefficients maximise the slope at zero rather than converge, so singular
    values end up roughly in ``[0.5, 1.5]`` instead of exactly 1 (which the
    reference reports does not hurt training). Returns a bfloat16 tensor of
    ``g``'s shape.
    """
    if g.ndim != 2:
        raise ValueError(f"newton_schulz takes one matrix, got shape {tuple(g.shape)}")
    a, b, c = NS_COEFFICIENTS
    x = g.to(torch.bfloat16)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.mT
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + (c * gram) @ gram
        x = a * x + poly @ x
    if tall:
        x = x.mT
    return x


def _refuse_model_parallel(p: torch.Tensor, index: int, optimizer: str) -> None:
    """Tensor / expert parallelism's chunks are not whole matrices or the tensor's blocks: refused, not misread."""
    if isinstance(p, RaggedDTensor) and p.device_mesh.ndim > 1:
        raise NotImplementedError(
            f"{optimizer} parameter {_name(p, index)} is also sharded by tensor / expert parallelism "
            f"({p.placements}): its whole matrices and blocks span ranks of that dimension; use torch's optimizers"
        )


def _muon_info(p: torch.Tensor, index: int) -> tuple[ShardInfo, int, int]:
    """Check that ``p``'s local part is whole matrices; (info, M, K)."""
    name = _name(p, index)
    _refuse_model_parallel(p, index, "Muon")
    shape = p.shape
    if len(shape) < 2:
        raise ValueError(
            f"Muon parameter {name} has shape {tuple(shape)}: Muon is for matrices; "
            "put 1-D parameters (norms, biases) in adamw_params"
        )
    m, k = muon_matrix_shape(shape)
    mk = m * k
    info = shard_info(p, unit_elems=mk)
    if mk and (info.unit_elems != mk or (info.numel and (info.begin % mk or info.numel % mk))):
        raise ValueError(
            f'Muon parameter {name} needs granularity="matrix": its local elements '
            f"[{info.begin}, {info.end}) in blocks of {info.unit_elems} are not whole "
            f"{m}x{k} matrices ({mk} elements each, starting on a matrix edge); shard "
            'its group with granularity="matrix" or give it to adamw_params'
        )
    return info, m, k


def _adamw_math(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay) -> None:
    """One AdamW step on flat fp32 tensors; m and v are updated in place.

    torch.optim.AdamW's formula (``m = lerp(m, g, 1-b1)``, ``v = b2*v +
    (1-b2)*g*g``, decoupled decay, ``denom = sqrt(v) / sqrt(1 - b2^t) + eps``,
    ``p -= lr / (1 - b1^t) * m / denom``), spelled as single-rounding
    elementwise kernels only (see the module docstring).
    """
    _lerp(m, g, 1.0 - beta1, out=m)
    gg = g * g
    gg.mul_(1.0 - beta2)
    v.mul_(beta2)
    v.add_(gg)
    bias1 = 1.0 - beta1**step
    bias2 = 1.0 - beta2**step
    denom = v.sqrt()
    denom.div_(math.sqrt(bias2))
    denom.add_(eps)
    if weight_decay:
        p.mul_(1.0 - lr * weight_decay)
    upd = m / denom
    upd.mul_(lr / bias1)
    p.sub_(upd)


def _lerp(start: torch.Tensor, end: torch.Tensor, weight: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.lerp``'s formula, one rounding per operation (no FMA).

    ``start + w*(end - start)`` for ``w < 0.5``, else ``end - (end - start)*(1 - w)``,
    as ATen writes it; ``out`` may be ``start`` (in place).
    """
    diff = end - start
    if weight < 0.5:
        diff.mul_(weight)
        return torch.add(start, diff, out=out)
    diff.mul_(1.0 - weight)
    return torch.sub(end, diff, out=out)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """The elements this process holds, 1-D (a RaggedShard DTensor's local elements)."""
    return local_elements(t).detach().view(-1)


class Muon(Optimizer):
    """Muon for matrices, AdamW for the rest, with no communication when sharded.

    ``Muon(params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5,
    weight_decay=0.0, adamw_params=None, adamw_lr=3e-4, adamw_betas=(0.9, 0.95),
    adamw_eps=1e-10, adamw_weight_decay=0.0)``

    ``params`` are the parameters Muon orthogonalises (hidden-layer matrices;
    tensors or param-group dicts). ``adamw_params`` get AdamW: 1-D norms and
    biases and, by the reference's recipe, the embedding and the LM head,
    whose shape is 2-D but which are not hidden-layer linear maps -- which
    parameters go where is the caller's choice. Internally each group carries
    ``use_muon``; the defaults follow the reference's ``MuonWithAuxAdam``.

    Per Muon parameter and step (the variant implemented):

    1. momentum ``m = lerp(m, g, 1-beta)`` (= ``beta*m + (1-beta)*g``),
    2. Nesterov: ``u = lerp(g, m, beta)``; otherwise ``u = m``,
    3. for each whole matrix ``U`` of ``u`` (:func:`muon_matrix_shape`):
       ``O = newton_schulz(U, ns_steps)`` in bf16,
    4. ``p = p*(1 - lr*weight_decay)``, then
       ``p = p - (lr*sqrt(max(1, M/K))) * float(O)``.

    Differences from the reference, all rounding-level: the lerps use
    ``torch.lerp``'s formula with one rounding per operation (see the module
    docstring), and the shape factor ``sqrt(max(1, M/K))`` is applied in fp32
    together with ``lr`` instead of in bf16.

    A Muon parameter must be whole matrices locally: a RaggedShard DTensor whose
    ``unit_elems`` is not ``M*K`` or whose range does not start and end on a
    matrix edge raises ValueError asking for ``granularity="matrix"`` (checked
    when the group is added, on every rank, empty local parts included).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.0,
        adamw_params: Iterable | None = None,
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-10,
        adamw_weight_decay: float = 0.0,
    ):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if ns_steps < 1:
            raise ValueError(f"ns_steps must be >= 1, got {ns_steps}")
        self._muon_defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, weight_decay=weight_decay
        )
        self._adamw_defaults = dict(
            lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps, weight_decay=adamw_weight_decay
        )
        groups = _as_groups(params, use_muon=True) + _as_groups(adamw_params, use_muon=False)
        super().__init__(groups, {})

    def add_param_group(self, param_group: dict) -> None:
        param_group = dict(param_group)
        param_group.setdefault("use_muon", True)
        defaults = self._muon_defaults if param_group["use_muon"] else self._adamw_defaults
        for key, value in defaults.items():
            param_group.setdefault(key, value)
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        if param_group["use_muon"]:
            for i, p in enumerate(params):
                _muon_info(p, i)
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                # A rank that holds none of a parameter still makes its (empty) state: a
                # checkpoint's state dict must name the same tensors on every rank.
                if p.grad is None:
                    continue
                if group["use_muon"]:
                    self._muon_param(p, i, group)
                else:
                    self._adamw_param(p, group)
        return loss

    def _muon_param(self, p: torch.Tensor, index: int, group: dict) -> None:
        _, m_rows, k_cols = _muon_info(p, index)
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        buf = _flat(state["momentum_buffer"])
        g = _flat(p.grad)
        beta = group["momentum"]
        _lerp(buf, g, 1.0 - beta, out=buf)
        u = _lerp(g, buf, beta) if group["nesterov"] else buf
        flat = _flat(p)
        lr = group["lr"]
        if group["weight_decay"]:
            flat.mul_(1.0 - lr * group["weight_decay"])
        step_scale = lr * max(1.0, m_rows / k_cols) ** 0.5
        mk = m_rows * k_cols
        for j in range(flat.numel() // mk):
            part = slice(j * mk, (j + 1) * mk)
            o = newton_schulz(u[part].view(m_rows, k_cols), group["ns_steps"])
            o = o.float()
            o.mul_(step_scale)
            flat[part].view(m_rows, k_cols).sub_(o)

    def _adamw_param(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        _adamw_math(
            _flat(p), _flat(p.grad), _flat(state["exp_avg"]), _flat(state["exp_avg_sq"]),
            state["step"], group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
        )


# ----------------------------------------------------------- 8-bit AdamW


def _block_views(x: torch.Tensor, q: int) -> list[torch.Tensor]:
    """``x`` (flat) as 2-D views of whole blocks: ``[nfull, q]`` and ``[1, tail]``."""
    n = x.numel()
    full = n // q
    views = []
    if full:
        views.append(x[: full * q].view(full, q))
    if n - full * q:
        views.append(x[full * q :].view(1, n - full * q))
    return views


def _quantize(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, q: int, levels: int) -> None:
    """Linear per-block codes ``round(x / absmax * levels)``; ``scales`` = per-block absmax."""
    row = 0
    for xv, cv in zip(_block_views(x, q), _block_views(codes, q)):
        amax = xv.abs().amax(dim=1, keepdim=True)
        safe = torch.where(amax > 0, amax, torch.ones_like(amax))
        c = xv / safe
        c.mul_(levels)
        c.round_()
        cv.copy_(c)
        scales[row : row + amax.shape[0]].copy_(amax.view(-1))
        row += amax.shape[0]


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, q: int, levels: int) -> torch.Tensor:
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    row = 0
    for cv, ov in zip(_block_views(codes, q), _block_views(out, q)):
        step = scales[row : row + cv.shape[0]] / levels
        ov.copy_(cv)
        ov.mul_(step.view(-1, 1))
        row += cv.shape[0]
    return out


def _per_block_zeros(p: torch.Tensor, q: int) -> torch.Tensor:
    """fp32 zeros, one per block of ``q`` of the elements this process holds of ``p``.

    On a RaggedShard DTensor: a RaggedShard DTensor of the tensor's blocks
    (global shape ``(blocks,)``, rank r holding its elements' blocks), so
    per-block state checkpoints like the parameter.
    """
    if not isinstance(p, RaggedDTensor):
        return torch.zeros(-(-p.numel() // q), dtype=torch.float32, device=p.device)
    numel, ragged = p.numel(), p.ragged
    counts = [-(-(end - begin) // q) for begin, end in (ragged.rank_range(r, numel) for r in range(ragged.ranks))]
    mine = counts[mesh_rank(p.device_mesh)]
    local = torch.zeros(mine, dtype=torch.float32, device=local_elements(p).device)
    return RaggedDTensor.from_local(local, p.device_mesh, RaggedShard(1, counts), (sum(counts),))


class Adam8bit(Optimizer):
    """AdamW with block-wise 8-bit moments whose blocks are RaggedShard blocks.

    ``Adam8bit(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=0.01, block_elems=None)``

    Quantisation block of a parameter (``q`` elements, contiguous in the
    flattened tensor, counted from the tensor's start; the last one may be
    shorter): a RaggedShard DTensor's ``unit_elems`` by default, or
    ``block_elems`` if the group sets it, which must then divide
    ``unit_elems`` (so blocks still never straddle ranks); a plain tensor's
    ``block_elems``, default :data:`DEFAULT_BLOCK_ELEMS`. For a single-process
    run to hold the same state as a sharded one, give each plain parameter
    ``block_elems`` = its sharded ``unit_elems``.

    State per parameter (local elements only): ``step``; ``m_codes`` int8 and
    ``m_scale`` fp32 per block; ``v_codes`` uint8 and ``v_scale`` fp32 per
    block -- 2 bytes per element plus 8 bytes per block.

    Quantisation:

    * first moment ``m`` (signed): signed int8 on its signed square root
      ``s = copysign(sqrt(|m|), m)``: ``code = round(127 * s / absmax(s))``,
      ``m = a * |a|`` with ``a = code * absmax(s) / 127``; the stored scale
      is ``absmax(s)``. Small momenta keep a value down to ``127^-2 ~ 6e-5``
      of the block's largest, where linear codes would zero everything
      below ``1/254`` of it (on the regression test this halves the
      distance to fp32 AdamW compared with linear codes on ``m``).
    * second moment ``v`` (non-negative, a range that is the *square* of the
      gradients' range): uint8 on its fourth root ``r = sqrt(sqrt(v))``,
      ``code = round(255 * r / absmax(r))``, ``v = (code * absmax(r)/255)^4``;
      the stored scale is ``absmax(r)``. Linear codes on ``v`` itself would
      flush every ``v`` below ``absmax/510`` to zero and turn
      ``m / (sqrt(v) + eps)`` into ``m / eps`` -- the classic 8-bit Adam
      blow-up (on the regression test it diverges). The fourth root keeps
      values down to ``255^-4 ~ 2e-10`` of the block's largest (gradients
      down to ~1/65000 of the largest) non-zero, with relative resolution
      finest for the large values that dominate the denominator (~0.8% on
      ``sqrt(v)`` at the top code).

    Both maps need only ``sqrt``, ``abs``, ``copysign``, multiplies and
    round-to-nearest-even, which are exact or correctly rounded -- unlike a
    log / dynamic-tree map, whose ``log``/``exp`` may round differently in
    vector and scalar code paths (breaking bit equality between ranks and
    the single run).

    Each step: dequantise both moments, run AdamW (torch.optim.AdamW's
    formula, decoupled weight decay) with them in fp32, requantise them per
    block. Everything is elementwise or per block, so rank ``r``'s state and
    parameters equal bit for bit the single-process values of its blocks.
    Rounding to nearest (not stochastic), so runs are deterministic.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        block_elems: int | None = None,
    ):
        if block_elems is not None and block_elems < 1:
            raise ValueError(f"block_elems must be >= 1, got {block_elems}")
        super().__init__(
            params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, block_elems=block_elems)
        )
        self.register_load_state_dict_post_hook(Adam8bit._codes_back_to_8_bits)

    _CODE_DTYPES = {"m_codes": torch.int8, "v_codes": torch.uint8}

    @staticmethod
    def _codes_back_to_8_bits(optimizer: Optimizer) -> None:
        """torch's load_state_dict casts every state tensor of a floating-point parameter to the
        parameter's dtype; the codes are integers (exact in fp32), so they go back to 8 bits."""
        for state in optimizer.state.values():
            for key, dtype in Adam8bit._CODE_DTYPES.items():
                if key in state and state[key].dtype != dtype:
                    state[key] = state[key].to(dtype)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for i, p in enumerate(group["params"]):
            self._block(p, i, group)

    @staticmethod
    def _block(p: torch.Tensor, index: int, group: dict) -> int:
        """The quantisation block of ``p`` in elements, checked against its shard."""
        block = group["block_elems"]
        _refuse_model_parallel(p, index, "Adam8bit")
        if isinstance(p, RaggedDTensor):
            info = p.shard_info
            q = block if block is not None else info.unit_elems
            if q < 1 or info.unit_elems % q:
                raise ValueError(
                    f"Adam8bit parameter {_name(p, index)}: block_elems={q} does not divide its "
                    f"RaggedShard block of {info.unit_elems} elements, so quantisation blocks "
                    "would straddle ranks"
                )
        else:
            q = block if block is not None else DEFAULT_BLOCK_ELEMS
            info = shard_info(p, unit_elems=q)
        total = info.global_shape.numel()
        if info.numel and (info.begin % q or (info.end % q and info.end != total)):
            raise ValueError(
                f"Adam8bit parameter {_name(p, index)}: local elements [{info.begin}, {info.end}) "
                f"are not whole blocks of {q}"
            )
        return q

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                q = self._block(p, i, group)
                state = self.state[p]
                if not state:
                    # The codes have the parameter's layout, the scales one element per block:
                    # on a RaggedShard parameter both are RaggedShard DTensors, which DCP saves
                    # whole and reshards (under the same block size).
                    state["step"] = 0
                    state["m_codes"] = torch.zeros_like(p, dtype=torch.int8, memory_format=torch.contiguous_format)
                    state["m_scale"] = _per_block_zeros(p, q)
                    state["v_codes"] = torch.zeros_like(p, dtype=torch.uint8, memory_format=torch.contiguous_format)
                    state["v_scale"] = _per_block_zeros(p, q)
                state["step"] += 1
                if _flat(p).numel() == 0:
                    continue
                m_codes, m_scale = _flat(state["m_codes"]), _flat(state["m_scale"])
                v_codes, v_scale = _flat(state["v_codes"]), _flat(state["v_scale"])
                a = _dequantize(m_codes, m_scale, q, 127)
                m = a * a.abs()
                r = _dequantize(v_codes, v_scale, q, 255)
                v = r * r
                v.mul_(v)
                _adamw_math(
                    _flat(p), _flat(p.grad), m, v, state["step"],
                    group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                )
                a = m.abs().sqrt_()
                _quantize(torch.copysign(a, m, out=a), m_codes, m_scale, q, 127)
                r = v.sqrt()
                r.sqrt_()
                _quantize(r, v_codes, v_scale, q, 255)
        return loss


# ------------------------------------------------- FSDP2 comparison (report)


class GatherBytes(NamedTuple):
    per_rank: int  #: bytes each rank receives per Muon step
    total: int  #: summed over all ranks


def fsdp2_muon_gather_bytes(shapes: Iterable[Sequence[int]], world_size: int, dtype_bytes: int = 4) -> GatherBytes:
    """Bytes FSDP2 must all-gather per Muon step so Newton-Schulz sees whole matrices.

    FSDP2 shards each parameter on dim 0 into ``ceil(d0/V)`` rows per rank
    (padded). The scheme counted: every rank all-gathers the whole
    momentum-updated gradient of each matrix that dim-0 sharding splits, runs
    Newton-Schulz on it redundantly, and keeps the rows of its own shard -- so
    nothing is scattered back. Each rank receives the ``V - 1`` other ranks'
    padded shards: ``(V-1) * ceil(d0/V) * prod(shape[1:]) * dtype_bytes`` per
    split matrix (its own shard is already local). ``total`` = ``V`` x that.

    Which shapes count: 2-D ``[d0, d1]`` and >=4-D (Muon's matrix is
    ``d0 x prod(rest)``) whenever ``ceil(d0/V) < d0``; 3-D ``[E, M, K]``
    experts never (dim 0 is the expert dim, so each rank already holds whole
    ``M x K`` experts); 1-D tensors never (they are AdamW's). Pass the Muon
    parameters' shapes; ``dtype_bytes`` is the gathered gradient's element
    size (4 for fp32, 2 for bf16). The dbuf counterpart with
    ``granularity="matrix"`` is 0.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    per_rank = 0
    for shape in shapes:
        shape = tuple(int(d) for d in shape)
        if len(shape) < 2 or len(shape) == 3:
            continue
        d0 = shape[0]
        rows = -(-d0 // world_size)
        if rows >= d0:
            continue
        per_rank += (world_size - 1) * rows * math.prod(shape[1:]) * dtype_bytes
    return GatherBytes(per_rank, per_rank * world_size)
