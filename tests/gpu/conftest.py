"""What the GPU tests share: the one place they build an `OffloadManager`, and CUDA set-up.

Importing this module does not touch CUDA: every test module of tests/gpu skips itself with
``pytest.mark.skipif(not torch.cuda.is_available(), ...)`` and CUDA is first used inside a test.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch

from chunk_offload import CudaStreams, OffloadConfig, OffloadManager, SchedulePolicy

# cuBLAS reads this when it first starts (inside a test, never at import): with it, matrix
# products are reproducible run to run, which `torch.use_deterministic_algorithms` needs.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

REQUIRES_CUDA_REASON = "needs a CUDA device (run on a GPU machine: bash bench/gpu_evidence.sh)"


def new_manager(*, streams=None, schedule_policy: SchedulePolicy | None = None, **config) -> OffloadManager:
    """An `OffloadManager` on real CUDA streams; ``config``: `OffloadConfig` fields.

    The only constructor call of tests/gpu.
    """
    return OffloadManager(OffloadConfig(**config), streams=streams if streams is not None else CudaStreams(), schedule_policy=schedule_policy)


@pytest.fixture
def make_manager():
    """`new_manager`, for tests that take it as a fixture (the caller closes what it makes)."""
    return new_manager


def _deterministic_algorithms(*, warn_only: bool) -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True, warn_only=...)`` while the fixture is alive, restored after."""
    previous, previous_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous, warn_only=previous_warn)


@pytest.fixture
def deterministic():
    """Deterministic kernels where torch has them (a warning where it does not), restored after."""
    yield from _deterministic_algorithms(warn_only=True)


@pytest.fixture
def strictly_deterministic():
    """Deterministic kernels only (an op without one raises), restored after.

    Needed to compare gradients of bf16 / fp16 SDPA bit for bit: torch's flash attention backward
    takes its deterministic path only so; with ``warn_only`` it warns and stays non-deterministic.
    """
    yield from _deterministic_algorithms(warn_only=False)


@pytest.fixture
def record_stream_calls(monkeypatch):
    """Every call of `torch.Tensor.record_stream` during the test, as ``(shape, stream)``, passed on to torch."""
    calls: list[tuple[list[int], torch.cuda.Stream]] = []
    real = torch.Tensor.record_stream

    def recorded(self, stream):
        calls.append((list(self.shape), stream))
        return real(self, stream)

    monkeypatch.setattr(torch.Tensor, "record_stream", recorded)
    return calls
