"""Fixtures of the single-process megatron tests: megatron's pipeline state set to one stage, and
managers attached to a `GPTLikeChunk`, closed after the test.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch

from chunk_offload.integrations.megatron import MegatronOffloadManager
from tests._megatron_offload import attach_with
from tests.integrations.megatron._auto_iterations import GPTLikeChunk


@pytest.fixture
def pipeline_of_one() -> Iterator[None]:
    """Megatron's pipeline size 1 and rank 0 (what `_prepare_plan` reads), no calculator; reset after."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import unset_num_microbatches_calculator

    parallel_state.set_pipeline_model_parallel_world_size(1)
    parallel_state.set_pipeline_model_parallel_rank(0)
    unset_num_microbatches_calculator()
    try:
        yield
    finally:
        unset_num_microbatches_calculator()
        parallel_state.set_pipeline_model_parallel_world_size(None)
        parallel_state.set_pipeline_model_parallel_rank(None)


@pytest.fixture
def managed(pipeline_of_one) -> Iterator[Any]:
    """``managed(**options)`` -> (chunk, manager) offloading ``qkv_linear`` of every chunk; closed after the test."""
    made: list[MegatronOffloadManager] = []

    def make(**options: Any) -> tuple[GPTLikeChunk, MegatronOffloadManager]:
        torch.manual_seed(0)
        chunk = GPTLikeChunk()
        options = {"min_offload_bytes": 1, "schedule_policy": None, **options}
        made.append(attach_with(chunk, "qkv_linear", **options))
        return chunk, made[-1]

    yield make
    for manager in made:
        manager.detach()
        manager.close()
