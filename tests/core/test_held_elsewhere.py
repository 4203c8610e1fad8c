"""Storages another reference holds are learned at a chunk's end and kept on device from then on.

A baseline learns them without copying (its probe); groups that save one storage are recorded.

NOTE [Storages held elsewhere] (core/held_elsewhere.py): copying such a storage frees nothing.
The first chunk copies it and finds, at its forward's end, that its memory outlived the release;
later chunks at the same place keep it on device, uncopied, and the records say so, so that the
theory (`simulate` with the kept bytes) predicts what the device shows.
"""

from __future__ import annotations

import pytest
import torch

from chunk_offload import OffloadConfig, OffloadManager
from chunk_offload.core.held_elsewhere import HeldElsewhere
from chunk_offload.schedule import megatron_plan, simulate
from chunk_offload.report import stage_report
from tests._driver import Hooks, RunResult, assert_identical, drive
from tests.core._models import Fn, assert_clean

ROWS, COLS = 16, 64
F32 = 4


def _exp(x: torch.Tensor) -> torch.Tensor:
    return (x * 1.0).exp()  # exp saves its output: a fresh storage the group saves


def _square_sum(y: torch.Tensor) -> torch.Tensor:
    return (y * y).sum()  # mul saves y: held by autograd outside the group


def _sum(y: torch.Tensor) -> torch.Tensor:
    return y.sum()


def _run(manager: OffloadManager | None, module: Fn, x: torch.Tensor, *, held: bool, offload: bool | None = None) -> RunResult:
    """One forward + backward, ``x``'s gradient; with ``held``, an op outside the group saves the group's output too."""
    return drive(module, inputs=[x], manager=manager, loss=_square_sum if held else _sum, params=[x], lr=None, offload=offload)


NBYTES = ROWS * COLS * F32


@pytest.mark.parametrize(
    ("held", "per_iteration"),
    [
        # Copied once, found held at the chunk's end, then kept:
        # (offload, offloaded, copied for nothing, kept, learned at the chunk's end).
        (True, [(True, NBYTES, NBYTES, 0, NBYTES), (True, 0, 0, NBYTES, 0)]),
        # Only the group holds it: copied every time.
        (False, [(True, NBYTES, 0, 0, 0), (True, NBYTES, 0, 0, 0)]),
        # A baseline first probes its chunks (`HeldElsewhere.probe`): learned without a copy, so the
        # first iteration that copies keeps it from its first chunk on.
        (True, [(False, 0, 0, 0, NBYTES), (True, 0, 0, NBYTES, 0)]),
        (False, [(False, 0, 0, 0, 0), (True, NBYTES, 0, 0, 0)]),
    ],
    ids=["saved_outside_the_group", "only_the_group_holds_it", "baseline_then_saved_outside", "baseline_then_only_the_group"],
)
def test_a_storage_held_elsewhere_is_copied_once_then_kept(held: bool, per_iteration: list[tuple[bool, int, int, int, int]]) -> None:
    x = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0), requires_grad=True)
    module = Fn(_exp)
    expected = _run(None, module, x, held=held)
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    try:
        manager.offload_module(module, "exp")
        for offload, offloaded, copied_for_nothing, kept, learned in per_iteration:
            assert_identical(expected, _run(manager, module, x, held=held, offload=offload))
            record = manager.last_iteration
            g = record.groups["exp"]
            assert (g.bytes_offloaded, g.bytes_copied_held_elsewhere, g.bytes_kept_held_elsewhere) == (offloaded, copied_for_nothing, kept)
            assert record.group_bytes[(0, 0)] == [NBYTES] and record.group_kept_bytes[(0, 0)] == [kept]
            assert record.group_learned_bytes == {(0, 0): [learned]}
        assert_clean(manager)
    finally:
        manager.close()


def test_learned_places_are_forgotten_when_the_modules_change() -> None:
    x = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(2), requires_grad=True)
    module = Fn(_exp)
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    try:
        registration = manager.offload_module(module, "exp")
        _run(manager, module, x, held=True)
        registration.remove()
        manager.offload_module(module, "exp")
        _run(manager, module, x, held=True)
        g = manager.last_iteration.groups["exp"]
        assert g.bytes_copied_held_elsewhere == ROWS * COLS * F32 and g.bytes_kept_held_elsewhere == 0
    finally:
        manager.close()


def test_places_are_keyed_by_vp_stage_group_index_and_name() -> None:
    held = HeldElsewhere()
    held.note(1, 3, "core_attn", 2)
    assert held.kept(1, 3, "core_attn") == {2}
    assert held.kept(0, 3, "core_attn") is None and held.kept(1, 3, "qkv_linear") is None
    assert len(held) == 1
    held.clear()
    assert len(held) == 0


def test_the_report_predicts_the_drop_with_kept_bytes_exactly() -> None:
    """1F1B on stage 0 of 4: each chunk's output is held by the schedule (as a pipeline holds
    what it sent until backward); the report's theory, with the kept bytes, equals the accounting."""
    plan = megatron_plan(pp_size=4, pp_rank=0, num_microbatches=8)
    module = Fn(_exp)
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    inputs = [torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(i), requires_grad=True) for i in range(8)]
    try:
        manager.offload_module(module, "exp")
        records = []
        drive(
            module,
            inputs=inputs,
            manager=manager,
            order=plan.actions,
            iterations=4,
            offload=lambda it: (False, True, False, True)[it],
            loss=_square_sum,
            lr=None,
            hooks=Hooks(after_iteration=lambda manager, it: records.append(manager.last_iteration)),
        )
        baseline, offloaded = records[2], records[3]
        report = stage_report(baseline=baseline, offloaded=offloaded, plan=plan, rank=0)
        assert offloaded.groups["exp"].bytes_offloaded == 0  # all kept once learned
        assert report.theoretical_drop == report.measured_drop == 0
        naive = simulate(plan, offloaded.group_bytes)  # without the kept bytes: a drop that never comes
        assert naive.drop > 0
        assert_clean(manager)
    finally:
        manager.close()


def test_the_probe_keeps_the_in_place_check() -> None:
    """The probe swaps a held original for a detached alias: same storage and version counter, so
    an in-place change after the chunk still fails backward as autograd's own check does."""
    w = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(4), requires_grad=True)
    module = Fn(torch.sin)  # saves its input, the group's input, held as it is until the probe
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    try:
        manager.offload_module(module, "sin")
        with manager.iteration(offload=False):
            with manager.chunk(microbatch=0):
                a = w * 2.0
                y = module(a).sum()
            a.add_(1.0)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.backward()
    finally:
        manager.close()


def test_groups_that_save_one_storage_are_recorded_together() -> None:
    """exp saves its output, and the next group's sin saves it as its input: one storage, two groups
    (`IterationRecord.group_shared`), in a baseline and when both are copied; nothing else holds it."""
    x = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(5), requires_grad=True)
    first, second = Fn(_exp), Fn(torch.sin)
    chain = torch.nn.Sequential(first, second)
    expected = drive(chain, inputs=[x], loss=_square_sum, params=[x], lr=None)
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    try:
        manager.offload_module(first, "exp")
        manager.offload_module(second, "sin")
        for offload in (False, True):
            assert_identical(expected, drive(chain, inputs=[x], manager=manager, loss=_square_sum, params=[x], lr=None, offload=offload))
            record = manager.last_iteration
            assert record.group_shared == {(0, 0): [(0, 1)]} and record.group_learned_bytes == {(0, 0): [0, 0]}
        assert_clean(manager)
    finally:
        manager.close()
