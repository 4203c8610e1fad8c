"""Host time by Python function (cProfile own time), shared by the benches that print where it goes.

`own_times` runs a callable under cProfile and keeps, per function, its calls and its own time
(time spent in the function itself, not in what it calls; a C function such as ``copy_`` or
``Event.record`` counts the driver calls it makes). Over several profiled calls it keeps each
function's median, so that a rare stall (a thread hand-off, a collection) landing in one
function of one step does not rank it. `engine_seconds` adds up what one engine spends: the own
time of the functions in its files and of the C functions they call directly. `over` subtracts
a baseline run's profile, so that what is left is what an engine adds to the host path of the
same training step; `format_rows` prints the heaviest per unit of work.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
from typing import Callable

__all__ = ["FunctionTimes", "engine_seconds", "format_rows", "over", "own_times"]

FunctionTimes = dict[tuple[str, int, str], tuple[float, float]]
"""(file, line, function) -> (calls, own seconds)."""


def _profile(work: Callable[[], object]) -> dict:
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        work()
    finally:
        profiler.disable()
    return pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, own, cumulative, callers)}


def own_times(work: Callable[[], object], *, steps: int = 1, engine: Callable[[str], bool] | None = None) -> tuple[FunctionTimes, float]:
    """Median calls and own seconds of every function over ``steps`` profiled calls of ``work()``;
    and the median seconds the ``engine`` spent (`engine_seconds`; 0.0 without a predicate)."""
    runs = [_profile(work) for _ in range(steps)]
    keys = {key for stats in runs for key in stats}
    times = {
        key: (statistics.median(s[key][1] if key in s else 0 for s in runs), statistics.median(s[key][2] if key in s else 0.0 for s in runs))
        for key in keys
    }
    spent = statistics.median(engine_seconds(stats, engine) for stats in runs) if engine is not None else 0.0
    return times, spent


def engine_seconds(stats: dict, engine: Callable[[str], bool]) -> float:
    """Own time of the functions whose file ``engine`` claims, plus that of the C functions
    (cProfile's file ``~``) each spent directly under one of them."""
    total = 0.0
    for (file, _, _), (_, _, own, _, callers) in stats.items():
        if engine(file):
            total += own
        elif file == "~":
            total += sum(times[2] for (caller_file, _, _), times in callers.items() if engine(caller_file))
    return total


def over(times: FunctionTimes, baseline: FunctionTimes) -> FunctionTimes:
    """``times`` less ``baseline``, function by function (a function absent from either counts 0)."""
    none = (0, 0.0)
    return {key: (times.get(key, none)[0] - baseline.get(key, none)[0], times.get(key, none)[1] - baseline.get(key, none)[1])
            for key in times.keys() | baseline.keys()}  # fmt: skip


def format_rows(times: FunctionTimes, per: float, *, top: int = 20) -> list[str]:
    """The ``top`` functions by own time, in microseconds and calls per ``per`` units of work
    (a group, a layer call): own time, calls, ``function (file:line)``."""
    rows = sorted(times.items(), key=lambda item: item[1][1], reverse=True)[:top]
    return [f"{own * 1e6 / per:10.2f} {calls / per:9.2f}  {name} ({file.rsplit('/', 1)[-1]}:{line})"
            for (file, line, name), (calls, own) in rows]  # fmt: skip
