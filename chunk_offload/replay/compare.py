"""One stage, three or four ways: no offload, chunk-offload, megatron-core's built-in offload,
and chunk-offload under a device budget.

`compare_with_megatron` replays the same stage (same shape, seed and therefore weights), the
same plan (megatron's schedule for the stage) and the same inputs three ways: the replay's
baseline and chunk-offload iterations (`replay`, alternating, on one build of the chunks), then
megatron-core's fine-grained activation offloading (`megatron_builtin`) on a second build with
megatron's offload flags, which its layers read when they are built. Where megatron's path
cannot run, `Comparison.skipped` says why and the other two modes stand alone. With
``budget_bytes`` a fourth build runs chunk-offload as training does under that device budget
(`replay_under_budget`); ``"megatron"`` takes megatron's measured peak as the budget, so that
the two engines compare at equal memory (CUDA only: on CPU megatron's path has no peak).

Peaks: on CUDA ``torch.cuda.max_memory_allocated`` of each iteration for every mode, each later
build's (and its budget) over what the builds before it left allocated (`Comparison.left_bytes`,
named under the table when not 0); on CPU there is no device allocator, so the table shows
chunk-offload's accounting of saved bytes for the first two modes and n/a for megatron's.

Host time per group (``host_profile_iterations``): after its measured iterations each mode runs
that many more under cProfile, and the row shows the median host time of the engine's own code
per iteration (its functions and the C calls they make: copies, events, stream switches;
`chunk_offload.devkit.host_profile.engine_files`), over the groups chunk-offload tracks per
iteration (one module call of one layer and microbatch): the same count for both engines, which
offload the same module calls. cProfile slows every Python call alike, so the row compares the
engines, not the step times.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import torch

from ..core.config import OffloadConfig
from ..core.errors import ChunkOffloadError
from ..core.streams import StreamBackend
from ..devkit.gpt import GPTShape
from ..devkit.host_profile import EngineHostTime, format_rows
from ..module_names import canonical_modules
from .megatron_builtin import BuiltinResult, builtin_config, builtin_unavailable, run_builtin
from .result import BudgetReplay, ReplayResult
from .run import replay, replay_under_budget
from .stage import device_bytes_left, megatron_stage

__all__ = ["Comparison", "compare_with_megatron"]

logger = logging.getLogger(__name__)

_MIB = float(1 << 20)
MODES = ("none", "chunk_offload", "megatron", "chunk_offload_budget")
"""The modes, as named in the JSON summary (the last only with a budget)."""
HOST_ROWS = 12
"""Functions listed per profiled mode under the table: where its host time per group goes."""


@dataclass(kw_only=True)
class Comparison:
    """The three modes of one stage replay and whether they agree bit for bit."""

    replay: ReplayResult
    """No offload (``replay.baseline``) and chunk-offload (``replay.offload``)."""
    builtin: BuiltinResult | None
    """megatron-core's built-in offload; None when skipped."""
    skipped: str | None
    """Why megatron's path did not run; None when it ran."""
    megatron_version: str
    """The megatron-core version that ran."""
    budget: BudgetReplay | None = None
    """chunk-offload under a device budget; None when no budget was asked for."""
    budget_is_megatron_peak: bool = False
    """Whether that budget is megatron's measured peak (``budget_bytes="megatron"``)."""
    budget_skipped: str | None = None
    """Why the budget mode asked for did not run (megatron's peak unknown); None otherwise."""
    left_bytes: dict[str, int] = field(default_factory=dict)
    """Per later build (``"megatron"``, ``"chunk_offload_budget"``): device bytes the builds before
    it left allocated (`device_bytes_left`), taken off its peaks and its budget; 0 on CPU."""

    def identical(self, mode: str) -> dict[str, bool | None]:
        """Whether ``mode``'s losses and parameter gradients equal the no-offload run's (`torch.equal`).

        ``losses`` is None on a stage without the loss (not the last stage).
        """
        base = self.replay.baseline
        others = {"chunk_offload": self.replay.offload, "megatron": self.builtin, "chunk_offload_budget": self.budget and self.budget.result}
        other = others.get(mode)
        if other is None:
            ran = [name for name, result in others.items() if result is not None]
            raise ChunkOffloadError(f"chunk_offload: mode {mode!r} did not run; identical() takes one of {ran}")
        losses = None
        if base.losses:
            losses = len(base.losses) == len(other.losses) and all(map(torch.equal, base.losses, other.losses))
        grads = base.grads.keys() == other.grads.keys() and all(torch.equal(g, other.grads[k]) for k, g in base.grads.items())
        return {"losses": losses, "grads": grads}

    def _modes(self) -> dict[str, dict[str, Any]]:
        r = self.replay
        cpu = r.baseline.last.device_peak_bytes is None
        modes: dict[str, dict[str, Any]] = {
            "none": {"step_time_s": r.baseline.step_time_s, "peak_bytes": r.baseline.peak_bytes, "bytes_offloaded": 0},
            "chunk_offload": {
                "step_time_s": r.offload.step_time_s,
                "peak_bytes": r.offload.peak_bytes,
                "drop_bytes": r.measured_drop,
                "R": r.ratio,
                "bytes_offloaded": r.offload.bytes_offloaded,
                "wait_time_s": r.offload.wait_time_s,
                "offload_copy_time_s": r.offload.offload_time_s,
                **self._host(r.offload.host_time),
                **self.identical("chunk_offload"),
            },
        }
        if self.builtin is None:
            modes["megatron"] = {"skipped": self.skipped}
        else:
            b, peak = self.builtin, self.megatron_peak_bytes
            modes["megatron"] = {
                "step_time_s": b.step_time_s,
                "peak_bytes": peak,
                "left_bytes": self.left_bytes.get("megatron", 0),
                "drop_bytes": None if peak is None or cpu else r.baseline.peak_bytes - peak,
                "bytes_offloaded": b.bytes_offloaded[-1],
                "megatron_version": self.megatron_version,
                **self._host(b.host_time),
                **self.identical("megatron"),
            }
        if self.budget_skipped is not None:
            modes["chunk_offload_budget"] = {"skipped": self.budget_skipped}
        if self.budget is not None:
            left = self.left_bytes.get("chunk_offload_budget", 0)
            budget = self.budget.summary()
            budget.update(budget_bytes=budget["budget_bytes"] - left, peak_bytes=budget["peak_bytes"] - left, left_bytes=left)
            modes["chunk_offload_budget"] = {
                **budget,
                "drop_bytes": r.baseline.peak_bytes - budget["peak_bytes"],
                **self._host(self.budget.result.host_time),
                **self.identical("chunk_offload_budget"),
            }
        return modes

    @property
    def groups_per_iteration(self) -> int:
        """The groups chunk-offload tracks per iteration (every chunk's, offloaded or kept): the
        unit of the host time row, for every engine."""
        return sum(len(groups) for groups in self.replay.offload.last.group_bytes.values())

    def _host(self, host: EngineHostTime | None) -> dict[str, Any]:
        """A mode's host time fields: per iteration, per group, and the heaviest functions per group
        (`HOST_ROWS` of them: own us, calls, function) (none when it was not profiled)."""
        if host is None:
            return {}
        groups = max(self.groups_per_iteration, 1)
        return {"host_engine_s": host.seconds, "host_us_per_group": host.seconds * 1e6 / groups,
                "host_functions": format_rows(host.functions, groups, top=HOST_ROWS)}  # fmt: skip

    @property
    def megatron_peak_bytes(self) -> int | None:
        """megatron's measured peak over what the builds before it left (None: no peak, or skipped)."""
        if self.builtin is None or self.builtin.peak_bytes is None:
            return None
        return self.builtin.peak_bytes - self.left_bytes.get("megatron", 0)

    def summary(self) -> dict[str, Any]:
        """The figures of `format` as plain numbers (for JSON), with the replay's own summary."""
        cpu = self.replay.baseline.last.device_peak_bytes is None
        return {
            "modes": self._modes(),
            "peak_measure": "chunk-offload accounting of saved bytes (CPU)" if cpu else "torch.cuda.max_memory_allocated",
            "groups_per_iteration": self.groups_per_iteration,
            "replay": self.replay.summary(),
        }

    def format(self) -> str:
        """The side-by-side table, with the one-line skip reason when megatron's path did not run."""
        r, modes = self.replay, self._modes()
        cpu = r.baseline.last.device_peak_bytes is None
        names = ["none", "chunk_offload"] + ([] if self.builtin is None else ["megatron"]) + ([] if self.budget is None else ["chunk_offload_budget"])
        headers = {
            "none": "no offload",
            "chunk_offload": "chunk-offload",
            "megatron": f"megatron {self.megatron_version}",
            "chunk_offload_budget": "chunk-offload budget",
        }
        budget = modes["chunk_offload_budget"] if self.budget is not None else None

        def row(label: str, cells: dict[str, str]) -> str:
            return f"{label:<30}" + "".join(f"{cells.get(n, '-'):>22}" for n in names)

        def mib(value: int | None) -> str:
            return "n/a" if value is None else f"{value / _MIB:.2f}"

        rows = [
            f"{r.stage}, {r.plan.source}, {len(r.plan.chunks)} chunk forwards, device {r.device}; "
            f"modules {','.join(r.modules)}",
            row("", headers),
            row("step time (ms)", {n: f"{m['step_time_s'] * 1e3:.2f}" for n, m in modes.items() if "step_time_s" in m}),
            row("peak (MiB)" + (" [accounting]" if cpu else ""), {n: mib(m.get("peak_bytes")) for n, m in modes.items() if "skipped" not in m}),
            row("drop vs none (MiB)", {n: mib(m["drop_bytes"]) for n, m in modes.items() if "drop_bytes" in m}),
            row("R (measured/theory)", {n: "n/a" if m.get("R") is None else f"{m['R']:.4f}" for n, m in modes.items() if n != "none"}),
            row("offloaded / iteration (MiB)", {n: mib(m["bytes_offloaded"]) for n, m in modes.items() if "bytes_offloaded" in m}),
            row("compute wait (ms)", {n: f"{m['wait_time_s'] * 1e3:.2f}" if "wait_time_s" in m else "n/a" for n, m in modes.items() if n != "none"}),
            row("host time / group (us)", {n: f"{m['host_us_per_group']:.1f}" if "host_us_per_group" in m else "n/a"
                                            for n, m in modes.items() if n != "none"}),  # fmt: skip
            row("D2H copy time (ms)", {n: f"{m['offload_copy_time_s'] * 1e3:.2f}" if "offload_copy_time_s" in m else "n/a" for n, m in modes.items() if n != "none"}),
            row("losses bit-identical", {n: _yes(m["losses"]) for n, m in modes.items() if "losses" in m} | {"none": "(reference)"}),
            row("grads bit-identical", {n: _yes(m["grads"]) for n, m in modes.items() if "grads" in m} | {"none": "(reference)"}),
        ]
        if any("host_us_per_group" in m for m in modes.values()):
            profiled = "CPU copy streams' worker threads not seen" if cpu else "CUDA: backward's too, run on the profiled thread"
            rows.append(f"host time / group: the engine's own host time per profiled iteration (cProfile; {profiled}) over the "
                        f"{self.groups_per_iteration} groups chunk-offload tracks per iteration, for each engine alike")  # fmt: skip
            for n, m in modes.items():
                if "host_functions" in m:
                    rows += [f"{headers[n]}'s host time by function (us per group, calls per group):", *m["host_functions"]]
        if cpu:
            rows.append("peak on CPU: chunk-offload's accounting of saved bytes; megatron's path has none (n/a)")
        else:
            rows.append("peak: torch.cuda.max_memory_allocated per iteration; grads on CUDA depend on deterministic kernels")
        if budget is not None:
            over = budget["peak_bytes"] - budget["budget_bytes"]
            rows.append(
                f"chunk-offload budget: device budget {mib(budget['budget_bytes'])} MiB"
                + (" (megatron's peak)" if self.budget_is_megatron_peak else "")
                + f", {'predicted to fit' if budget['budget_fits'] else 'out of reach (predicted)'}, measured peak "
                + f"{mib(budget['peak_bytes'])} MiB ({abs(over) / _MIB:.2f} MiB {'under' if over <= 0 else 'over'} it)"
                + "; groups copied: "
                + (", ".join(f"{name} {count}" for name, count in budget["offloaded_groups"].items()) or "none")
            )
        if any(self.left_bytes.values()):
            rows.append("left allocated by the builds before (MiB; taken off that column's peak and added to its budget): "
                        + ", ".join(f"{headers[n]} {mib(b)}" for n, b in self.left_bytes.items() if b))  # fmt: skip
        if self.budget_skipped is not None:
            rows.append(f"chunk-offload budget: skipped: {self.budget_skipped}")
        if self.skipped is not None:
            rows.append(f"megatron-core built-in offload: skipped: {self.skipped}")
        elif cpu and self.builtin is not None and self.builtin.bytes_offloaded[-1] == 0:
            rows.append(f"megatron-core {self.megatron_version} copied nothing on CPU (0.19 manages CUDA tensors only)")
        rows += ["chunk-offload against no offload, in detail:", r.format()]
        return "\n".join(rows)


def _yes(flag: bool | None) -> str:
    return "n/a" if flag is None else "yes" if flag else "NO"


def compare_with_megatron(
    shape: GPTShape,
    *,
    pp_size: int,
    pp_rank: int,
    vp_size: int = 1,
    modules: str | Sequence[str],
    num_microbatches: int | None = None,
    iterations: int = 1,
    warmup: int = 1,
    seed: int = 1234,
    config: OffloadConfig | None = None,
    streams: Callable[[], StreamBackend] | None = None,
    skip_builtin: str | None = None,
    budget_bytes: int | Literal["megatron"] | None = None,
    timed_reload_ahead: bool = True,
    host_profile_iterations: int = 1,
) -> Comparison:
    """Replay stage ``pp_rank`` of ``pp_size`` without offload, with chunk-offload and with megatron's own.

    ``skip_builtin``: a reason not to run megatron's path (it is reported as the skip line).
    ``budget_bytes``: also run chunk-offload under this device budget, as training does
    (`replay_under_budget`, with ``timed_reload_ahead``); ``"megatron"``: megatron's measured
    peak (where megatron's path has none, skipped or on CPU, `Comparison.budget_skipped` says so).
    ``streams``: makes the copy streams of each chunk-offload run (its manager closes them; None:
    the device's default). ``config``: the chunk-offload runs' (default `OffloadConfig()`); megatron's
    takes its ``min_offload_bytes``.
    ``host_profile_iterations``: iterations each mode runs under cProfile after its measured ones,
    for the host time row (0: no row). The other arguments are `replay`'s and `megatron_stage`'s.
    """
    import megatron.core

    if not (budget_bytes is None or budget_bytes == "megatron" or (isinstance(budget_bytes, int) and not isinstance(budget_bytes, bool) and budget_bytes >= 0)):
        raise ChunkOffloadError(f"chunk_offload: budget_bytes must be an int >= 0 (bytes), 'megatron' or None, got {budget_bytes!r}")
    modules = canonical_modules(modules)
    config = config or OffloadConfig()
    stage_of = functools.partial(megatron_stage, shape, pp_size=pp_size, pp_rank=pp_rank, vp_size=vp_size, seed=seed)

    def chunk_offload_run() -> dict[str, Any]:
        """What every chunk-offload run takes: its own streams (its manager closes them)."""
        return dict(
            modules=modules, iterations=iterations, warmup=warmup, config=config, keep_tensors=True,
            streams=None if streams is None else streams(), host_profile_iterations=host_profile_iterations,
        )  # fmt: skip

    left: dict[str, int] = {}
    first = device_bytes_left()
    with stage_of() as stage:
        result = replay(stage, num_microbatches=num_microbatches, **chunk_offload_run())
    reason = skip_builtin or builtin_unavailable(modules)
    builtin = None
    if reason is None:
        overrides = builtin_config(modules, min_offload_bytes=config.min_offload_bytes, dtype=shape.dtype)
        left["megatron"] = device_bytes_left() - first
        try:
            with stage_of(config_overrides=overrides) as stage:
                builtin = run_builtin(stage, result.plan, iterations=iterations, warmup=warmup, keep_tensors=True,
                                      host_profile_iterations=host_profile_iterations)  # fmt: skip
        except torch.OutOfMemoryError:
            raise
        except (AssertionError, ValueError, RuntimeError) as e:  # megatron's own refusals are asserts
            logger.debug("megatron-core's built-in offload failed", exc_info=True)
            reason = f"megatron-core raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no message'}"
    comparison = Comparison(replay=result, builtin=builtin, skipped=reason, megatron_version=megatron.core.__version__, left_bytes=left)
    if budget_bytes is None:
        return comparison
    if budget_bytes == "megatron":
        if comparison.megatron_peak_bytes is None:
            comparison.budget_skipped = "megatron's peak is the budget, and megatron's path " + (
                "did not run" if builtin is None else "has no peak on CPU (no device allocator)"
            )
            return comparison
        budget_bytes, comparison.budget_is_megatron_peak = comparison.megatron_peak_bytes, True
    left_before = comparison.left_bytes["chunk_offload_budget"] = device_bytes_left() - first
    with stage_of() as stage:  # the budget is over what the builds before left (`Comparison.left_bytes`)
        comparison.budget = replay_under_budget(
            stage, plan=result.plan, device_budget_bytes=budget_bytes + left_before,
            timed_reload_ahead=timed_reload_ahead, **chunk_offload_run(),
        )  # fmt: skip
    return comparison

