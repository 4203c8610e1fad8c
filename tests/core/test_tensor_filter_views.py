"""Views and aliasing of saved tensors: q, k, v views of one storage copied once, saved views of every
layout coming back exactly with their strides, a view's copy limited to its span, two dtypes on one storage.

Gradients are compared with `torch.equal` against the same computation without a manager, byte
counts as exact integers computed from shapes.
"""

from __future__ import annotations

from typing import Callable, Sequence

import pytest
import torch
from torch import nn

from chunk_offload import OffloadManager
from tests.core._models import CoreAttention, Fn
from tests._driver import chunk_scope, iteration_scope
from tests.core._edge_cases import B, F32, H, N, SPAN_ALIGN, T, assert_same, run_fn

# ----------------------------------------------------------------------------- q, k, v views


SEEN: list[tuple[torch.Tensor, ...]] = []


class QKVMix(torch.autograd.Function):
    """Saves q, k, v (views of one qkv tensor) and records what backward gets back."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return q * k + v.sin()

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        SEEN.append((q, k, v))
        return g * k, g * q, g * v.cos()


class QKVBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv_linear = nn.Linear(H, 3 * H)
        self.core_attn = Fn(QKVMix.apply)
        self.qkv_storage: list[torch.Tensor] = []

    def forward(self, x):
        qkv = self.qkv_linear(x)
        self.qkv_storage.append(qkv)  # keep the original alive: a reload must get other memory
        q, k, v = qkv.chunk(3, dim=-1)
        return self.core_attn(q, k, v)


def _run_qkv(manager: OffloadManager | None):
    SEEN.clear()
    block = QKVBlock()
    if manager is not None:
        manager.offload_module(block.core_attn, "core_attn")
    x = torch.randn(B, T, H, generator=torch.Generator().manual_seed(3), requires_grad=True)
    with iteration_scope(manager):
        with chunk_scope(manager):
            out = block(x)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(4)))
    grads = [x.grad] + [p.grad for p in block.parameters()]
    return block, out.detach(), grads, SEEN[0]


def test_qkv_views_of_one_storage_are_copied_once(make_manager):
    _, ref_out, ref_grads, _ = _run_qkv(None)
    manager = make_manager(min_offload_bytes=1)
    block, out, grads, (q, k, v) = _run_qkv(manager)
    assert torch.equal(out, ref_out)
    for i, (a, b) in enumerate(zip(grads, ref_grads)):
        assert torch.equal(a, b), f"gradient {i} differs"

    stats = manager.stats().groups["core_attn"]
    qkv_bytes = B * T * 3 * H * F32  # q starts at byte 0 and v ends at the end of the qkv storage
    assert stats.groups == 1
    assert stats.tensors_offloaded == 3
    assert stats.tensors_kept == 0
    assert stats.bytes_offloaded == qkv_bytes
    assert stats.bytes_reloaded == qkv_bytes

    # Rebuilt as the same three views of one new storage.
    original = block.qkv_storage[0]
    storages = {t.untyped_storage().data_ptr() for t in (q, k, v)}
    assert len(storages) == 1
    assert storages != {original.untyped_storage().data_ptr()}
    assert q.data_ptr() != original.data_ptr()
    for i, t in enumerate((q, k, v)):
        assert t.shape == (B, T, H)
        assert t.stride() == (T * 3 * H, 3 * H, 1)
        assert t.data_ptr() - q.data_ptr() == i * H * F32
        assert torch.equal(t, original.detach().chunk(3, dim=-1)[i])


def test_qkv_with_the_models_core_attention_keeps_exact_grads(make_manager):
    def run(manager):
        torch.manual_seed(0)
        lin = nn.Linear(H, 3 * H)
        attn = CoreAttention(4)
        if manager is not None:
            manager.offload_module(attn, "core_attn")
        x = torch.randn(B, T, H, generator=torch.Generator().manual_seed(5), requires_grad=True)
        with iteration_scope(manager):
            with chunk_scope(manager):
                out = attn(*lin(x).chunk(3, dim=-1))
            out.pow(2).sum().backward()
        return [out.detach(), x.grad, lin.weight.grad, lin.bias.grad]

    ref = run(None)
    manager = make_manager(min_offload_bytes=1)
    got = run(manager)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    stats = manager.stats().groups["core_attn"]
    assert stats.groups == 1 and stats.tensors_offloaded > 0
    assert stats.bytes_reloaded == stats.bytes_offloaded > 0
    s = manager.stats()
    assert (s.resident_bytes, s.host_bytes, s.pool.in_use_bytes) == (0, 0, 0)


# ----------------------------------------------------------------------------- views and aliasing


def _sin_of(view_fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: view_fn(x).sin()  # sin saves exactly its input: the view


def _span_bytes(offset: int, size: Sequence[int], stride: Sequence[int], itemsize: int) -> int:
    extent = 1 + sum((n - 1) * s for n, s in zip(size, stride))
    start = offset * itemsize // SPAN_ALIGN * SPAN_ALIGN
    return (offset + extent) * itemsize - start


VIEW_CASES = {
    "transpose": ((N, H), lambda x: x.t(), N * H * F32),
    "slice_with_offset": ((N, H), lambda x: x[2:, 5:], _span_bytes(2 * H + 5, (N - 2, H - 5), (H, 1), F32)),
    "as_strided": ((N, H), lambda x: x.as_strided((4, 8), (9, 1), 3), _span_bytes(3, (4, 8), (9, 1), F32)),
    "square_transpose": ((H, H), lambda x: x.t(), H * H * F32),
    "expand": ((1, H), lambda x: x.expand(N, H), H * F32),
    "small_view_of_large_storage": ((64, 64), lambda x: x[10:12], 2 * 64 * F32),
}


@pytest.mark.parametrize("case", list(VIEW_CASES))
def test_saved_views_round_trip_exactly(make_manager, case):
    shape, view_fn, expected_bytes = VIEW_CASES[case]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(11))
    fn = _sin_of(view_fn)
    ref = run_fn(fn, [x], None, seed=12)
    manager = make_manager(min_offload_bytes=1)
    got = run_fn(fn, [x], manager, seed=12)
    assert_same(got, ref)
    stats = manager.stats()
    group = stats.groups["g"]
    assert group.tensors_offloaded == 1
    assert group.bytes_offloaded == expected_bytes
    assert group.bytes_reloaded == expected_bytes
    assert (stats.resident_bytes, stats.host_bytes, stats.pool.in_use_bytes) == (0, 0, 0)


def test_small_view_copies_only_its_span(make_manager):
    shape, view_fn, expected = VIEW_CASES["small_view_of_large_storage"]
    manager = make_manager(min_offload_bytes=1)
    run_fn(_sin_of(view_fn), [torch.randn(shape)], manager, seed=0)
    storage_bytes = shape[0] * shape[1] * F32
    assert manager.stats().groups["g"].bytes_offloaded == expected < storage_bytes


def test_square_transpose_comes_back_with_its_strides(make_manager):
    seen: list[torch.Tensor] = []

    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a)
            return a.clone()

        @staticmethod
        def backward(ctx, g):
            (a,) = ctx.saved_tensors
            seen.append(a)
            return g * a

    x = torch.randn(H, H, generator=torch.Generator().manual_seed(2))
    fn = lambda x: Keep.apply(x.t())  # noqa: E731
    ref = run_fn(fn, [x], None, seed=3)
    manager = make_manager(min_offload_bytes=1)
    got = run_fn(fn, [x], manager, seed=3)
    assert_same(got, ref)
    back = seen[-1]
    assert back.shape == (H, H) and back.stride() == (1, H)
    assert torch.equal(back, x.t())


DTYPE_SEEN: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []


class FloatAndBytes(torch.autograd.Function):
    """Saves a float view and a uint8 view of one storage; backward checks both came back intact."""

    @staticmethod
    def forward(ctx, x):
        f = x[1:]  # storage offset H floats
        u = f.view(torch.uint8)
        ctx.save_for_backward(f, u)
        ctx.expected = (f.clone(), u.clone())
        return f * 2

    @staticmethod
    def backward(ctx, g):
        f, u = ctx.saved_tensors
        DTYPE_SEEN.append((f, u, *ctx.expected))
        grad = torch.zeros(g.shape[0] + 1, g.shape[1])
        grad[1:] = g * 2
        return grad


def test_two_dtypes_viewing_one_storage(make_manager):
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(9))
    DTYPE_SEEN.clear()
    ref = run_fn(FloatAndBytes.apply, [x], None, seed=1)
    manager = make_manager(min_offload_bytes=1)
    got = run_fn(FloatAndBytes.apply, [x], manager, seed=1)
    assert_same(got, ref)
    f, u, f_expected, u_expected = DTYPE_SEEN[-1]
    assert f.dtype == torch.float32 and u.dtype == torch.uint8
    assert torch.equal(f, f_expected)
    assert torch.equal(u, u_expected)
    assert torch.equal(u, f.view(torch.uint8))
    assert f.untyped_storage().data_ptr() == u.untyped_storage().data_ptr()
    assert f.data_ptr() == u.data_ptr()
    stats = manager.stats().groups["g"]
    assert stats.tensors_offloaded == 2
    assert stats.bytes_offloaded == (N - 1) * H * F32  # one span: rows 1.. (offset 128 bytes, aligned)
