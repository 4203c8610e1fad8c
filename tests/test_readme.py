"""The README's quick-start commands and the CI entry point that runs them.

CI (``.ci/run``) runs the test command it reads from README.md, so these tests pin down the
README format that both sides rely on. Nothing here imports torch or touches a device.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
README = REPO_ROOT / "README.md"
CI_RUN = REPO_ROOT / ".ci" / "run"

MAIN_HEADING = "### Run the main job"
TESTS_HEADING = "### Run the tests"
TORCH_PIN = "torch==2.13.0"

_FENCE_OPEN = re.compile(r"^```bash\s*$")
_FENCE_CLOSE = re.compile(r"^```\s*$")


def _bash_block_under(text: str, heading: str, *, directly: bool) -> str:
    """Return the body of the first ```bash block in the section that starts at ``heading``.

    With ``directly=True`` only blank lines may separate the heading from the block.
    """
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line == heading]
    assert len(starts) == 1, f"expected exactly one {heading!r} line in README.md, found {len(starts)}"
    i = starts[0] + 1
    while i < len(lines) and not _FENCE_OPEN.match(lines[i]):
        line = lines[i]
        assert not line.startswith("#"), f"no ```bash block under {heading!r} before {line!r}"
        assert not (directly and line.strip()), (
            f"the ```bash block must come directly under {heading!r}; found {line!r} in between"
        )
        i += 1
    assert i < len(lines), f"no ```bash block under {heading!r}"
    body = []
    for line in lines[i + 1 :]:
        if _FENCE_CLOSE.match(line):
            return "\n".join(body)
        body.append(line)
    raise AssertionError(f"the ```bash block under {heading!r} is not closed")


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\s*\n(.*?)^```\s*$", text, flags=re.MULTILINE | re.DOTALL)


@pytest.fixture(scope="module")
def readme_text() -> str:
    return README.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def main_command(readme_text: str) -> str:
    return _bash_block_under(readme_text, MAIN_HEADING, directly=True)


@pytest.fixture(scope="module")
def tests_command(readme_text: str) -> str:
    return _bash_block_under(readme_text, TESTS_HEADING, directly=True)


@pytest.mark.parametrize("fixture_name", ["main_command", "tests_command"])
def test_quick_start_command_is_one_line_with_full_setup(request, fixture_name: str) -> None:
    command = request.getfixturevalue(fixture_name)
    assert "\n" not in command.strip(), f"{fixture_name} must be a single command line: {command!r}"
    assert command.startswith("pip install "), f"{fixture_name} must start with its own set-up: {command!r}"
    assert TORCH_PIN in command.split(), f"{fixture_name} must pin {TORCH_PIN}: {command!r}"
    assert '-e ".[megatron,plot,test]"' in command, command
    assert " && " in command, command


def test_main_command_runs_the_megatron_example_with_pp2_vpp2(main_command: str) -> None:
    run = main_command.split(" && ", 1)[1].split()
    assert run[:3] == ["torchrun", "--nproc-per-node", "2"] and run[3] == "examples/pretrain_gpt.py", main_command
    flags = dict(zip(run[4::2], run[5::2]))
    assert flags["--pipeline-model-parallel-size"] == "2", main_command
    assert flags["--virtual-pipeline-model-parallel-size"] == "2", main_command
    assert flags["--chunk-offload-modules"], main_command


def test_tests_command_runs_pytest_on_tests(tests_command: str) -> None:
    assert " && python -m pytest -q tests && " in tests_command, tests_command
    # then the Megatron-dependent tests again against the newest megatron-core, in their own venv
    assert tests_command.endswith(" && bash tests/run_megatron_019.sh"), tests_command
    assert (REPO_ROOT / "tests" / "run_megatron_019.sh").is_file()


def test_every_pip_install_in_readme_pins_torch(readme_text: str) -> None:
    # A pip install without the exact pin can resolve a CUDA torch and download gigabytes.
    installs = [
        line
        for block in _bash_blocks(readme_text)
        for line in block.splitlines()
        if "pip install" in line
    ]
    assert installs, "README.md has no pip install command"
    for line in installs:
        assert TORCH_PIN in line.split(), f"pip install without {TORCH_PIN}: {line!r}"
    loose = re.findall(r"torch\s*(?:>=|~=|<=|>|<|!=)\s*[0-9.]+", readme_text)
    loose = [spec for spec in loose if not spec.startswith("torch>=2.6")]  # the runtime floor
    assert not loose, f"loose torch requirement in README.md: {loose}"


def test_ci_run_is_an_executable_strict_bash_script() -> None:
    assert CI_RUN.is_file()
    assert CI_RUN.stat().st_mode & stat.S_IXUSR, ".ci/run must be executable"
    text = CI_RUN.read_text(encoding="utf-8")
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text


def test_ci_run_prints_exactly_the_readme_tests_command(tests_command: str) -> None:
    out = subprocess.run(
        ["bash", str(CI_RUN), "--print-command"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.rstrip("\n") == tests_command


# The runs below use a copy of .ci/run next to a throwaway README, so they execute a harmless
# command instead of the real test suite.


def _run_ci_copy(tmp_path: Path, command: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / ".ci").mkdir()
    shutil.copy2(CI_RUN, tmp_path / ".ci" / "run")
    (tmp_path / "README.md").write_text(
        f"# x\n\n{MAIN_HEADING}\n\n```bash\nfalse\n```\n\n{TESTS_HEADING}\n\n```bash\n{command}\n```\n",
        encoding="utf-8",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run(
        ["bash", str(tmp_path / ".ci" / "run"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )


def test_ci_run_runs_the_command_from_the_repo_root(tmp_path: Path) -> None:
    result = _run_ci_copy(tmp_path, "test -f README.md && echo ran-it")
    assert result.returncode == 0, result.stderr
    assert "+ test -f README.md && echo ran-it" in result.stdout
    assert "ran-it" in result.stdout


def test_ci_run_treats_no_tests_collected_as_failure(tmp_path: Path) -> None:
    result = _run_ci_copy(tmp_path, "exit 5")
    assert result.returncode == 5
    assert "no tests" in result.stderr


def test_ci_run_propagates_failure(tmp_path: Path) -> None:
    result = _run_ci_copy(tmp_path, "exit 3")
    assert result.returncode == 3
    assert "exited with code 3" in result.stderr


def test_ci_run_fails_without_tests_heading(tmp_path: Path) -> None:
    result = _run_ci_copy(tmp_path, "true")
    assert result.returncode == 0
    (tmp_path / "README.md").write_text("# nothing here\n", encoding="utf-8")
    result = subprocess.run(
        ["bash", str(tmp_path / ".ci" / "run"), "--print-command"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert TESTS_HEADING in result.stderr
