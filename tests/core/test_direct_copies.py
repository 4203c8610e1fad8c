"""NOTE [Direct copies] (core/copies.py): a storage saved through one contiguous view that covers
its span (once, or several times as the same view) is copied as that view itself; any other
storage as a uint8 byte span whose views are rebuilt at unpack. Both give backward the same values, shapes and strides.

Which form ran is seen from outside through torch's profiler: the byte form costs one
``aten::set_`` at the offload (the byte view) and one per unpack (the rebuilt view); the direct
form none.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from chunk_offload import OffloadConfig, OffloadManager

from ._models import Fn, assert_clean

ROWS, COLS = 6, 8


def _run(module: torch.nn.Module, x: torch.Tensor, manager: OffloadManager | None) -> tuple[torch.Tensor, int]:
    """One forward and backward of ``module`` on ``x``: the input's gradient and the ``aten::set_`` calls made."""
    x = x.detach().requires_grad_(True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        if manager is None:
            module(x).pow(2).sum().backward()
        else:
            with manager.iteration():
                with manager.chunk(microbatch=0):
                    loss = module(x).pow(2).sum()
                loss.backward()
    set_calls = sum(event.count for event in prof.key_averages() if event.key == "aten::set_")
    return x.grad, set_calls


def _without_and_with_offload(module: torch.nn.Module, x: torch.Tensor):
    """``module`` run without a manager, then offloaded as group ``g``: the input's gradient of
    each, the ``aten::set_`` calls of the offloaded run and its group's stats (nothing left after)."""
    expected, _ = _run(module, x, None)
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    try:
        manager.offload_module(module, "g")
        got, set_calls = _run(module, x, manager)
        stats = manager.stats().groups["g"]
        assert_clean(manager)
    finally:
        manager.close()
    return expected, got, set_calls, stats


@pytest.mark.parametrize(
    ("make_view", "direct"),
    [
        (lambda z: z, True),  # a fresh activation: the common case
        (lambda z: z[1:], True),  # one contiguous view at an aligned offset of its storage
        (lambda z: z.t(), False),  # strided: its strides must come back as they were
        (lambda z: z[:, 1:], False),  # a strided slice
    ],
    ids=["fresh", "aligned-slice", "transposed", "strided-slice"],
)
def test_copied_as_itself_or_as_bytes_with_the_same_strides(make_view, direct: bool) -> None:
    x = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(3))

    def forward(z: torch.Tensor) -> torch.Tensor:
        return SaveOne.apply(make_view(z * 1.5))  # a product by a number saves nothing

    SaveOne.seen.clear()
    expected, got, set_calls, stats = _without_and_with_offload(Fn(forward), x)
    assert torch.equal(got, expected)
    assert stats.bytes_offloaded > 0 and stats.bytes_reloaded == stats.bytes_offloaded
    # Shapes and strides backward saw: the run without offload first, then with it.
    assert SaveOne.seen[1] == SaveOne.seen[0]
    assert set_calls == (0 if direct else 2)


class SaveOne(torch.autograd.Function):
    """``view ** 2`` saving ``view``; backward records the shape and strides of what it gets back."""

    seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    @staticmethod
    def forward(ctx, view: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(view)
        return view * view

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (view,) = ctx.saved_tensors
        SaveOne.seen.append((tuple(view.shape), view.stride()))
        return grad * 2.0 * view


@pytest.mark.parametrize(
    ("make_views", "set_calls_expected"),
    [
        (lambda v: (v, v), 0),  # one tensor saved twice (an output, then the next call's input)
        (lambda v: (v, v.view(v.shape)), 0),  # two tensors, one view of the storage
        (lambda v: (v, v[1:]), 3),  # two views: a byte view at offload, one rebuilt view per unpack
        (lambda v: (v, v.view(COLS, ROWS)), 3),  # the same bytes, another shape
    ],
    ids=["same-tensor", "same-view", "two-views", "reshaped"],
)
def test_a_storage_saved_twice_as_one_view_is_copied_directly(make_views, set_calls_expected: int) -> None:
    x = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(5))
    SaveTwo.seen.clear()
    expected, got, set_calls, stats = _without_and_with_offload(Fn(lambda z: SaveTwo.apply(*make_views(z * 1.5))), x)
    assert torch.equal(got, expected)
    assert SaveTwo.seen[1] == SaveTwo.seen[0]
    assert stats.tensors_offloaded == 2 and stats.bytes_offloaded == x.numel() * x.element_size()
    assert set_calls == set_calls_expected


class SaveTwo(torch.autograd.Function):
    """``a * b.sum()`` saving ``a`` and ``b``; backward records the shapes and strides it gets back."""

    seen: list[tuple[tuple[int, ...], ...]] = []

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a * b.sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        SaveTwo.seen.append((tuple(a.shape), a.stride(), tuple(b.shape), b.stride()))
        return grad * b.sum(), (grad * a).sum().expand_as(b)


def test_a_group_input_that_requires_grad_is_copied_without_history() -> None:
    """The group's own input (a leaf that requires grad) is saved as it is and copied directly:
    the copy into the pooled host buffer records no autograd history. With history, the buffer
    would reach the leaf through its gradient accumulator and keep it alive in the pool."""
    x = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(4))
    module = Fn(lambda z: SaveOne.apply(z))
    expected, _ = _run(module, x, None)
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    try:
        manager.offload_module(module, "g")
        leaf = x.clone().requires_grad_(True)
        with manager.iteration():
            with manager.chunk(microbatch=0):
                loss = module(leaf).pow(2).sum()
            loss.backward()
        assert torch.equal(leaf.grad, expected)
        stats = manager.stats().groups["g"]
        gone = weakref.ref(leaf)
        del leaf, loss
        gc.collect()
        assert gone() is None, "the leaf is still alive: a copy recorded autograd history"
        assert_clean(manager)
    finally:
        manager.close()
    assert stats.tensors_offloaded == 1 and stats.bytes_offloaded == x.numel() * x.element_size()
