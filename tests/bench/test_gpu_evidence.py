"""`bench/gpu_evidence.sh` on a CPU host: argument parsing, the dry run, and its step plumbing.

The dry run (and a run without CUDA) prints every step with its time limit and writes nothing;
bad arguments are usage errors (exit 2). The plumbing is checked with a stand-in Python that
says CUDA is there and fails one step: the other steps still run, every step's output lands in
evidence.log, summary.txt says which step failed, and the exit status is 1.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_evidence.sh"
STEPS = ("install", "env", "tests", "sanitizer", "sanitizer_pp4", "replay_last", "replay_coplan", "overhead", "replay", "compare",
         "compare_host", "bandwidth")  # fmt: skip
BESIDE = ("tests", "sanitizer", "sanitizer_pp4", "replay_last", "replay_coplan")  # no timing: run side by side

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")


def _run(*args: str, cwd: Path = ROOT, python: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": python or sys.executable}
    env.pop("OUT", None)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=env, cwd=cwd)


def test_dry_run_lists_every_step_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "evidence"
    done = _run("--dry-run", "--out", str(out))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "dry run: nothing is run" and lines[1] == f"output folder: {out}"
    assert [line.split()[0] for line in lines[2:-1]] == list(STEPS)
    limits = {line.split()[0]: int(line.split("(limit ")[1].split("s")[0]) for line in lines[2:-1]}
    assert [line.split()[0] for line in lines[2:-1] if "s, side by side)" in line.split(":")[0]] == list(BESIDE)
    most = sum(n for name, n in limits.items() if name not in BESIDE) + max(limits[name] for name in BESIDE)
    assert lines[-1] == f"budget: 540s for every step together; by their limits at most {most}s (the side-by-side steps by the longest)"
    assert "TORCH_CUDA_SANITIZER=1" in lines[2 + STEPS.index("sanitizer")]
    assert "--pp 4 --vpp 2 --stage 0" in lines[2 + STEPS.index("replay")]
    assert "--modules attn_norm,qkv_linear --recompute-modules core_attn" in lines[2 + STEPS.index("replay_coplan")]
    assert not out.exists()


def test_without_cuda_it_prints_the_plan_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "evidence"
    done = _run("--out", str(out), "--only", "tests,replay")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].startswith("no CUDA device")
    assert [line.split()[0] for line in done.stdout.splitlines()[2:-1]] == ["tests", "replay"]
    assert not out.exists()


def test_relative_out_is_relative_to_the_caller(tmp_path: Path) -> None:
    done = _run("--dry-run", "--out", "here", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"output folder: {tmp_path / 'here'}" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bogus"], "unknown argument '--bogus'"),
        (["--out"], "--out needs a value"),
        (["--out", "--dry-run"], "--out needs a value"),
        (["--only", "tests,nope"], "--only: unknown step 'nope'"),
        (["--budget", "0"], "--budget: expected a whole number of seconds >= 1, got '0'"),
        (["--budget=9m"], "--budget: expected a whole number of seconds >= 1, got '9m'"),
        (["--budget"], "--budget needs a value"),
    ],
)
def test_bad_arguments_are_usage_errors(args: list[str], message: str) -> None:
    done = _run(*args)
    assert done.returncode == 2
    assert message in done.stderr and "usage: bash bench/gpu_evidence.sh" in done.stderr


def test_help() -> None:
    done = _run("--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: bash bench/gpu_evidence.sh")


def test_a_failing_step_does_not_stop_the_others(tmp_path: Path) -> None:
    """A stand-in Python: CUDA 'available', bench/bandwidth.py fails, the rest is the real Python."""
    fake = _stand_in(tmp_path, 'echo "bandwidth stand-in fails"; exit 7')
    out = tmp_path / "evidence"
    done = _run("--out", str(out), "--only", "bandwidth,env", python=str(fake))
    assert done.returncode == 1, done.stdout + done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["evidence.log", "summary.txt"]
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0] == f"# bash bench/gpu_evidence.sh --out {out} --only bandwidth,env"
    assert [row.split()[:2] for row in summary[1:]] == [["env", "ok"], ["bandwidth", "failed"], ["(total)", "every"]]
    assert "(exit 7)" in summary[2] and summary[3].endswith("s of 540s")
    log = (out / "evidence.log").read_text()
    assert "=== step env: print_environment" in log and "command: bash bench/gpu_evidence.sh" in log
    assert f"torch {__import__('torch').__version__}" in log
    assert "bandwidth stand-in fails" in log and "=== limit 30s" in log


def _stand_in(tmp_path: Path, bandwidth: str, others: str = "") -> Path:
    """A Python for which CUDA is 'available' and bench/bandwidth.py runs ``bandwidth`` (bash), then
    the bash lines ``others``; the rest is the real one."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$*" == *"torch.cuda.is_available"* ]]; then exit 0; fi\n'
        f'if [[ "$*" == *bench/bandwidth.py* ]]; then {bandwidth}; fi\n{others}'
        f'exec {sys.executable} "$@"\n'
    )
    fake.chmod(0o755)
    return fake


def test_a_step_gets_at_most_what_is_left_of_the_budget(tmp_path: Path) -> None:
    """bandwidth's own limit is 30 s; with a budget of 16 s it is stopped at 16 s or less."""
    out = tmp_path / "evidence"
    done = _run("--out", str(out), "--only", "bandwidth", "--budget", "16", python=str(_stand_in(tmp_path, "sleep 40")))
    assert done.returncode == 1, done.stdout + done.stderr
    row = (out / "summary.txt").read_text().splitlines()[1].split()
    assert row[:2] == ["bandwidth", "timed"] and int(row[-1].removesuffix("s")) <= 16


def test_steps_without_enough_budget_left_are_skipped_and_listed(tmp_path: Path) -> None:
    out = tmp_path / "evidence"
    done = _run("--out", str(out), "--only", "env,bandwidth", "--budget", "14", python=str(_stand_in(tmp_path, "exit 0")))
    assert done.returncode == 1, done.stdout + done.stderr
    rows = [row.split()[:3] for row in (out / "summary.txt").read_text().splitlines()[1:]]
    assert rows == [["env", "skipped", "(budget)"], ["bandwidth", "skipped", "(budget)"], ["(total)", "every", "step"]]
    log = (out / "evidence.log").read_text()
    # 14 s left at the first step, 13 where the clock's second turned since the steps began
    assert re.search(r"=== step env: print_environment\n=== skipped: 1[34]s of the 14s budget left \(under 15s\)", log), log


def test_the_steps_that_time_nothing_run_side_by_side(tmp_path: Path) -> None:
    """tests, sanitizer and replay_coplan start together, each under its own limit; their outputs
    and rows follow in the usual order; one failing does not stop the others, nor the step after."""
    spans = tmp_path / "spans"
    fake = _stand_in(tmp_path, 'echo "bandwidth after them"; exit 0', (
        'if [[ "$*" == *"-m pytest"* || "$*" == *chunk_offload.replay* ]]; then\n'
        f'  echo "start $(date +%s.%N)" >>{spans}; sleep 2; echo "end $(date +%s.%N)" >>{spans}\n'
        '  echo "stand-in for: $*"; [[ -n "${TORCH_CUDA_SANITIZER:-}" ]] && exit 7; exit 0\n'
        "fi\n"
    ))
    out = tmp_path / "evidence"
    done = _run("--out", str(out), "--only", "bandwidth,replay_coplan,sanitizer,tests", python=str(fake))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "=== side by side: tests sanitizer replay_coplan" in done.stdout
    rows = [row.split() for row in (out / "summary.txt").read_text().splitlines()[1:]]
    assert [row[:2] for row in rows] == [["tests", "ok"], ["sanitizer", "failed"], ["replay_coplan", "ok"], ["(beside)", "the"],
                                         ["bandwidth", "ok"], ["(total)", "every"]]  # fmt: skip
    assert [row[-1] for row in rows[:3]] == ["90s", "150s", "90s"]  # each its own limit
    # The side-by-side steps' wall: the longest of them, not their sum (each sleeps 2 s).
    seconds = [int(row[row.index("of") - 1].removesuffix("s")) if "of" in row else int(row[-1].removesuffix("s")) for row in rows]
    assert rows[3][1:5] == ["the", "3", "above,", "side"] and seconds[3] < sum(seconds[:3])
    times = [line.split() for line in spans.read_text().splitlines()]
    starts, ends = [float(t) for k, t in times if k == "start"], [float(t) for k, t in times if k == "end"]
    assert len(starts) == 3 and max(starts) < min(ends), times  # all three ran at once
    log = (out / "evidence.log").read_text()
    steps = [log.index(f"=== step {name}:") for name in ("tests", "sanitizer", "replay_coplan", "bandwidth")]
    assert steps == sorted(steps) and "stand-in for: -m pytest" in log and "bandwidth after them" in log
