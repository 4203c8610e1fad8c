"""`deterministic_kernels`: torch's deterministic kernels, so that runs compare bit for bit on CUDA too.

On CUDA several kernels accumulate in an order that changes from run to run (flash attention's
backward among them), so two runs of one model differ in their last bits with or without offload,
and a comparison of gradients then says nothing about the offload. Under
``torch.use_deterministic_algorithms(True)`` (no ``warn_only``) torch takes deterministic kernels
(flash attention's backward included) or raises where it has none, and cuBLAS needs a fixed
workspace (``CUBLAS_WORKSPACE_CONFIG``, read when cuBLAS first starts: call this before the
first matrix product). Deterministic kernels may be slower: step times measured under them are
those kernels'. On CPU the kernels the replay and the benches use are deterministic already.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

__all__ = ["CUBLAS_WORKSPACE", "deterministic_kernels"]

CUBLAS_WORKSPACE = ":4096:8"
"""The ``CUBLAS_WORKSPACE_CONFIG`` set where none is: cuBLAS's fixed workspace for reproducible products."""


@contextlib.contextmanager
def deterministic_kernels() -> Iterator[None]:
    """Deterministic kernels while the block runs (torch's previous setting restored after it);
    ``CUBLAS_WORKSPACE_CONFIG`` is set, where unset, for the rest of the process."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    previous, previous_warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous, warn_only=previous_warn_only)
