"""Edge cases: views and aliasing inside offloaded modules, autograd corner cases, host pool
exhaustion and backward from another thread.

Every test runs the same computation with `OffloadManager(OffloadConfig(min_offload_bytes=1))` (so every
eligible saved tensor moves) and without one, and compares with `torch.equal`. After each
scenario the manager must hold nothing: pool buffers back, resident/host bytes zero, no live chunk.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import warnings
from typing import Callable, Sequence

import pytest
import torch
from torch import nn

from chunk_offload import ChunkOffloadError, OffloadManager
from tests.core._models import HIDDEN, Fn, assert_clean, make_stack, microbatches, register

B, T, H = 2, 8, 32
N = B * T
F32 = 4


def _iteration(mgr: OffloadManager | None):
    return mgr.iteration() if mgr is not None else contextlib.nullcontext()


def _chunk(mgr: OffloadManager | None, microbatch: int = 0, vp_stage: int = 0):
    return mgr.chunk(microbatch=microbatch, vp_stage=vp_stage) if mgr is not None else contextlib.nullcontext()


def _run_fn(fn: Callable, inputs: Sequence[torch.Tensor], mgr: OffloadManager | None, *, seed: int = 0, name: str = "g"):
    """``fn`` as an (optionally offloaded) module on fresh leaves; output and input grads."""
    module = Fn(fn)
    if mgr is not None:
        mgr.offload_module(module, name)
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    with _iteration(mgr):
        with _chunk(mgr):
            out = module(*leaves)
        cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
        out.backward(cot)
    return out.detach(), [x.grad for x in leaves]


def _assert_same(a, b) -> None:
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert torch.equal(out_a, out_b), "outputs differ"
    assert len(grads_a) == len(grads_b)
    for i, (x, y) in enumerate(zip(grads_a, grads_b)):
        assert x is not None and y is not None, f"gradient {i} missing"
        assert torch.equal(x, y), f"gradient {i} differs"


def _span_bytes(offset: int, size: Sequence[int], stride: Sequence[int], itemsize: int = F32) -> int:
    extent = 1 + sum((n - 1) * s for n, s in zip(size, stride))
    start = offset * itemsize // 16 * 16
    return (offset + extent) * itemsize - start


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ============================================================================= 1. views and aliasing


def test_overlapping_as_strided_view_round_trips(make_manager):
    # Rows overlap: element (i, j) is at 5 + 8 i + j, rows of 16 advance by 8.
    size, stride, offset = (N, 16), (8, 1), 5
    fn = lambda x: x.as_strided(size, stride, offset).sin()  # noqa: E731  (sin saves the view)
    x = _randn(N * H, seed=1)
    ref = _run_fn(fn, [x], None, seed=2)
    mgr = make_manager()
    got = _run_fn(fn, [x], mgr, seed=2)
    _assert_same(got, ref)
    group = mgr.stats().groups["g"]
    assert group.tensors_offloaded == 1
    assert group.bytes_offloaded == group.bytes_reloaded == _span_bytes(offset, size, stride)
    assert_clean(mgr)


def test_slice_with_offset_of_an_activation_made_inside_the_module(make_manager):
    def fn(x):
        h = x * 1.5 + 0.25  # a new storage, larger than what is saved from it
        return h[3:, 7:].sin() + h[3:, 7:]  # sin saves a view at storage offset 3 * H + 7

    x = _randn(N, H, seed=3)
    ref = _run_fn(fn, [x], None, seed=4)
    mgr = make_manager()
    got = _run_fn(fn, [x], mgr, seed=4)
    _assert_same(got, ref)
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
    ref = _run_fn(fn, [x], None, seed=6)
    mgr = make_manager()
    got = _run_fn(fn, [x], mgr, seed=6)
    _assert_same(got, ref)
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
    ref = _run_fn(fn, [x], None, seed=42)
    mgr = make_manager(min_offload_bytes=H * F32 + 1 if keep == "below_threshold" else 1)
    got = _run_fn(fn, [x], mgr, seed=42)
    _assert_same(got, ref)
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
    ref = _run_fn(fn, [x], None, seed=8)
    mgr = make_manager()
    got = _run_fn(fn, [x], mgr, seed=8)
    _assert_same(got, ref)
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
        with _iteration(mgr):
            with _chunk(mgr):
                y = model(w * 1.0)
            y.pow(2).sum().backward()
        return y.detach(), [w.grad]

    ref = run(None)
    mgr = make_manager()
    got = run(mgr)
    _assert_same(got, ref)
    assert mgr.stats().groups["g"].bytes_reloaded > 0
    assert_clean(mgr)


# ============================================================================= 2. autograd edge cases


def _model_and_reference(mgr: OffloadManager, layers: int = 2, seed: int = 0):
    model = make_stack(layers, seed=seed)
    reference = make_stack(layers, seed=seed)
    register(mgr, model)
    return model, reference


def _assert_grads_equal(model: nn.Module, reference: nn.Module) -> None:
    for i, (p, q) in enumerate(zip(model.parameters(), reference.parameters())):
        assert (p.grad is None) == (q.grad is None), f"gradient {i} present in only one run"
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), f"gradient {i} differs"


def test_retain_graph_then_second_backward_accumulates_exactly(make_manager):
    mgr = make_manager()
    model, reference = _model_and_reference(mgr)
    x = microbatches(1)[0]
    with mgr.iteration():
        with mgr.chunk(microbatch=0):
            loss = model(x).pow(2).mean()
        loss.backward(retain_graph=True)
        first = [p.grad.clone() for p in model.parameters()]
        loss.backward()
    ref_loss = reference(x).pow(2).mean()
    ref_loss.backward(retain_graph=True)
    ref_first = [p.grad.clone() for p in reference.parameters()]
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    for a, b in zip(first, ref_first):
        assert torch.equal(a, b)
    _assert_grads_equal(model, reference)
    assert mgr.stats().groups["mlp_fc1"].bytes_offloaded > 0
    del loss
    assert_clean(mgr)


class Tanh2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.fc2 = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)).sin())


def _double_backward(mgr: OffloadManager | None, seed: int = 0):
    torch.manual_seed(seed)
    model = Tanh2()
    if mgr is not None:
        mgr.offload_module(model, "mlp")
    x = _randn(N, HIDDEN, seed=seed + 1).requires_grad_(True)
    with _iteration(mgr):
        with _chunk(mgr):
            y = model(x)
        (gx,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
        penalty = gx.pow(2).sum()
        penalty.backward()
    return y.detach(), gx.detach(), [p.grad for p in model.parameters()], x.grad


def test_create_graph_double_backward_is_exact(make_manager):
    ref = _double_backward(None)
    mgr = make_manager()
    got = _double_backward(mgr)
    assert torch.equal(got[0], ref[0])
    assert torch.equal(got[1], ref[1]), "first-order gradient differs"
    for i, (a, b) in enumerate(zip(got[2], ref[2])):
        assert a is not None and torch.equal(a, b), f"second-order gradient of parameter {i} differs"
    assert torch.equal(got[3], ref[3])
    stats = mgr.stats()
    assert stats.groups["mlp"].bytes_offloaded > 0
    assert stats.groups["mlp"].bytes_reloaded == stats.groups["mlp"].bytes_offloaded
    del got
    assert_clean(mgr)


def test_create_graph_double_backward_through_transformer_blocks_is_exact(make_manager):
    # LayerNorm, softmax attention and GELU each offloaded; a gradient penalty on the input.
    def run(mgr):
        model = make_stack(2, seed=0)
        if mgr is not None:
            register(mgr, model)
        x = microbatches(1)[0].requires_grad_(True)
        with _iteration(mgr):
            with _chunk(mgr):
                loss = model(x).pow(2).mean()
            (gx,) = torch.autograd.grad(loss, x, create_graph=True)
            gx.pow(2).sum().backward()
        return loss.detach(), gx.detach(), [p.grad for p in model.parameters()]

    ref = run(None)
    mgr = make_manager()
    got = run(mgr)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    for i, (a, b) in enumerate(zip(got[2], ref[2])):
        assert a is not None and torch.equal(a, b), f"second-order gradient of parameter {i} differs"
    stats = mgr.stats()
    for kind in ("attn_norm", "core_attn", "mlp_fc1"):
        assert stats.groups[kind].bytes_reloaded == stats.groups[kind].bytes_offloaded > 0
    del got
    assert_clean(mgr)


def test_partial_backward_with_retain_graph_then_full_backward(make_manager):
    mgr = make_manager()
    model, reference = _model_and_reference(mgr)
    x = microbatches(1)[0]
    with mgr.iteration():
        with mgr.chunk(microbatch=0):
            h = model[0](x)
            loss = model[1](h).pow(2).mean()
        (gh,) = torch.autograd.grad(loss, h, retain_graph=True)  # block 1 only; block 0 prefetched
        loss.backward()
    ref_h = reference[0](x)
    ref_loss = reference[1](ref_h).pow(2).mean()
    (ref_gh,) = torch.autograd.grad(ref_loss, ref_h, retain_graph=True)
    ref_loss.backward()
    assert torch.equal(gh, ref_gh)
    _assert_grads_equal(model, reference)
    del loss, h
    assert_clean(mgr)


@pytest.mark.parametrize("first", [0, 1], ids=["older_first", "newer_first"])
def test_two_forwards_of_the_same_chunk_before_backward(make_manager, first):
    mgr = make_manager()
    model, reference = _model_and_reference(mgr)
    xs = microbatches(2)
    with mgr.iteration():
        losses = []
        for x in xs:
            with mgr.chunk(microbatch=0):  # the same (microbatch, vp_stage) twice
                losses.append(model(x).pow(2).mean())
        assert len(mgr.live_chunks()) == 2
        assert mgr.stats().host_bytes > 0
        order = [first, 1 - first]
        for i in order:
            losses[i].backward()
    ref_losses = [reference(x).pow(2).mean() for x in xs]
    for i in order:
        ref_losses[i].backward()
    for a, b in zip(losses, ref_losses):
        assert torch.equal(a, b)
    _assert_grads_equal(model, reference)
    del losses
    assert_clean(mgr)


def test_backward_after_the_iteration_closed(make_manager):
    mgr = make_manager()
    model, reference = _model_and_reference(mgr)
    xs = microbatches(2)
    with mgr.iteration():
        losses = []
        for m, x in enumerate(xs):
            with mgr.chunk(microbatch=m):
                losses.append(model(x).pow(2).mean())
    assert sorted(k.microbatch for k in mgr.live_chunks()) == [0, 1]
    assert mgr.stats().host_bytes > 0
    for loss in reversed(losses):
        loss.backward()
    ref = [reference(x).pow(2).mean() for x in xs]
    for loss in reversed(ref):
        loss.backward()
    for a, b in zip(losses, ref):
        assert torch.equal(a, b)
    _assert_grads_equal(model, reference)
    assert mgr.live_chunks() == []
    assert mgr.stats().pool.in_use_bytes == 0
    del losses
    assert_clean(mgr)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_grad_off_forward_inside_a_tracked_chunk_tracks_nothing(make_manager, mode):
    mgr = make_manager()
    model, reference = _model_and_reference(mgr)
    x = microbatches(1)[0]
    grad_off = torch.no_grad if mode == "no_grad" else torch.inference_mode
    before = mgr.stats()
    with mgr.iteration():
        with mgr.chunk(microbatch=0) as handler:
            assert handler is not None  # the chunk itself is tracked
            with grad_off():
                y = model(x)
        assert handler.groups == []
    assert torch.equal(y, reference(x))
    assert mgr.stats() == before
    assert mgr.live_chunks() == []
    assert_clean(mgr)

    # And a tracked forward of the same model afterwards is offloaded and exact.
    with mgr.iteration():
        with mgr.chunk(microbatch=0):
            loss = model(x).pow(2).mean()
        loss.backward()
    reference(x).pow(2).mean().backward()
    _assert_grads_equal(model, reference)
    assert mgr.stats().groups["mlp_fc1"].bytes_offloaded > 0
    del loss
    assert_clean(mgr)


class Boom(Exception):
    pass


@pytest.mark.parametrize("where", ["inside_open_group", "after_commit"])
def test_exception_mid_forward_then_a_clean_iteration(make_manager, where):
    mgr = make_manager()
    model, reference = _model_and_reference(mgr)
    xs = microbatches(2)
    calls = {"n": 0}

    def maybe_fail(*_):
        calls["n"] += 1
        if calls["n"] == 3:  # mid-forward of microbatch 1, at block 1's offloaded core_attn
            raise Boom("forward failed")

    core_attn = model[1].core_attn
    if where == "inside_open_group":  # runs after the offload pre-hook opened the group
        handle = core_attn.register_forward_pre_hook(maybe_fail)
    else:  # runs after the offload post-hook committed the group
        handle = core_attn.register_forward_hook(maybe_fail)
    with pytest.raises(Boom):
        with mgr.iteration():
            with mgr.chunk(microbatch=0):
                loss0 = model(xs[0]).pow(2).mean()
            with mgr.chunk(microbatch=1):
                model(xs[0])
                model(xs[1])
    handle.remove()
    del loss0
    assert_clean(mgr)

    with mgr.iteration():
        losses = []
        for m, x in enumerate(xs):
            with mgr.chunk(microbatch=m):
                losses.append(model(x).pow(2).mean())
        for loss in losses:
            loss.backward()
    ref = [reference(x).pow(2).mean() for x in xs]
    for loss in ref:
        loss.backward()
    for a, b in zip(losses, ref):
        assert torch.equal(a, b)
    _assert_grads_equal(model, reference)
    del losses
    assert_clean(mgr)


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        raise Boom("backward failed")


def test_exception_in_one_chunks_backward_leaves_the_other_chunk_exact(make_manager):
    mgr = make_manager()
    model, reference = _model_and_reference(mgr)
    failing = Fn(FailingBackward.apply)
    mgr.offload_module(failing, "failing")
    xs = microbatches(2)
    with mgr.iteration():
        with mgr.chunk(microbatch=0):
            loss0 = model(xs[0]).pow(2).mean()
        with mgr.chunk(microbatch=1):
            loss1 = model[1](failing(model[0](xs[1]))).pow(2).mean()
    # Backward outside the iteration: the failure must not discard microbatch 0's chunk.
    with pytest.raises(Boom, match="backward failed"):
        loss1.backward()
    del loss1
    gc.collect()
    model.zero_grad(set_to_none=True)  # block 1's backward of microbatch 1 ran before the failure
    assert [k.microbatch for k in mgr.live_chunks()] == [0]
    loss0.backward()
    ref0 = reference(xs[0]).pow(2).mean()
    ref0.backward()
    assert torch.equal(loss0, ref0)
    _assert_grads_equal(model, reference)
    del loss0
    assert_clean(mgr)

    # A clean next iteration, exact.
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    with mgr.iteration():
        with mgr.chunk(microbatch=0):
            loss = model(xs[1]).pow(2).mean()
        loss.backward()
    reference(xs[1]).pow(2).mean().backward()
    _assert_grads_equal(model, reference)
    del loss
    assert_clean(mgr)


def test_exception_in_backward_inside_the_iteration_then_clean(make_manager):
    mgr = make_manager()
    model, reference = _model_and_reference(mgr)
    failing = Fn(FailingBackward.apply)
    mgr.offload_module(failing, "failing")
    x = microbatches(1)[0]
    with pytest.raises(Boom, match="backward failed"):
        with mgr.iteration():
            with mgr.chunk(microbatch=0):
                loss = model[1](failing(model[0](x))).pow(2).mean()
            loss.backward()
    del loss
    assert_clean(mgr)
    model.zero_grad(set_to_none=True)
    with mgr.iteration():
        with mgr.chunk(microbatch=0):
            loss = model(x).pow(2).mean()
        loss.backward()
    reference(x).pow(2).mean().backward()
    _assert_grads_equal(model, reference)
    del loss
    assert_clean(mgr)


def test_partial_backward_to_an_intermediate_then_drop_the_graph(make_manager):
    mgr = make_manager()
    model, reference = _model_and_reference(mgr)
    x = microbatches(1)[0]
    with mgr.iteration():
        with mgr.chunk(microbatch=0):
            h = model[0](x)
            loss = model[1](h).pow(2).mean()
        (gh,) = torch.autograd.grad(loss, h)  # runs only block 1's groups
    ref_h = reference[0](x)
    (ref_gh,) = torch.autograd.grad(reference[1](ref_h).pow(2).mean(), ref_h)
    assert torch.equal(gh, ref_gh)
    stats = mgr.stats()
    assert mgr.live_chunks() != []  # block 0's groups were never consumed
    assert stats.host_bytes + stats.resident_bytes > 0
    del loss, h
    assert_clean(mgr)


# ============================================================================= 3. host pool exhaustion


def _train(mgr: OffloadManager | None, iterations: int = 2, seed: int = 0):
    """A few iterations of 2 microbatches (F0 F1 B0 B1) of a 2-block stack; losses and grads."""
    model = make_stack(2, seed=seed)
    if mgr is not None:
        register(mgr, model)
    xs = microbatches(2)
    losses, grads = [], []
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(iterations):
        opt.zero_grad(set_to_none=True)
        with _iteration(mgr):
            outs = []
            for m, x in enumerate(xs):
                with _chunk(mgr, m):
                    outs.append(model(x).pow(2).mean())
            for out in outs:
                out.backward()
        losses += [o.detach() for o in outs]
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return losses, grads


def _assert_runs_equal(a, b) -> None:
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    for ga, gb in zip(a[1], b[1]):
        for x, y in zip(ga, gb):
            assert torch.equal(x, y)


def test_pool_fallback_is_exact_and_warns_once(make_manager):
    plain = _train(None)
    pooled_mgr = make_manager()
    pooled = _train(pooled_mgr)
    _assert_runs_equal(pooled, plain)
    full = pooled_mgr.stats().pool.allocated_bytes
    assert full > 0

    cap = full // 4
    mgr = make_manager(host_pool_bytes=cap, on_exhausted="fallback")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        capped = _train(mgr)
    ours = [w for w in caught if "host pool at its cap" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert f"of host_pool_bytes={cap}" in str(ours[0].message)
    _assert_runs_equal(capped, plain)
    stats = mgr.stats()
    assert stats.pool.fallback_allocations > 0
    assert stats.pool.allocated_bytes <= cap
    assert stats.bytes_offloaded == pooled_mgr.stats().bytes_offloaded
    assert_clean(mgr)


def test_pool_error_raises_before_allocating_then_clean(make_manager):
    plain = _train(None, iterations=1)
    probe = make_manager()
    _train(probe, iterations=1)
    full = probe.stats().pool.allocated_bytes

    cap = full // 3
    mgr = make_manager(host_pool_bytes=cap, on_exhausted="error")
    with pytest.raises(ChunkOffloadError) as info:
        _train(mgr, iterations=1)
    message = str(info.value)
    assert "host pool exhausted" in message
    assert f"of host_pool_bytes={cap}" in message
    requested = int(message.split("host pool exhausted: ")[1].split(" bytes requested")[0])
    stats = mgr.stats()
    assert 0 < requested
    assert stats.pool.allocated_bytes <= cap  # the refused buffer was never allocated
    assert stats.pool.allocated_bytes + -(-requested // 512) * 512 > cap
    assert stats.pool.fallback_allocations == 0
    assert_clean(mgr)

    fresh = make_manager()
    _assert_runs_equal(_train(fresh, iterations=1), plain)
    assert_clean(fresh)


# ============================================================================= 4. threading


def test_backward_in_another_thread_is_exact(make_manager):
    mgr = make_manager()
    model, reference = _model_and_reference(mgr)
    xs = microbatches(2)
    errors: list[BaseException] = []

    def backward(loss):
        try:
            loss.backward()
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    with mgr.iteration():
        losses = []
        for m, x in enumerate(xs):
            with mgr.chunk(microbatch=m):
                losses.append(model(x).pow(2).mean())
        for loss in losses:
            thread = threading.Thread(target=backward, args=(loss,))
            thread.start()
            thread.join()
    assert errors == []
    ref = [reference(x).pow(2).mean() for x in xs]
    for loss in ref:
        loss.backward()
    for a, b in zip(losses, ref):
        assert torch.equal(a, b)
    _assert_grads_equal(model, reference)
    assert mgr.stats().groups["mlp_fc1"].bytes_reloaded > 0
    del losses
    assert_clean(mgr)


@pytest.mark.parametrize("fn", [torch.sigmoid, torch.sigmoid_], ids=["output", "input_modified_in_place"])
@pytest.mark.parametrize("offload", [False, True], ids=["kept", "offloaded"])
def test_retained_graph_frees_without_garbage_collection(make_manager, offload, fn):
    """A saved *output* (sigmoid saves its result) held by a kept group must not form a cycle,
    also when it is the group's input modified in place (its node is then the saving one).

    Under ``retain_graph=True`` (zero-bubble input-gradient steps) autograd keeps the saved
    tensors until the graph dies; the group must then free them by reference counting alone,
    not at the next garbage collection (which may come after the iteration or never).
    """
    mgr = make_manager()
    sigmoid = Fn(fn)
    mgr.offload_module(sigmoid, "act")
    x = torch.randn(B, T, HIDDEN, requires_grad=True)
    gc.disable()
    try:
        with mgr.iteration(offload=offload):
            with mgr.chunk(microbatch=0):
                loss = sigmoid(x * 2).sum()
            loss.backward(retain_graph=True)
            assert mgr.live_chunks() != []  # the retained graph still holds the saved output
            del loss
        assert mgr.live_chunks() == []
        assert mgr.stats().resident_bytes == 0 and mgr.stats().host_bytes == 0
    finally:
        gc.enable()
    reference = x.detach().clone().requires_grad_(True)
    torch.sigmoid(reference * 2).sum().backward()
    assert torch.equal(x.grad, reference.grad)
