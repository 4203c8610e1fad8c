"""NOTE [Group slabs] (core/slab.py): a small group's storages share one host buffer and come back in
one device buffer, with one copy each way per group on the host-to-device side.

What is checked: training stays bit-identical with slabs and without (``slab_bytes=0``) under
random copy delays and the happens-before checker; a slabbed group takes one pool buffer and its
reloaded tensors share one device storage; a storage autograd drops before the reload leaves the
slab, the rest reload one by one from their slices, and the slab goes back to the pool once.
"""

from __future__ import annotations

import pytest
import torch

from chunk_offload import CpuStreams, OffloadConfig, OffloadManager
from chunk_offload.core import GroupState
from chunk_offload.core.slab import SLAB_ALIGN, slab_offsets
from tests._driver import assert_identical

from ._models import INTERLEAVED, MODULE_KINDS, Fn, assert_clean, run_schedule

SLAB_BYTES = OffloadConfig().group_slab_bytes  # the default
ROWS, COLS = 4, 40  # 640-byte float tensors: a slice each of two SLAB_ALIGN units


class SaveThree(torch.autograd.Function):
    """Saves three tensors of distinct storages; backward records the device storage of each."""

    storages: list[list[int]] = []

    @staticmethod
    def forward(ctx, a, b, c):
        ctx.save_for_backward(a, b, c)
        return a * b * c

    @staticmethod
    def backward(ctx, grad):
        a, b, c = ctx.saved_tensors
        SaveThree.storages.append([t.untyped_storage().data_ptr() for t in (a, b, c)])
        return grad * b * c, grad * a * c, grad * a * b


def _three(x: torch.Tensor) -> torch.Tensor:
    # Products by numbers save nothing: the group saves SaveThree's three (the last one strided: copied as bytes).
    return SaveThree.apply(x * 1.5, x * 2.5, (x * 3.5).t().contiguous().t())


def run_three(manager: OffloadManager | None, x: torch.Tensor) -> torch.Tensor:
    """One forward and backward of `SaveThree`'s group on ``x`` (offloaded under ``manager``); x's gradient."""
    x = x.detach().requires_grad_(True)
    module = Fn(_three)
    if manager is None:
        _three(x).sum().backward()
        return x.grad
    manager.offload_module(module, "three")
    with manager.iteration():
        with manager.chunk(microbatch=0):
            loss = module(x).sum()
        loss.backward()
    return x.grad


def check_three_offloaded(manager: OffloadManager, x: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """`run_three` under ``manager`` (closed after): bit-identical to ``expected``, nothing left,
    and with a slab (``group_slab_bytes`` > 0) one pool buffer and one device storage, else three
    of each. Returns the gradient."""
    SaveThree.storages.clear()
    acquired: list[int] = []
    acquire = manager.pool.acquire
    manager.pool.acquire = lambda nbytes: acquired.append(nbytes) or acquire(nbytes)  # this manager's pool only
    try:
        got = run_three(manager, x)
        stats = manager.stats()
        assert_clean(manager)
    finally:
        manager.close()
    assert torch.equal(got, expected)
    slabbed = manager.config.group_slab_bytes > 0
    assert acquired == ([3 * 2 * SLAB_ALIGN] if slabbed else [ROWS * COLS * 4] * 3), "host buffers asked for by the group"
    _assert_three_slabbed(stats, SaveThree.storages[0], slabbed=slabbed)
    return got


def _assert_three_slabbed(stats, reloaded_storages: list[int], slabbed: bool) -> None:
    assert stats.groups["three"].bytes_reloaded == stats.groups["three"].bytes_offloaded == 3 * ROWS * COLS * 4
    if slabbed:
        assert stats.pool.allocations == 1 and stats.pool.peak_requested_bytes == 3 * 2 * SLAB_ALIGN
        assert len(set(reloaded_storages)) == 1, "a slab's storages come back as slices of one device buffer"
    else:
        assert stats.pool.allocations == 3
        assert len(set(reloaded_storages)) == 3


@pytest.mark.parametrize("slab_bytes", [SLAB_BYTES, 0], ids=["slab", "buffer_per_storage"])
def test_a_slabbed_group_takes_one_buffer_and_reloads_into_one_device_storage(slab_bytes: int) -> None:
    x = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(5))
    expected = run_three(None, x)
    config = OffloadConfig(min_offload_bytes=1, group_slab_bytes=slab_bytes)
    check_three_offloaded(OffloadManager(config, streams=CpuStreams(max_delay_s=0.002, seed=3, check_order=True)), x, expected)


def test_slab_offsets_start_each_storage_aligned_and_refuse_one_storage_or_past_the_limit() -> None:
    class Span:
        def __init__(self, nbytes: int) -> None:
            self.nbytes = nbytes

    spans = [Span(1), Span(SLAB_ALIGN), Span(0), Span(SLAB_ALIGN + 1)]
    assert slab_offsets(spans, SLAB_BYTES) == ([0, SLAB_ALIGN, 2 * SLAB_ALIGN, 2 * SLAB_ALIGN], 4 * SLAB_ALIGN)
    assert slab_offsets(spans, 4 * SLAB_ALIGN - 1) is None
    assert slab_offsets(spans[:1], SLAB_BYTES) is None


def test_a_storage_freed_before_the_reload_leaves_the_slab_and_the_rest_reload_from_their_slices() -> None:
    """Three storages in one slab; autograd drops the graph of one before backward reaches the group."""
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1), streams=CpuStreams(check_order=True))
    x = torch.randn(ROWS, COLS, requires_grad=True)
    w = torch.randn(ROWS, COLS)
    try:
        with manager.iteration():
            with manager.chunk(microbatch=0) as handler:
                manager.group_start(x, "three")
                kept = (x * 2).sin()  # saves x * 2
                dropped = (x * 3).cos()  # saves x * 3: its graph is dropped below
                out = manager.group_commit(kept * w, "three")  # saves w too
            (group,) = handler.groups
            assert group.state is GroupState.ON_HOST
            assert manager.stats().pool.allocations == 1
            del dropped  # its saved tensor's storage is freed while on host
            assert manager.stats().pool.in_use_bytes > 0, "the slab stays out while a storage still holds it"
            out.sum().backward()
        assert torch.equal(x.grad, (x.detach() * 2).cos() * 2 * w)
        assert group.state is GroupState.RELEASED
        assert manager.stats().groups["three"].bytes_reloaded == 2 * ROWS * COLS * 4
        assert_clean(manager)
    finally:
        manager.close()


@pytest.mark.parametrize("group_by", ["module", "layer"])
def test_training_is_bit_identical_with_and_without_slabs_under_copy_delays(group_by: str) -> None:
    reference = run_schedule(lambda: None, order=INTERLEAVED, model_chunks=2, iterations=2)
    allocations = {}
    for slab_bytes in (SLAB_BYTES, 0):

        def make() -> OffloadManager:
            streams = CpuStreams(max_delay_s=0.001, seed=11, check_order=True)
            return OffloadManager(OffloadConfig(min_offload_bytes=1, group_by=group_by, group_slab_bytes=slab_bytes), streams=streams)

        def after(manager: OffloadManager, iteration: int) -> None:
            allocations[slab_bytes] = manager.stats().pool.allocations

        result = run_schedule(make, order=INTERLEAVED, model_chunks=2, iterations=2, kinds=MODULE_KINDS, after_iteration=after)
        assert_identical(result, reference)
    assert allocations[SLAB_BYTES] < allocations[0], "slabs take fewer host buffers"
