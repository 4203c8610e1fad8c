"""Edge cases of views and aliasing inside offloaded modules: strided and overlapping views, views
kept on device, several views of one storage; each compared bit-exact with a run without offload."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests._driver import chunk_scope, iteration_scope
from tests.core._edge_cases import F32, H, N, _randn, _span_bytes, assert_same, run_fn
from tests.core._models import Fn, assert_clean


# ============================================================================= 1. views and aliasing


def test_overlapping_as_strided_view_round_trips(make_manager):
    # Rows overlap: element (i, j) is at 5 + 8 i + j, rows of 16 advance by 8.
    size, stride, offset = (N, 16), (8, 1), 5
    fn = lambda x: x.as_strided(size, stride, offset).sin()  # noqa: E731  (sin saves the view)
    x = _randn(N * H, seed=1)
    ref = run_fn(fn, [x], None, seed=2)
    mgr = make_manager()
    got = run_fn(fn, [x], mgr, seed=2)
    assert_same(got, ref)
    group = mgr.stats().groups["g"]
    assert group.tensors_offloaded == 1
    assert group.bytes_offloaded == group.bytes_reloaded == _span_bytes(offset, size, stride)
    assert_clean(mgr)


def test_slice_with_offset_of_an_activation_made_inside_the_module(make_manager):
    def fn(x):
        h = x * 1.5 + 0.25  # a new storage, larger than what is saved from it
        return h[3:, 7:].sin() + h[3:, 7:]  # sin saves a view at storage offset 3 * H + 7

    x = _randn(N, H, seed=3)
    ref = run_fn(fn, [x], None, seed=4)
    mgr = make_manager()
    got = run_fn(fn, [x], mgr, seed=4)
    assert_same(got, ref)
    group = mgr.stats().groups["g"]
    assert group.tensors_offloaded == 1
    assert group.bytes_offloaded == _span_bytes(3 * H + 7, (N - 3, H - 7), (H, 1)) < N * H * F32
    assert_clean(mgr)


def test_square_transpose_and_its_base_saved_by_one_matmul(make_manager):
    # mm(x.t(), x) saves both operands: two views with equal shapes but swapped strides of one
    # storage. Rebuilding either with the other's strides would transpose it silently.
    def fn(x):
        h = x * 2.0
        return h.t() @ h

    x = _randn(H, H, seed=5)
    ref = run_fn(fn, [x], None, seed=6)
    mgr = make_manager()
    got = run_fn(fn, [x], mgr, seed=6)
    assert_same(got, ref)
    group = mgr.stats().groups["g"]
    assert group.tensors_offloaded == 2
    assert group.bytes_offloaded == H * H * F32  # one storage, copied once
    assert_clean(mgr)


@pytest.mark.parametrize("keep", ["below_threshold", "marked_view"])
def test_a_view_kept_on_device_keeps_its_whole_storage(make_manager, keep):
    # mul saves both operands: the whole activation and one row of it, views of one storage.
    # When the row stays on device (below the threshold, or marked by Transformer Engine's
    # per-tensor attribute), it holds the whole storage there: copying the other view would
    # free nothing while counting its bytes as moved to host.
    def fn(x):
        h = x * 2.0
        row = h[:1]
        if keep == "marked_view":
            row._TE_do_not_offload = True
        other = x * 3.0  # a storage of its own in the same group, offloaded as usual
        return h * row + other.sin()

    x = _randn(N, H, seed=41)
    ref = run_fn(fn, [x], None, seed=42)
    mgr = make_manager(min_offload_bytes=H * F32 + 1 if keep == "below_threshold" else 1)
    got = run_fn(fn, [x], mgr, seed=42)
    assert_same(got, ref)
    group = mgr.stats().groups["g"]
    assert group.bytes_offloaded == group.bytes_reloaded == N * H * F32  # `other` only
    assert (group.tensors_offloaded, group.tensors_kept) == (1, 2)
    assert_clean(mgr)


def test_several_views_of_one_storage_saved_by_different_ops(make_manager):
    def fn(x):
        h = x * 1.5  # the only storage saved below (mul by a scalar saves nothing)
        a = h[:, :16].sin()  # saves h[:, :16]
        b = h.t().cos()  # saves h.t()
        c = h[2:] * h[:-2]  # saves two overlapping row slices
        d = h.pow(2)  # saves h
        return torch.cat([a.flatten(), b.flatten(), c.flatten(), d.flatten()])

    x = _randn(N, H, seed=7)
    ref = run_fn(fn, [x], None, seed=8)
    mgr = make_manager()
    got = run_fn(fn, [x], mgr, seed=8)
    assert_same(got, ref)
    group = mgr.stats().groups["g"]
    assert group.tensors_offloaded == 5
    assert group.bytes_offloaded == group.bytes_reloaded == N * H * F32
    assert_clean(mgr)


UNPACKED: list[torch.Tensor] = []


class TransposedGrad(torch.autograd.Function):
    """Saves ``a.t()`` and returns ``saved.t()`` (a view of the unpacked tensor) as a's gradient."""

    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a.t())
        return a * 3.0

    @staticmethod
    def backward(ctx, g):
        (saved,) = ctx.saved_tensors
        UNPACKED.append(saved)
        return saved.t()  # contiguous again: the leaf keeps it as its .grad without a copy


def test_gradient_that_views_an_unpacked_tensor_survives_pool_reuse(make_manager):
    mgr = make_manager()
    module = Fn(TransposedGrad.apply)
    mgr.offload_module(module, "tgrad")
    other = Fn(lambda z: z.sin())
    mgr.offload_module(other, "other")

    x = _randn(H, H, seed=9).requires_grad_(True)
    expected = x.detach().clone()  # d/dx as defined by TransposedGrad: saved.t() == x
    with mgr.iteration():
        with mgr.chunk(microbatch=0):
            y = module(x)
        y.sum().backward()
    grad = x.grad
    assert torch.equal(grad, expected)
    # The leaf kept the returned view itself: its storage is the group's reload buffer.
    unpacked = UNPACKED.pop()
    assert grad.untyped_storage().data_ptr() == unpacked.untyped_storage().data_ptr()
    assert unpacked.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    del unpacked
    assert mgr.stats().groups["tgrad"].bytes_reloaded == H * H * F32
    allocations = mgr.stats().pool.allocations
    assert_clean(mgr)

    # Another chunk offloads the same number of bytes: it takes the same host buffer, overwrites
    # it, and its own reload and release run, all while `grad` is still held.
    z = _randn(H, H, seed=10).mul(7.0).requires_grad_(True)
    with mgr.iteration():
        with mgr.chunk(microbatch=1):
            w = other(z * 1.0)  # a fresh storage: the test holds z, not z * 1.0
        w.sum().backward()
    stats = mgr.stats()
    assert stats.pool.allocations == allocations, "the second chunk should reuse the pooled buffer"
    assert stats.groups["other"].bytes_offloaded == H * H * F32
    assert torch.equal(z.grad, z.detach().cos())
    assert x.grad is grad
    assert torch.equal(grad, expected), "the gradient changed after the pool buffer was reused"
    assert_clean(mgr)


class TwiceThenResidual(nn.Module):
    """An offloaded module that uses its input twice (like a gated MLP), then a residual add."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Fn(lambda x: x.sin() * x.cos())

    def forward(self, x):
        return self.inner(x) + x  # the residual use of x is created after the group


def test_input_used_twice_in_a_group_and_again_after_it_keeps_exact_grads(make_manager):
    # Without offload, x's gradient is summed as ((residual + cos-path) + sin-path). An autograd
    # node on the group's inputs would pre-sum the two in-group contributions:
    # residual + (cos-path + sin-path), which differs in the last bits.
    def run(mgr):
        model = TwiceThenResidual()
        if mgr is not None:
            mgr.offload_module(model.inner, "g")
        w = _randn(4 * N, H, seed=21).requires_grad_(True)
        with iteration_scope(mgr):
            with chunk_scope(mgr):
                y = model(w * 1.0)
            y.pow(2).sum().backward()
        return y.detach(), [w.grad]

    ref = run(None)
    mgr = make_manager()
    got = run(mgr)
    assert_same(got, ref)
    assert mgr.stats().groups["g"].bytes_reloaded > 0
    assert_clean(mgr)
