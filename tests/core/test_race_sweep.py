"""A wide sweep of random delays on the CPU worker-thread streams, and the two rare paths under it.

`test_races.py` rotates 20 seeds over the delay patterns; this file runs 50 seeds on EACH side
(d2h: offloads lag behind compute, h2d: reloads lag, compute: the host thread lags behind the
copies) with exact parity against one shared no-offload baseline, 25 more per side with the
plan-driven prefetch and in-chunk reload-ahead of `PlanPolicy`, plus 50 seeds each of:

- backward reaching a group before its own offload copy finished (the shape of Megatron-LM issue
  7398, where an inline reload raced its group's device-to-host copy), under d2h delays: per
  microbatch, backward starts inside the chunk (the last group is still offloading), or the last
  group is prefetched with ``bulk_reload_group`` while its offload is in flight, or backward
  starts right after the chunk ended (inline reload, no prefetch, of a group whose copy just ended);
- a host buffer handed back to the pool by a reload and reused by another chunk's offload while
  that reload may still read it (prefetch with ``handler.bulk_reload_group``, nothing waits on it,
  then chunk B's forward), under h2d delays.

The happens-before checker is on everywhere (`CpuStreams` default), so a missing wait raises at
the access even when the delays do not turn it into wrong numbers. Random delays make a window
likely, not certain, so each rare path also has a gated variant: a copy stream is held by an
event that opens only once the racing access was issued, which puts the access inside the
window on every run.

The worker threads and torch's intra-op pool fight for the 2 cores; with torch's default
threads a seed costs 3-10x more, so the module runs torch single-threaded (baseline included,
restored afterwards). Cost per seed measured on 2 cores shared with other jobs: sweep ~0.3-0.4 s
(2 iterations), backward-meets-offload ~0.3 s, buffer reuse ~0.02 s; the file ~60-80 s.

How often the delays really open the windows (measured, 20-50 seeds): compute found a copy still
pending in ~18% (d2h), ~35% (h2d) and ~10% (compute side) of its waits in the sweep; the last
group's offload was pending when backward reached it in ~60% of the cases; A's reload was pending
when B reused its buffer in ~70% of the seeds.
"""

from __future__ import annotations

import threading

import pytest
import torch

from chunk_offload import CpuStreams, OffloadConfig, OffloadManager
from chunk_offload.core import GroupState
from chunk_offload.schedule import Plan, PlanPolicy
from tests._driver import Hooks, RunResult, Step, assert_identical, assert_no_live_chunks, drive
from tests.core._models import (
    MODULE_KINDS,
    ONE_F_ONE_B,
    assert_reuse_exact,
    make_stack,
    microbatches,
    register,
    reuse_during_reload,
    run_schedule,
)

ITERATIONS = 2
LAYERS = 2
SEEDS = range(50)
PLAN_SEEDS = range(25)
SIDES = ("d2h", "h2d", "compute")
# The smallest delays that still reorder the streams: an offload or reload copy here takes a few
# microseconds and the compute between two group commits some tens to hundreds, so sleeps of up
# to 0.2 ms leave a copy pending when compute reaches its wait in a good share of the waits.
MAX_DELAY_S = 2e-4
# For the reuse path the window is chunk B's whole forward (about 1 ms here): the reload must
# still be pending when B's offload is issued.
REUSE_MAX_DELAY_S = 2e-3
# The backward-meets-offload window is one group's backward setup; with 0.2 ms sleeps the last
# group's copy was still pending in ~6% of the cases, with 2 ms in ~60% (measured, 2 loaded cores).
MEETS_MAX_DELAY_S = 2e-3
# Every manager here takes module groups (group_by="module"): six groups per layer, whose copies the
# delays reorder, and the per-kind stats the checks read (the last group is layer 1's mlp_fc1).


@pytest.fixture(scope="module", autouse=True)
def _single_threaded_torch():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


_baseline: list[RunResult] = []


def baseline() -> RunResult:
    """The no-offload run, computed once and shared by every seed (same thread count as the seeds)."""
    if not _baseline:
        _baseline.append(run_schedule(lambda: None, order=ONE_F_ONE_B, iterations=ITERATIONS, layers=LAYERS))
    return _baseline[0]


def _assert_clean(manager: OffloadManager) -> None:
    stats = manager.stats()
    assert set(stats.groups) == set(MODULE_KINDS)
    for kind, g in stats.groups.items():
        assert g.bytes_offloaded > 0 and g.bytes_reloaded == g.bytes_offloaded, (kind, g)
    assert stats.resident_bytes == 0 and stats.host_bytes == 0 and stats.pool.in_use_bytes == 0


# ----------------------------------------------------------------------------- the sweep


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("side", SIDES)
def test_parity_sweep(side: str, seed: int) -> None:
    _sweep(side, seed, schedule_policy=None)


@pytest.mark.parametrize("seed", PLAN_SEEDS)
@pytest.mark.parametrize("side", SIDES)
def test_parity_sweep_plan_policy(side: str, seed: int) -> None:
    """The same with `PlanPolicy`: every chunk's last group is reloaded during the action before
    its backward (a forward in steady 1F1B, the previous backward in the cool-down), and in
    backward up to 8000 bytes of earlier groups reload ahead of the running one (2-3 groups here)."""
    plan = Plan.from_order([(a[0], int(a[1:]), 0) for a in ONE_F_ONE_B])
    _sweep(side, seed, schedule_policy=PlanPolicy(plan, reload_ahead_bytes=8_000))


def _sweep(side: str, seed: int, *, schedule_policy: PlanPolicy | None) -> None:
    def factory() -> OffloadManager:
        streams = CpuStreams(max_delay_s=MAX_DELAY_S, delay_on=(side,), seed=seed)
        return OffloadManager(OffloadConfig(min_offload_bytes=1, group_by="module"), streams=streams, schedule_policy=schedule_policy)

    def check(manager: OffloadManager, it: int) -> None:
        if it == ITERATIONS - 1:
            _assert_clean(manager)

    result = run_schedule(factory, order=ONE_F_ONE_B, iterations=ITERATIONS, layers=LAYERS, after_iteration=check)
    assert_identical(baseline(), result)


# ----------------------------------------------------------------------------- backward before the offload finished

MICROBATCHES = 3
# Per microbatch m, by m % 3: how its backward meets the chunk's last group.
INSIDE, PREFETCH_IN_FLIGHT, AFTER = 0, 1, 2


def _train_backward_meets_offload(
    manager: OffloadManager | None, *, pending: list[bool] | None = None
) -> RunResult:
    """Train 2 iterations of MICROBATCHES microbatches, each forward followed at once by its backward.

    INSIDE: backward starts inside the chunk; the last group is OFFLOADING (its offload issued,
    device tensors still held), so backward cancels the offload and uses the originals.
    PREFETCH_IN_FLIGHT: inside the chunk, ``bulk_reload_group`` on the last group while its offload
    is in flight (the cancel path through the prefetch), then the chunk ends and backward runs.
    AFTER: the chunk ends (every group released to host) and backward reloads the last group inline,
    without a prefetch, right after its offload copy finished.

    ``pending``: gets, for INSIDE and PREFETCH_IN_FLIGHT, whether the last group's offload copy was
    still pending when backward / the prefetch reached the group.
    """
    model = make_stack(LAYERS, seed=0)
    if manager is not None:
        register(manager, model, MODULE_KINDS)

    def forwarded(step: Step, loss: torch.Tensor) -> None:
        if step.handler is None or step.microbatch % 3 == AFTER:
            return
        last = step.handler.groups[-1]
        assert last.state is GroupState.OFFLOADING
        assert all(g.state is GroupState.ON_HOST for g in step.handler.groups[:-1])
        if pending is not None:
            pending.append(not last._d2h_event.query())
        if step.microbatch % 3 == PREFETCH_IN_FLIGHT:
            step.handler.bulk_reload_group(last.index)
            assert last.state is GroupState.RESIDENT  # offload cancelled, originals kept

    def chunk_ended(step: Step) -> None:
        if step.handler is not None and step.microbatch % 3 == AFTER:
            assert all(g.state is GroupState.ON_HOST for g in step.handler.groups)
        if step.handler is not None and step.kind == "FB":
            assert step.handler.released

    def after_backward(step: Step) -> None:
        if step.handler is not None and step.kind == "B":
            assert step.handler.released

    order = []
    for m in range(MICROBATCHES):
        order += [("FB", m, 0)] if m % 3 == INSIDE else [("F", m, 0), ("B", m, 0)]
    hooks = Hooks(forwarded=forwarded, chunk_ended=chunk_ended, after_backward=after_backward, after_iteration=assert_no_live_chunks)
    return drive(model, inputs=microbatches(MICROBATCHES), manager=manager, order=order, iterations=ITERATIONS, hooks=hooks)


_meets_offload_baseline: list[RunResult] = []


def _meets_offload_reference() -> RunResult:
    if not _meets_offload_baseline:
        _meets_offload_baseline.append(_train_backward_meets_offload(None))
    return _meets_offload_baseline[0]


def _assert_meets_offload_stats(manager: OffloadManager) -> None:
    stats = manager.stats()
    # The last group of every chunk is layer 1's mlp_fc1. Its offload was cancelled in the INSIDE and
    # PREFETCH_IN_FLIGHT microbatches (2 of 3): mlp_fc1 offloaded 2 layers x 3 microbatches and
    # reloaded layer 0's 3 plus layer 1's 1 (AFTER), per iteration. Every other kind went to host and back.
    fc1 = stats.groups["mlp_fc1"]
    per_call = fc1.bytes_offloaded // (2 * MICROBATCHES * ITERATIONS)
    assert fc1.bytes_offloaded == per_call * 2 * MICROBATCHES * ITERATIONS > 0
    assert fc1.bytes_reloaded == per_call * (MICROBATCHES + 1) * ITERATIONS
    for kind in MODULE_KINDS:
        if kind != "mlp_fc1":
            g = stats.groups[kind]
            assert g.bytes_offloaded > 0 and g.bytes_reloaded == g.bytes_offloaded, (kind, g)
    assert stats.resident_bytes == 0 and stats.host_bytes == 0 and stats.pool.in_use_bytes == 0


@pytest.mark.parametrize("seed", SEEDS)
def test_backward_meets_in_flight_offload(seed: int) -> None:
    streams = CpuStreams(max_delay_s=MEETS_MAX_DELAY_S, delay_on=("d2h",), seed=seed)
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1, group_by="module"), streams=streams)
    try:
        result = _train_backward_meets_offload(manager)
        _assert_meets_offload_stats(manager)
    finally:
        manager.close()
    assert_identical(_meets_offload_reference(), result)


class _D2HGate:
    """Holds the d2h stream before a chunk's offloads until the chunk's last group is reached.

    Opened by the patched `OffloadGroup._cancel_offload` (backward or prefetch reached the group
    whose copy is queued behind the gate), so the copy is pending at that moment on every run.
    """

    def __init__(self, manager: OffloadManager) -> None:
        self.manager = manager
        self.event: threading.Event | None = None

    def close(self) -> None:
        event = self.event = threading.Event()
        self.manager.streams.d2h.launch(lambda: event.wait(timeout=30.0))

    def open(self) -> None:
        if self.event is not None:
            self.event.set()


def test_backward_meets_offload_held_by_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deterministic window: the offload copy of the chunk's groups cannot run until backward (or the
    prefetch) reached the last group. The earlier groups' release waits on their copies, so the gate
    must open before the chunk's second commit: it holds only the last group's copy, closed just
    before that group's offload is issued."""
    from chunk_offload.core import group as group_module

    manager = OffloadManager(
        OffloadConfig(min_offload_bytes=1, group_by="module"), streams=CpuStreams(max_delay_s=MAX_DELAY_S, delay_on=("d2h",), seed=0)
    )
    gate = _D2HGate(manager)
    reached_pending: list[bool] = []
    original_offload = group_module.OffloadGroup._offload
    original_cancel = group_module.OffloadGroup._cancel_offload

    def offload(self):
        # Close the gate just before the chunk's last group (layer 1's mlp_fc1) issues its copies.
        if self.index == len(MODULE_KINDS) * LAYERS - 1 and self.handler.key.microbatch % 3 != AFTER:
            gate.close()
        return original_offload(self)

    def cancel(self):
        reached_pending.append(not self._d2h_event.query())
        result = original_cancel(self)
        gate.open()
        return result

    monkeypatch.setattr(group_module.OffloadGroup, "_offload", offload)
    monkeypatch.setattr(group_module.OffloadGroup, "_cancel_offload", cancel)
    try:
        result = _train_backward_meets_offload(manager)
        _assert_meets_offload_stats(manager)
    finally:
        gate.open()
        manager.close()
    assert_identical(_meets_offload_reference(), result)
    # 2 of 3 microbatches per iteration reach their last group with its copy held behind the gate.
    assert reached_pending == [True] * (2 * ITERATIONS), reached_pending


# ----------------------------------------------------------------------------- host buffer reused during its reload


@pytest.mark.parametrize("seed", SEEDS)
def test_reuse_during_delayed_reload(seed: int) -> None:
    assert_reuse_exact(reuse_during_reload(CpuStreams(max_delay_s=REUSE_MAX_DELAY_S, delay_on=("h2d",), seed=seed)))


@pytest.mark.parametrize("seed", range(5))
def test_reuse_during_held_reload(seed: int) -> None:
    """Deterministic window: A's reload cannot start before B's offload took its buffer."""
    outcome = reuse_during_reload(CpuStreams(max_delay_s=REUSE_MAX_DELAY_S, delay_on=("h2d",), seed=seed), hold_reload=True)
    assert_reuse_exact(outcome)
    assert outcome.pending_at_reuse == [True]
