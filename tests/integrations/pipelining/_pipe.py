"""Train a tiny transformer stack under torch.distributed.pipelining schedules on gloo CPU ranks.

One `spawn_cases` call starts ``world_size`` processes and runs every `Case` in them: for each
schedule, a baseline (no offload) and the same training with `chunk_offload.pipelining.attach`,
each from the same seed, ``ITERATIONS`` optimizer steps. Every rank returns a `CaseResult` per
case with the losses, every gradient of every iteration, the offload statistics and plans, so
the tests compare them with ``torch.equal`` in the parent.

Children arm ``faulthandler.dump_traceback_later``: a hang prints every thread's stack and exits.
"""

from __future__ import annotations

import gc
import time
import warnings
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import chunk_offload
from chunk_offload import OffloadConfig
from chunk_offload.integrations.pipelining import attach

from ..._driver import snapshot
from ..._spawn import run_ranks
from ...core._models import BATCH, HIDDEN, SEQ, Block

__all__ = ["Case", "CaseResult", "ITERATIONS", "LAYERS", "MICROBATCHES", "OFFLOAD_MODULES", "spawn_cases", "stage_indices"]

ITERATIONS = 3
MICROBATCHES = 4
LAYERS = 4  # whole model; split evenly over the stages
OFFLOAD_MODULES = {
    "norm": nn.LayerNorm,  # attn_norm and mlp_norm of every block, by class
    "qkv_linear": "*.qkv_linear",
    "core_attn": "*.core_attn",  # q, k, v are views of one qkv tensor
    "mlp_fc1": ["*.mlp_fc1"],
}
V_SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


@dataclass(frozen=True, kw_only=True)
class Case:
    """One schedule to train, with and without offload."""

    schedule: str
    """Class name in torch.distributed.pipelining."""
    max_delay_s: float = 0.0
    """Random delays on the copy streams of the offload run (`CpuStreams`), to shake races."""
    seed: int = 0
    """Seeds the delays."""
    eval_after: bool = False
    """Call ``schedule.eval`` after training (torch 2.13's V schedules fail in eval on their own)."""
    passes_between: bool = False
    """Offload run: after each optimizer step, forward-only passes (`_forward_only_passes`)."""
    device_budget_bytes: int | str | None = None
    """`attach`'s ``device_budget_bytes`` for the offload run."""
    host_budget_bytes: int | None = None
    """`attach`'s ``host_budget_bytes`` for the offload run."""
    first_stage_blocks: int = 0
    """Blocks added to stage 0 after its share of `LAYERS` (a first stage heavier than the
    others, as an embedding makes it)."""
    group_by: str = "module"
    """`OffloadConfig.group_by` of the offload run ("layer": each Block's offload modules one group)."""


@dataclass(kw_only=True)
class CaseResult:
    """What one rank saw in one case."""

    schedule: str
    rank: int
    stage_indices: list[int]
    losses: dict[str, list[list[torch.Tensor]]]
    """``losses[run][iteration][microbatch]`` for run "baseline" / "offload" (empty off the last stage)."""
    grads: dict[str, list[dict[str, torch.Tensor]]]
    """``grads[run][iteration]``: parameter name -> gradient before the optimizer step."""
    observed: list[list[str]]
    """The offload run's observed order per iteration."""
    listed: list[str] | None
    listed_error: str | None
    plan: list[str] | None
    plan_source: str | None
    plan_mismatch: str | None
    warnings: list[str]
    """chunk_offload warnings raised during the offload run."""
    leaks: list[dict[str, object]]
    """After each offload step: live chunks, resident/host bytes, pool bytes in use."""
    groups: dict[str, dict[str, int]]
    """Per offload-module name: groups, bytes offloaded, bytes reloaded (all iterations)."""
    registered: dict[str, int]
    """Per offload-module name: submodules registered on this rank."""
    records: list[dict[str, object]] = field(default_factory=list)
    """After each offload step: its `IterationRecord`'s peaks, group bytes, group names and bytes
    copied, and the `SchedulePolicy` the step ran under."""
    registered_per_stage: dict[str, list[int]] = field(default_factory=dict)
    """Per offload-module name: submodules registered on each of this rank's stages (vp order)."""
    released_after: list[tuple[str, bool, int]] = field(default_factory=list)
    """Offload run, first iteration: per backward call of a stage, as torch's action (``"1B0"``
    full, ``"1I0"`` input gradients, ``"1W0"`` weights, with the virtual stage), whether its
    chunk's saved tensors were all released right after it, and the bytes reloaded during it."""
    eval_unchanged: bool = False
    """``schedule.eval`` after training left the offload counters and live chunks untouched."""
    passes_unchanged: list[bool] = field(default_factory=list)
    """With ``passes_between``, after each step: the passes left the manager as it was (`_forward_only_passes`)."""
    budgets: dict[str, object] = field(default_factory=dict)
    """After the offload run: what its budgets decided (levelled budget, the choice's peaks, host caps)."""
    model_freed: bool = False
    """After the offload run's detach and close: the stages' modules were freed although the
    manager was still referenced (it holds the schedule and stages weakly)."""
    seconds: float = 0.0


def stage_indices(schedule: str, rank: int, world_size: int) -> list[int]:
    """The global stage indices rank ``rank`` holds under ``schedule`` (in stage order)."""
    if schedule in ("Schedule1F1B", "ScheduleGPipe"):
        return [rank]
    if schedule in V_SCHEDULES:
        return sorted([rank, 2 * world_size - 1 - rank])
    return [rank, rank + world_size]


def spawn_cases(cases: list[Case], *, world_size: int = 2, timeout_s: float = 150.0) -> list[list[CaseResult]]:
    """Run ``cases`` in ``world_size`` gloo ranks; returns ``results[case][rank]``."""
    per_rank = run_ranks(_rank_cases, (list(cases),), world_size=world_size, timeout_s=timeout_s, what="pipelining ranks")
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(cases))]


def _rank_cases(rank: int, world_size: int, cases: list[Case]) -> list[CaseResult]:
    return [_run_case(case, rank, world_size) for case in cases]


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def _batches(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + iteration)
    shape = (MICROBATCHES * BATCH, SEQ, HIDDEN)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _build(schedule_name: str, rank: int, world_size: int, first_stage_blocks: int = 0):
    """The schedule over this rank's stages of a freshly seeded model (same on every rank)."""
    from torch.distributed import pipelining

    indices = stage_indices(schedule_name, rank, world_size)
    num_stages = world_size * (1 if schedule_name in ("Schedule1F1B", "ScheduleGPipe") else 2)
    torch.manual_seed(0)
    blocks = [Block() for _ in range(LAYERS + first_stage_blocks)]
    per_stage = LAYERS // num_stages
    sizes = [per_stage + (first_stage_blocks if i == 0 else 0) for i in range(num_stages)]
    starts = [sum(sizes[:i]) for i in range(num_stages)]
    stages = [
        pipelining.PipelineStage(nn.Sequential(*blocks[starts[i] : starts[i] + sizes[i]]), i, num_stages, torch.device("cpu"))
        for i in indices
    ]
    cls = getattr(pipelining, schedule_name)
    single = issubclass(cls, pipelining.schedules.PipelineScheduleSingle)
    schedule = cls(stages[0] if single else stages, n_microbatches=MICROBATCHES, loss_fn=_mse)
    return schedule, stages, num_stages


def _train(case: Case, rank: int, world_size: int, offload: bool, result: CaseResult) -> None:
    schedule, stages, num_stages = _build(case.schedule, rank, world_size, case.first_stage_blocks)
    manager = None
    run = "offload" if offload else "baseline"
    if offload:
        streams = chunk_offload.CpuStreams(max_delay_s=case.max_delay_s, seed=case.seed)
        manager = attach(
            schedule,
            OFFLOAD_MODULES,
            config=OffloadConfig(min_offload_bytes=0, group_by=case.group_by),
            streams=streams,
            device_budget_bytes=case.device_budget_bytes,
            host_budget_bytes=case.host_budget_bytes,
        )
        result.registered = {name: sum(len(q) for q in per_stage) for name, per_stage in manager.registered.items()}
        result.registered_per_stage = {name: [len(q) for q in per_stage] for name, per_stage in manager.registered.items()}
        result.listed = None if manager.listed_plan is None else [str(a) for a in manager.listed_plan.actions]
        result.listed_error = manager.listed_error
        for vp, stage in enumerate(stages):
            for method in ("backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, method, _record_release(getattr(stage, method), manager, vp, method, result))
    params = {f"stage{s.stage_index}.{n}": p for s in stages for n, p in s.submod.named_parameters()}
    optimizer = torch.optim.SGD(params.values(), lr=0.05)
    first, last = stages[0].stage_index == 0, stages[-1].stage_index == num_stages - 1
    result.losses[run], result.grads[run] = [], []
    for iteration in range(ITERATIONS):
        optimizer.zero_grad(set_to_none=True)
        x, y = _batches(iteration)
        losses: list[torch.Tensor] = []
        schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses)
        result.losses[run].append([snapshot(loss) for loss in losses])
        result.grads[run].append({n: snapshot(p.grad) for n, p in params.items()})
        if manager is not None:
            stats = manager.stats()
            pool = manager.pool.stats()
            result.leaks.append(
                dict(
                    live_chunks=list(manager.live_chunks()),
                    resident_bytes=stats.resident_bytes,
                    host_bytes=stats.host_bytes,
                    pool_in_use=pool.in_use_bytes,
                    fallback_in_use=pool.fallback_in_use_bytes,
                )
            )
            result.observed.append([str(a) for a in manager.observed_order])
            record = manager.last_iteration
            result.records.append(
                dict(
                    peak_saved_bytes=record.peak_saved_bytes,
                    peak_resident_bytes=record.peak_resident_bytes,
                    group_bytes=record.group_bytes,
                    # NOTE [Storages held elsewhere]: bytes each group kept on device (zeros where none).
                    group_kept_bytes={chunk: record.kept_bytes_of(*chunk) for chunk in record.group_bytes},
                    bytes_offloaded=sum(g.bytes_offloaded for g in record.groups.values()),
                    group_names=record.group_names,
                    policy=manager.tracking.ran_policy,
                )
            )
        optimizer.step()
        if manager is not None and case.passes_between:
            result.passes_unchanged.append(_forward_only_passes(schedule, stages, manager, x, y, first, last))
    if manager is not None:
        if case.eval_after:
            before = manager.stats().groups
            schedule.eval(*((x,) if first else ()), target=y if last else None)
            result.eval_unchanged = manager.stats().groups == before and manager.live_chunks() == []
        stats = manager.stats()
        result.groups = {
            name: dict(groups=g.groups, bytes_offloaded=g.bytes_offloaded, bytes_reloaded=g.bytes_reloaded)
            for name, g in stats.groups.items()
        }
        budgets = manager.budgets
        if budgets.active:
            choice = budgets.choice
            result.budgets = dict(
                leveled=budgets.leveled_budget,
                predicted=None if choice is None else choice.predicted_peak_bytes,
                lowest=None if choice is None else choice.lowest_peak_bytes,
                host_cap=budgets.host_cap,
                host_caps=budgets.host_caps,
                pool_cap=manager.pool.capacity_bytes,
            )
        plan = manager.plan
        result.plan = None if plan is None else [str(a) for a in plan.actions]
        result.plan_source = None if plan is None else plan.source
        result.plan_mismatch = manager.plan_mismatch
        manager.detach()
        manager.close()
        submods = [weakref.ref(stage.submod) for stage in stages]
        del schedule, stages, stage, params, optimizer, losses  # every local that holds a stage or its graph
        gc.collect()
        result.model_freed = [ref() for ref in submods] == [None] * len(submods) and manager.stages == []


def _forward_only_passes(schedule, stages, manager, x, y, first: bool, last: bool) -> bool:
    """``schedule.eval`` (gradients enabled) and a ``torch.no_grad()`` forward of each stage (a
    log-probability pass): whether the counters, live chunks, training calls, order, plan, record
    and policy stayed as they were (NOTE [Forward-only passes])."""

    def state():
        return (manager.stats(), manager.live_chunks(), manager.training_calls, list(manager.observed_order), manager.plan,
                manager.last_iteration, manager.schedule_policy, manager.engine.in_iteration)

    before = state()
    schedule.eval(*((x,) if first else ()), target=y if last else None)
    with torch.no_grad():
        for stage in stages:
            stage.submod(x[:BATCH])
    after = state()
    return all(a is b or a == b for a, b in zip(before, after, strict=True))


def _record_release(method, manager, vp_stage: int, name: str, result: CaseResult):
    """Wrap a stage's backward method to record whether its chunk was released right after it
    and the bytes reloaded during it."""

    def wrapped(bwd_chunk_id: int, *args, **kwargs):
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        kind = "W" if name == "backward_weight_one_chunk" else "B" if full else "I"
        before = _bytes_reloaded(manager)
        out = method(bwd_chunk_id, *args, **kwargs)
        if not result.observed:  # first iteration only
            live = {(key.microbatch, key.vp_stage) for key in manager.live_chunks()}
            released = (bwd_chunk_id, vp_stage) not in live
            result.released_after.append((f"{vp_stage}{kind}{bwd_chunk_id}", released, _bytes_reloaded(manager) - before))
        return out

    return wrapped


def _bytes_reloaded(manager) -> int:
    return sum(g.bytes_reloaded for g in manager.stats().groups.values())


def _run_case(case: Case, rank: int, world_size: int) -> CaseResult:
    started = time.perf_counter()
    result = CaseResult(
        schedule=case.schedule,
        rank=rank,
        stage_indices=stage_indices(case.schedule, rank, world_size),
        losses={},
        grads={},
        observed=[],
        listed=None,
        listed_error=None,
        plan=None,
        plan_source=None,
        plan_mismatch=None,
        warnings=[],
        leaks=[],
        groups={},
        registered={},
    )
    _train(case, rank, world_size, False, result)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(case, rank, world_size, True, result)
    result.warnings = [str(w.message) for w in caught if "chunk_offload" in str(w.message)]
    result.seconds = time.perf_counter() - started
    return result
