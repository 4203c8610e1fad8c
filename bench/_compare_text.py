"""What `bench/megatron_compare.py` prints (its table of runs and, with ``--profile``, each run's
host time over the run without offload) and writes (``--json``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from chunk_offload.devkit.host_profile import format_rows

__all__ = ["format_profiles", "format_table", "write_json"]

_GB = 1e9


def format_profiles(rows: list[dict[str, Any]], layer_calls: int) -> list[str]:
    """Each run's host time over 'none' by function (`--profile`): what the engine adds to one step."""
    lines = ["host profile (--profile; cProfile slows every Python call: compare the runs, not with the step times): "
             f"per layer call (one layer's forward and backward of one microbatch; {layer_calls} per step), median of the "
             "profiled steps: the engine's own host time (its functions and the C calls they make), then the functions "
             "adding most own time over 'none' (us, calls)"]  # fmt: skip
    for r in rows:
        added = r.get("_host_added")
        if added is None:
            continue
        lines.append(f"{r['modules']} / {r['run']}: engine {r['engine_host_ms'] * 1e3 / layer_calls:.1f} us per layer call")
        lines.extend(format_rows(added, layer_calls, top=15))
        if r["_api_added"]:
            lines.append("  CUDA API calls added over 'none' (torch.profiler: host us, calls per layer call):")
            lines.extend(format_rows(r["_api_added"], layer_calls, top=10))
    if not torch.cuda.is_available():
        lines.append("CUDA API calls (torch.profiler): none without CUDA")
    return lines


def format_table(rows: list[dict[str, Any]], device: str, *, deterministic: bool = False, cpu_copies: str = "inline") -> str:
    """One line per run (one ``skipped`` or ``failed`` line for a run that could not run or failed),
    then what the columns measure (``deterministic``: every run on deterministic kernels; ``cpu_copies``:
    ``--cpu-copies``)."""
    def gb(value: int | None) -> str:
        return "n/a" if value is None else f"{value / _GB:.4g}"

    w, rw = 2 + max(len(r["modules"]) for r in rows), 2 + max(len(r["run"]) for r in rows)
    lines = [f"{'modules':<{w}}{'run':<{rw}}{'peak GB':>9}{'median ms':>11}{'min ms':>9}{'overhead':>10}{'min ovh':>9}{'GB copied':>11}"
             f"{'losses =':>10}{'grads =':>9}{'wait ms':>9}{'gc ms':>8}"]  # fmt: skip
    for r in rows:
        if "skipped" in r or "failed" in r:
            why = "skipped" if "skipped" in r else "failed"
            lines.append(f"{r['modules']:<{w}}{r['run']:<{rw}}{why}: {r[why]}")
            continue
        lines.append(
            f"{r['modules']:<{w}}{r['run']:<{rw}}{gb(r['peak_bytes']):>9}{r['median_step_s'] * 1e3:>11.2f}{r['min_step_s'] * 1e3:>9.2f}"
            f"{r['overhead'] * 100:>9.1f}%{r['overhead_min'] * 100:>8.1f}%{gb(r['bytes_copied']):>11}"
            f"{'yes' if r['losses_identical'] else 'no':>10}{'yes' if r['grads_identical'] else 'no':>9}"
            f"{'n/a' if r['compute_wait_ms'] is None else format(r['compute_wait_ms'], '.2f'):>9}{r['gc_ms']:>8.2f}"
        )
    lines.extend(_against_megatron(rows))
    cpu = device == "cpu"
    lines.append("peak: " + ("CPU has no device allocator: chunk-offload's accounting of saved bytes, n/a for the others"
                             if cpu else "torch.cuda.max_memory_allocated per iteration (max over measured iterations)"))  # fmt: skip
    left = [f"{r['modules']} / {r['run']} {gb(r['left_bytes'])}" for r in rows if r.get("left_bytes")]
    if left:
        lines.append("left allocated by the runs before (GB; taken off that run's peak and added to its budget): " + ", ".join(left))
    shared = [r for r in rows if "same_run_as" in r]
    if shared:
        lines.append(f"none: one run, shown in every module set (it offloads nothing): the run of {shared[0]['same_run_as']}")
    lines.append("overhead: median step over 'none''s; min ovh: fastest step over 'none''s (less moved by a busy host)"
                 + ("; with 'none again': over the mean of both medians, and the faster fastest step" if any(r["run"] == "none again" for r in rows) else ""))
    if cpu:
        lines.append(f"chunk-offload's copies on CPU: {'inline on the calling thread, as megatron copies on CPU' if cpu_copies == 'inline' else 'on its CPU streams worker threads'} "
                     "(--cpu-copies; NOTE [Copies on CPU] in bench/megatron_compare.py)")  # fmt: skip
    timed = sorted({r["timed_reload_ahead"] for r in rows if r.get("timed_reload_ahead") is not None})
    if timed:
        lines.append("chunk-offload's reloads: " + " / ".join("ahead by the last iteration's copy timing" if t else "one group ahead" for t in timed)
                     + " (timed_reload_ahead; by default timed on CUDA only)")
    lines.append("wait ms: chunk-offload's compute waits on its copies per iteration (median), n/a for the others; "
                 "gc ms: the garbage collector's time per step (median)")
    kernels = (" (deterministic kernels, --deterministic: a difference is the offload's)" if deterministic
               else "" if cpu else " (CUDA: flash attention backward is not deterministic, grads may differ without offload)")  # fmt: skip
    lines.append("losses: first measured iteration; grads: last one; torch.equal against 'none'" + kernels)
    return "\n".join(lines)


def _against_megatron(rows: list[dict[str, Any]]) -> list[str]:
    """Per chunk-offload run, its overheads over megatron's in the same set (issue 26's target:
    at most 0.5 in the host-bound configuration, at a peak at or below megatron's)."""
    def times(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f}x"

    lines = []
    for r in rows:
        against = r.get("vs_megatron")
        if against is None:
            continue
        peak = {None: "peak: no device peak to compare", True: "peak at or below megatron's", False: "peak above megatron's"}
        lines.append(f"{r['modules']} / {r['run']}: overhead {times(against['overhead'])} megatron's (fastest step "
                     f"{times(against['overhead_min'])}), {peak[against['peak_at_or_below']]}")  # fmt: skip
    return lines


def write_json(args: argparse.Namespace, rows: list[dict[str, Any]], device: str, *, complete: bool) -> None:
    """``--json``: the rows so far (``complete``: every set and profile ran); after each run too, for a comparison a limit stops."""
    if args.json is None:
        return
    from megatron.core import __version__ as megatron_core_version

    args.json.parent.mkdir(parents=True, exist_ok=True)
    public = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    for row, r in zip(public, rows):
        if r.get("_host_added") is not None:  # the 15 functions adding most host time, seconds per step
            heaviest = sorted(r["_host_added"].items(), key=lambda item: item[1][1], reverse=True)[:15]
            row["host_added_s"] = {f"{name} ({file}:{line})": own for (file, line, name), (_, own) in heaviest}
            # Every CUDA API call's change over 'none', per step: [calls, host seconds].
            row["cuda_api_added"] = {name: [calls, seconds] for (_, _, name), (calls, seconds) in r["_api_added"].items()}
    args.json.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                     "device": device, "megatron_core": megatron_core_version, "complete": complete,
                                     "rows": public}, indent=2))  # fmt: skip
