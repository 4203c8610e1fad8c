"""`bench/budget_reload.py` on one configuration: both runs printed, within the budget, bit-identical.

The waits depend on the host; the test checks the rows (one per run, the peak within the printed
budget, gradients equal to a run without offload) and that the printed ratio is the quotient of
the printed waits. Bad arguments are usage errors (exit status 2).
"""

from __future__ import annotations

import re
import subprocess

import pytest

from ._scripts import run_bench_script


def _run(*args: str) -> subprocess.CompletedProcess:
    return run_bench_script("budget_reload", *args)


def test_prints_both_runs_within_the_budget_and_the_ratio() -> None:
    done = _run("--configs", "pp2", "--iterations", "3")
    assert done.returncode == 0, done.stderr
    waits = {}
    for run in ("one ahead", "timed"):
        match = re.search(rf"^pp2\s+{run}\s+(\d+)\s+(\d+)\s+(\d+)\s+([0-9.]+)  (yes|NO)$", done.stdout, re.M)
        assert match, f"no row for {run}:\n{done.stdout}"
        budget, peak, copied, wait, equal = match.groups()
        assert int(peak) <= int(budget) and int(copied) > 0 and equal == "yes", match.group(0)
        waits[run] = float(wait)
    match = re.search(r"^pp2\s+one ahead / timed wait: ([0-9.]+|inf)$", done.stdout, re.M)
    assert match, done.stdout
    if waits["timed"] > 0.05:  # printed to 0.1 ms: the quotient of the rounded waits is only near
        assert float(match.group(1)) == pytest.approx(waits["one ahead"] / waits["timed"], rel=0.5)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--iterations", "2"], "--iterations must be an integer >= 3"),
        (["--fraction", "1.5"], "--fraction must be in [0, 1], got 1.5"),
        (["--configs", "pp3"], "argument --configs: invalid choice: 'pp3'"),
    ],
)
def test_usage_errors(args: list[str], message: str) -> None:
    done = _run(*args)
    assert done.returncode == 2 and message in done.stderr, done.stderr
