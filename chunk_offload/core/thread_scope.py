"""Which thread an `OffloadManager`'s scopes belong to.

A chunk belongs to the thread that opened it: a forward run on another thread meanwhile (a
data-loader warm-up, an evaluation thread) is not pulled into it. The iteration belongs to the
thread that began it (the training thread): what must not race its copy streams (waiting for
them, closing them) is refused on other threads with a message naming both.
"""

from __future__ import annotations

import threading

from .errors import ChunkOffloadError

__all__ = ["ThreadScope"]


class _ChunkLocal(threading.local):
    """Per thread: the handler of the chunk that thread opened (None on every other thread)."""

    handler = None


class ThreadScope:
    """The training thread (the last to begin an iteration) and, per thread, the chunk it opened."""

    __slots__ = ("owner", "owner_name", "chunk")

    def __init__(self) -> None:
        self.owner = threading.get_ident()
        self.owner_name = threading.current_thread().name
        self.chunk = _ChunkLocal()
        """``chunk.handler``: on the thread that opened the open chunk, its handler; elsewhere None."""

    def claim(self) -> None:
        """The calling thread begins an iteration: it becomes the training thread."""
        self.owner = threading.get_ident()
        self.owner_name = threading.current_thread().name

    def on_owner(self) -> bool:
        """Whether the calling thread is the training thread."""
        return threading.get_ident() == self.owner

    def require_owner(self, what: str, fix: str) -> None:
        """Refuse ``what`` on a thread other than the training thread, naming both and the ``fix``."""
        if threading.get_ident() != self.owner:
            raise ChunkOffloadError(
                f"{what} called on thread {threading.current_thread().name!r} while an iteration is open "
                f"on thread {self.owner_name!r} (the training thread); {fix}"
            )
