"""NOTE [Budget splits layer groups]: a device budget out of reach of layer groups lowers their bound.

One process, a `TrainingSession` on CPU streams training a stack of Megatron-like blocks (each
block's modules one layer) at PP=1 (each chunk's backward right after its forward), as the
integrations drive it. The budget sits between the lowest peak module groups reach and the one
whole-layer groups reach: the session splits its groups until it fits, with no warning, and trains
bit-identically to the run without offload; a budget below what module groups reach warns once,
only after the bound reached 0. `OffloadManager.regroup`'s refusals name what is wrong.
"""

from __future__ import annotations

import logging
import re
import warnings

import pytest
import torch

from chunk_offload import ChunkOffloadError, CpuStreams, OffloadConfig, OffloadManager
from chunk_offload.core import Action, ActionKind, IterationRecord
from chunk_offload.integrations.layer_split import can_split, split_bound
from chunk_offload.integrations.options import ScheduleOptions
from chunk_offload.integrations.session import TrainingSession
from chunk_offload.schedule import Plan, choose_offload
from tests.core._models import make_stack, microbatches, register

MICROBATCHES = 2
PLAN = Plan(
    tuple(Action(kind, mb, 0) for mb in range(MICROBATCHES) for kind in (ActionKind.FORWARD, ActionKind.BACKWARD)),
    pp_rank=0, pp_size=1, vp_size=1, source="test",
)  # fmt: skip
_MiB = 1 << 20


def _train(config: OffloadConfig, budget: int | None, iterations: int) -> tuple[TrainingSession, list[float], list[torch.Tensor]]:
    """``iterations`` training iterations of a 4-block stack; the session (closed), losses and the last grads."""
    model = make_stack(layers=4)
    session = TrainingSession(config=config, streams=CpuStreams(), options=ScheduleOptions(device_budget_bytes=budget), check_order=lambda order: None)
    register(session.engine, model)
    session.use_plan(PLAN)
    losses = []
    try:
        for _ in range(iterations):
            model.zero_grad(set_to_none=True)
            with session.training_iteration():
                for mb, x in enumerate(microbatches(MICROBATCHES)):
                    with session.chunk(microbatch=mb, vp_stage=0):
                        loss = model(x).square().mean()
                    session.chunk_backward_started(microbatch=mb, vp_stage=0)
                    loss.backward()
                    losses.append(loss.item())
    finally:
        session.engine.close()
    return session, losses, [p.grad.clone() for p in model.parameters()]


def _lowest(config: OffloadConfig) -> int:
    """The lowest peak a budget reaches with ``config``'s groups (one iteration that records them)."""
    session, _, _ = _train(config, None, 1)
    return choose_offload(PLAN, session.engine.last_iteration.group_bytes, 0).lowest_peak_bytes


def test_a_budget_out_of_reach_of_layer_groups_splits_them_until_it_fits(caplog) -> None:
    layers, modules = _lowest(OffloadConfig(min_offload_bytes=1)), _lowest(OffloadConfig(min_offload_bytes=1, group_by="module"))
    assert modules < layers  # whole-layer groups (this stack's layers hold far less than 16 MiB) hold more at the lowest
    budget = (modules + layers) // 2
    _, base_losses, base_grads = _train(OffloadConfig(min_offload_bytes=1, offload=False), None, 4)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger="chunk_offload.integrations.plan_tracking"):
        warnings.simplefilter("always")
        session, losses, grads = _train(OffloadConfig(min_offload_bytes=1), budget, 4)
    assert not [w for w in caught if "device_budget_bytes" in str(w.message)]
    splits = [r.getMessage() for r in caplog.records if "out of reach of layer groups" in r.getMessage()]
    first = re.fullmatch(
        rf"chunk_offload: rank 0: device_budget_bytes {budget} is (\d+) bytes out of reach of layer groups bounded at {16 * _MiB} "
        r"bytes: layer groups bounded at (\d+) bytes from the next iteration on \(NOTE \[Budget splits layer groups\]\)",
        splits[0],
    )
    assert first is not None and 0 < int(first[1]) and 0 < int(first[2]) < 16 * _MiB, splits
    bound = session.engine.config.layer_group_bytes
    assert bound < 16 * _MiB and f"layer groups bounded at {bound} bytes from the next iteration on" in splits[-1]
    record = session.engine.last_iteration
    assert session.tracking.budgets.choice.fits and record.peak_resident_bytes <= budget
    assert len(record.group_bytes[(0, 0)]) > 4  # finer than one group per block
    assert losses == base_losses and all(torch.equal(a, b) for a, b in zip(grads, base_grads))


def test_a_budget_out_of_reach_of_any_grouping_warns_once_the_bound_is_0() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session, _, _ = _train(OffloadConfig(min_offload_bytes=1), 1, 6)
    shortfalls = [str(w.message) for w in caught if "device_budget_bytes" in str(w.message)]
    assert session.engine.config.layer_group_bytes == 0
    assert len(shortfalls) == 1 and shortfalls[0].startswith("chunk_offload: pipeline rank 0: device_budget_bytes 1 bytes cannot be met: ")
    assert shortfalls[0].endswith(f"(to at least {session.tracking.budgets.choice.lowest_peak_bytes} bytes, or 'auto')")


def test_only_an_explicit_budget_under_bounded_layer_groups_splits() -> None:
    layer = OffloadConfig()
    assert can_split(layer, 1000) and can_split(OffloadConfig(layer_group_bytes=None), 1000)
    assert not can_split(layer, "auto") and not can_split(layer, None)
    assert not can_split(OffloadConfig(group_by="module"), 1000) and not can_split(OffloadConfig(layer_group_bytes=0), 1000)


@pytest.mark.parametrize(
    ("bound", "largest", "expected"),
    [(16 * _MiB, 14 * _MiB, 14 * _MiB // 4), (None, 14 * _MiB, 14 * _MiB // 4), (3 * _MiB, 8 * _MiB, 2 * _MiB), (2 * _MiB, 8 * _MiB, 0), (5, 3, 0)],
)
def test_the_bound_drops_to_a_quarter_of_the_largest_group_then_to_0(bound: int | None, largest: int, expected: int) -> None:
    record = IterationRecord(
        offload=True, peak_resident_bytes=0, peak_saved_bytes=0, host_bytes_at_saved_peak=0, device_peak_bytes=None,
        resident_trace=None, device_trace=None, group_bytes={(0, 0): [1, largest], (1, 0): [largest // 2]}, groups={},
        order=[], wall_time_s=0.0,
    )  # fmt: skip
    assert split_bound(bound, record) == expected


@pytest.mark.parametrize(
    ("config", "value", "message"),
    [
        (OffloadConfig(group_by="module"), 0, "regroup() bounds layer groups: it needs OffloadConfig.group_by='layer', got 'module'"),
        (OffloadConfig(), -1, "layer_group_bytes"),
        (OffloadConfig(), "16MiB", "layer_group_bytes"),
    ],
)
def test_regroup_refuses_what_it_cannot_do(config: OffloadConfig, value: object, message: str) -> None:
    manager = OffloadManager(config, streams=CpuStreams())
    try:
        with pytest.raises(ChunkOffloadError, match=message.replace("(", r"\(").replace(")", r"\)")):
            manager.regroup(value)
        with manager.iteration():
            with pytest.raises(ChunkOffloadError, match=r"regroup\(\) while an iteration is open; call it between iterations"):
                manager.regroup(1024)
        assert manager.config.layer_group_bytes == config.layer_group_bytes
    finally:
        manager.close()
