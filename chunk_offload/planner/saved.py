"""`SavedTensor` and `group_bytes`: the engine's rules for the bytes one offload group moves.

Per call of an offloaded submodule the engine moves the tensors autograd saves inside it that are
not parameters and hold at least ``min_offload_bytes`` (numel x element size of the saved view,
like `chunk_offload.core.tensor_filter.TensorFilter`); views of one storage are moved once, as the span
from their lowest start (rounded down to 16 bytes) to their highest end
(``chunk_offload/core/group.py``). The byte models describe every module as a list of
`SavedTensor` and `group_bytes` applies those rules; `storage_bytes` gives the same bytes per
storage, so that the planner can hold some of them on device (`model.held_elsewhere`).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

__all__ = ["SavedTensor", "group_bytes", "storage_bytes", "whole"]

_SPAN_ALIGN = 16  # the engine rounds a copied span's start down to this (SPAN_ALIGN, chunk_offload/core/saved.py)


class SavedTensor(NamedTuple):
    """One tensor a module saves for backward."""

    storage: str
    """Which storage it views (names are local to one call)."""
    offset: int
    """Byte offset of the view's first element in the storage."""
    span: int
    """Bytes from the first element to one past the last."""
    nbytes: int
    """numel x element size: what ``min_offload_bytes`` is compared with."""


def whole(storage: str, nbytes: int) -> SavedTensor:
    """A tensor that is its whole (contiguous) storage."""
    return SavedTensor(storage, 0, nbytes, nbytes)


def storage_bytes(saved: Sequence[SavedTensor], *, min_offload_bytes: int) -> dict[str, int]:
    """Bytes the engine moves per storage of one group that saved ``saved`` (threshold, dedup, 16-byte start)."""
    spans: dict[str, tuple[int, int]] = {}
    for tensor in saved:
        if tensor.nbytes < min_offload_bytes:
            continue  # stays on device
        start, end = tensor.offset, tensor.offset + tensor.span
        if tensor.storage in spans:
            low, high = spans[tensor.storage]
            start, end = min(start, low), max(end, high)
        spans[tensor.storage] = (start, end)
    return {storage: max(end - start // _SPAN_ALIGN * _SPAN_ALIGN, 0) for storage, (start, end) in spans.items()}


def group_bytes(saved: Sequence[SavedTensor], *, min_offload_bytes: int) -> int:
    """Bytes the engine moves for one group that saved ``saved``: the sum of `storage_bytes`."""
    return sum(storage_bytes(saved, min_offload_bytes=min_offload_bytes).values())
