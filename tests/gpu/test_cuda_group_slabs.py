"""NOTE [Group slabs] (core/slab.py) on CUDA streams: a group of three storages takes one pinned
buffer and comes back in one device allocation, bit-identical to no offload and to a buffer per
storage, and every device byte it used is given back (the CPU test: tests/core/test_group_slabs.py)."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.core.test_group_slabs import COLS, ROWS, SLAB_BYTES, check_three_offloaded, run_three

from .conftest import REQUIRES_CUDA_REASON, new_manager

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=REQUIRES_CUDA_REASON)


@pytest.mark.parametrize("slab_bytes", [SLAB_BYTES, 0], ids=["slab", "buffer_per_storage"])
def test_a_slabbed_group_on_cuda(slab_bytes: int) -> None:
    x = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(5)).cuda()
    expected = run_three(None, x)
    gc.collect()
    before = torch.cuda.memory_allocated()
    got = check_three_offloaded(new_manager(min_offload_bytes=1, group_slab_bytes=slab_bytes), x, expected)
    del got
    gc.collect()
    assert torch.cuda.memory_allocated() == before, "the run left device memory allocated"
