"""Helpers shared by the `CpuStreams` tests: finding a backend's worker threads."""

from __future__ import annotations

import threading

JOIN_TIMEOUT_S = 10.0


def worker_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name in ("chunk_offload-d2h", "chunk_offload-h2d")}
