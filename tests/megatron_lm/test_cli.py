"""``python -m chunk_offload.megatron_lm``: usage errors, and a script run as ``__main__``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _launch(*argv: str, cwd: Path, **env_vars: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), **env_vars}
    return subprocess.run([sys.executable, "-m", "chunk_offload.megatron_lm", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_missing_script_is_a_usage_error(tmp_path: Path) -> None:
    proc = _launch(cwd=tmp_path)
    assert proc.returncode == 2
    assert "the following arguments are required: script" in proc.stderr


def test_script_that_is_not_a_file_is_a_usage_error(tmp_path: Path) -> None:
    proc = _launch("no_such_pretrain_gpt.py", "--num-layers", "2", cwd=tmp_path)
    assert proc.returncode == 2
    assert "script 'no_such_pretrain_gpt.py' is not a file" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_script_runs_as_main_with_its_folder_on_path_and_its_arguments(tmp_path: Path) -> None:
    folder = tmp_path / "megatron_lm_checkout"
    folder.mkdir()
    (folder / "helper_next_to_script.py").write_text("VALUE = 'imported from the script folder'\n")
    (folder / "train.py").write_text(
        "import sys\n"
        "from helper_next_to_script import VALUE\n"
        "if __name__ == '__main__':\n"
        "    print(VALUE, sys.argv[1:], sys.argv[0].endswith('train.py'))\n"
    )
    proc = _launch(str(folder / "train.py"), "--num-layers", "2", "--chunk-offload-modules", "core_attn", cwd=tmp_path)
    if importlib.util.find_spec("megatron.training") is None:  # megatron-core 0.16.1: no megatron.training
        assert proc.returncode == 1, proc.stderr
        assert "the launcher needs Megatron-LM's megatron.training" in proc.stderr
        assert "Traceback" not in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    assert "imported from the script folder ['--num-layers', '2', '--chunk-offload-modules', 'core_attn'] True" in proc.stdout


# Megatron-LM's megatron/core/datasets/Makefile (core_v0.16 to core_v0.19).
MAKEFILE = """CXXFLAGS += -O3 -Wall -shared -std=c++17 -fPIC -fdiagnostics-color
CPPFLAGS += $(shell python3 -m pybind11 --includes)

LIBNAME = helpers_cpp
LIBEXT = $(shell python3-config --extension-suffix)

OUT = $(LIBNAME)$(LIBEXT)
SRC = helpers.cpp

default: $(OUT)

$(OUT): $(SRC)
\t$(CXX) $(CXXFLAGS) $(CPPFLAGS) $< -o $@
"""


def test_a_checkout_whose_dataset_helpers_cannot_be_built_fails_before_any_work(tmp_path: Path) -> None:
    """Run from inside a Megatron-LM checkout (its megatron.core first on the path, helpers.cpp not built yet)
    on a host without the build tools: one error naming what is missing, before the script or megatron runs."""
    checkout = tmp_path / "Megatron-LM"
    datasets = checkout / "megatron" / "core" / "datasets"
    datasets.mkdir(parents=True)
    (datasets.parent / "__init__.py").write_text("raise SystemExit('megatron.core was imported')\n")  # found, not imported
    (datasets / "Makefile").write_text(MAKEFILE)
    (datasets / "helpers.cpp").write_text("")
    (checkout / "megatron" / "training").mkdir()
    (checkout / "megatron" / "training" / "__init__.py").write_text("")
    (checkout / "pretrain_gpt.py").write_text("raise SystemExit('the script ran')\n")
    no_tools = tmp_path / "no_tools"
    no_tools.mkdir()
    proc = _launch("pretrain_gpt.py", "--mock-data", "--chunk-offload-modules", "core_attn", cwd=checkout, PATH=str(no_tools))
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith(
        "python -m chunk_offload.megatron_lm: error: chunk_offload: Megatron-LM builds its dataset helpers (helpers.cpp, used by "
        f"every dataset, mock data included) with make in {datasets} at start-up, and this host lacks: make (e.g. apt install "
        "make); a C++ compiler: 'g++' is not on PATH"
    ), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_a_megatron_training_that_does_not_import_names_the_missing_package(tmp_path: Path) -> None:
    """A checkout's megatron.training that needs a package this Python lacks (triton, on a CPU host): one
    error naming it, no traceback. The checkout has no megatron/core: the installed megatron-core serves."""
    checkout = tmp_path / "Megatron-LM"
    (checkout / "megatron" / "training").mkdir(parents=True)
    (checkout / "megatron" / "training" / "__init__.py").write_text("import chunk_offload_test_missing_dependency\n")
    (checkout / "pretrain_gpt.py").write_text("raise SystemExit('the script ran')\n")
    if importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core is not installed")
    proc = _launch("pretrain_gpt.py", "--chunk-offload-modules", "core_attn", cwd=checkout)
    assert proc.returncode == 1, proc.stderr
    assert (
        f"python -m chunk_offload.megatron_lm: error: chunk_offload: Megatron-LM's megatron.training "
        f"({checkout / 'megatron' / 'training' / '__init__.py'}) does not import: No module named "
        "'chunk_offload_test_missing_dependency'; install it (pip install chunk_offload_test_missing_dependency; "
        "megatron.training imports triton even on CPU"
    ) in proc.stderr
    assert "Traceback" not in proc.stderr and "the script ran" not in proc.stderr
