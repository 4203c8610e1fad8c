"""On real CUDA streams, training with offload is bit-identical to training without it.

The core test models (tests/core/_models.py) run 1F1B and interleaved orders for several seeds
on the GPU, once without a manager and once offloading every module kind on `CudaStreams`
(copies on two side streams, ordered by events only). Losses, every gradient of every
iteration and the final parameters must be `torch.equal`; bytes must really go to host and
back; the host buffers must be pinned (else the copies are synchronous and hide races); and
`torch.Tensor.record_stream` is called only where NOTE [Release by the copy stream] says (on
the offload stream, never with ``deterministic_memory``). Run the module again under
``TORCH_CUDA_SANITIZER=1`` (bench/gpu_evidence.sh does) for PyTorch's stream-race checker.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.core import _models
from tests._driver import assert_identical
from tests.core._models import INTERLEAVED, MODULE_KINDS, ONE_F_ONE_B, CoreAttention, run_schedule

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU machine: bash bench/gpu_evidence.sh)")

ORDERS = {"1f1b": (ONE_F_ONE_B, 1), "interleaved": (INTERLEAVED, 2)}
SEEDS = (0, 1, 2)
ITERATIONS = 3


class _DeviceCoreAttention(CoreAttention):
    """The core models' attention, building its causal mask on the device of its inputs."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with torch.device(q.device):  # only factory calls inside the module body: the mask
            return super().forward(q, k, v)


@pytest.fixture
def on_cuda(monkeypatch):
    """`run_schedule` builds its models and microbatches on the GPU (same values as on CPU)."""
    device = torch.device("cuda", torch.cuda.current_device())
    make_stack, microbatches = _models.make_stack, _models.microbatches

    def cuda_stack(layers: int = 2, seed: int = 0):
        stack = make_stack(layers, seed)
        for block in stack:
            block.core_attn = _DeviceCoreAttention(block.core_attn.heads)
        return stack.to(device)

    monkeypatch.setattr(_models, "make_stack", cuda_stack)
    monkeypatch.setattr(_models, "microbatches", lambda count, seed=1: [x.to(device) for x in microbatches(count, seed)])
    return device


class _Watch:
    """Per iteration: the stats; per host-buffer acquisition: whether the buffer is pinned."""

    def __init__(self) -> None:
        self.stats = []
        self.pinned: list[bool] = []

    def attach(self, manager):
        acquire = manager.pool.acquire

        def watched(nbytes: int):
            buf = acquire(nbytes)
            self.pinned.append(buf.tensor.is_pinned())
            return buf

        manager.pool.acquire = watched  # this manager's pool only
        return manager

    def __call__(self, manager, iteration: int) -> None:
        self.stats.append(manager.stats())


@pytest.mark.parametrize("deterministic_memory", [False, True], ids=["copy_stream_release", "deterministic_memory"])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("order_id", sorted(ORDERS))
def test_offload_on_cuda_streams_is_bit_identical(
    order_id, seed, deterministic_memory, on_cuda, make_manager, deterministic, record_stream_calls
) -> None:
    order, model_chunks = ORDERS[order_id]
    kwargs = dict(order=order, model_chunks=model_chunks, iterations=ITERATIONS, layers=2, seed=seed)
    baseline = run_schedule(lambda: None, **kwargs)
    watch = _Watch()
    compute = torch.cuda.current_stream()
    # run_schedule closes the manager it gets.
    # Module groups: one group per module call, each checked below.
    make = lambda: watch.attach(make_manager(min_offload_bytes=1, group_by="module", deterministic_memory=deterministic_memory))  # noqa: E731
    result = run_schedule(make, kinds=MODULE_KINDS, after_iteration=watch, **kwargs)
    if deterministic_memory:
        assert record_stream_calls == []
    else:  # every release hands its originals to the one offload stream, never to compute
        streams = {stream for _, stream in record_stream_calls}
        assert len(streams) == 1 and compute not in streams, streams

    assert_identical(baseline, result)
    assert all(g.is_cuda for g in result.grads[-1]), "the models did not run on the GPU"
    assert len(watch.stats) == ITERATIONS
    for it, stats in enumerate(watch.stats):
        assert set(stats.groups) == set(MODULE_KINDS), it
        for kind, g in stats.groups.items():
            assert g.bytes_offloaded > 0 and g.bytes_reloaded == g.bytes_offloaded, (it, kind, g)
        assert stats.resident_bytes == 0 and stats.host_bytes == 0, (it, stats)
        assert stats.pool.in_use_bytes == 0 and stats.pool.fallback_allocations == 0, (it, stats.pool)
    assert watch.pinned and all(watch.pinned), f"{watch.pinned.count(False)} of {len(watch.pinned)} host buffers not pinned"
    # After the first iteration every host buffer comes from the pool: no pinned allocation per step.
    assert watch.stats[-1].pool.allocations == watch.stats[0].pool.allocations


def test_cuda_streams_pin_host_memory(make_manager) -> None:
    with contextlib.closing(make_manager()) as manager:
        assert manager.streams.device.type == "cuda" and manager.streams.pin_memory
        buf = manager.pool.acquire(4096)
        assert buf.tensor.is_pinned()
        manager.pool.release(buf, None)


@pytest.mark.parametrize("order_id", sorted(ORDERS))
def test_layer_groups_on_cuda_streams_are_bit_identical(order_id, on_cuda, make_manager, deterministic) -> None:
    """``group_by="layer"`` (NOTE [Layer groups]): each block's modules one group, one copy launch
    and one event each way per block on the CUDA streams; the same numbers (and, under the
    sanitizer, no race)."""
    order, model_chunks = ORDERS[order_id]
    kwargs = dict(order=order, model_chunks=model_chunks, iterations=ITERATIONS, layers=2, seed=0)
    baseline = run_schedule(lambda: None, **kwargs)
    watch = _Watch()
    make = lambda: watch.attach(make_manager(min_offload_bytes=1, group_by="layer"))  # noqa: E731
    result = run_schedule(make, kinds=MODULE_KINDS, after_iteration=watch, **kwargs)
    assert_identical(baseline, result)
    name = "+".join(MODULE_KINDS)
    for it, stats in enumerate(watch.stats):
        assert list(stats.groups) == [name], it
        g = stats.groups[name]
        assert g.bytes_offloaded > 0 and g.bytes_reloaded == g.bytes_offloaded, (it, g)
        assert stats.resident_bytes == 0 and stats.host_bytes == 0 and stats.pool.in_use_bytes == 0, (it, stats)
    assert watch.pinned and all(watch.pinned)


def test_joined_calls_on_cuda_streams_are_bit_identical(make_manager, deterministic) -> None:
    """NOTE [Joined calls]: ``proj`` saves ``core``'s output as its input and joins its group; on
    the CUDA streams the same numbers as without offload, the shared storage copied once (and,
    under the sanitizer, no race)."""
    from tests.core import test_joined_calls as joined

    device = torch.device("cuda", torch.cuda.current_device())
    reference, _ = joined._train(None, device)
    by_call, manager = make_manager(min_offload_bytes=1, group_by="call"), make_manager(min_offload_bytes=1, group_by="module")
    try:
        grads_call, _ = joined._train(by_call, device)
        grads, names = joined._train(manager, device)
        copied = [sum(g.bytes_offloaded for g in m.stats().groups.values()) for m in (by_call, manager)]
    finally:
        by_call.close()
        manager.close()
    assert all(torch.equal(a, b) for a, b in zip(reference, grads_call, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(reference, grads, strict=True))
    assert names == ["core+proj", "post"] * joined.LAYERS
    assert copied[0] - copied[1] == joined.ROWS * joined.HIDDEN * 4 * joined.LAYERS * joined.MICROBATCHES
