"""dbuf.torch: PyTorch FSDP through dbufd.

``fully_shard`` has the signature and meaning of PyTorch FSDP2's
``torch.distributed.fsdp.fully_shard``; a training script moves over by
changing its import::

    from dbuf.torch import fully_shard, MixedPrecisionPolicy   # was: torch.distributed.fsdp

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters())    # the fp32 master shards

Launch with torchrun: rank, world size, local rank and the job id come from its
environment, the daemon's socket from ``$DBUF_SOCKET`` (:func:`init` sets them
explicitly), and torch.distributed's default process group from torchrun's
(dbuf.torch makes it where the trainer did not). Parameters and gradients are
DTensors with a :class:`RaggedShard` placement (:class:`RaggedDTensor`), so
torch.distributed.checkpoint, ``torch.nn.utils.clip_grad_norm_`` and code that
reads parameter shapes work as under FSDP2.
"""

from . import _torch_version

_torch_version.check()

from ._clip import clip_grad_norm_  # noqa: E402 - after the version check
from ._fully_shard import MixedPrecisionPolicy, fully_shard, units  # noqa: E402
from ._module import DBufModule  # noqa: E402
from ._dtensor import RaggedDTensor, distribute_ragged, local_elements, shard_info  # noqa: E402
from ._ragged import RaggedShard, ShardInfo, StridedRaggedShard  # noqa: E402
from ._session import Session, default_session, destroy, init, is_initialized, sessions  # noqa: E402
from ._state_dict import LocalShard, get_model_state_dict, set_model_state_dict  # noqa: E402
from ._wrap import WrappedUnit, auto_wrap  # noqa: E402

__all__ = [
    "DBufModule",
    "LocalShard",
    "WrappedUnit",
    "auto_wrap",
    "clip_grad_norm_",
    "get_model_state_dict",
    "set_model_state_dict",
    "MixedPrecisionPolicy",
    "RaggedDTensor",
    "RaggedShard",
    "StridedRaggedShard",
    "Session",
    "ShardInfo",
    "default_session",
    "destroy",
    "distribute_ragged",
    "fully_shard",
    "init",
    "is_initialized",
    "local_elements",
    "sessions",
    "shard_info",
    "units",
]
