"""The exceptions of dbuf: one class per libdbuf error code.

Every error from libdbuf or from the daemon is raised as a subclass of
:class:`dbuf.Error`, carrying the code, the daemon's message and, where the
daemon names them, the ranks the error is about (``ranks``: those that did not
arrive in time, died, or disagreed). Each class also derives from the closest
built-in exception, so ``except TimeoutError`` or ``except ValueError`` work as
a Python user expects.
"""

from __future__ import annotations

import builtins
import enum
from typing import Iterable


class ErrorCode(enum.IntEnum):
    """libdbuf's error codes (dbuf::ErrorCode), with the same values."""

    INVALID_ARGUMENT = 0
    NOT_FOUND = 1
    IO = 2
    INFEASIBLE = 3
    INTERNAL = 4
    PERMISSION_DENIED = 5
    CONFLICT = 6
    TIMEOUT = 7
    UNAVAILABLE = 8
    WOULD_BLOCK = 9
    DEVICE = 10
    CANCELLED = 11


class Error(Exception):
    """A dbuf error.

    Attributes:
        code: the :class:`ErrorCode`.
        message: what went wrong, as libdbuf or the daemon said it.
        ranks: the ranks the error names, ascending (empty if none). For an op's
            error, at most the first six: the message names all of them.
    """

    code: ErrorCode = ErrorCode.INTERNAL

    def __new__(cls, message: str, ranks: Iterable[int] = ()):
        # One argument only for the built-in bases: OSError would read two as
        # (errno, strerror).
        return super().__new__(cls, message)

    def __init__(self, message: str, ranks: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.ranks: tuple[int, ...] = tuple(ranks)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return (type(self), (self.message, self.ranks))


class InvalidArgumentError(Error, builtins.ValueError):
    """The request is malformed or out of range."""

    code = ErrorCode.INVALID_ARGUMENT


class NotFoundError(Error, builtins.LookupError):
    """A named thing (group, file, tensor) does not exist."""

    code = ErrorCode.NOT_FOUND


class IoError(Error, builtins.OSError):
    """Reading or writing a file or a socket failed."""

    code = ErrorCode.IO


class InfeasibleError(Error):
    """Well formed but cannot be satisfied (over a memory quota, say)."""

    code = ErrorCode.INFEASIBLE


class InternalError(Error):
    """A bug in dbuf: the message says which invariant broke."""

    code = ErrorCode.INTERNAL


class PermissionDeniedError(Error, builtins.PermissionError):
    """This user may not do this (not in the job's tenant, say)."""

    code = ErrorCode.PERMISSION_DENIED


class ConflictError(Error):
    """Clashes with the state of others: a rank taken, specs or ops that differ between ranks."""

    code = ErrorCode.CONFLICT


class TimeoutError(Error, builtins.TimeoutError):  # noqa: A001 - dbuf.TimeoutError on purpose
    """A deadline passed; ``ranks`` are those the daemon still waited for."""

    code = ErrorCode.TIMEOUT


class UnavailableError(Error, builtins.ConnectionError):
    """dbufd is gone, shutting down, or the client is closed."""

    code = ErrorCode.UNAVAILABLE


class WouldBlockError(Error, builtins.BlockingIOError):
    """No room now (a full ring) and the call was asked not to wait."""

    code = ErrorCode.WOULD_BLOCK


class DeviceError(Error):
    """The GPU, its driver or NCCL failed."""

    code = ErrorCode.DEVICE


class CancelledError(Error):
    """A wait was stopped by the client's interrupt check (Python raises KeyboardInterrupt instead)."""

    code = ErrorCode.CANCELLED


_BY_CODE: dict[int, type[Error]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        IoError,
        InfeasibleError,
        InternalError,
        PermissionDeniedError,
        ConflictError,
        TimeoutError,
        UnavailableError,
        WouldBlockError,
        DeviceError,
        CancelledError,
    )
}


for _cls in (Error, *_BY_CODE.values()):
    _cls.__module__ = "dbuf"  # shown (and pickled) as dbuf.TimeoutError, ...


def _from_native(code: int, message: str, ranks: Iterable[int]) -> Error:
    """The exception for an error of the native core (called from C++)."""
    return _BY_CODE.get(code, InternalError)(message, ranks)
