"""Run a stage's plan, action by action, with and without offload, and compare the two.

`replay` attaches one `MegatronOffloadManager` to the stage's chunks and runs the plan's
iterations alternately as baselines (``manager.iteration(offload=False)``: the same groups
and bytes are tracked, nothing is copied) and with offload, after one warm-up of each. Each
action does what megatron-core's schedules do on that stage (`ChunkDriver`): ``F`` the
chunk's forward inside the manager's chunk scope (opened by its hooks), ``B`` its backward.

Gradients accumulate into ``param.grad`` over the microbatches and are zeroed in place before
each iteration, as megatron's persistent gradient buffers are. Every iteration sees the same
inputs, so a baseline and an offload iteration must agree bit for bit.
"""

from __future__ import annotations

import functools
from typing import Literal, Sequence

import torch

from ..core.config import OffloadConfig
from ..core.errors import ChunkOffloadError, internal_assert
from ..core.schedule_policy import SchedulePolicy
from ..core.streams import StreamBackend
from ..devkit.host_profile import engine_host_time
from ..integrations.megatron import MegatronOffloadManager, attach
from ..report.stage import stage_report
from ..schedule import PlanPolicy, simulate
from ..core.actions import ActionKind
from ..schedule.plan import Plan
from .driver import ChunkDriver
from .result import BudgetReplay, ModeResult, ReplayResult
from .stage import MegatronStage

__all__ = ["replay", "replay_under_budget"]

def replay(
    stage: MegatronStage,
    *,
    modules: str | Sequence[str],
    num_microbatches: int | None = None,
    plan: Plan | None = None,
    iterations: int = 1,
    warmup: int = 1,
    streams: StreamBackend | None = None,
    schedule_policy: SchedulePolicy | Literal["plan"] | None = "plan",
    prefetch_bytes: int | None = None,
    reload_ahead_bytes: int | None = None,
    keep_tensors: bool = False,
    host_profile_iterations: int = 0,
    config: OffloadConfig | None = None,
) -> ReplayResult:
    """Replay ``stage``'s plan with and without offloading ``modules``; measure both.

    ``plan``: default megatron's schedule of the stage for ``num_microbatches`` (default
    ``2 * pp_size``). ``iterations`` measured iterations per mode, after ``warmup`` of each.
    ``schedule_policy``: ``"plan"`` (what `attach` uses in training: `PlanPolicy` of the plan,
    with ``prefetch_bytes`` and ``reload_ahead_bytes``, and, as training has them after its
    baseline iteration, the groups of one baseline iteration run first: with them a chunk whose
    backward follows its forward at once copies all but its last group, NOTE [Kept tail]), None
    (every chunk offloaded, each group reloaded when backward reaches the group after it) or a
    `SchedulePolicy`. ``streams`` and ``config`` (default `OffloadConfig()`) go to `attach`.
    ``keep_tensors``: also keep chunk outputs and gradients in the result, for comparisons.
    ``host_profile_iterations``: after the measured iterations, this many more offload iterations
    under cProfile, for the engine's host time (`ModeResult.host_time`).
    """
    if plan is None:
        plan = stage.plan(num_microbatches if num_microbatches is not None else 2 * stage.pp_size)
    elif num_microbatches is not None:
        raise ChunkOffloadError("replay takes num_microbatches or plan, not both (a plan fixes its microbatches)")
    _check_plan(stage, plan)
    for label, value, low in (("iterations", iterations, 1), ("warmup", warmup, 0), ("host_profile_iterations", host_profile_iterations, 0)):
        if not isinstance(value, int) or value < low:
            raise ChunkOffloadError(f"replay needs {label} as an int >= {low}, got {value!r}")
    learn_groups = schedule_policy == "plan"
    if learn_groups:  # until the first baseline iteration knows the groups
        plan_policy = functools.partial(PlanPolicy, plan, prefetch_bytes=prefetch_bytes, reload_ahead_bytes=reload_ahead_bytes)
        schedule_policy = plan_policy()
    elif prefetch_bytes is not None or reload_ahead_bytes is not None:
        raise ChunkOffloadError(
            f"prefetch_bytes={prefetch_bytes} and reload_ahead_bytes={reload_ahead_bytes} apply to schedule_policy='plan', "
            f"not to {schedule_policy!r}"
        )
    elif schedule_policy is None:
        schedule_policy = SchedulePolicy()
    manager = attach(stage.chunks, modules, config=config or OffloadConfig(), streams=streams, schedule_policy=schedule_policy)
    try:
        runner = _Runner(stage, plan, manager, keep_tensors=keep_tensors)
        if learn_groups:
            runner.run(offload=False)
            schedule_policy = plan_policy(group_bytes=manager.last_iteration.group_bytes)
            manager.engine.schedule_policy = schedule_policy  # between iterations, as training's plan tracking sets it
        for _ in range(warmup):
            runner.run(offload=False)
            runner.run(offload=True)
        measured: dict[bool, list[ModeResult]] = {False: [], True: []}
        for _ in range(iterations):
            for offload in (False, True):  # alternate, so that drifts of the host hit both alike
                measured[offload].append(runner.run(offload=offload))
        host_time = engine_host_time(lambda: runner.run(offload=True), host_profile_iterations, "chunk_offload")
    finally:
        manager.detach()
        manager.close()
    baseline, offloaded = _merge(measured[False]), _merge(measured[True])
    offloaded.host_time = host_time
    group_bytes = baseline.last.group_bytes
    simulation = simulate(
        plan,
        lambda microbatch, vp_stage: group_bytes[(microbatch, vp_stage)],
        policy=schedule_policy,
        kept_bytes=offloaded.last.kept_bytes_of,
    )
    report = stage_report(
        baseline=max(baseline.records, key=lambda r: r.peak_bytes),
        offloaded=max(offloaded.records, key=lambda r: r.peak_bytes),
        plan=plan,
        rank=torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
        policy=schedule_policy,
    )
    return ReplayResult(
        stage=f"stage {stage.pp_rank} of {stage.pp_size}" + (f" ({stage.vp_size} chunks)" if stage.vp_size > 1 else ""),
        plan=plan,
        modules=list(manager.offload_modules),
        recompute_modules=stage.recompute_modules,
        device=str(stage.device),
        baseline=baseline,
        offload=offloaded,
        schedule_policy=schedule_policy,
        simulation=simulation,
        report=report,
    )


def replay_under_budget(
    stage: MegatronStage,
    *,
    modules: str | Sequence[str],
    plan: Plan,
    device_budget_bytes: int,
    timed_reload_ahead: bool = True,
    iterations: int = 1,
    warmup: int = 1,
    streams: StreamBackend | None = None,
    keep_tensors: bool = False,
    host_profile_iterations: int = 0,
    config: OffloadConfig | None = None,
) -> BudgetReplay:
    """Replay ``stage``'s megatron plan as training does under ``device_budget_bytes``.

    The iterations are training calls (`MegatronOffloadManager.wrap`), so the budgets decide
    after each as in training (NOTE [Device budget] in integrations/budgets.py): one baseline
    (the bytes per group, and on CUDA the device bytes besides them), one offloaded iteration
    under the choice made from it (its copy timing: with ``timed_reload_ahead`` the choice is
    made again with the reload-ahead budgets, NOTE [Reload room]), ``warmup`` more, then
    ``iterations`` measured ones. ``streams``, ``host_profile_iterations`` (training calls here)
    and ``config`` as `replay` takes them.
    """
    _check_plan(stage, plan)
    manager = attach(
        stage.chunks,
        modules,
        config=config or OffloadConfig(),
        streams=streams,
        device_budget_bytes=device_budget_bytes,
        timed_reload_ahead=timed_reload_ahead,
        baseline_iterations=1,
    )
    try:
        runner = _Runner(stage, plan, manager, keep_tensors=keep_tensors)
        for _ in range(2 + warmup):
            runner.run_training()
        result = _merge([runner.run_training() for _ in range(iterations)])
        report = manager.report()
        result.host_time = engine_host_time(runner.run_training, host_profile_iterations, "chunk_offload")
    finally:
        manager.detach()
        manager.close()
    return BudgetReplay(budget_bytes=device_budget_bytes, result=result, report=report)


def _check_plan(stage: MegatronStage, plan: Plan) -> None:
    if not isinstance(plan, Plan):
        raise ChunkOffloadError(f"replay expects a chunk_offload.schedule.Plan, got {type(plan).__name__}")
    if (plan.pp_size, plan.pp_rank, plan.vp_size) != (stage.pp_size, stage.pp_rank, stage.vp_size):
        raise ChunkOffloadError(
            f"plan {plan.source} is for stage {plan.pp_rank} of {plan.pp_size} with {plan.vp_size} chunk(s), but the stage "
            f"is {stage.pp_rank} of {stage.pp_size} with {stage.vp_size}; build it with stage.plan(...)"
        )
    if plan.has_weight_steps:
        raise ChunkOffloadError(
            f"plan {plan.source} has weight-gradient (W) steps; megatron-core's GPT chunks run B as the whole backward"
        )


class _Runner:
    """Runs one plan's iterations on one stage through one manager."""

    def __init__(self, stage: MegatronStage, plan: Plan, manager: MegatronOffloadManager, *, keep_tensors: bool) -> None:
        self.plan = plan
        self.manager = manager
        self.num_microbatches = 1 + max(mb for mb, _ in plan.chunks)
        self.driver = ChunkDriver(stage, self.num_microbatches, keep_tensors=keep_tensors)

    def run(self, *, offload: bool) -> ModeResult:
        """One iteration of the plan in the manager's own scope (no decisions after it), as a result of one record."""
        result = ModeResult(offload=offload, records=[])
        with self.manager.iteration(offload=offload):
            self._actions(result)
        return self._ended(result)

    def run_training(self) -> ModeResult:
        """One iteration of the plan as a training call through `MegatronOffloadManager.wrap` (a
        baseline while baseline iterations remain; the budgets decide after it), as a result of one record."""
        result = ModeResult(offload=self.manager.training_calls >= self.manager.baseline_iterations, records=[])
        self.manager.wrap(lambda num_microbatches: self._actions(result))(num_microbatches=self.num_microbatches)
        return self._ended(result)

    def _actions(self, result: ModeResult) -> None:
        driver = self.driver
        driver.zero_grads()
        pending: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        for action in self.plan.actions:
            if action.kind is ActionKind.FORWARD:
                pending[action.chunk] = driver.forward(*action.chunk, result)
            else:
                driver.backward(*action.chunk, *pending.pop(action.chunk), result)
        internal_assert(not pending, f"chunks without backward after the plan: {sorted(pending)}")

    def _ended(self, result: ModeResult) -> ModeResult:
        difference = self.plan.diff(self.manager.observed_order)
        internal_assert(difference is None, f"the manager saw another order than the replayed plan: {difference}")
        result.records.append(self.manager.last_iteration)
        self.driver.keep_grads(result)
        return result


def _merge(runs: list[ModeResult]) -> ModeResult:
    """The last run's tensors with every run's record."""
    merged = runs[-1]
    merged.records = [record for run in runs for record in run.records]
    return merged
