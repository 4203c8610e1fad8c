"""Exceptions in forward or backward under offload: the manager is left clean and the next
iteration, or the other chunk, stays bit-exact."""

from __future__ import annotations

import gc

import pytest
import torch

from tests._driver import assert_identical, drive
from tests.core._edge_cases import _assert_grads_equal, _model_and_reference
from tests.core._models import Fn, assert_clean, microbatches


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

    order = ("F0", "F1", "B0", "B1")
    result = drive(model, inputs=xs, manager=mgr, order=order, lr=None)
    assert_identical(drive(reference, inputs=xs, order=order, lr=None), result)
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
    assert_identical(drive(reference, inputs=xs[1:], lr=None), drive(model, inputs=xs[1:], manager=mgr, lr=None))
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
    assert_identical(drive(reference, inputs=[x], lr=None), drive(model, inputs=[x], manager=mgr, lr=None))
    assert_clean(mgr)
