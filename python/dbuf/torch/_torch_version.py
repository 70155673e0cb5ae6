"""The torch versions dbuf.torch is tested with, checked before anything of torch's internals is used.

dbuf.torch reaches into torch where FSDP2 and DTensor give it no public way
(the DTensor constructor and spec, ``DeviceMesh._concatenate``, FSDP2's
``_orig_cls_mro_index``, state-dict helpers); those change between torch
releases. A torch outside TESTED fails at ``import dbuf.torch`` with what
to install, not somewhere inside a training step.
"""

from __future__ import annotations

import torch

#: (major, minor) releases of torch the suite runs against (python/requirements.txt pins one of them).
TESTED: tuple[tuple[int, int], ...] = ((2, 15),)
#: Set to 1 to import against an untested torch anyway (at the user's risk: what breaks is not reported).
OVERRIDE = "DBUF_TORCH_UNTESTED"


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version string ('2.15.0+cu130' -> (2, 15)); None if unreadable."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def check(version: str = torch.__version__, override: str | None = None) -> None:
    """Raises ImportError for a torch that dbuf.torch is not tested with (unless $DBUF_TORCH_UNTESTED=1)."""
    import os

    if release(version) in TESTED:
        return
    if (override if override is not None else os.environ.get(OVERRIDE, "")) == "1":
        return
    tested = ", ".join(f"{major}.{minor}" for major, minor in TESTED)
    raise ImportError(
        f"dbuf.torch is tested with torch {tested} and uses its internals; this is torch {version}. Install a "
        f"tested torch (pip install 'torch=={TESTED[-1][0]}.{TESTED[-1][1]}.*'), or set ${OVERRIDE}=1 to try "
        f"this one at your own risk"
    )
