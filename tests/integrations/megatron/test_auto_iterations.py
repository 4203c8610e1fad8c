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

Single-process tests (plain modules shaped like a GPTModel chunk, megatron's pipeline size and
rank set through its public setters) check the errors and the lifecycle: no microbatch count,
a forward too many, ``wrap``/``iteration``/``end_iteration`` in the wrong mode, discarding, closing,
and the warning in explicit mode when a training forward runs outside any iteration.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import warnings
from dataclasses import dataclass, field, fields
from typing import Any, Iterator

import pytest
import torch
from torch import nn

from chunk_offload.core.errors import ChunkOffloadError
from chunk_offload.core.stats import GroupStats, IterationRecord
from chunk_offload.integrations.megatron import MegatronOffloadManager, attach

from tests.core._models import assert_clean

from tests._megatron import RankResult, Run, TinyGPTConfig, spawn_runs
from tests._megatron_offload import OffloadHooks, attach_with

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


def _comparable(record: IterationRecord) -> dict[str, Any]:
    """Every field of a record except times (wall time, action starts, copy and wait seconds)."""
    counts = [f.name for f in fields(GroupStats) if not f.name.endswith("_time_s")]
    out = {f.name: getattr(record, f.name) for f in fields(IterationRecord) if f.name not in ("groups", "wall_time_s", "action_starts_s")}
    out["groups"] = {name: {c: getattr(g, c) for c in counts} for name, g in record.groups.items()}
    return out


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
            assert _comparable(rw) == _comparable(ra), f"{what} record {i}"
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


# --------------------------------------------------------------------------------------------
# One process: plain modules shaped like a GPTModel chunk (`decoder.layers[i].self_attention`).
# --------------------------------------------------------------------------------------------


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attention = nn.Module()
        self.self_attention.linear_qkv = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.self_attention.linear_qkv(x))


class _Chunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList([_Layer(), _Layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.decoder.layers:
            x = layer(x)
        return x


@pytest.fixture
def pipeline_of_one() -> Iterator[None]:
    """Megatron's pipeline size 1 and rank 0 (what `_prepare_plan` reads), no calculator; reset after."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import unset_num_microbatches_calculator

    parallel_state.set_pipeline_model_parallel_world_size(1)
    parallel_state.set_pipeline_model_parallel_rank(0)
    unset_num_microbatches_calculator()
    try:
        yield
    finally:
        unset_num_microbatches_calculator()
        parallel_state.set_pipeline_model_parallel_world_size(None)
        parallel_state.set_pipeline_model_parallel_rank(None)


@pytest.fixture
def managed(pipeline_of_one) -> Iterator[Any]:
    """``managed(**options)`` -> (chunk, manager) offloading ``qkv_linear`` of every chunk; closed after the test."""
    made: list[MegatronOffloadManager] = []

    def make(**options: Any) -> tuple[_Chunk, MegatronOffloadManager]:
        torch.manual_seed(0)
        chunk = _Chunk()
        options = {"min_offload_bytes": 1, "schedule_policy": None, **options}
        made.append(attach_with(chunk, "qkv_linear", **options))
        return chunk, made[-1]

    yield make
    for manager in made:
        manager.detach()
        manager.close()


def _batch(i: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(i))


def _step(chunk: nn.Module, microbatches: int, *, first: int = 0) -> list[torch.Tensor]:
    """What megatron's no-pipelining schedule does: forward and backward of each microbatch in turn."""
    losses = []
    for i in range(first, first + microbatches):
        loss = chunk(_batch(i)).sum()
        loss.backward()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"iterations": "sometimes"},
            "iterations must be 'wrap' (each manager.wrap(forward_backward_func) call is one iteration) or 'auto' "
            "(the chunk hooks delimit iterations, for Megatron-LM's own training loop), got 'sometimes'",
        ),
        (
            {"num_microbatches": 4},
            "num_microbatches=4 applies to iterations='auto'; with iterations='wrap' each call's num_microbatches= "
            "keyword is used.",
        ),
        (
            {"iterations": "auto", "num_microbatches": 0},
            "num_microbatches must be an int >= 1, a callable returning one, or None (Megatron's get_num_microbatches()), "
            "got 0",
        ),
        (
            {"iterations": "auto", "num_microbatches": True},
            "num_microbatches must be an int >= 1, a callable returning one, or None (Megatron's get_num_microbatches()), "
            "got True",
        ),
    ],
)
def test_options_are_checked(options: dict[str, Any], message: str):
    with pytest.raises(ChunkOffloadError, match="^" + re.escape("chunk_offload: " + message) + "$"):
        attach(_Chunk(), "qkv_linear", **options)


def test_auto_offloads_like_wrap_and_closes_at_the_next_forward(managed):
    """Two steps without wrap: gradients and bytes equal those of the same steps through wrap."""
    torch.manual_seed(0)
    reference = _Chunk()  # the same initial weights as the managed chunks, never offloaded
    chunk, manager = managed(iterations="auto", num_microbatches=2)
    wrapped_chunk, wrapped = managed()
    step = wrapped.wrap(lambda *, num_microbatches, first: _step(wrapped_chunk, num_microbatches, first=first))
    for first in (0, 2):
        for module in (chunk, wrapped_chunk, reference):
            module.zero_grad(set_to_none=True)
        losses = _step(chunk, 2, first=first)
        assert manager.training_calls == first // 2, "the step's iteration stays open until the next forward"
        assert manager.observed_order == [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)]
        for a, b, c in zip(losses, step(num_microbatches=2, first=first), _step(reference, 2, first=first), strict=True):
            assert torch.equal(a, b) and torch.equal(a, c)
        for (name, p), q, r in zip(chunk.named_parameters(), wrapped_chunk.parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad) and torch.equal(p.grad, r.grad), name
    with torch.no_grad():
        chunk(_batch(0))  # an evaluation forward: closes the finished iteration, opens none
    assert manager.training_calls == wrapped.training_calls == 2
    assert manager.live_chunks() == [] and manager.observed_order == wrapped.observed_order
    assert _comparable(manager.last_iteration) == _comparable(wrapped.last_iteration)
    # Each qkv_linear saves its [4, 8] fp32 input (128 bytes), and another reference holds both on
    # device (NOTE [Storages held elsewhere]): layer 0's is the chunk's input, which the caller
    # holds; layer 1's is layer 0's tanh output, which tanh saves. The first microbatch of the
    # first iteration copies both and learns it; every later group keeps them on device.
    nbytes = 4 * 8 * 4
    last = manager.last_iteration.groups["qkv_linear"]
    assert (last.groups, last.bytes_offloaded, last.bytes_copied_held_elsewhere, last.bytes_kept_held_elsewhere) == (
        4, 0, 0, 4 * nbytes
    )
    for m in (manager, wrapped):
        total = m.stats().groups["qkv_linear"]
        assert (total.groups, total.bytes_offloaded, total.bytes_reloaded) == (8, 2 * nbytes, 2 * nbytes)
        assert (total.bytes_copied_held_elsewhere, total.bytes_kept_held_elsewhere) == (2 * nbytes, 6 * nbytes)
    assert manager.plan == wrapped.plan and manager.plan.diff(manager.observed_order) is None


def test_evaluation_forwards_open_no_iteration(managed):
    chunk, manager = managed(iterations="auto", num_microbatches=2)
    with torch.no_grad():
        chunk(_batch(0))
    with torch.inference_mode():
        chunk(_batch(1))
    assert manager.training_calls == 0 and manager.last_iteration is None and manager.observed_order == []
    assert manager.stats().groups == {}
    manager.end_iteration()  # none open: nothing to do
    assert manager.training_calls == 0


def test_default_count_needs_megatrons_calculator(managed):
    chunk, manager = managed(iterations="auto")
    message = (
        "chunk_offload: iterations='auto' without num_microbatches reads megatron.core.num_microbatches_calculator."
        "get_num_microbatches(), but that calculator is not initialised (Megatron-LM's initialize_megatron initialises "
        "it; megatron-core alone does not). Pass attach(..., num_microbatches=N), or a callable returning the current count."
    )
    with pytest.raises(ChunkOffloadError, match="^" + re.escape(message) + "$"):
        chunk(_batch(0))
    assert manager.training_calls == 0 and manager.live_chunks() == [] and manager.observed_order == []


def test_default_count_follows_megatrons_calculator(managed):
    """The count is read for each iteration: a reconfigured calculator (batch-size ramp-up) is followed."""
    from megatron.core import num_microbatches_calculator as calculator

    from chunk_offload.schedule import megatron_plan

    calculator.init_num_microbatches_calculator(0, None, 3, 1, 1)  # global batch 3, micro batch 1, DP 1: 3 microbatches
    chunk, manager = managed(iterations="auto")
    _step(chunk, 3)
    manager.end_iteration()
    assert manager.training_calls == 1
    assert manager.plan == megatron_plan(pp_size=1, pp_rank=0, num_microbatches=3)
    calculator.reconfigure_num_microbatches_calculator(0, None, 2, 1, 1)
    _step(chunk, 2)
    manager.end_iteration()
    assert manager.training_calls == 2
    assert manager.plan == megatron_plan(pp_size=1, pp_rank=0, num_microbatches=2)
    assert manager.plan.diff(manager.observed_order) is None


def test_callable_count_is_checked(managed):
    counts = [2, 0]
    chunk, manager = managed(iterations="auto", num_microbatches=lambda: counts.pop(0))
    _step(chunk, 2)
    message = r"^chunk_offload: the num_microbatches callable <function .*> returned 0; the number of microbatches must be an int >= 1$"
    with pytest.raises(ChunkOffloadError, match=message):
        chunk(_batch(2))
    assert manager.training_calls == 1  # the complete iteration was closed before the count was read


def test_a_forward_too_many_names_the_counts(managed):
    chunk, manager = managed(iterations="auto", num_microbatches=2)
    outputs = [chunk(_batch(0)), chunk(_batch(1))]  # two forwards whose backwards have not run
    message = (
        "chunk_offload: model chunk 0 starts training forward 3 of an iteration of num_microbatches=2 (training forwards "
        "per model chunk so far: [2]), but that iteration is not complete (2 chunk backward(s) not begun; 2 chunk(s) "
        "still holding saved tensors). Set attach(..., num_microbatches=...) to the number of microbatches of each "
        "forward_backward_func call (an int, or a callable returning the current count); run evaluation under "
        "torch.no_grad() (a forward_only=True call with gradients enabled looks like training); after a step that "
        "failed part-way, call manager.end_iteration(discard=True)."
    )
    with pytest.raises(ChunkOffloadError, match="^" + re.escape(message) + "$"):
        chunk(_batch(2))
    incomplete = (
        "chunk_offload: end_iteration(): the open iteration of num_microbatches=2 is not complete (1 chunk backward(s) "
        "not begun; 1 chunk(s) still holding saved tensors); finish the step's forwards and backwards first, or call "
        "end_iteration(discard=True) to drop it."
    )
    outputs[0].sum().backward()
    with pytest.raises(ChunkOffloadError, match="^" + re.escape(incomplete) + "$"):
        manager.end_iteration()
    outputs[1].sum().backward()
    with pytest.warns(RuntimeWarning, match=re.escape("observed: 0F0 [0F1] 0B0 0B1")):
        manager.end_iteration()  # F0 F1 B0 B1 is not megatron's no-pipelining order: the plan check says so
    assert manager.training_calls == 1 and manager.live_chunks() == []
    moved = manager.last_iteration.groups["qkv_linear"]
    assert moved.bytes_reloaded == moved.bytes_offloaded > 0


def test_too_few_forwards_is_incomplete(managed):
    chunk, manager = managed(iterations="auto", num_microbatches=3)
    _step(chunk, 2)
    with pytest.raises(ChunkOffloadError, match=re.escape("(training forwards per model chunk [2] of 3 each)")):
        manager.end_iteration()


def test_discard_drops_the_open_iteration(managed):
    chunk, manager = managed(iterations="auto", num_microbatches=2)
    dropped = chunk(_batch(0))
    manager.end_iteration(discard=True)
    assert manager.training_calls == 0 and manager.last_iteration is None and manager.live_chunks() == []
    with pytest.raises(ChunkOffloadError, match=r"discarded \(its chunk or iteration raised"):
        dropped.sum().backward()  # its saved tensors were discarded
    _step(chunk, 2)  # the next forward opens a fresh iteration
    manager.end_iteration()
    assert manager.training_calls == 1 and manager.observed_order == [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)]


def test_a_forward_that_raises_discards_the_open_iteration(managed, caplog):
    chunk, manager = managed(iterations="auto", num_microbatches=2)
    held = chunk(_batch(0))  # the step's first microbatch: its saved tensors are held
    layer = chunk.decoder.layers[1]
    failing = layer.register_forward_hook(lambda module, args, output: 1 / 0)
    with caplog.at_level(logging.WARNING, logger="chunk_offload.integrations.megatron.chunk_hooks"), pytest.raises(ZeroDivisionError):
        chunk(_batch(1))
    failing.remove()
    assert [r.getMessage() for r in caplog.records] == ["chunk_offload: a forward of model chunk 0 raised; discarding the open iteration."]
    assert manager.live_chunks() == [] and manager.training_calls == 0
    assert_clean(manager)
    with pytest.raises(ChunkOffloadError, match=r"discarded \(its chunk or iteration raised"):
        held.sum().backward()
    chunk.zero_grad(set_to_none=True)
    losses = _step(chunk, 2)  # the next step runs in a fresh iteration, exactly
    manager.end_iteration()
    assert manager.training_calls == 1
    torch.manual_seed(0)
    reference = _Chunk()  # the same parameters, no offload
    assert all(torch.equal(a, b) for a, b in zip(losses, _step(reference, 2), strict=True))
    for (name, p), q in zip(chunk.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_wrap_and_iteration_are_refused_in_auto_mode(managed):
    chunk, manager = managed(iterations="auto", num_microbatches=1)
    wrap_message = (
        "chunk_offload: wrap() on a manager attached with iterations='auto', which opens an iteration at the first "
        "training chunk forward of each step by itself; call get_forward_backward_func() unwrapped, or attach with "
        "iterations='wrap' to delimit iterations by the wrapped calls."
    )
    with pytest.raises(ChunkOffloadError, match="^" + re.escape(wrap_message) + "$"):
        manager.wrap(lambda **kwargs: None)
    iteration_message = (
        "chunk_offload: iteration() on a manager attached with iterations='auto', which opens and closes its "
        "iterations itself; run the training steps without it, or attach with iterations='wrap'."
    )
    with pytest.raises(ChunkOffloadError, match="^" + re.escape(iteration_message) + "$"):
        manager.iteration()


def test_end_iteration_is_refused_in_wrap_mode(managed):
    chunk, manager = managed()
    message = (
        "chunk_offload: end_iteration() is for managers attached with iterations='auto'; with iterations='wrap' each "
        "call of the wrapped forward_backward_func is one iteration and ends with the call."
    )
    with pytest.raises(ChunkOffloadError, match="^" + re.escape(message) + "$"):
        manager.end_iteration()


def test_close_ends_a_complete_iteration_and_discards_an_incomplete_one(managed, caplog):
    chunk, manager = managed(iterations="auto", num_microbatches=2)
    _step(chunk, 2)
    manager.close()
    assert manager.training_calls == 1 and manager.last_iteration.order == [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)]
    chunk, manager = managed(iterations="auto", num_microbatches=2)
    output = chunk(_batch(0))  # kept: its saved tensors are held
    with caplog.at_level(logging.WARNING, logger="chunk_offload.integrations.megatron.attach"):
        manager.close()
    assert manager.training_calls == 0 and manager.live_chunks() == [] and output.requires_grad
    assert [r.getMessage() for r in caplog.records] == [
        "chunk_offload: discarding the open incomplete iteration (training forwards per model chunk [1] of 2 each; "
        "1 chunk backward(s) not begun; 1 chunk(s) still holding saved tensors) at close()."
    ]


def test_explicit_mode_warns_once_about_a_training_forward_outside_any_iteration(managed):
    chunk, manager = managed()
    message = (
        "chunk_offload: a training forward (gradients enabled) of model chunk 0 ran outside any offload iteration, so "
        "nothing it saves is offloaded. Run training through manager.wrap(get_forward_backward_func()), or, when the "
        "training loop calls get_forward_backward_func() itself (Megatron-LM's pretrain), attach with "
        "iterations='auto' (--chunk-offload-iterations auto). Shown once per manager."
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            chunk(_batch(0))  # evaluation: no warning
        with manager.iteration():
            _step(chunk, 1)  # inside an iteration: no warning
        chunk(_batch(1)).sum().backward()
        chunk(_batch(2)).sum().backward()
    assert [(w.category, str(w.message)) for w in caught] == [(RuntimeWarning, message)]
    assert manager.stats().groups["qkv_linear"].groups == 2  # the one step inside the iteration (2 layers)
    other_chunk, other = managed()
    with pytest.warns(RuntimeWarning, match="^" + re.escape(message) + "$"):
        other_chunk(_batch(0))
