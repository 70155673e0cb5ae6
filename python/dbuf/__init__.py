"""dbuf: the Python client of dbufd, the sharded-training communication daemon.

A trainer process attaches to its node's dbufd, registers groups of tensors
(FSDP units) that the daemon lays out with RaggedShard (no block split between
ranks, minimal padding), and runs grouped collectives on them through shared
memory::

    import dbuf
    client = dbuf.Client()                      # $DBUF_SOCKET or /run/dbufd/dbufd.sock
    client.attach("run-42", rank, world_size)
    group = client.register_group("layer0", [dbuf.TensorSpec("w", (1024, 1024))],
                                  granularity="rows:32")
    group.shard_view("w").numpy()[:] = 1.0      # this rank's fp32 master elements
    group.unshard()                             # all-gather (to bf16) into the unsharded slot
    w = group.unsharded_view("w").torch()       # the whole tensor, zero-copy
    ...
    group.reduce_scatter(op=dbuf.ReduceOp.AVG)  # unsharded grads -> this rank's fp32 sharded grad
    group.reshard()

``dbuf.torch`` builds PyTorch FSDP on it (``dbuf.torch.fully_shard``). Errors are
exceptions derived from :class:`dbuf.Error`.
"""

from __future__ import annotations

from . import _dbuf
from ._dbuf import (
    Client,
    Group,
    GroupPlan,
    MergedRun,
    MergePlan,
    Op,
    OpResult,
    PlacedTensor,
    PlanDiagnosis,
    ReduceOp,
    TensorSpec,
    TensorView,
    UnitPlan,
    plan_merges,
    plan_model,
    plan_unit,
)
from ._errors import (
    CancelledError,
    ConflictError,
    DeviceError,
    Error,
    ErrorCode,
    InfeasibleError,
    InternalError,
    InvalidArgumentError,
    IoError,
    NotFoundError,
    PermissionDeniedError,
    TimeoutError,
    UnavailableError,
    WouldBlockError,
)

#: Whether this build of dbuf can map GPU memory (libdbuf built with CUDA).
cuda_built: bool = _dbuf.cuda

__version__ = "0.1.0"

__all__ = [
    "CancelledError",
    "Client",
    "ConflictError",
    "DeviceError",
    "Error",
    "ErrorCode",
    "Group",
    "GroupPlan",
    "InfeasibleError",
    "InternalError",
    "InvalidArgumentError",
    "IoError",
    "MergePlan",
    "MergedRun",
    "NotFoundError",
    "Op",
    "OpResult",
    "PermissionDeniedError",
    "PlacedTensor",
    "PlanDiagnosis",
    "ReduceOp",
    "TensorSpec",
    "TensorView",
    "TimeoutError",
    "UnavailableError",
    "UnitPlan",
    "WouldBlockError",
    "cuda_built",
    "plan_merges",
    "plan_model",
    "plan_unit",
]
