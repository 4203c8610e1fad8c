"""The one exception type users see, the assertion used for our own bugs, and renamed attributes' warnings."""

from __future__ import annotations

import warnings
from typing import Callable

__all__ = ["ChunkOffloadError", "ChunkOffloadValueError", "HappensBeforeError", "internal_assert", "renamed_attributes"]

_REPORT_HINT = "This is a bug in chunk_offload; please report it with the traceback."


class ChunkOffloadError(RuntimeError):
    """A misuse of chunk_offload: the message names the values involved and a fix."""

    def __init__(self, message: str) -> None:
        if not message.startswith("chunk_offload:"):
            message = f"chunk_offload: {message}"
        super().__init__(message)


class ChunkOffloadValueError(ChunkOffloadError, ValueError):
    """An argument outside the values a call accepts (a negative byte count, a non-integer size).

    Both a `ChunkOffloadError` and a `ValueError`, so either ``except`` catches it.
    """


class HappensBeforeError(ChunkOffloadError):
    """A copy or a compute step touched memory before the step it depends on was known done.

    Raised by the ordering checker of the streams (see NOTE [Happens-before rules] in
    `streams.py`); ``rule`` is the rule's short name, e.g. ``"R1"``.
    """

    def __init__(self, rule: str, message: str) -> None:
        self.rule = rule
        super().__init__(f"chunk_offload: happens-before rule {rule} violated: {message}")


def internal_assert(condition: bool, message: str) -> None:
    """Check an invariant of our own code; unlike `assert`, it survives `python -O`."""
    if not condition:
        raise AssertionError(f"chunk_offload internal error: {message}. {_REPORT_HINT}")


def renamed_attributes(renamed: dict[str, str]) -> Callable[[object, str], object]:
    """A class's ``__getattr__`` that serves each old name of ``renamed`` (old -> new) with a
    `DeprecationWarning` for one release; only missing attributes reach it, so it costs nothing else."""

    def __getattr__(self: object, name: str) -> object:
        new = renamed.get(name)
        if new is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        warnings.warn(
            f"{type(self).__name__}.{name} is deprecated and will be removed in the next release; use .{new}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(self, new)

    return __getattr__
