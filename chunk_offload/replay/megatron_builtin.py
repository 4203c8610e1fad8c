"""megatron-core's own fine-grained activation offloading, driven through a stage's plan.

megatron-core (0.16.1, 0.19.2) offloads the inputs of the modules in
``TransformerConfig.offload_modules`` when ``fine_grained_activation_offloading`` is set. The
layers read those flags when they are built; ``GPTModel.forward`` opens one chunk handler per
(microbatch, vp stage) itself (``init_chunk_handler``), and the schedules' only call is
``off_interface.reset()`` after the last backward of ``forward_backward_func``. So the replay
builds the chunks with `builtin_config`, runs the plan's forwards and backwards with the same
`ChunkDriver` as the other modes, and calls ``reset()`` at the end of each iteration, as the
schedules do. Its first iteration is megatron's own warm-up (it records the groups, then decides
which to keep on device), so at least one warm-up iteration always runs.

NOTE [ Transformer Engine stand-in ]
Without Transformer Engine, megatron's offload manager raises "TE CPU offload is not available"
on entering an offload scope, although all it does there is set TE's module flag
``cpu_offload.CPUOffloadEnabled`` (read only by TE layers, of which a local-spec model has none).
`te_cpu_offload_stand_in` binds a small object with that attribute as
``megatron.core.extensions.transformer_engine.cpu_offload`` while the replay runs and restores
the old value (None) on exit; it does nothing when Transformer Engine is installed. No megatron
source file is changed.

On a CPU-only host, `cpu_compat` already makes megatron's side streams synchronous; megatron's
offload also calls ``torch.cuda.nvtx`` ranges and ``Tensor.record_stream`` with those stand-in
streams, which `megatron_offload_on_cpu` turns into no-ops for as long as it runs.
megatron-core 0.19.2 only manages CUDA tensors, so on CPU its path runs and copies nothing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from ..core.actions import ActionKind
from ..devkit.host_profile import EngineHostTime, engine_host_time
from ..schedule.plan import Plan
from .driver import ChunkDriver, Kept
from .stage import MegatronStage

__all__ = [
    "BuiltinResult",
    "builtin_config",
    "builtin_unavailable",
    "collect_offloaded",
    "megatron_offload_on_cpu",
    "run_builtin",
    "summary_to_log",
    "te_cpu_offload_stand_in",
]

logger = logging.getLogger(__name__)

_OFFLOAD_MODULE = "megatron.core.pipeline_parallel.fine_grained_activation_offload"
_MEGATRON_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")


@dataclass(kw_only=True)
class BuiltinResult(Kept):
    """The measured iterations of megatron-core's built-in offload (tensors of the last one)."""

    step_times_s: list[float] = field(default_factory=list)
    """Wall time of each measured iteration (CUDA synchronised before and after)."""
    device_peaks: list[int | None] = field(default_factory=list)
    """``torch.cuda.max_memory_allocated`` of each measured iteration; None on CPU."""
    bytes_offloaded: list[int] = field(default_factory=list)
    """Bytes megatron copied to host in each measured iteration."""
    host_time: EngineHostTime | None = None
    """Host time megatron's offload module spent per iteration, by function (median of the profiled
    ones, `chunk_offload.devkit.host_profile.engine_host_time`); None when none was profiled."""

    @property
    def step_time_s(self) -> float:
        """Median wall time of the measured iterations."""
        return statistics.median(self.step_times_s)

    @property
    def peak_bytes(self) -> int | None:
        """Highest device peak of the measured iterations; None on CPU (no device allocator)."""
        peaks = [p for p in self.device_peaks if p is not None]
        return max(peaks) if peaks else None


def builtin_unavailable(modules: Sequence[str]) -> str | None:
    """Why megatron-core's built-in offload cannot run here, or None when it can."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec(_OFFLOAD_MODULE) is None:
        return "this megatron-core has no fine_grained_activation_offload module (0.16.1 and 0.19.2 have it)"
    missing = [m for m in modules if m not in _MEGATRON_MODULES]
    if missing:
        return f"it has no offload module {', '.join(map(repr, missing))} (its modules: {', '.join(_MEGATRON_MODULES)})"
    if "attn_proj" in modules and "core_attn" not in modules:
        return "it offloads attn_proj only together with core_attn"
    import megatron.core.extensions.transformer_engine as te_ext

    if not hasattr(te_ext, "cpu_offload"):
        return "megatron.core.extensions.transformer_engine has no cpu_offload to stand in for (Transformer Engine required)"
    return None


def builtin_config(modules: Sequence[str], *, min_offload_bytes: int, dtype: torch.dtype) -> dict[str, Any]:
    """The ``TransformerConfig`` fields that switch megatron's offload on for ``modules``.

    megatron's threshold counts elements (``tensor.numel() < min_offloaded_tensor_size`` stays):
    ``min_offload_bytes`` is converted with the model dtype's element size.
    """
    element = torch.empty((), dtype=dtype).element_size()
    return {
        "fine_grained_activation_offloading": True,
        "offload_modules": list(modules),
        "min_offloaded_tensor_size": math.ceil(min_offload_bytes / element),
    }


class _TeCpuOffloadStandIn:
    """Has the one attribute megatron's offload toggles on TE's ``cpu_offload`` module."""

    CPUOffloadEnabled = False


@contextlib.contextmanager
def te_cpu_offload_stand_in() -> Iterator[bool]:
    """Bind a stand-in for TE's ``cpu_offload`` while active; yields whether one was bound.

    See NOTE [ Transformer Engine stand-in ].
    """
    import megatron.core.extensions.transformer_engine as te_ext

    previous = te_ext.cpu_offload
    if previous is not None:
        yield False
        return
    te_ext.cpu_offload = _TeCpuOffloadStandIn()
    try:
        yield True
    finally:
        te_ext.cpu_offload = previous


@contextlib.contextmanager
def megatron_offload_on_cpu() -> Iterator[None]:
    """On a CPU-only host: no-op NVTX ranges and ``record_stream`` of stand-in streams while active.

    Inert when CUDA is available. Use inside `cpu_compat.megatron_on_cpu` (which `megatron_stage` enters).
    """
    if torch.cuda.is_available():
        yield
        return
    nvtx, tensor = torch.cuda.nvtx, torch.Tensor
    saved = (nvtx.range_push, nvtx.range_pop, tensor.record_stream)
    real_record_stream = tensor.record_stream

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        if isinstance(stream, torch.Stream):
            real_record_stream(self, stream)

    nvtx.range_push, nvtx.range_pop = (lambda msg: None), (lambda: None)
    tensor.record_stream = record_stream
    try:
        yield
    finally:
        nvtx.range_push, nvtx.range_pop, tensor.record_stream = saved


def run_builtin(
    stage: MegatronStage, plan: Plan, *, iterations: int, warmup: int, keep_tensors: bool, host_profile_iterations: int = 0
) -> BuiltinResult:
    """Run ``plan`` on ``stage`` (built with `builtin_config`) under megatron's offload; measure it.

    ``warmup`` iterations (at least one: megatron's own warm-up) before ``iterations`` measured
    ones, then ``host_profile_iterations`` under cProfile (`BuiltinResult.host_time`).
    """
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        FineGrainedActivationOffloadingInterface as off_interface,
    )

    cuda = stage.device.type == "cuda"
    driver = ChunkDriver(stage, 1 + max(mb for mb, _ in plan.chunks), keep_tensors=keep_tensors)
    result = BuiltinResult()
    with te_cpu_offload_stand_in(), megatron_offload_on_cpu():
        off_interface.reset_instance()  # megatron's manager is a process-wide singleton: start afresh
        try:
            for i in range(max(warmup, 1) + iterations):
                kept = Kept()
                if cuda:
                    torch.cuda.synchronize(stage.device)
                    torch.cuda.reset_peak_memory_stats(stage.device)
                start = time.perf_counter()
                moved = _iteration(driver, plan, off_interface, kept)
                if cuda:
                    torch.cuda.synchronize(stage.device)
                elapsed = time.perf_counter() - start
                if i >= max(warmup, 1):
                    result.step_times_s.append(elapsed)
                    result.device_peaks.append(torch.cuda.max_memory_allocated(stage.device) if cuda else None)
                    result.bytes_offloaded.append(moved)
                    result.losses, result.outputs, result.input_grads = kept.losses, kept.outputs, kept.input_grads
            driver.keep_grads(result)
            result.host_time = engine_host_time(
                lambda: _iteration(driver, plan, off_interface, Kept()), host_profile_iterations, "megatron"
            )
        finally:
            off_interface.reset_instance()  # drop the last iteration's handlers and host buffers
    return result


def _iteration(driver: ChunkDriver, plan: Plan, off_interface: Any, kept: Kept) -> int:
    """One iteration of ``plan``, then megatron's end-of-iteration reset. Returns the bytes offloaded."""
    driver.zero_grads()
    pending: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
    offloaded: dict[int, tuple[Any, int]] = {}
    for action in plan.actions:
        if action.kind is ActionKind.FORWARD:
            pending[action.chunk] = driver.forward(*action.chunk, kept)
            collect_offloaded(offloaded)
        else:
            driver.backward(*action.chunk, *pending.pop(action.chunk), kept)
    with summary_to_log():
        off_interface.reset()  # forward_backward_func's last step
    return sum(nbytes for _, nbytes in offloaded.values())


@contextlib.contextmanager
def summary_to_log() -> Iterator[None]:
    """Send what is printed meanwhile (megatron's offload summary table, printed by ``print`` at the
    first ``reset()`` after its warm-up) to this module's debug log instead of stdout."""
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        yield
    if printed.getvalue().strip():
        logger.debug("megatron-core offload summary:\n%s", printed.getvalue())


def collect_offloaded(offloaded: dict[int, tuple[Any, int]]) -> None:
    """Add the host copies megatron's offload manager holds now to ``offloaded`` (by identity; reads, never writes).

    megatron keeps an offloaded tensor as a tuple ``(device, host_copy, use_pool)`` in its
    group until the backward reloads it; right after a forward, every copy that forward made is
    still there. The tuple itself is kept in ``offloaded`` so that its id stays unique. Call it
    after each chunk forward; the bytes copied are ``sum(n for _, n in offloaded.values())``.
    """
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager

    manager = PipelineOffloadManager.get_instance()
    for handler in getattr(manager, "_cached_chunks_forward", ()):
        for group in getattr(handler, "offload_groups", ()):
            for state in getattr(group, "_tensors", {}).values():
                if isinstance(state, tuple) and len(state) == 3 and isinstance(state[1], torch.Tensor):
                    offloaded.setdefault(id(state), (state, state[1].nbytes))
