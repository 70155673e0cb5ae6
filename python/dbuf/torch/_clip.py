"""Gradient clipping over a sharded model: the norm of the whole gradient, not of this rank's part."""

from __future__ import annotations

from typing import Iterable

import torch

from ._dtensor import RaggedDTensor, local_elements
from ._session import Session, default_session


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    session: Session | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for dbuf.torch: the global gradient norm (collective).

    Each rank's sharded parameters (RaggedShard DTensors) hold disjoint parts of the gradient, so the
    p-th powers of their local norms are summed over the ranks by dbufd (fp32)
    before the root is taken; parameters no unit shards hold the same
    gradient on every rank and count once. Every rank then scales its part by
    the same ``max_norm / (norm + 1e-6)`` when that is below 1, and gets the
    same total norm back. Agrees with the single-process function to fp32
    rounding (the sum runs in another order). ``norm_type``: any p > 0
    (``inf`` needs a max-reduction, which dbufd does not offer).
    """
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    p = float(norm_type)
    if not p > 0 or p == float("inf"):
        raise ValueError(f"norm_type must be a finite p > 0, got {norm_type}")
    session = session if session is not None else default_session()
    if len(session.passes.sessions()) > 1:
        raise NotImplementedError(
            "dbuf.torch.clip_grad_norm_ sums over one dbuf job; this process's units live in several (expert "
            "parallelism's layout): use torch.nn.utils.clip_grad_norm_, which sums each DTensor's norm over its mesh"
        )
    for param in parameters:
        if isinstance(param, RaggedDTensor) and param.device_mesh.ndim > 1:
            raise NotImplementedError(
                "dbuf.torch.clip_grad_norm_ sums over the dbuf job (the dp ranks); with tensor / expert parallelism "
                "use torch.nn.utils.clip_grad_norm_, which sums each DTensor's norm over its whole mesh"
            )
    grads = [local_elements(param.grad) for param in parameters if param.grad is not None]
    sharded = [isinstance(param, RaggedDTensor) for param in parameters if param.grad is not None]
    local = torch.zeros((), dtype=torch.float32, device=session.torch_device)
    for grad, is_sharded in zip(grads, sharded):
        if is_sharded or session.rank == 0:
            local += torch.linalg.vector_norm(grad.float(), p) ** p
    total = session.all_reduce_sum(local.reshape(1))[0] ** (1.0 / p)
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        with torch.no_grad():
            for grad in grads:
                grad.mul_(scale.to(grad.dtype))
    return total
