"""The one way dbuf.torch changes a function of torch's: a wrapper that keeps the original.

Where torch offers no hook, dbuf.torch puts a wrapper in place of a function
(``functools.wraps``: its name, signature and docstring are the original's,
``__wrapped__`` is the original). A target that is not there (torch renamed
it) is an error at import, never a silent skip: dbuf.torch would otherwise run
with torch's behaviour where it needs its own.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Callable

_MARK = "_dbuf_wrapped"


def wrap(owners: list[ModuleType], name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replaces ``owner.name`` in every module of `owners` by ``make(original)`` (idempotent).

    Every owner must hold the same original (a name torch re-exports, as
    ``torch.distributed.destroy_process_group``); each gets the one wrapper.
    """
    originals = {id(getattr(owner, name, None)): getattr(owner, name, None) for owner in owners}
    missing = [owner.__name__ for owner in owners if getattr(owner, name, None) is None]
    if missing:
        raise ImportError(
            f"dbuf.torch: torch has no {name} in {', '.join(missing)} (this torch is not one dbuf.torch supports)"
        )
    wrapped = [value for value in originals.values() if getattr(value, _MARK, False)]
    if wrapped:
        return
    if len(originals) != 1:
        raise ImportError(f"dbuf.torch: {name} differs between {', '.join(owner.__name__ for owner in owners)}")
    original = next(iter(originals.values()))
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _MARK, True)
    for owner in owners:
        setattr(owner, name, wrapper)
