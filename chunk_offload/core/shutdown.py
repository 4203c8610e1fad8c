"""Cleaning up (closing a manager, aborting a chunk, discarding an iteration) without hiding the
exception that made the user clean up."""

from __future__ import annotations

import logging
import sys
from typing import Callable

__all__ = ["run_cleanup"]

logger = logging.getLogger(__name__)


def run_cleanup(step: Callable[[], None], what: str) -> None:
    """Run ``step`` (``what`` names it in messages); if it fails while another exception propagates
    (called in an ``except`` or ``finally``), that exception stays the one raised: the failure is
    added to it as a note and logged, so neither is lost. Without one, the failure is raised."""
    propagating = sys.exc_info()[1]
    try:
        step()
    except Exception as complaint:
        if propagating is None or complaint is propagating:
            raise
        logger.error("chunk_offload: %s failed while %r propagated", what, propagating, exc_info=complaint)
        if hasattr(propagating, "add_note"):  # Python >= 3.11
            propagating.add_note(f"chunk_offload: {what} during this exception also failed: {complaint!r}")
