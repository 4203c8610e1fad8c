"""Exceptions leave nothing behind: no saved-tensor hooks remain installed, every host buffer is back
in the pool, accounting is zero, no chunk is live, and the next iteration trains bit-identically."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from chunk_offload import ChunkOffloadError, OffloadManager
from tests._driver import assert_identical, drive
from tests.core._errors import CHUNK0
from tests.core._models import HIDDEN, assert_clean, make_stack, microbatches, register


# ----------------------------------------------------------------------------- exceptions


@pytest.fixture
def manager(make_manager) -> OffloadManager:
    """The tests' manager (``min_offload_bytes=1``), with module groups: the checks read per-module
    groups (``mlp_fc1``'s, a group named after one module in an error message)."""
    return make_manager(group_by="module")


class Boom(Exception):
    pass


class Raising(nn.Module):
    """Saves a tensor, then raises (a failing submodule inside an offloaded module)."""

    def forward(self, x):
        x.sin().mul(2)  # sin saves x into the open group
        raise Boom("forward failed")


class FailingBlockWrapper(nn.Module):
    """An offloaded module that saves tensors and then calls a submodule that raises."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)
        self.raising = Raising()

    def forward(self, x):
        return self.raising(self.lin(x))


def _clean_iteration_matches_reference(mgr: OffloadManager, model: nn.Module) -> None:
    """One clean iteration on microbatch 0 equals that of a fresh model without offload."""
    xs = microbatches(1)
    assert_identical(drive(make_stack(2, seed=0), inputs=xs, lr=None), drive(model, inputs=xs, manager=mgr, lr=None))
    assert mgr.stats().groups["mlp_fc1"].bytes_offloaded > 0
    assert_clean(mgr)


def _offloaded_model(mgr: OffloadManager) -> nn.Module:
    model = make_stack(2, seed=0)
    register(mgr, model)
    return model


@pytest.mark.parametrize("where", ["inside_offloaded_module", "between_offloaded_modules"])
def test_exception_in_chunk_forward_leaves_nothing_behind(manager, where):
    model = _offloaded_model(manager)
    failing = FailingBlockWrapper()
    second = nn.Linear(HIDDEN, HIDDEN)
    if where == "inside_offloaded_module":
        manager.offload_module(failing, "failing")
    else:
        manager.offload_module(failing.lin, "first")
        manager.offload_module(second, "second")
    x = microbatches(1)[0]
    with pytest.raises(Boom, match="forward failed"):
        with manager.iteration():
            with manager.chunk(microbatch=0):
                h = model(x)  # a full offloaded forward first
                h = failing(h)
                second(h)
    assert_clean(manager)
    _clean_iteration_matches_reference(manager, model)


def test_exception_in_a_later_chunk_discards_the_earlier_chunks_too(manager):
    model = _offloaded_model(manager)
    failing = FailingBlockWrapper()
    manager.offload_module(failing, "failing")
    xs = microbatches(2)
    with pytest.raises(Boom):
        with manager.iteration():
            with manager.chunk(microbatch=0):
                loss0 = model(xs[0]).pow(2).mean()
            with manager.chunk(microbatch=1):
                failing(model(xs[1]))
    assert_clean(manager)
    with pytest.raises(ChunkOffloadError, match=rf"cannot unpack a tensor of group '\w+' of chunk {CHUNK0}: the group was discarded"):
        loss0.backward()
    del loss0
    assert_clean(manager)
    _clean_iteration_matches_reference(manager, model)


def test_exception_after_forward_before_backward_discards_the_graph(manager):
    model = _offloaded_model(manager)
    x = microbatches(1)[0]
    with pytest.raises(Boom):
        with manager.iteration():
            with manager.chunk(microbatch=0):
                loss = model(x).pow(2).mean()
            assert manager.stats().host_bytes > 0
            raise Boom("between forward and backward")
    # The graph is still referenced by `loss`; its buffers are back in the pool all the same.
    assert_clean(manager)
    with pytest.raises(ChunkOffloadError, match=r"discarded \(its chunk or iteration raised an exception"):
        loss.backward()
    del loss
    gc.collect()
    assert_clean(manager)
    _clean_iteration_matches_reference(manager, model)


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        raise Boom("backward failed")


class FailingBackwardModule(nn.Module):
    def forward(self, x):
        return FailingBackward.apply(x)


@pytest.mark.parametrize("inside_iteration", [True, False], ids=["inside_iteration", "after_iteration"])
def test_exception_mid_backward_leaves_nothing_behind(manager, inside_iteration):
    model = _offloaded_model(manager)
    # Between the two blocks, so part of the chunk's backward (block 1's groups) has run when it fails.
    failing = FailingBackwardModule()
    manager.offload_module(failing, "failing_backward")
    blocks = list(model)
    x = microbatches(1)[0]

    def forward():
        with manager.chunk(microbatch=0):
            return blocks[1](failing(blocks[0](x))).pow(2).mean()

    if inside_iteration:
        with pytest.raises(Boom, match="backward failed"):
            with manager.iteration():
                loss = forward()
                loss.backward()
    else:
        with manager.iteration():
            loss = forward()
        with pytest.raises(Boom, match="backward failed"):
            loss.backward()
    assert manager.stats().groups["mlp_fc1"].bytes_reloaded > 0  # block 1 was reloaded before the failure
    del loss
    gc.collect()
    assert_clean(manager)
    _clean_iteration_matches_reference(manager, model)


@pytest.mark.parametrize("slab", [False, True], ids=["buffer_per_storage", "group_slab"])
def test_a_group_whose_offload_failed_returns_its_host_buffers_when_autograd_frees_it(make_manager, slab):
    """The pool refuses a group's host memory at the cap: the group stays on device (kept), and when
    the caller goes on without aborting the chunk, nothing it was handed stays out of the pool.
    With a buffer per storage the first storage's buffer was handed out before the second was
    refused, and autograd's release of its saved tensors returns it; a group slab (NOTE [Group
    slabs] in core/slab.py) is one request, refused whole: nothing was handed out."""
    mgr = make_manager(host_pool_bytes=1024, on_exhausted="error", min_offload_bytes=1, **({} if slab else {"group_slab_bytes": 0}))
    mgr.begin_iteration()
    mgr.begin_chunk(microbatch=0)
    x = torch.randn(256, requires_grad=True)
    a, b = x * 2, x * 3  # two storages of 1024 bytes: the first fits the cap, the second (or both) does not
    mgr.group_start(a, "two")
    out = a.sin() + b.cos()
    with pytest.raises(ChunkOffloadError, match="host pool exhausted: 2048 bytes requested" if slab else "host pool exhausted: 1024 bytes"):
        mgr.group_commit(out, "two")
    (group,) = mgr.current_handler.groups
    assert group.state.value == "kept"
    assert mgr.stats().pool.in_use_bytes == (0 if slab else 1024), "what was handed out before the refusal"
    mgr.end_chunk()
    out.sum().backward()
    assert group.state.value == "released"
    assert mgr.stats().pool.in_use_bytes == 0, "autograd's release must return the buffer to the pool"
    mgr.end_iteration()
