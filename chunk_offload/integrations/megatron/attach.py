"""`attach`: offload chosen submodules of megatron-core GPTModel chunks under Megatron's schedules.

Nothing in Megatron is patched. Module hooks do all the work:

- each offloaded submodule (see `modules.py`) becomes one group per call;
- each model chunk's forward opens the chunk handler for (microbatch, vp_stage): Megatron's
  schedules run the forwards of one model chunk in microbatch order, so the microbatch is the
  number of forwards that chunk already ran in this iteration;
- `MegatronOffloadManager.wrap(forward_backward_func)` makes each call one iteration, and runs a
  ``forward_only=True`` call (evaluation) without offload, leaving the training state untouched;
- or, with ``iterations="auto"`` (for loops that call ``get_forward_backward_func()`` themselves,
  like Megatron-LM's ``pretrain``), the chunk hooks open and close the iterations: see NOTE
  [Automatic iterations].

A training forward (gradients enabled) outside any iteration offloads nothing; the manager then
warns once, naming both ways to open iterations.

The rank's plan comes from Megatron's own schedule tables (`chunk_offload.schedule.megatron_plan`)
at the first training call, and drives a `PlanPolicy` by default: chunks whose backward follows
at once stay on device, and the next backward chunk is reloaded during the action before it.
The order in which chunks really ran is recorded per iteration (`observed_order`) and checked
against the plan after every iteration: on a difference a warning shows both, and the observed
order becomes the plan.

``baseline_iterations=N`` runs the first N training calls without copies (identical
accounting); their `IterationRecord` and the last offloaded one are kept in `records`, from
which `report` builds the rank's per-stage report.

NOTE [Automatic iterations]
With ``iterations="auto"`` no wrap is needed. The first training chunk forward (gradients
enabled, not inference mode) while no iteration is open opens one, for N microbatches: the
``num_microbatches`` int, the callable's value, or by default Megatron's
``get_num_microbatches()`` (Megatron-LM's ``initialize_megatron`` sets that calculator up; the
count is read again for every iteration, so batch-size ramp-up is followed). The iteration is
complete when every model chunk of the rank ran N training forwards, the gradient of every chunk
output reached it (each chunk's backward began) and every chunk handler released its saved
tensors. A complete iteration is closed lazily, never from inside autograd's backward: by the
next chunk forward of any kind (a training forward then opens the next iteration; an evaluation
forward under ``torch.no_grad()`` opens nothing and offloads nothing), by `end_iteration`,
`report`, `detach` or `close`. Closing does what `wrap` does after a call: count the training
call, keep its record, check the plan. A chunk forward that raises discards the open iteration
at once (its chunks' saved tensors are freed; the next training forward opens a fresh one); an
exception in backward leaves it open, and `end_iteration(discard=True)` or `close` frees it. A training forward of a chunk that already ran N forwards
in an incomplete iteration cannot belong to that iteration nor start the next one: it raises,
with the counts. `wrap` and `iteration` are refused in this mode (one owner of the iterations).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, Sequence

import torch
from torch import nn

from ...core.errors import ChunkOffloadError
from ...core.manager import OffloadManager
from ...core.schedule_policy import SchedulePolicy
from ...core.stats import IterationRecord
from ...schedule import Plan, PlanPolicy, megatron_plan
from .modules import canonical_names, resolve

if TYPE_CHECKING:
    from ...report import StageReport

__all__ = ["ITERATION_MODES", "MegatronOffloadManager", "attach"]

logger = logging.getLogger(__name__)

ITERATION_MODES = ("wrap", "auto")
"""How training iterations are delimited: by ``manager.wrap(forward_backward_func)`` calls, or
by the chunk hooks themselves (NOTE [Automatic iterations])."""

_MISSING_HINTS = {
    "attn_norm": "with the Transformer Engine spec the attention norm is fused into linear_qkv: offload qkv_linear",
    "mlp_norm": "with the Transformer Engine spec the MLP norm is fused into linear_fc1: offload mlp_fc1/expert_fc1",
    "mlp_fc1": "MoE layers have no dense MLP: offload expert_fc1",
    "expert_fc1": "dense layers have no experts, and GroupedMLP has no fc1 module: use SequentialMLP or TEGroupedMLP",
    "moe_act": "the expert activation is a plain function in this model, not a module",
}


@dataclass(slots=True)
class _AutoIteration:
    """The iteration that auto mode opened: its microbatch count, its scope, its backwards to come."""

    num_microbatches: int
    scope: contextlib.AbstractContextManager
    pending_backwards: int = 0
    """Chunk outputs whose gradient has not arrived yet (their chunk's backward has not begun)."""


class MegatronOffloadManager(OffloadManager):
    """An `OffloadManager` bound to the model chunks of one pipeline rank.

    ``iterations``: ``"wrap"`` (default): each call of ``manager.wrap(get_forward_backward_func())``
    is one iteration. ``"auto"``: the chunk hooks open and close iterations themselves, for
    training loops that call ``get_forward_backward_func()`` themselves (Megatron-LM's
    ``pretrain``); ``num_microbatches`` (an int, or a callable returning the current count; None:
    Megatron's ``get_num_microbatches()``) is the forwards per chunk in one iteration. See NOTE
    [Automatic iterations].
    """

    def __init__(
        self,
        model_chunks: nn.Module | Sequence[nn.Module],
        offload_modules: str | Sequence[str],
        *,
        schedule_policy: SchedulePolicy | Literal["plan"] | None = "plan",
        prefetch_bytes: int | None = None,
        reload_ahead_bytes: int | None = None,
        baseline_iterations: int = 0,
        iterations: Literal["wrap", "auto"] = "wrap",
        num_microbatches: int | Callable[[], int] | None = None,
        **options: Any,
    ) -> None:
        offload_modules = canonical_names(offload_modules)  # fail before the streams start
        if not (schedule_policy is None or schedule_policy == "plan" or isinstance(schedule_policy, SchedulePolicy)):
            raise ChunkOffloadError(
                f"schedule_policy must be 'plan', None (reload at group start) or a SchedulePolicy, got {schedule_policy!r}"
            )
        if not isinstance(baseline_iterations, int) or baseline_iterations < 0:
            raise ChunkOffloadError(f"baseline_iterations must be an int >= 0, got {baseline_iterations!r}")
        _check_iterations(iterations, num_microbatches)
        use_plan = isinstance(schedule_policy, str)
        super().__init__(schedule_policy=None if use_plan else schedule_policy, **options)
        self._plan_policy = use_plan
        self._plan_options = PlanPolicy.check_budgets(prefetch_bytes=prefetch_bytes, reload_ahead_bytes=reload_ahead_bytes)
        self.baseline_iterations = baseline_iterations
        self.plan: Plan | None = None
        """This rank's plan for the last training call (Megatron's tables, or the observed order if they differed)."""
        self._baseline_records: list[IterationRecord] = []
        self._last_record: IterationRecord | None = None
        self._training_calls = 0
        self._plan_key: tuple | None = None
        chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        if not chunks or not all(isinstance(c, nn.Module) for c in chunks):
            raise ChunkOffloadError(
                f"attach expects a GPTModel chunk or a list of them (one per virtual stage), got {model_chunks!r:.200}"
            )
        self.model_chunks = chunks
        self.offload_modules = offload_modules
        self.registered: dict[str, int] = {}
        for chunk in chunks:
            self.protect_module(chunk)
            for name in self.offload_modules:
                for module in resolve(chunk, name):
                    self.offload_module(module, name)
                    self.registered[name] = self.registered.get(name, 0) + 1
        for name in self.offload_modules:
            if name not in self.registered:
                logger.warning(
                    "chunk_offload: offload module %r matches no submodule on this rank (%s); nothing of it is offloaded here.",
                    name,
                    _MISSING_HINTS.get(name, "not present in this model"),
                )
        self.iterations = iterations
        """``"wrap"`` or ``"auto"``: who opens and closes the training iterations (`ITERATION_MODES`)."""
        self._num_microbatches = num_microbatches
        self._auto: _AutoIteration | None = None  # the open iteration in auto mode
        self._warned_outside_iteration = False
        self._forwards = [0] * len(chunks)
        self._chunk_scopes: list[contextlib.ExitStack] = []
        self._forward_only = False
        self.observed_order: list[tuple[str, int, int]] = []
        """The (F|B, microbatch, vp_stage) actions of the last training iteration, as they ran."""
        self._chunk_hooks = []
        for vp_stage, chunk in enumerate(chunks):
            self._chunk_hooks.append(chunk.register_forward_pre_hook(self._make_pre(vp_stage)))
            self._chunk_hooks.append(chunk.register_forward_hook(self._make_post(vp_stage), always_call=True))

    # ------------------------------------------------------------------ chunk scopes
    def _make_pre(self, vp_stage: int) -> Callable:
        def pre(module: nn.Module, args: tuple) -> None:
            if self._forward_only:
                return
            training = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
            if self.iterations == "auto":
                self._auto_before_forward(vp_stage, training)
                if not training:
                    return
            elif not self._in_iteration:
                if training:
                    self._warn_outside_iteration(vp_stage)
                return
            microbatch = self._forwards[vp_stage]
            self._forwards[vp_stage] += 1
            scope = contextlib.ExitStack()
            handler = scope.enter_context(self.chunk(microbatch=microbatch, vp_stage=vp_stage))
            self._chunk_scopes.append(scope)
            if handler is not None:
                self.observed_order.append(("F", microbatch, vp_stage))

        return pre

    def _make_post(self, vp_stage: int) -> Callable:
        def post(module: nn.Module, args: tuple, output: Any) -> Any:
            if not self._chunk_scopes:
                return None
            scope = self._chunk_scopes.pop()
            handler = self.current_handler
            error = sys.exc_info()
            scope.__exit__(*error)  # inside torch's except clause when the forward raised
            if error[0] is not None and self._auto is not None:
                # The step is broken: free what its earlier chunks hold now, not when someone
                # calls end_iteration(discard=True); the next training forward opens a fresh one.
                logger.warning("chunk_offload: a forward of model chunk %d raised; discarding the open iteration.", vp_stage)
                self._close_auto(discard=True)
                return None
            if handler is not None and output is not None:
                # Bound to this iteration's order and state, even if the gradient arrives after it closed.
                order, auto, action = self.observed_order, self._auto, ("B", handler.key.microbatch, vp_stage)

                def backward_began() -> None:
                    order.append(action)
                    if auto is not None:
                        auto.pending_backwards -= 1

                if _on_backward(output, backward_began) and auto is not None:
                    auto.pending_backwards += 1
            return None

        return post

    def _warn_outside_iteration(self, vp_stage: int) -> None:
        if self._warned_outside_iteration:
            return
        self._warned_outside_iteration = True
        warnings.warn(
            f"chunk_offload: a training forward (gradients enabled) of model chunk {vp_stage} ran outside any offload "
            "iteration, so nothing it saves is offloaded. Run training through "
            "manager.wrap(get_forward_backward_func()), or, when the training loop calls get_forward_backward_func() "
            "itself (Megatron-LM's pretrain), attach with iterations='auto' (--chunk-offload-iterations auto). "
            "Shown once per manager.",
            RuntimeWarning,
            stacklevel=3,
        )

    # ------------------------------------------------------------------ iterations
    def iteration(self, *, offload: bool | None = None) -> contextlib.AbstractContextManager["MegatronOffloadManager"]:
        """One training iteration (`OffloadManager.iteration`); each chunk counts its forwards from microbatch 0 again."""
        if self.iterations == "auto":
            raise ChunkOffloadError(
                "iteration() on a manager attached with iterations='auto', which opens and closes its iterations "
                "itself; run the training steps without it, or attach with iterations='wrap'."
            )
        return self._iteration_scope(offload=offload)

    @contextlib.contextmanager
    def _iteration_scope(self, *, offload: bool | None) -> Iterator["MegatronOffloadManager"]:
        with super().iteration(offload=offload):
            self._forwards = [0] * len(self.model_chunks)  # after the nesting checks
            self.observed_order = []
            yield self

    def wrap(self, forward_backward_func: Callable) -> Callable:
        """Return ``forward_backward_func`` with each training call run as one offload iteration."""
        if self.iterations == "auto":
            raise ChunkOffloadError(
                "wrap() on a manager attached with iterations='auto', which opens an iteration at the first training "
                "chunk forward of each step by itself; call get_forward_backward_func() unwrapped, or attach with "
                "iterations='wrap' to delimit iterations by the wrapped calls."
            )

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("forward_only", False):
                previous, self._forward_only = self._forward_only, True
                try:
                    return forward_backward_func(*args, **kwargs)
                finally:
                    self._forward_only = previous
            self._prepare_plan(kwargs.get("num_microbatches"))
            with self.iteration(offload=self._next_offload()):
                result = forward_backward_func(*args, **kwargs)
            self._after_training_call()
            return result

        wrapped.__wrapped__ = forward_backward_func
        return wrapped

    def _next_offload(self) -> bool | None:
        """``iteration(offload=...)`` of the next training call: False while baseline iterations remain."""
        return False if self._training_calls < self.baseline_iterations else None

    def _after_training_call(self) -> None:
        self._training_calls += 1
        self._keep_record(self.last_iteration)
        self._check_plan()

    @property
    def training_calls(self) -> int:
        """Training iterations completed so far: `wrap` calls (not ``forward_only``), or closed automatic iterations."""
        return self._training_calls

    # ------------------------------------------------------------------ automatic iterations
    def _auto_before_forward(self, vp_stage: int, training: bool) -> None:
        """Auto mode, before a chunk forward: close a complete iteration, then open one for a training forward."""
        auto = self._auto
        if auto is not None:
            if self._auto_missing() is None:
                self._close_auto()
            elif training and self._forwards[vp_stage] >= auto.num_microbatches:
                raise ChunkOffloadError(
                    f"model chunk {vp_stage} starts training forward {self._forwards[vp_stage] + 1} of an iteration of "
                    f"num_microbatches={auto.num_microbatches} (training forwards per model chunk so far: "
                    f"{self._forwards}), but that iteration is not complete ({self._auto_missing()}). Set "
                    "attach(..., num_microbatches=...) to the number of microbatches of each forward_backward_func "
                    "call (an int, or a callable returning the current count); run "
                    "evaluation under torch.no_grad() (a forward_only=True call with gradients enabled looks like "
                    "training); after a step that failed part-way, call manager.end_iteration(discard=True)."
                )
        if training and self._auto is None:
            num_microbatches = self._current_num_microbatches()
            self._prepare_plan(num_microbatches)
            scope = self._iteration_scope(offload=self._next_offload())
            scope.__enter__()
            self._auto = _AutoIteration(num_microbatches, scope)

    def _current_num_microbatches(self) -> int:
        source = self._num_microbatches
        if source is None:
            from megatron.core import num_microbatches_calculator

            try:
                value = num_microbatches_calculator.get_num_microbatches()
            except AttributeError as e:  # megatron-core's global calculator is None until initialised
                raise ChunkOffloadError(
                    "iterations='auto' without num_microbatches reads megatron.core.num_microbatches_calculator."
                    "get_num_microbatches(), but that calculator is not initialised (Megatron-LM's initialize_megatron "
                    "initialises it; megatron-core alone does not). Pass attach(..., num_microbatches=N), or a callable "
                    "returning the current count."
                ) from e
            what = "megatron.core.num_microbatches_calculator.get_num_microbatches()"
        elif callable(source):
            value, what = source(), f"the num_microbatches callable {source!r}"
        else:
            return source  # checked in __init__
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ChunkOffloadError(f"{what} returned {value!r}; the number of microbatches must be an int >= 1")
        return value

    def _auto_missing(self) -> str | None:
        """What the open automatic iteration still lacks (None: it is complete)."""
        auto = self._auto
        n = auto.num_microbatches
        missing = []
        if any(f != n for f in self._forwards):
            missing.append(f"training forwards per model chunk {self._forwards} of {n} each")
        if auto.pending_backwards:
            missing.append(f"{auto.pending_backwards} chunk backward(s) not begun")
        holding = sum(not h.released for h in self._iteration_handlers)
        if holding:
            missing.append(f"{holding} chunk(s) still holding saved tensors")
        return "; ".join(missing) or None

    def _close_auto(self, *, discard: bool = False) -> None:
        auto, self._auto = self._auto, None
        if discard:  # the core iteration's error path: every chunk of it is discarded
            reason = ChunkOffloadError("the iteration was discarded by end_iteration(discard=True)")
            auto.scope.__exit__(type(reason), reason, None)
            return
        auto.scope.__exit__(None, None, None)
        self._after_training_call()

    def end_iteration(self, *, discard: bool = False) -> None:
        """Close the iteration that ``iterations="auto"`` opened, now instead of at the next chunk forward.

        Raises `ChunkOffloadError` if it is not complete (some forwards or backwards of the step
        have not run), unless ``discard=True``: then its chunks are dropped without a record or
        a training call (their saved tensors can no longer be used). No-op when none is open.
        """
        if self.iterations != "auto":
            raise ChunkOffloadError(
                "end_iteration() is for managers attached with iterations='auto'; with iterations='wrap' each call of "
                "the wrapped forward_backward_func is one iteration and ends with the call."
            )
        if self._auto is None:
            return
        if not discard:
            missing = self._auto_missing()
            if missing is not None:
                raise ChunkOffloadError(
                    f"end_iteration(): the open iteration of num_microbatches={self._auto.num_microbatches} is not "
                    f"complete ({missing}); finish the step's forwards and backwards first, or call "
                    "end_iteration(discard=True) to drop it."
                )
        self._close_auto(discard=discard)

    def _settle_auto(self, *, discard_incomplete: bool) -> None:
        """Close an open automatic iteration if complete; else discard it (with a warning) or leave it open."""
        if self._auto is None:
            return
        missing = self._auto_missing()
        if missing is None:
            self._close_auto()
        elif discard_incomplete:
            logger.warning("chunk_offload: discarding the open incomplete iteration (%s) at close().", missing)
            self._close_auto(discard=True)

    # ------------------------------------------------------------------ plan
    def _prepare_plan(self, num_microbatches: int | None) -> None:
        """Build this rank's plan from Megatron's tables (once per microbatch count)."""
        if num_microbatches is None:
            raise ChunkOffloadError("the wrapped forward_backward_func must be called with num_microbatches=... (keyword)")
        from megatron.core import parallel_state

        config = getattr(self.model_chunks[0], "config", None)
        vp = len(self.model_chunks) if len(self.model_chunks) > 1 else None
        key = (
            num_microbatches,
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_rank(),
            vp,
            getattr(config, "microbatch_group_size_per_vp_stage", None),
        )
        if key == self._plan_key:
            return
        self._plan_key = key
        self.plan = megatron_plan(
            num_microbatches=key[0], pp_size=key[1], pp_rank=key[2], vp_size=key[3], microbatch_group_size_per_vp_stage=key[4]
        )
        self._use_plan(self.plan)

    def _use_plan(self, plan: Plan) -> None:
        if self._plan_policy:
            self.schedule_policy = PlanPolicy(plan, **self._plan_options)

    def _check_plan(self) -> None:
        """After an iteration: the order that ran must be the plan; if not, the observed order wins."""
        if self.plan is None:
            return
        difference = self.plan.diff(self.observed_order)
        if difference is None:
            return
        try:
            observed = Plan.from_order(
                self.observed_order, pp_rank=self.plan.pp_rank, pp_size=self.plan.pp_size, vp_size=self.plan.vp_size, source="observed"
            )
        except ChunkOffloadError as e:
            observed = None
            difference += f"\nThe observed order is not a complete plan either ({e}); schedule decisions are off."
        warnings.warn(
            f"chunk_offload: the schedule that ran differs from Megatron's table; using the observed order. {difference}",
            RuntimeWarning,
            stacklevel=3,
        )
        self.plan = observed
        if observed is not None:
            self._use_plan(observed)
        elif self._plan_policy:
            self.schedule_policy = SchedulePolicy()

    def _keep_record(self, record: IterationRecord | None) -> None:
        if record is None:
            return
        if self._training_calls <= self.baseline_iterations:
            self._baseline_records.append(record)
        else:
            self._last_record = record

    @property
    def records(self) -> list[IterationRecord]:
        """The baseline iterations' records, then the last later iteration's."""
        return self._baseline_records + ([self._last_record] if self._last_record is not None else [])

    def report(self) -> "StageReport":
        """This rank's per-stage report: the first baseline iteration against the last offloaded one.

        Needs ``baseline_iterations >= 1`` and one offloaded training call after them. Gather
        the ranks' reports explicitly with `chunk_offload.report.gather_reports`. In auto mode the
        open iteration is closed first (`end_iteration`: it must be complete).
        """
        from .reporting import build_stage_report

        if self.iterations == "auto":
            self.end_iteration()
        return build_stage_report(self)

    def close(self) -> None:
        """`OffloadManager.close`; in auto mode first close the open iteration (discarded, with a warning, if incomplete)."""
        if not self._closed:
            self._settle_auto(discard_incomplete=True)
        super().close()

    def detach(self) -> None:
        """Remove every hook this manager installed on the model (in auto mode: closing a complete open iteration first)."""
        self._settle_auto(discard_incomplete=False)
        for handle in self._chunk_hooks:
            handle.remove()
        self._chunk_hooks = []
        for registration in self._registrations:
            registration.remove()
        self._registrations.clear()


def _on_backward(output: Any, callback: Callable[[], None]) -> bool:
    """Call ``callback`` once when the gradient of the chunk's output tensor is computed; False if it never can be."""
    tensor = output if isinstance(output, torch.Tensor) else None
    if tensor is None and isinstance(output, (tuple, list)):
        tensor = next((t for t in output if isinstance(t, torch.Tensor)), None)
    if tensor is None or not tensor.requires_grad:
        return False
    fired = []

    def hook(grad: torch.Tensor) -> None:
        if not fired:
            fired.append(True)
            callback()

    tensor.register_hook(hook)
    return True


def _check_iterations(iterations: Any, num_microbatches: Any) -> None:
    if iterations not in ITERATION_MODES:
        raise ChunkOffloadError(
            f"iterations must be 'wrap' (each manager.wrap(forward_backward_func) call is one iteration) or 'auto' "
            f"(the chunk hooks delimit iterations, for Megatron-LM's own training loop), got {iterations!r}"
        )
    if num_microbatches is None:
        return
    if iterations == "wrap":
        raise ChunkOffloadError(
            f"num_microbatches={num_microbatches!r} applies to iterations='auto'; with iterations='wrap' each call's "
            "num_microbatches= keyword is used."
        )
    if callable(num_microbatches):
        return
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ChunkOffloadError(
            f"num_microbatches must be an int >= 1, a callable returning one, or None (Megatron's "
            f"get_num_microbatches()), got {num_microbatches!r}"
        )


def attach(model_chunks: nn.Module | Sequence[nn.Module], offload_modules: str | Sequence[str], **options: Any) -> MegatronOffloadManager:
    """Offload ``offload_modules`` of megatron-core GPTModel ``model_chunks`` (one per virtual stage).

    ``offload_modules``: names from `chunk_offload.integrations.megatron.OFFLOAD_MODULE_NAMES`
    (a list or a comma-separated string). ``options``: `MegatronOffloadManager` keywords,
    `OffloadConfig` fields and ``streams``. Wrap Megatron's ``get_forward_backward_func()`` with
    the returned manager's `wrap`, or pass ``iterations="auto"`` when the training loop calls it
    itself (Megatron-LM's ``pretrain``).
    """
    return MegatronOffloadManager(model_chunks, offload_modules, **options)
