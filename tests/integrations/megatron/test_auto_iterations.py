"""Automatic iterations: `attach(..., iterations="auto")` needs no wrap of Megatron's schedule.

Under Megatron's own schedules (one spawn, PP=2 VPP=2 on 2 gloo CPU ranks, 3 training
iterations, every dense module offloaded under the default plan policy, the first iteration a
baseline, memory traced), four runs of the same training loop:

- without offload (the reference);
- ``iterations="wrap"``, each ``manager.wrap(get_forward_backward_func())`` call one iteration;
- ``iterations="auto"``, schedule unwrapped, the microbatch count from Megatron's calculator
  (initialised as Megatron-LM's ``initialize_megatron`` does): each iteration stays open until
  the next step's first forward closes it, the last one until ``report()``;
- ``iterations="auto"`` with ``num_microbatches=N`` and an evaluation (``forward_only=True`` under
  ``torch.no_grad()``) after each training call: the evaluation's first forward closes the
  finished iteration, and the evaluation itself offloads nothing.

On every rank: losses, gradients and parameters of both automatic runs are bit-identical to
the run without offload and to the wrapped run; so are, per iteration, the `IterationRecord`
(peaks, traces, bytes per group, order, per-module counters), the observed order and the plan;
bytes are offloaded on the first stage; ``report()`` closes the last iteration and reports
what the wrapped run reports.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, fields
from typing import Any

import pytest
import torch
from torch import nn

from chunk_offload.core.records import IterationRecord
from tests._megatron import RankResult, Run, TinyGPTConfig, spawn_runs
from tests._megatron_offload import OffloadHooks
from tests.integrations.megatron._auto_iterations import comparable

_NO_MEGATRON = importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None
pytestmark = pytest.mark.skipif(_NO_MEGATRON, reason='megatron-core is not installed (pip install "chunk-offload[megatron]")')

_TIMEOUT_S = 150.0
_DENSE = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1")
_CONFIG = TinyGPTConfig(pipeline_parallel=2, virtual_pipeline=2, iterations=3)
_WORLD = 2
_OPTIONS = {"min_offload_bytes": 1, "baseline_iterations": 1, "trace": True}


# --------------------------------------------------------------------------------------------
# Under Megatron's schedules (spawned ranks).
# --------------------------------------------------------------------------------------------


@dataclass
class _StepHooks(OffloadHooks):
    """`OffloadHooks` that also keep, per step, what the manager holds, and every iteration's record.

    ``calculator``: (num_microbatches, micro_batch_size) to initialise Megatron's
    num-microbatches calculator with before attaching (unset again after the run).
    """

    calculator: tuple[int, int] | None = None
    records: list[IterationRecord] = field(default_factory=list)
    """Each iteration's record, in order, collected as soon as the manager has it."""

    def wrap_model(self, chunks: list[nn.Module]) -> list[nn.Module]:
        if self.calculator is not None:
            import torch.distributed as dist
            from megatron.core import parallel_state
            from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

            count, micro_batch_size = self.calculator
            dp = parallel_state.get_data_parallel_world_size()
            init_num_microbatches_calculator(dist.get_rank(), None, count * micro_batch_size * dp, micro_batch_size, dp)
        return super().wrap_model(chunks)

    def _collect(self) -> None:
        record = self.manager.last_iteration
        if record is not None and all(record is not r for r in self.records):
            self.records.append(record)

    def after_step(self, chunks: list[nn.Module], iteration: int) -> dict[str, Any]:
        from tests._megatron import step_params

        self._collect()
        manager = self.manager
        return {
            "params": step_params(chunks, iteration),
            "training_calls": manager.training_calls,
            "order": list(manager.observed_order),
            "plan": manager.plan,
        }

    def report(self, chunks: list[nn.Module]) -> dict[str, Any]:
        try:
            report = self.manager.report()  # auto mode: closes the last iteration
        finally:
            if self.calculator is not None:
                from megatron.core.num_microbatches_calculator import unset_num_microbatches_calculator

                unset_num_microbatches_calculator()
        self._collect()
        training_calls = self.manager.training_calls
        return {**super().report(chunks), "report": report, "records": self.records, "training_calls": training_calls}


def _run(hooks: _StepHooks) -> Run:
    return Run(config=_CONFIG, hooks=hooks.with_steps())


_N = _CONFIG.num_microbatches
_MODES = {
    "wrap": _StepHooks(_DENSE, options=_OPTIONS),
    "auto": _StepHooks(
        _DENSE, options={**_OPTIONS, "iterations": "auto"}, wrap_schedule=False, calculator=(_N, _CONFIG.micro_batch_size)
    ),
    "auto_eval": _StepHooks(
        _DENSE, options={**_OPTIONS, "iterations": "auto", "num_microbatches": _N}, wrap_schedule=False, evaluate_between=True
    ),
}


@pytest.fixture(scope="module")
def spawned() -> dict[str, list[RankResult]]:
    if torch.cuda.is_available():
        pytest.skip("cpu_compat is inert on a CUDA host")
    results = spawn_runs([Run(config=_CONFIG)] + [_run(h) for h in _MODES.values()], world_size=_WORLD, timeout_s=_TIMEOUT_S)
    return dict(zip(["none", *_MODES], results, strict=True))


def _assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    differing = [name for name in a if not torch.equal(a[name], b[name])]
    assert not differing, f"{what} differ: {differing[:5]}"


@pytest.mark.parametrize("mode", ["auto", "auto_eval"])
def test_numerics_equal_without_offload_and_with_wrap(spawned, mode: str):
    for none, wrapped, auto in zip(spawned["none"], spawned["wrap"], spawned[mode], strict=True):
        what = f"{mode} rank {auto.rank}"
        assert len(auto.losses) == (_CONFIG.iterations if auto.is_last_stage else 0), what
        for reference in (none, wrapped):
            for i, (la, lb) in enumerate(zip(reference.losses, auto.losses, strict=True)):
                assert all(torch.equal(x, y) for x, y in zip(la, lb, strict=True)), f"{what} iteration {i}"
            _assert_same_tensors(reference.grads, auto.grads, f"{what} gradients")
            _assert_same_tensors(reference.params, auto.params, f"{what} parameters")
        for step, (a, b) in enumerate(zip(wrapped.steps, auto.steps, strict=True)):
            _assert_same_tensors(a["params"], b["params"], f"{what} parameters after step {step}")


@pytest.mark.parametrize("mode", ["auto", "auto_eval"])
def test_iterations_equal_the_wrapped_ones(spawned, mode: str):
    """Per iteration: the same record, observed order and plan as with wrap; megatron's plan ran."""
    from chunk_offload.schedule import megatron_plan

    for wrapped, auto in zip(spawned["wrap"], spawned[mode], strict=True):
        what = f"{mode} rank {auto.rank}"
        w, a = wrapped.extra, auto.extra
        assert w["training_calls"] == a["training_calls"] == _CONFIG.iterations, what
        assert len(w["records"]) == len(a["records"]) == _CONFIG.iterations, what
        assert [r.offload for r in a["records"]] == [False] + [True] * (_CONFIG.iterations - 1), what
        for i, (rw, ra) in enumerate(zip(w["records"], a["records"], strict=True)):
            assert comparable(rw) == comparable(ra), f"{what} record {i}"
        plan = megatron_plan(pp_size=2, pp_rank=auto.pipeline_rank, num_microbatches=_N, vp_size=2)
        for i, (sw, sa) in enumerate(zip(wrapped.steps, auto.steps, strict=True)):
            assert sa["order"] == sw["order"], f"{what} step {i}"
            assert plan.diff(sa["order"]) is None, f"{what} step {i}"
            assert sa["plan"] == sw["plan"] and sa["plan"].actions == plan.actions, f"{what} step {i}"


def test_auto_iterations_close_lazily(spawned):
    """After each optimizer step the wrapped call has ended its iteration; the automatic one ends
    at the next step's first forward (or at the evaluation's first forward)."""
    for wrapped, auto, auto_eval in zip(spawned["wrap"], spawned["auto"], spawned["auto_eval"], strict=True):
        steps = range(_CONFIG.iterations)
        assert [s["training_calls"] for s in wrapped.steps] == [i + 1 for i in steps]
        assert [s["training_calls"] for s in auto.steps] == list(steps)
        assert [s["training_calls"] for s in auto_eval.steps] == [i + 1 for i in steps]


def test_bytes_are_offloaded_and_nothing_is_left(spawned):
    for mode in ("auto", "auto_eval"):
        for wrapped, auto in zip(spawned["wrap"], spawned[mode], strict=True):
            what = f"{mode} rank {auto.rank}"
            stats = auto.extra
            assert stats["offloaded"] == wrapped.extra["offloaded"], what
            assert stats["reloaded"] == stats["offloaded"], what
            assert stats["groups"] == wrapped.extra["groups"], what
            if auto.pipeline_rank == 0:
                assert sum(stats["offloaded"].values()) > 0, what
            assert (stats["pool_in_use"], stats["resident"], stats["host"], stats["live_chunks"]) == (0, 0, 0, []), what


def test_evaluation_offloads_nothing(spawned):
    """The evaluations ran through every chunk, with no group or byte beyond the training ones."""
    chunk_forwards = _CONFIG.iterations * _N * _CONFIG.virtual_pipeline
    for auto, auto_eval in zip(spawned["auto"], spawned["auto_eval"], strict=True):
        assert auto_eval.extra["evaluations"] == _CONFIG.iterations
        assert auto_eval.extra["evaluation_forwards"] == chunk_forwards
        assert auto.extra["evaluation_forwards"] == 0
        assert auto_eval.extra["groups"] == auto.extra["groups"]
        assert auto_eval.extra["offloaded"] == auto.extra["offloaded"]


def test_report_in_auto_mode(spawned):
    """report() closes the last iteration: baseline 0 against the last one, as with wrap."""
    times = ("copy_ms", "wait_ms")
    for mode in ("auto", "auto_eval"):
        for wrapped, auto in zip(spawned["wrap"], spawned[mode], strict=True):
            rw, ra = wrapped.extra["report"], auto.extra["report"]
            assert (ra.baseline_iteration, ra.offload_iteration) == (0, _CONFIG.iterations - 1)
            assert {f.name: getattr(ra, f.name) for f in fields(ra) if f.name not in times} == {
                f.name: getattr(rw, f.name) for f in fields(rw) if f.name not in times
            }
            assert ra.measured_drop == ra.theoretical_drop
