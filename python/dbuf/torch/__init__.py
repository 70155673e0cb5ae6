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
explicitly). No process group is needed.
"""

from ._clip import clip_grad_norm_
from ._fully_shard import DBufModule, MixedPrecisionPolicy, fully_shard, units
from ._param import ShardedParameter, ShardInfo, shard_info
from ._session import Session, default_session, destroy, init, is_initialized
from ._state_dict import LocalShard, get_model_state_dict, set_model_state_dict
from ._wrap import WrappedUnit, auto_wrap

__all__ = [
    "DBufModule",
    "LocalShard",
    "WrappedUnit",
    "auto_wrap",
    "clip_grad_norm_",
    "get_model_state_dict",
    "set_model_state_dict",
    "MixedPrecisionPolicy",
    "Session",
    "ShardInfo",
    "ShardedParameter",
    "default_session",
    "destroy",
    "fully_shard",
    "init",
    "is_initialized",
    "shard_info",
    "units",
]
