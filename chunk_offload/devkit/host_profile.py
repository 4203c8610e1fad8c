"""Host time by Python function (cProfile own time), shared by the replay's comparison and the benches.

`own_times` runs a callable under cProfile and keeps, per function, its calls and its own time
(time spent in the function itself, not in what it calls; a C function such as ``copy_`` or
``Event.record`` counts the driver calls it makes). Over several profiled calls it keeps each
function's median, so that a rare stall (a thread hand-off, a collection) landing in one
function of one step does not rank it. `engine_seconds` adds up what one engine spends: the own
time of the functions in its files (`engine_files`: chunk-offload's or megatron-core's offload)
and of the C functions they call directly. cProfile sees the calling thread only: work that CPU
copy streams do on their worker threads is not in it. Autograd runs the backward of CUDA tensors
on a worker thread of that device, which would hide backward's hooks and both engines' reloads;
so the profiled calls run with multithreaded backward off
(`torch.autograd.set_multithreading_enabled`), backward then on the calling thread with the same
work. `over` subtracts a baseline run's profile, so that what is left is what an engine adds to
the host path of the same training step; `format_rows` prints the heaviest per unit of work.
`api_times` counts, with torch.profiler, the CUDA runtime and driver calls a step makes, which cProfile sees only inside
the Python calls that make them (the copies' ``cudaMemcpyAsync``, event records, stream waits, the
caching allocators' calls, host-device synchronisations); its rows take the same `over` and
`format_rows`. `GcClock` times the garbage collector's runs, which no function owns.
"""

from __future__ import annotations

import cProfile
import gc
import logging
import pstats
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch.autograd import DeviceType

__all__ = [
    "API_FILE",
    "ENGINES",
    "EngineHostTime",
    "FunctionTimes",
    "GcClock",
    "ProfilerUnavailable",
    "api_calls",
    "api_times",
    "engine_files",
    "engine_functions",
    "engine_host_time",
    "engine_seconds",
    "format_rows",
    "over",
    "own_times",
]

logger = logging.getLogger(__name__)

FunctionTimes = dict[tuple[str, int, str], tuple[float, float]]
"""(file, line, function) -> (calls, own seconds)."""


class ProfilerUnavailable(RuntimeError):
    """cProfile could not start: another profiler is active (Python 3.12 refuses a second one)."""


def _profile(work: Callable[[], object]) -> dict:
    profiler = cProfile.Profile()
    try:
        profiler.enable()
    except ValueError as e:  # "Another profiling tool is already active"; ``work`` did not run
        raise ProfilerUnavailable(f"cProfile cannot start: {e}") from e
    try:
        with torch.autograd.set_multithreading_enabled(False):  # backward on this thread, in the profile
            work()
    finally:
        profiler.disable()
    return pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, own, cumulative, callers)}


def own_times(work: Callable[[], object], *, steps: int = 1, engine: Callable[[str], bool] | None = None) -> tuple[FunctionTimes, float]:
    """Median calls and own seconds of every function over ``steps`` profiled calls of ``work()``;
    and the median seconds the ``engine`` spent (`engine_seconds`; 0.0 without a predicate)."""
    runs = [_profile(work) for _ in range(steps)]
    times = _medians([{key: (calls, own) for key, (_, calls, own, _, _) in stats.items()} for stats in runs])
    spent = statistics.median(engine_seconds(stats, engine) for stats in runs) if engine is not None else 0.0
    return times, spent


def _medians(runs: list[FunctionTimes]) -> FunctionTimes:
    """Per key, the median calls and seconds over ``runs`` (a key absent from a run counts 0 there)."""
    keys = {key for run in runs for key in run}
    none = (0, 0.0)
    return {key: (statistics.median(run.get(key, none)[0] for run in runs), statistics.median(run.get(key, none)[1] for run in runs))
            for key in keys}  # fmt: skip


API_FILE = "CUDA API"
"""The file part of `api_times`' keys: ``(API_FILE, 0, "cudaMemcpyAsync")``."""


def api_times(work: Callable[[], object], *, steps: int = 1) -> FunctionTimes:
    """Median calls and host seconds of each CUDA runtime or driver call made during ``work()``,
    over ``steps`` calls under torch.profiler; empty without CUDA (nothing to count)."""
    if not torch.cuda.is_available():
        return {}
    from torch.profiler import ProfilerActivity, profile

    runs = []
    for _ in range(steps):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            work()
        runs.append(api_calls(prof.key_averages()))
    return _medians(runs)


def api_calls(averages: Iterable) -> FunctionTimes:
    """The CUDA API rows of torch.profiler's ``key_averages()``: host-side events named ``cu...``
    (``cudaMemcpyAsync``, ``cuLaunchKernel``), keyed ``(API_FILE, 0, name)`` with (calls, host seconds);
    device-side activities (kernels, memcpys on the GPU's timeline) and operators are left out."""
    return {(API_FILE, 0, e.key): (e.count, e.cpu_time_total / 1e6)
            for e in averages if e.device_type == DeviceType.CPU and e.key.startswith("cu")}  # fmt: skip


ENGINES = ("chunk_offload", "megatron")
"""The offload engines `engine_files` knows."""


def engine_files(engine: str) -> Callable[[str], bool]:
    """Which source files are ``engine``'s, for `engine_seconds` and `own_times`: chunk-offload's
    package less its development kit and replay (they drive the model, they are not the engine),
    or megatron-core's fine-grained activation offloading module."""
    if engine == "chunk_offload":
        return lambda file: "/chunk_offload/" in file and not any(f"/chunk_offload/{part}/" in file for part in ("devkit", "replay"))
    if engine == "megatron":
        return lambda file: file.endswith("fine_grained_activation_offload.py")
    raise ValueError(f"engine_files: engine must be one of {', '.join(ENGINES)}, got {engine!r}")


@dataclass(frozen=True)
class EngineHostTime:
    """What one engine's code cost the host per profiled call (`engine_host_time`)."""

    seconds: float
    """Median seconds over the profiled calls (`engine_seconds`)."""
    functions: FunctionTimes
    """Median calls and seconds by function (`engine_functions`): where those seconds go."""


def engine_host_time(work: Callable[[], object], steps: int, engine: str) -> EngineHostTime | None:
    """The host time ``engine`` (`engine_files`) spends in a call of ``work()``, over ``steps``
    profiled calls; None when ``steps`` is 0 or cProfile cannot start (another profiler runs the
    process: a warning says so, and nothing is profiled)."""
    if not steps:
        return None
    claims = engine_files(engine)
    try:
        runs = [engine_functions(_profile(work), claims) for _ in range(steps)]
    except ProfilerUnavailable as e:
        logger.warning("%s's host time is not measured: %s", engine, e)
        return None
    return EngineHostTime(seconds=statistics.median(_total(run) for run in runs), functions=_medians(runs))


def engine_functions(stats: dict, engine: Callable[[str], bool]) -> FunctionTimes:
    """Calls and own seconds of the functions whose file ``engine`` claims, and of the C functions
    (cProfile's file ``~``) counting only their calls made directly from one of those."""
    functions: FunctionTimes = {}
    for key, (_, calls, own, _, callers) in stats.items():
        if engine(key[0]):
            functions[key] = (calls, own)
        elif key[0] == "~":
            mine = [times for (caller_file, _, _), times in callers.items() if engine(caller_file)]
            if mine:
                functions[key] = (sum(times[1] for times in mine), sum(times[2] for times in mine))
    return functions


def engine_seconds(stats: dict, engine: Callable[[str], bool]) -> float:
    """Own time of the functions whose file ``engine`` claims, plus that of the C functions
    (cProfile's file ``~``) each spent directly under one of them."""
    return _total(engine_functions(stats, engine))


def _total(functions: FunctionTimes) -> float:
    return sum(own for _, own in functions.values())


def over(times: FunctionTimes, baseline: FunctionTimes) -> FunctionTimes:
    """``times`` less ``baseline``, function by function (a function absent from either counts 0)."""
    none = (0, 0.0)
    return {key: (times.get(key, none)[0] - baseline.get(key, none)[0], times.get(key, none)[1] - baseline.get(key, none)[1])
            for key in times.keys() | baseline.keys()}  # fmt: skip


def format_rows(times: FunctionTimes, per: float, *, top: int = 20) -> list[str]:
    """The ``top`` functions by own time, in microseconds and calls per ``per`` units of work
    (a group, a layer call): own time, calls, ``function (file:line)`` (a CUDA API call: its name)."""
    rows = sorted(times.items(), key=lambda item: item[1][1], reverse=True)[:top]
    return [f"{own * 1e6 / per:10.2f} {calls / per:9.2f}  {name}" + ("" if file == API_FILE else f" ({file.rsplit('/', 1)[-1]}:{line})")
            for (file, line, name), (calls, own) in rows]  # fmt: skip


class GcClock:
    """Collections by generation and seconds the garbage collector ran while entered (``gc.callbacks``):
    host time that no function's profile shows as its own (a collection runs inside whatever
    allocation crosses the threshold), and that grows with the objects an engine makes per step."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.seconds = 0.0
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.collections[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._start

    def __enter__(self) -> "GcClock":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)
