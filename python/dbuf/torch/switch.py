"""dbuf's switch: a trainer written for FSDP2 runs on dbufd without an edit.

Set ``DBUF_FSDP=1`` in the trainer's environment (``DBUF_FSDP=1 torchrun ...
train.py``): at the start of every Python process of the environment dbuf is
installed in, the package's ``dbuf-fsdp.pth`` calls :func:`install`, before
the trainer imports anything. It puts :func:`dbuf.torch.fully_shard` where
FSDP2's is looked up (``torch.distributed.fsdp.fully_shard`` and the older
``torch.distributed._composable.fsdp.fully_shard``); every other name of
FSDP2 stays torch's and works with dbuf's modules: they are ``FSDPModule`` s,
``MixedPrecisionPolicy`` and ``OffloadPolicy`` are taken as they are, and
``register_fsdp_forward_method`` runs their hooks. Code that calls
:func:`install` itself needs no variable.

The session (dbufd's socket, the job) comes from torchrun's environment and
``DBUF_SOCKET`` as for :func:`dbuf.torch.init`. Without the variable nothing
of dbuf or torch is imported at startup.
"""

from __future__ import annotations

import os
import sys

ENVIRONMENT_VARIABLE = "DBUF_FSDP"

_installed = False


def install() -> None:
    """Makes ``torch.distributed.fsdp.fully_shard`` dbuf's (idempotent)."""
    global _installed
    if _installed:
        return
    import torch.distributed._composable.fsdp as composable_fsdp
    import torch.distributed.fsdp as fsdp

    from ._fully_shard import fully_shard

    fsdp.fully_shard = fully_shard
    composable_fsdp.fully_shard = fully_shard
    _installed = True


def installed() -> bool:
    """Whether :func:`install` ran in this process."""
    return _installed


def install_from_environment() -> None:
    """``dbuf-fsdp.pth``'s entry: :func:`install` when ``$DBUF_FSDP`` is 1; a failure ends the process.

    A trainer asked to run on dbuf must not go on with FSDP2 because the
    switch failed (Python's startup would print the error and continue).
    """
    value = os.environ.get(ENVIRONMENT_VARIABLE, "")
    if value in ("", "0"):
        return
    if value != "1":
        sys.stderr.write(f"dbuf: ${ENVIRONMENT_VARIABLE}={value!r}: set 1 (run on dbufd) or 0 / unset (FSDP2)\n")
        os._exit(2)
    try:
        install()
    except Exception as error:  # noqa: BLE001 - reported, then the process ends
        sys.stderr.write(f"dbuf: ${ENVIRONMENT_VARIABLE}=1 but dbuf.torch could not replace FSDP2: {error!r}\n")
        os._exit(2)
