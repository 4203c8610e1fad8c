"""The checks of `HostPool`'s arguments: each error names the argument, its value and what is accepted."""

from __future__ import annotations

import numbers

from .config import ON_EXHAUSTED as _VALID_ON_EXHAUSTED
from .errors import ChunkOffloadError, ChunkOffloadValueError

__all__ = ["check_capacity", "check_nbytes", "check_options"]

_VALID_CLASSES = (1, 2, 4, 8, 16)


def check_capacity(capacity_bytes: object) -> int | None:
    """``capacity_bytes`` as an int, or None (no cap); `ChunkOffloadError` naming it otherwise."""
    if capacity_bytes is None:
        return None
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, numbers.Integral):
        raise ChunkOffloadError(
            f"HostPool capacity_bytes must be an int number of bytes >= 0 or None, got {capacity_bytes!r} "
            f"({type(capacity_bytes).__name__}); pass e.g. 1 << 30 for 1 GiB, or None for no cap"
        )
    if capacity_bytes < 0:
        raise ChunkOffloadError(
            f"host pool capacity_bytes must be >= 0 or None, got {capacity_bytes!r}; pass a byte count, or None for no cap"
        )
    return int(capacity_bytes)


def check_options(on_exhausted: object, pin_memory: object, per_doubling: object, idle_acquires: object) -> None:
    """Raise `ChunkOffloadError` naming the first of `HostPool`'s other options whose value is not accepted."""
    if not isinstance(on_exhausted, str) or on_exhausted not in _VALID_ON_EXHAUSTED:
        raise ChunkOffloadError(f"on_exhausted={on_exhausted!r} is not valid; choose one of {_VALID_ON_EXHAUSTED}")
    if not isinstance(pin_memory, bool):
        raise ChunkOffloadError(f"HostPool pin_memory must be True or False, got {pin_memory!r}")
    if per_doubling is not None and (isinstance(per_doubling, bool) or per_doubling not in _VALID_CLASSES):
        raise ChunkOffloadError(
            f"HostPool classes_per_doubling={per_doubling!r} is not valid; choose one of {_VALID_CLASSES}, "
            "or None (1 when pinned, else 4)"
        )
    if isinstance(idle_acquires, bool) or not isinstance(idle_acquires, numbers.Integral) or idle_acquires < 1:
        raise ChunkOffloadError(f"HostPool idle_acquires must be an int >= 1, got {idle_acquires!r}")


def check_nbytes(nbytes: object) -> int:
    """``nbytes`` as an int if it is a byte count (an integer >= 0, not a bool); else `ChunkOffloadValueError`."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) or nbytes < 0:
        raise ChunkOffloadValueError(
            f"HostPool.acquire(nbytes=...) takes an int number of bytes >= 0, got {nbytes!r} "
            f"({type(nbytes).__name__}); pass the byte size to hold (e.g. t.untyped_storage().nbytes())"
        )
    return int(nbytes)
