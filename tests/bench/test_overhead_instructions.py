"""`bench/overhead_instructions.py`: usage errors, the skip without valgrind, and one tiny counted run.

The counts depend on the host's CPU and libraries; the test checks that each mode was counted
(plain autograd and the floor cost instructions, the floor more than plain, layer groups with
copies more than bookkeeping) and that the printed ratios are the quotients of the printed
per-group counts.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ._scripts import run_bench_script


def _run(*args: str, path: str | None = None) -> subprocess.CompletedProcess:
    return run_bench_script("overhead_instructions", *args, timeout=900, path=path)


def test_bad_argument_is_a_usage_error() -> None:
    done = _run("--iterations", "0")
    assert done.returncode == 2
    assert "--iterations: must be an integer >= 1, got '0'" in done.stderr
    assert "Traceback" not in done.stderr


def test_modules_per_layer_below_one_is_a_usage_error() -> None:
    done = _run("--modules-per-layer", "0")
    assert done.returncode == 2
    assert "--modules-per-layer: must be an integer >= 1, got '0'" in done.stderr
    assert "Traceback" not in done.stderr


def test_skips_cleanly_without_valgrind(tmp_path: Path) -> None:
    done = _run("--layers", "2", path=str(tmp_path))  # an empty PATH: no valgrind
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "skipped: valgrind, callgrind_control not found (install valgrind to count instructions)"


@pytest.mark.skipif(shutil.which("valgrind") is None or shutil.which("callgrind_control") is None, reason="needs valgrind")
def test_counts_each_mode_and_prints_the_ratio() -> None:
    done = _run("--layers", "4", "--iterations", "1", "--modules-per-layer", "2", "--modes", "bookkeeping", "offload_layer")
    assert done.returncode == 0, done.stderr
    rows = {}
    for mode in ("plain", "floor", "bookkeeping", "offload_layer"):  # plain and floor are added to the modes asked
        match = re.search(rf"^{mode}\s+([0-9,]+)\s+(-?[0-9,]+)$", done.stdout, re.M)
        assert match, f"no row for {mode}:\n{done.stdout}"
        rows[mode] = [int(v.replace(",", "")) for v in match.groups()]
    assert rows["plain"][0] > 0 and rows["plain"][1] == 0
    assert rows["floor"][1] > 0, f"the floor costs no instructions over plain autograd:\n{done.stdout}"
    match = re.search(r"^bookkeeping / floor \(instructions per group over plain\): ([0-9.]+)$", done.stdout, re.M)
    assert match, done.stdout
    assert float(match.group(1)) == pytest.approx(rows["bookkeeping"][1] / rows["floor"][1], abs=0.002)
    match = re.search(r"^offload_layer / bookkeeping \(instructions per group over plain\): ([0-9.]+)$", done.stdout, re.M)
    assert match, done.stdout
    assert float(match.group(1)) == pytest.approx(rows["offload_layer"][1] / rows["bookkeeping"][1], abs=0.002)
    assert rows["offload_layer"][1] > rows["bookkeeping"][1], f"layer groups copy, bookkeeping does not:\n{done.stdout}"
