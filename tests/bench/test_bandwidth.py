"""`bench/bandwidth.py` without CUDA: it says it skipped, writes that to its JSON, exits 0;
bad arguments are usage errors. (On a GPU it runs in `bench/gpu_evidence.sh`.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "bandwidth.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # as on a CPU host, also on a GPU one
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=env)


def test_skips_without_cuda(tmp_path: Path) -> None:
    out = tmp_path / "bandwidth.json"
    done = _run("--sizes-mib", "1", "--repeats", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "bandwidth: skipped, CUDA is not available"
    summary = json.loads(out.read_text())
    assert summary["skipped"] == "CUDA is not available" and "results" not in summary


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sizes-mib", "0"], "sizes must be >= 1 MiB, got '0'"),
        (["--sizes-mib", "1,x"], "takes comma-separated integers (MiB), got '1,x'"),
        (["--repeats", "-2"], "--repeats: must be an integer >= 1, got '-2'"),
        (["--json", "/no/such/folder/b.json"], "--json: folder '/no/such/folder' does not exist"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_arguments_are_usage_errors(args: list[str], message: str) -> None:
    done = _run(*args)
    assert done.returncode == 2, done
    assert message in done.stderr and "Traceback" not in done.stderr
