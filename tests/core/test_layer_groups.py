"""Layer groups (NOTE [Layer groups] in core/marks.py): one group per layer, the same numbers.

With ``OffloadConfig(group_by="layer")`` the offload modules of one block form one group. The
training must stay bit-identical to training without offload, move exactly the bytes the
per-module groups move, and issue the per-group stream work (one wait, one copy launch, one
event each way) once per layer instead of once per module. A group of anything else between
two calls of a layer ends the layer group; an error inside or between its calls leaves nothing.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from chunk_offload import ChunkOffloadError, CpuStreams, OffloadConfig, OffloadManager
from chunk_offload.core import group_members, layer_group_name
from tests._driver import assert_identical
from tests.core._models import (
    INTERLEAVED,
    MODULE_KINDS,
    ONE_F_ONE_B,
    Block,
    Fn,
    assert_clean,
    make_stack,
    microbatches,
    register,
    run_schedule,
)
from tests.core.test_cuda_call_counts import CountingStreams

LAYERS = 2
ITERATIONS = 2
LAYER_NAME = "+".join(MODULE_KINDS)
ORDERS = {"1f1b": (ONE_F_ONE_B, 1), "interleaved": (INTERLEAVED, 2)}


def _run(order_id: str, *, streams_factory=None, **fields):
    """Train the shared stack under ``order_id``; None in ``fields`` means without a manager."""
    order, chunks = ORDERS[order_id]
    managers: list[OffloadManager] = []
    recorded: list = []

    def factory() -> OffloadManager | None:
        if fields.get("off"):
            return None
        streams = streams_factory() if streams_factory is not None else None
        manager = OffloadManager(OffloadConfig(min_offload_bytes=1, **fields), streams=streams)
        managers.append(manager)
        return manager

    def record(manager: OffloadManager | None, iteration: int) -> None:
        if manager is not None and iteration == ITERATIONS - 1:
            recorded.append(manager.stats())

    result = run_schedule(factory, order=order, model_chunks=chunks, iterations=ITERATIONS, layers=LAYERS, after_iteration=record)
    return result, (recorded[0] if recorded else None)


@pytest.mark.parametrize("order_id", list(ORDERS))
def test_layer_groups_are_bit_identical_and_move_the_same_bytes(order_id: str) -> None:
    baseline, _ = _run(order_id, off=True)
    by_module, module_stats = _run(order_id)
    by_layer, layer_stats = _run(order_id, group_by="layer")
    assert_identical(baseline, by_module)
    assert_identical(baseline, by_layer)
    _, chunks = ORDERS[order_id]
    microbatches_run = 1 + max(m for _, m, _ in _order_actions(order_id))
    assert list(layer_stats.groups) == [LAYER_NAME]
    merged = layer_stats.groups[LAYER_NAME]
    assert merged.groups == ITERATIONS * microbatches_run * chunks * LAYERS
    for field in ("bytes_offloaded", "bytes_reloaded", "tensors_offloaded", "tensors_kept"):
        per_module = sum(getattr(g, field) for g in module_stats.groups.values())
        assert getattr(merged, field) == per_module, field
    assert merged.bytes_offloaded > 0
    assert layer_stats.resident_bytes == 0 and layer_stats.host_bytes == 0 and layer_stats.pool.in_use_bytes == 0


def _order_actions(order_id: str):
    from tests._driver import actions

    return actions(ORDERS[order_id][0])


@pytest.mark.parametrize("deterministic_memory", [False, True])
@pytest.mark.parametrize("side", ["d2h", "h2d", "compute"])
@pytest.mark.parametrize("seed", range(4))
def test_layer_groups_under_delayed_streams(side: str, seed: int, deterministic_memory: bool) -> None:
    """Random delays on one side of the CPU streams (the happens-before checker on), with the copy
    stream releasing the originals or compute waiting for each copy first: still exact."""
    baseline, _ = _run("1f1b", off=True)
    delayed, _ = _run(
        "1f1b",
        group_by="layer",
        deterministic_memory=deterministic_memory,
        streams_factory=lambda: CpuStreams(max_delay_s=2e-4, delay_on=(side,), seed=seed),
    )
    assert_identical(baseline, delayed)


def _stream_ops(group_by: str) -> Counter:
    streams = CountingStreams()
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1, measure_time=False, group_by=group_by), streams=streams)
    model = make_stack(LAYERS)
    register(manager, model)
    (x,) = microbatches(1)
    try:
        with manager.iteration():
            with manager.chunk(microbatch=0):
                loss = model(x).square().mean()
            loss.backward()
    finally:
        manager.close()
    return Counter((op, stream) for op, stream, _, _ in streams.log)


def test_stream_work_is_issued_once_per_layer() -> None:
    per_module, per_layer = _stream_ops("module"), _stream_ops("layer")
    modules = len(MODULE_KINDS)
    for op in (("wait_stream", "d2h"), ("copy", "d2h"), ("record_event", "d2h"), ("retain", "d2h"), ("wait_stream", "h2d"), ("copy", "h2d"), ("record_event", "h2d")):
        assert per_module[op] == modules * LAYERS, op
        assert per_layer[op] == LAYERS, op
    assert per_layer[("wait_event", "compute")] == LAYERS
    assert per_module[("wait_event", "compute")] == modules * LAYERS


def test_module_without_layer_keeps_its_own_group(make_manager) -> None:
    """``group_by="layer"`` joins only modules registered with a layer; without one a module is its own group."""
    manager = make_manager(group_by="layer")
    block = Block()
    manager.offload_module(block.qkv_linear, "qkv_linear")
    manager.offload_module(block.mlp_fc1, "mlp_fc1")
    (x,) = microbatches(1)
    with manager.iteration():
        with manager.chunk(microbatch=0) as handler:
            loss = block(x).sum()
        names = [g.name for g in handler.groups]
        loss.backward()
    assert names == ["qkv_linear", "mlp_fc1"]
    assert_clean(manager)


class _Interrupted(nn.Module):
    """Two modules of one layer with another group (of no layer) called between them."""

    def __init__(self, between_fn) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.between = Fn(between_fn)
        self.second = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.between(self.first(x)))


def test_another_group_between_two_calls_ends_the_layer_group(make_manager) -> None:
    manager = make_manager(group_by="layer")
    layer = _Interrupted(torch.tanh)
    manager.offload_module(layer.first, "first", layer=layer)
    manager.offload_module(layer.between, "between")
    manager.offload_module(layer.second, "second", layer=layer)
    x = torch.randn(4, 8, requires_grad=True)
    reference = _Interrupted(torch.tanh)
    reference.load_state_dict(layer.state_dict())
    x_ref = x.detach().clone().requires_grad_()
    reference(x_ref).square().sum().backward()
    with manager.iteration():
        with manager.chunk(microbatch=0) as handler:
            loss = layer(x).square().sum()
        names = [g.name for g in handler.groups]
        loss.backward()
    assert names == ["first", "between", "second"]
    assert torch.equal(x.grad, x_ref.grad)
    for p, q in zip(layer.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert_clean(manager)


class _Boom(RuntimeError):
    pass


def _raise(*args: torch.Tensor) -> torch.Tensor:
    raise _Boom("forward failed")


@pytest.mark.parametrize("where", ["inside", "between"])
def test_an_error_in_a_layer_leaves_nothing(make_manager, where: str) -> None:
    """An error inside the layer's second call (its group open) or between its calls (its group
    pending) aborts the chunk: no hook left, no buffer or byte held, and the next iteration runs."""
    manager = make_manager(group_by="layer")
    block = Block()
    register(manager, nn.Sequential(block), ("attn_norm", "qkv_linear", "mlp_fc1"))
    (x,) = microbatches(1)
    original = block.qkv_linear.forward if where == "inside" else block.core_attn.forward
    if where == "inside":
        block.qkv_linear.forward = _raise
    else:
        block.core_attn.forward = _raise
    with pytest.raises(_Boom):
        with manager.iteration():
            with manager.chunk(microbatch=0):
                block(x)
    assert_clean(manager)
    if where == "inside":
        block.qkv_linear.forward = original
    else:
        block.core_attn.forward = original
    with manager.iteration():
        with manager.chunk(microbatch=0) as handler:
            loss = block(x).sum()
        loss.backward()
    assert [g.name for g in handler.groups] == ["attn_norm+qkv_linear+mlp_fc1"]
    assert group_members(handler.groups[0].name) == ["attn_norm", "qkv_linear", "mlp_fc1"]
    assert layer_group_name(group_members(handler.groups[0].name)) == handler.groups[0].name
    assert manager.stats().groups["attn_norm+qkv_linear+mlp_fc1"].bytes_offloaded > 0
    assert_clean(manager)


def test_group_by_is_checked(make_manager) -> None:
    with pytest.raises(ChunkOffloadError, match=r"group_by='block' is not valid; choose one of \('call', 'module', 'layer'\)"):
        OffloadManager(OffloadConfig(group_by="block"))
    manager = make_manager(group_by="layer")
    with pytest.raises(ChunkOffloadError, match=r"offload_module\(layer=\.\.\.\) needs an nn.Module or None, got int"):
        manager.offload_module(nn.Linear(2, 2), "x", layer=3)
