"""`attach`: offload chosen submodules of megatron-core GPTModel chunks under Megatron's schedules.

Nothing in Megatron is patched. Module hooks do all the work:

- each offloaded submodule (see `modules.py`) becomes one group per call;
- each model chunk's forward opens the chunk handler for (microbatch, vp_stage): Megatron's
  schedules run the forwards of one model chunk in microbatch order, so the microbatch is the
  number of forwards that chunk already ran in this iteration;
- `MegatronOffloadManager.wrap(forward_backward_func)` makes each call one iteration, and runs a
  ``forward_only=True`` call (evaluation) without offload, leaving the training state untouched.

The rank's plan comes from Megatron's own schedule tables (`chunk_offload.schedule.megatron_plan`)
at the first training call, and drives a `PlanPolicy` by default: chunks whose backward follows
at once stay on device, and the next backward chunk is reloaded during the action before it.
The order in which chunks really ran is recorded per iteration (`observed_order`) and checked
against the plan after every iteration: on a difference a warning shows both, and the observed
order becomes the plan.

``baseline_iterations=N`` runs the first N training calls without copies (identical
accounting); their `IterationRecord` and the last offloaded one are kept in `records`, from
which `report` builds the rank's per-stage report.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
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

__all__ = ["MegatronOffloadManager", "attach"]

logger = logging.getLogger(__name__)

_MISSING_HINTS = {
    "attn_norm": "with the Transformer Engine spec the attention norm is fused into linear_qkv: offload qkv_linear",
    "mlp_norm": "with the Transformer Engine spec the MLP norm is fused into linear_fc1: offload mlp_fc1/expert_fc1",
    "mlp_fc1": "MoE layers have no dense MLP: offload expert_fc1",
    "expert_fc1": "dense layers have no experts, and GroupedMLP has no fc1 module: use SequentialMLP or TEGroupedMLP",
    "moe_act": "the expert activation is a plain function in this model, not a module",
}


class MegatronOffloadManager(OffloadManager):
    """An `OffloadManager` bound to the model chunks of one pipeline rank."""

    def __init__(
        self,
        model_chunks: nn.Module | Sequence[nn.Module],
        offload_modules: str | Sequence[str],
        *,
        schedule_policy: SchedulePolicy | Literal["plan"] | None = "plan",
        prefetch_bytes: int | None = None,
        reload_ahead_bytes: int | None = None,
        baseline_iterations: int = 0,
        **options: Any,
    ) -> None:
        offload_modules = canonical_names(offload_modules)  # fail before the streams start
        if not (schedule_policy is None or schedule_policy == "plan" or isinstance(schedule_policy, SchedulePolicy)):
            raise ChunkOffloadError(
                f"schedule_policy must be 'plan', None (reload at group start) or a SchedulePolicy, got {schedule_policy!r}"
            )
        if not isinstance(baseline_iterations, int) or baseline_iterations < 0:
            raise ChunkOffloadError(f"baseline_iterations must be an int >= 0, got {baseline_iterations!r}")
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
            if not self._in_iteration or self._forward_only:
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
            scope.__exit__(*sys.exc_info())  # inside torch's except clause when the forward raised
            if handler is not None and output is not None:
                return _on_backward(output, lambda: self.observed_order.append(("B", handler.key.microbatch, vp_stage)))
            return None

        return post

    # ------------------------------------------------------------------ iterations
    @contextlib.contextmanager
    def iteration(self, *, offload: bool | None = None) -> Iterator["MegatronOffloadManager"]:
        """One training iteration (`OffloadManager.iteration`); each chunk counts its forwards from microbatch 0 again."""
        with super().iteration(offload=offload):
            self._forwards = [0] * len(self.model_chunks)  # after the nesting checks
            self.observed_order = []
            yield self

    def wrap(self, forward_backward_func: Callable) -> Callable:
        """Return ``forward_backward_func`` with each training call run as one offload iteration."""

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("forward_only", False):
                previous, self._forward_only = self._forward_only, True
                try:
                    return forward_backward_func(*args, **kwargs)
                finally:
                    self._forward_only = previous
            self._prepare_plan(kwargs.get("num_microbatches"))
            offload = False if self._training_calls < self.baseline_iterations else None
            with self.iteration(offload=offload):
                result = forward_backward_func(*args, **kwargs)
            self._training_calls += 1
            self._keep_record(self.last_iteration)
            self._check_plan()
            return result

        wrapped.__wrapped__ = forward_backward_func
        return wrapped

    @property
    def training_calls(self) -> int:
        """Training calls (not ``forward_only``) run through `wrap` so far."""
        return self._training_calls

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
        the ranks' reports explicitly with `chunk_offload.report.gather_reports`.
        """
        from .reporting import build_stage_report

        return build_stage_report(self)

    def detach(self) -> None:
        """Remove every hook this manager installed on the model."""
        for handle in self._chunk_hooks:
            handle.remove()
        self._chunk_hooks = []
        for registration in self._registrations:
            registration.remove()
        self._registrations.clear()


def _on_backward(output: Any, callback: Callable[[], None]) -> Any:
    """Call ``callback`` once when the gradient of the chunk's output tensor is computed."""
    tensor = output if isinstance(output, torch.Tensor) else None
    if tensor is None and isinstance(output, (tuple, list)):
        tensor = next((t for t in output if isinstance(t, torch.Tensor)), None)
    if tensor is not None and tensor.requires_grad:
        fired = []

        def hook(grad: torch.Tensor) -> None:
            if not fired:
                fired.append(True)
                callback()

        tensor.register_hook(hook)
    return None


def attach(model_chunks: nn.Module | Sequence[nn.Module], offload_modules: str | Sequence[str], **options: Any) -> MegatronOffloadManager:
    """Offload ``offload_modules`` of megatron-core GPTModel ``model_chunks`` (one per virtual stage).

    ``offload_modules``: names from `chunk_offload.integrations.megatron.OFFLOAD_MODULE_NAMES`
    (a list or a comma-separated string). ``options``: `OffloadConfig` fields and ``streams``.
    Wrap Megatron's ``get_forward_backward_func()`` with the returned manager's `wrap`.
    """
    return MegatronOffloadManager(model_chunks, offload_modules, **options)
