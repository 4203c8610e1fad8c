"""Autograd edge cases under offload: retain_graph, double backward, partial backward, two forwards of
one chunk, backward after the iteration closed, grad-off forwards; each bit-exact with a plain run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from chunk_offload import OffloadManager
from tests._driver import assert_identical, chunk_scope, drive, iteration_scope
from tests.core._edge_cases import N, _assert_grads_equal, _model_and_reference, _randn
from tests.core._models import HIDDEN, assert_clean, make_stack, microbatches, register


# ============================================================================= 2. autograd edge cases


def test_retain_graph_then_second_backward_accumulates_exactly(make_manager):
    mgr = make_manager(group_by="module")  # module groups: the check reads mlp_fc1's group
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
    with iteration_scope(mgr):
        with chunk_scope(mgr):
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
        with iteration_scope(mgr):
            with chunk_scope(mgr):
                loss = model(x).pow(2).mean()
            (gx,) = torch.autograd.grad(loss, x, create_graph=True)
            gx.pow(2).sum().backward()
        return loss.detach(), gx.detach(), [p.grad for p in model.parameters()]

    ref = run(None)
    mgr = make_manager(group_by="module")  # module groups: the check reads each kind's group
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
    mgr = make_manager(group_by="module")  # module groups: the check reads mlp_fc1's group
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
    assert_identical(drive(reference, inputs=[x], lr=None), drive(model, inputs=[x], manager=mgr, lr=None))
    assert mgr.stats().groups["mlp_fc1"].bytes_offloaded > 0
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
