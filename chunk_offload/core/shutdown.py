"""Closing a manager without hiding the exception that made the user close it."""

from __future__ import annotations

import logging
import sys
from typing import Callable

__all__ = ["run_close"]

logger = logging.getLogger(__name__)


def run_close(close: Callable[[], None]) -> None:
    """Run ``close``; if it fails while another exception propagates (close called in an ``except``
    or ``finally``), that exception stays the one raised: the failure is added to it as a note
    and logged, so neither is lost. Without one, the failure is raised as usual."""
    propagating = sys.exc_info()[1]
    try:
        close()
    except Exception as complaint:
        if propagating is None or complaint is propagating:
            raise
        logger.error("chunk_offload: close() failed while %r propagated", propagating, exc_info=complaint)
        if hasattr(propagating, "add_note"):  # Python >= 3.11
            propagating.add_note(f"chunk_offload: close() during this exception also failed: {complaint!r}")
