"""Edge cases of host pool exhaustion (fallback, error) and of backward from another thread or a
retained graph freed without garbage collection; each bit-exact with a run without offload."""

from __future__ import annotations

import gc
import threading
import warnings

import pytest
import torch

from chunk_offload import ChunkOffloadError, OffloadManager
from tests._driver import RunResult, Step, assert_identical, drive
from tests.core._edge_cases import B, T, _model_and_reference
from tests.core._models import HIDDEN, Fn, assert_clean, make_stack, microbatches, register


# ============================================================================= 3. host pool exhaustion


GPIPE = ("F0", "F1", "B0", "B1")


def _train(mgr: OffloadManager | None, iterations: int = 2, seed: int = 0) -> RunResult:
    """A few iterations of 2 microbatches (F0 F1 B0 B1) of a 2-block stack."""
    model = make_stack(2, seed=seed)
    if mgr is not None:
        register(mgr, model)
    return drive(model, inputs=microbatches(2), manager=mgr, order=GPIPE, iterations=iterations)


def test_pool_fallback_is_exact_and_warns_once(make_manager):
    plain = _train(None)
    pooled_mgr = make_manager()
    pooled = _train(pooled_mgr)
    assert_identical(plain, pooled)
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
    assert_identical(plain, capped)
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
    assert_identical(plain, _train(fresh, iterations=1))
    assert_clean(fresh)


# ============================================================================= 4. threading


def test_backward_in_another_thread_is_exact(make_manager):
    mgr = make_manager(group_by="module")  # module groups: the check reads mlp_fc1's group
    model, reference = _model_and_reference(mgr)
    xs = microbatches(2)
    errors: list[BaseException] = []

    def backward_in_a_thread(step: Step, loss: torch.Tensor) -> None:
        def backward() -> None:
            try:
                loss.backward()
            except BaseException as exc:  # surfaced in the main thread
                errors.append(exc)

        thread = threading.Thread(target=backward)
        thread.start()
        thread.join()

    result = drive(model, inputs=xs, manager=mgr, order=GPIPE, lr=None, backward=backward_in_a_thread)
    assert errors == []
    assert_identical(drive(reference, inputs=xs, order=GPIPE, lr=None), result)
    assert mgr.stats().groups["mlp_fc1"].bytes_reloaded > 0
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
