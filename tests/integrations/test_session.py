"""`TrainingSession` in one process: the after-iteration sequence, its records, the run order and
the rule that tells a training pass from a forward-only one.

The integrations' own tests run it under real schedules; these pin its order of steps.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from chunk_offload import ChunkOffloadError
from chunk_offload.core import Action, ActionKind, ChunkKey, CpuStreams, OffloadConfig
from chunk_offload.integrations.options import ScheduleOptions
from chunk_offload.integrations.session import TrainingSession
from chunk_offload.schedule import CopyTiming, Plan, PlanPolicy

F0, B0 = Action(ActionKind.FORWARD, 0, 0), Action(ActionKind.BACKWARD, 0, 0)


def _session(checks: list, options: ScheduleOptions | None = None, streams: CpuStreams | None = None, **kwargs) -> TrainingSession:
    session = TrainingSession(
        config=OffloadConfig(min_offload_bytes=1),
        streams=streams or CpuStreams(),
        options=options or ScheduleOptions(),
        check_order=lambda order: checks.append((list(order), session.training_calls, len(session.records), session.tracking.ran_policy)),
        **kwargs,
    )
    return session


def _step(session: TrainingSession, model: nn.Module) -> None:
    """One microbatch through one chunk, its backward recorded when the output's gradient arrives."""
    with session.training_iteration():
        with session.chunk(microbatch=0, vp_stage=0):
            out = model(torch.ones(2, 4))
        record_backward = session.backward_recorder(microbatch=0, vp_stage=0)
        out.register_hook(lambda grad: record_backward())
        out.sum().backward()


def test_the_sequence_records_then_checks_then_sets_the_policy() -> None:
    checks: list = []
    session = _session(checks, baseline_iterations=1)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    session.engine.offload_module(model[1], "act")
    plan = Plan((F0, B0), pp_rank=0, pp_size=1, vp_size=1, source="test")
    session.use_plan(plan)
    first_policy = session.engine.schedule_policy
    try:
        _step(session, model)
        _step(session, model)
    finally:
        session.engine.close()
    # The check sees the order that ran, after the call was counted and its record kept, and
    # before the new policy: the policy the iteration ran under is the plan's first one.
    assert checks[0] == ([F0, B0], 1, 1, first_policy)
    assert checks[1][:3] == ([F0, B0], 2, 2)
    assert [r.offload for r in session.records] == [False, True]  # the baseline, then the latest
    assert session.training_calls == 2
    # After it, the plan's policy learned the chunk's groups (NOTE [Kept tail]).
    policy = session.engine.schedule_policy
    assert isinstance(policy, PlanPolicy) and policy is not first_policy and policy.plan is plan


class _LinkTimedStreams(CpuStreams):
    """CPU streams whose copy times count as a device link's (`StreamBackend.measures_link`, as on CUDA)."""

    measures_link = True


@pytest.mark.parametrize(
    ("options", "measures_link", "timed"),
    [
        (ScheduleOptions(timed_reload_ahead=True), False, True),
        (ScheduleOptions(), False, False),
        (ScheduleOptions(), True, True),
        (ScheduleOptions(timed_reload_ahead=False), True, False),
        (ScheduleOptions(timed_reload_ahead=True, reload_ahead_bytes=0), True, False),
    ],
    ids=["timed", "default_on_cpu_streams", "default_on_a_device_link", "off_on_a_device_link", "given_wins"],
)
def test_the_policy_reads_the_latest_iterations_timing_for_its_reload_ahead(options: ScheduleOptions, measures_link: bool, timed: bool) -> None:
    """NOTE [Timed reload ahead]: groups of 64 KiB, 2 KiB and 16 KiB (kept, the last) on a 1 MB/s
    reload link: one group ahead, the 64 KiB reload starts only when the small group's backward
    does. With ``timed_reload_ahead`` the policy gets the offloaded iteration's `CopyTiming` and
    reloads it with the small one during the last group's backward; the lifespan rule reads no
    timing (the bytes copied stay). By default (``"auto"``) only where the streams time a device
    link (NOTE [Timed reload ahead by default]); a given ``reload_ahead_bytes`` wins."""
    streams = (_LinkTimedStreams if measures_link else CpuStreams)(reload_link_bytes_per_s=1e6)
    session = _session([], options, streams=streams, baseline_iterations=1)
    model = nn.Sequential(nn.Linear(4, 8192), nn.GELU(), nn.Linear(8192, 256), nn.GELU(), nn.Linear(256, 2048), nn.GELU())
    for index in (1, 3, 5):  # each GELU saves its input, which no other module saves
        session.engine.offload_module(model[index], f"gelu{index}")
    plan = Plan((F0, B0), pp_rank=0, pp_size=1, vp_size=1, source="test")
    session.use_plan(plan)
    try:
        _step(session, model)
        after_baseline = session.engine.schedule_policy
        _step(session, model)
    finally:
        session.engine.close()
    assert session.records[-1].group_bytes == {(0, 0): [65536, 2048, 16384]}
    assert after_baseline.reload_timing is None and after_baseline.copied_head == {(0, 0): 2}
    policy = session.engine.schedule_policy
    assert policy.copied_head == {(0, 0): 2} and policy.timing is None
    if timed:
        assert policy.reload_timing == CopyTiming.from_record(session.records[-1], plan) is not None
        assert policy.timed_reload_ahead == {(0, 0): 65536 + 2048}
    else:  # the decisions did not change: the policy learned at the baseline stays
        assert policy is after_baseline and policy.reload_ahead_bytes(ChunkKey(0, 0)) == options.reload_ahead_bytes


def test_the_reload_ahead_budgets_are_derived_again_only_when_the_timing_moves(monkeypatch) -> None:
    """NOTE [Timed reload ahead by default]: after the iteration whose timing made the policy, an
    iteration whose timing is within `CopyTiming.close_to` derives nothing (30 to 120 ms of CPU on
    a 70B-like plan); a reload link twice as fast derives the budgets again."""
    session = _session([], ScheduleOptions(timed_reload_ahead=True), streams=CpuStreams(reload_link_bytes_per_s=1e6), baseline_iterations=1)
    model = nn.Sequential(nn.Linear(4, 8192), nn.GELU(), nn.Linear(8192, 256), nn.GELU(), nn.Linear(256, 2048), nn.GELU())
    for index in (1, 3, 5):
        session.engine.offload_module(model[index], f"gelu{index}")
    plan = Plan((F0, B0), pp_rank=0, pp_size=1, vp_size=1, source="test")
    session.use_plan(plan)
    derived = []
    reload_ahead_from = PlanPolicy.reload_ahead_from
    monkeypatch.setattr(PlanPolicy, "reload_ahead_from", lambda self, *args: derived.append(args[1]) or reload_ahead_from(self, *args))
    timings = []
    from_record = CopyTiming.from_record.__func__
    monkeypatch.setattr(CopyTiming, "from_record", classmethod(lambda cls, record, plan: timings.pop(0) if timings else from_record(cls, record, plan)))
    try:
        _step(session, model)  # the baseline
        _step(session, model)  # the first timing: derived
        first = derived[-1]
        assert len(derived) == 1 and session.engine.schedule_policy.reload_timing is first
        timings.append(dataclasses.replace(first, bytes_per_s=first.bytes_per_s * 1.05, iteration_s=first.iteration_s * 1.02))
        _step(session, model)  # 5% off: the budgets derived from the first hold
        assert len(derived) == 1
        timings.append(dataclasses.replace(first, reload_bytes_per_s=first.reload_bytes_per_s * 2))
        _step(session, model)
        assert len(derived) == 2 and derived[-1].reload_bytes_per_s == 2 * first.reload_bytes_per_s
    finally:
        session.engine.close()


def test_timed_reload_ahead_needs_the_plan() -> None:
    with pytest.raises(ChunkOffloadError, match="timed_reload_ahead=True needs schedule_policy='plan'"):
        _session([], ScheduleOptions(schedule_policy=None, timed_reload_ahead=True))
    with pytest.raises(ChunkOffloadError, match="timed_reload_ahead must be True, False or 'auto', got 1"):
        _session([], ScheduleOptions(timed_reload_ahead=1))
    # "auto", the default, asks for nothing: without the plan it is off, even where the streams time a link.
    session = _session([], ScheduleOptions(schedule_policy=None), streams=_LinkTimedStreams())
    session.engine.close()
    assert session.tracking.timed_reload_ahead is False


def test_a_discarded_iteration_is_no_call() -> None:
    checks: list = []
    session = _session(checks)
    try:
        session.begin_iteration()
        session.end_iteration(discard=True)
        with pytest.raises(RuntimeError, match="boom"), session.training_iteration():
            raise RuntimeError("boom")
        assert not session.engine.in_iteration
    finally:
        session.engine.close()
    assert checks == [] and session.training_calls == 0 and session.records == []


def test_a_late_backward_goes_to_its_own_iteration() -> None:
    checks: list = []
    session = _session(checks)
    model = nn.Linear(4, 4)
    try:
        with session.training_iteration():
            with session.chunk(microbatch=0, vp_stage=0):
                out = model(torch.ones(2, 4))
            late = session.backward_recorder(microbatch=0, vp_stage=0)
        first = session.observed_order
        session.begin_iteration()
        late()
        session.chunk_backward_started(microbatch=1, vp_stage=0, kind=ActionKind.WEIGHT)
        session.end_iteration()
    finally:
        session.engine.close()
    del out
    assert first == [F0, B0]
    assert session.observed_order == [Action(ActionKind.WEIGHT, 1, 0)]
    assert [order for order, *_ in checks] == [[F0], [Action(ActionKind.WEIGHT, 1, 0)]]


@pytest.mark.parametrize("value", [-1, True, 1.5])
def test_bad_baseline_iterations_are_refused(value: object) -> None:
    with pytest.raises(ChunkOffloadError, match=rf"baseline_iterations must be an int >= 0, got {value!r}"):
        _session([], baseline_iterations=value)


def test_the_rule_of_forward_only_passes() -> None:
    """NOTE [Forward-only passes]: a pass trains only with gradients, outside inference mode, without
    the framework's flag and outside every `forward_only` scope (restored on an exception)."""
    session = _session([])
    try:
        assert session.is_training_pass()
        assert not session.is_training_pass(forward_only=True)
        with torch.no_grad():
            assert not session.is_training_pass()
        with torch.inference_mode():
            assert not session.is_training_pass()
        with pytest.raises(RuntimeError, match="raised inside"):
            with session.forward_only():
                with session.forward_only():
                    assert not session.is_training_pass()
                assert not session.is_training_pass()
                raise RuntimeError("raised inside")
        assert session.is_training_pass()
    finally:
        session.engine.close()
