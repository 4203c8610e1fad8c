"""megatron_dataset_helpers: what a build of Megatron's dataset helpers lacks, said before any work, and
``compile_helpers`` that imports the compiled module when it can and runs Megatron's ``make`` otherwise.

The tools are stand-in executables in a temporary ``PATH`` (the running Python's folder, which the
build puts first, is pointed there too), so the answers do not depend on this host's tools.
"""

from __future__ import annotations

import os
import stat
import sys
import sysconfig
from pathlib import Path

import pytest

from chunk_offload import ChunkOffloadError
from chunk_offload.devkit import megatron_dataset_helpers as helpers
from chunk_offload.devkit.megatron_dataset_helpers import HelpersFolder, check_helpers, compiled_or_built, missing_build_tools


def _tool(folder: Path, name: str, script: str = "exit 0") -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def bin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty ``PATH`` folder that is also the running Python's folder."""
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setattr(sys, "executable", str(folder / "python"))
    return folder


def _all_tools(folder: Path, *, pybind11: bool = True, suffix: str | None = None) -> None:
    include = folder.parent / "include"
    include.mkdir(exist_ok=True)
    (include / "Python.h").write_text("")
    for name in ("make", "g++"):
        _tool(folder, name)
    answer = f'echo "-I{include}"; exit 0' if pybind11 else "echo 'No module named pybind11' >&2; exit 1"
    _tool(folder, "python3", f'if [ "$1 $2" = "-m pybind11" ]; then {answer}; fi; exit 1')
    _tool(folder, "python3-config", f"echo '{suffix or sysconfig.get_config_var('EXT_SUFFIX')}'")


def test_nothing_missing(bin_dir: Path) -> None:
    _all_tools(bin_dir)
    assert missing_build_tools({"PATH": str(bin_dir)}) == []


def test_everything_missing_is_listed(bin_dir: Path) -> None:
    assert missing_build_tools({"PATH": str(bin_dir)}) == [
        "make (e.g. apt install make)",
        "a C++ compiler: 'g++' is not on PATH (make runs $(CXX), g++ unless CXX is set; e.g. apt install g++)",
        "python3 on PATH with pybind11 (the Makefile runs python3 -m pybind11 --includes)",
    ]


def test_pybind11_of_the_path_python3_and_a_foreign_python3_config(bin_dir: Path) -> None:
    _all_tools(bin_dir, pybind11=False, suffix=".cpython-310-x86_64-linux-gnu.so")
    missing = missing_build_tools({"PATH": str(bin_dir), "CXX": "clang++ -stdlib=libc++"})
    assert missing[0] == "a C++ compiler: 'clang++' is not on PATH (make runs $(CXX), g++ unless CXX is set; e.g. apt install g++)"
    assert missing[1] == f"pybind11 for {bin_dir / 'python3'} (pip install pybind11 into that Python)"
    assert missing[2].startswith(f"python3-config of this Python: {bin_dir / 'python3-config'} names the extension suffix '.cpython-310")
    assert len(missing) == 3


def test_check_helpers(bin_dir: Path, tmp_path: Path) -> None:
    check_helpers(HelpersFolder(path=tmp_path, compiled=tmp_path / "helpers_cpp.so", makefile=False))  # a wheel: nothing to build
    with pytest.raises(ChunkOffloadError, match="has neither the compiled dataset helpers"):
        check_helpers(HelpersFolder(path=tmp_path, compiled=None, makefile=False))
    checkout = HelpersFolder(path=tmp_path / "megatron/core/datasets", compiled=None, makefile=True)
    with pytest.raises(ChunkOffloadError) as error:
        check_helpers(checkout, {"PATH": str(bin_dir)})
    assert str(error.value).startswith(
        "chunk_offload: Megatron-LM builds its dataset helpers (helpers.cpp, used by every dataset, mock data included) "
        f"with make in {checkout.path} at start-up, and this host lacks: make (e.g. apt install make); a C++ compiler"
    )
    assert str(error.value).endswith(f"or run make -C {checkout.path} once yourself where they are installed")
    _all_tools(bin_dir)
    check_helpers(checkout, {"PATH": str(bin_dir)})


def test_compiled_or_built_imports_or_runs_megatrons_make(bin_dir: Path, tmp_path: Path, monkeypatch) -> None:
    calls: list[str] = []

    def compile_helpers() -> None:  # Megatron's: make, with the PATH the build sees
        calls.append(os.environ["PATH"].split(os.pathsep)[0])

    monkeypatch.setattr(helpers, "HELPERS_MODULE", "json")  # importable: make never runs
    compiled_or_built(compile_helpers)()
    assert calls == []
    monkeypatch.setattr(helpers, "HELPERS_MODULE", "no_such_helpers_cpp_module")
    checkout = HelpersFolder(path=tmp_path, compiled=None, makefile=True)
    monkeypatch.setattr(helpers, "locate", lambda: checkout)
    monkeypatch.setenv("PATH", str(tmp_path / "elsewhere"))  # the tools are found in the running Python's folder
    with pytest.raises(ChunkOffloadError, match="this host lacks: make"):
        compiled_or_built(compile_helpers)()
    assert calls == []
    _all_tools(bin_dir)
    path = os.environ["PATH"]
    compiled_or_built(compile_helpers)()
    assert calls == [str(bin_dir)] and os.environ["PATH"] == path  # the running Python's folder first, then PATH restored
    monkeypatch.setattr(helpers, "locate", lambda: HelpersFolder(path=tmp_path, compiled=tmp_path / "helpers_cpp.so", makefile=True))
    with pytest.raises(ChunkOffloadError, match=r"helpers_cpp.so is there but no_such_helpers_cpp_module does not import; delete it"):
        compiled_or_built(compile_helpers)()


def test_locate_finds_the_checkouts_folder_first(tmp_path: Path) -> None:
    """In a subprocess: the checkout's megatron.core on sys.path[0] wins, and is not imported."""
    import subprocess

    datasets = tmp_path / "megatron" / "core" / "datasets"
    datasets.mkdir(parents=True)
    (datasets.parent / "__init__.py").write_text("raise SystemExit('megatron.core was imported')\n")
    (datasets / "Makefile").write_text("")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from chunk_offload.devkit.megatron_dataset_helpers import locate; f = locate();"
        "print(f.path, f.compiled, f.makefile)"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout == f"{datasets} None True\n", done.stderr
