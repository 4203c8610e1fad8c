"""The one exception type users see, and the assertion used for our own bugs."""

from __future__ import annotations

__all__ = ["ChunkOffloadError", "ChunkOffloadValueError", "HappensBeforeError", "internal_assert"]

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
