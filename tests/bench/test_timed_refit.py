"""`bench/timed_refit.py`: one row per rank, the derivations counted both ways; bad arguments are usage errors.

CPU times depend on the host; the test checks the counts, which follow from the seeded jitter and
`CopyTiming.close_to`: identical timings are derived once, timings jittered by half never twice alike.
"""

from __future__ import annotations

import subprocess

import pytest

from ._scripts import run_bench_script


def _run(*args: str) -> subprocess.CompletedProcess:
    return run_bench_script("timed_refit", *args)


def _row(stdout: str, rank: int) -> list[str]:
    rows = [line.split() for line in stdout.splitlines() if line.split()[:1] == [str(rank)]]
    assert len(rows) == 1, stdout
    return rows[0]


@pytest.mark.parametrize(("jitter", "held"), [("0", 1), ("0.5", 3)])
def test_derivations_every_time_and_held(jitter: str, held: int) -> None:
    done = _run("--ranks", "7", "--iterations", "3", "--jitter", jitter)
    assert done.returncode == 0, done.stderr
    rank, with_timing, without, every, kept, every_s, held_s, ratio = _row(done.stdout, 7)
    assert (int(every), int(kept)) == (3, held)
    assert float(with_timing) > 0 and float(without) >= 0 and float(held_s) <= float(every_s)
    assert float(ratio) == 1.0 if held == 3 else float(ratio) > 1.0  # every time over held: the same derivations, or more
    assert "ratio: every time / held" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--iterations", "0"], "--iterations must be an integer >= 1, got 0"),
        (["--jitter", "1"], "--jitter must be in [0, 1), got 1.0"),
        (["--link-gbs", "0"], "--link-gbs must be > 0, got 0.0"),
        (["--ranks", "8"], "argument --ranks: invalid choice: 8"),
    ],
)
def test_bad_arguments_are_usage_errors(args: list[str], message: str) -> None:
    done = _run(*args)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
