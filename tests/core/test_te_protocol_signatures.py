"""`ChunkOffloadHandler` has the signatures of Transformer Engine's offload-handler protocol.

Transformer Engine cannot be imported without CUDA, and this file never imports it. Every method of
TE's ``AsyncDoubleBufferGroupOffloadHandler`` protocol exists on `ChunkOffloadHandler` with the same
positional parameter names, in the same order after ``self``, and ``**kwargs`` where TE has them.
Always against `TE_PROTOCOL`, a table written here; and, when a TE source is at hand, against the
file itself, parsed with `ast`. Where TE's source comes from, first match wins:

* ``CHUNK_OFFLOAD_TE_SOURCE``: a ``.py`` file, a ``.whl`` (read as a zip), or a directory
  (a TE checkout, a site-packages directory, an unpacked wheel, or the ``transformer_engine``
  package directory). Set but unusable: the test fails rather than skips. For example::

      pip download --no-deps transformer-engine==2.20.2 -d /tmp/te     # 1.2 MB, pure Python
      CHUNK_OFFLOAD_TE_SOURCE=/tmp/te/transformer_engine-2.20.2-py3-none-any.whl pytest tests/core/test_te_protocol_signatures.py

* an installed ``transformer_engine``, located with ``importlib.util.find_spec`` on the
  top-level name, which finds the package without executing it.

The class lives in ``transformer_engine/pytorch/cpu_offload.py`` up to TE 2.9 and in
``transformer_engine/pytorch/cpu_offload_v1.py`` from TE 2.10 (where ``cpu_offload.py`` holds
the v2 design and selects v1 with ``NVTE_CPU_OFFLOAD_V1=1``); both are tried.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import pytest

from chunk_offload.core import ChunkOffloadHandler

TE_SOURCE_ENV = "CHUNK_OFFLOAD_TE_SOURCE"
TE_CLASS = "AsyncDoubleBufferGroupOffloadHandler"
TE_FILES = ("transformer_engine/pytorch/cpu_offload_v1.py", "transformer_engine/pytorch/cpu_offload.py")


class Params(NamedTuple):
    """The parts of a signature the protocol fixes."""

    positional: tuple[str, ...]
    """Positional parameter names after ``self``, in order."""
    var_keyword: bool
    """Whether it takes ``**kwargs``."""


# What TE defines, checked identical in TE 1.13, 2.0, 2.4, 2.8, 2.9 (cpu_offload.py) and 2.10,
# 2.12, 2.18, 2.20.2 (cpu_offload_v1.py). `groupid_reset` is inherited from
# SynchronizedGroupOffloadHandler; the others are overridden by AsyncDoubleBufferGroupOffloadHandler.
TE_PROTOCOL: dict[str, Params] = {
    "tensor_push": Params(("tensor",), True),
    "tensor_pop": Params(("tensor_tag",), True),
    "on_group_commit_forward": Params((), False),
    "on_group_commit_backward": Params((), False),
    "bulk_offload_group": Params(("group_to_offload",), False),
    "bulk_reload_group": Params(("group_to_reload",), False),
    "groupid_reset": Params((), False),
}


# ----------------------------------------------------------------------------- signature helpers


def params_of(func: Callable[..., Any]) -> Params:
    """`Params` of a method, as looked up on the class (``self`` included in its signature)."""
    parameters = list(inspect.signature(func).parameters.values())
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return Params(tuple(positional[1:]), any(p.kind is p.VAR_KEYWORD for p in parameters))


def incompatibilities(cls: type, protocol: dict[str, Params]) -> list[str]:
    """Why ``cls`` could not stand in for a TE handler with ``protocol``; empty when it can."""
    problems = []
    for name, te in protocol.items():
        method = getattr(cls, name, None)
        if not callable(method):
            problems.append(f"{name}: missing")
            continue
        ours = params_of(method)
        if ours.positional != te.positional:
            problems.append(f"{name}: positional parameters {ours.positional} after self, TE has {te.positional}")
        if te.var_keyword and not ours.var_keyword:
            problems.append(f"{name}: TE passes **kwargs, ours takes none")
        required_kw_only = [
            p.name for p in inspect.signature(method).parameters.values() if p.kind is p.KEYWORD_ONLY and p.default is p.empty
        ]
        if required_kw_only:
            problems.append(f"{name}: required keyword-only parameters {required_kw_only} that TE never passes")
    return problems


def protocol_from_source(text: str, class_name: str = TE_CLASS) -> dict[str, Params]:
    """`Params` of each protocol method of ``class_name`` in a module's source, bases in that module included."""
    classes = {node.name: node for node in ast.parse(text).body if isinstance(node, ast.ClassDef)}
    if class_name not in classes:
        raise LookupError(f"class {class_name} not found")

    def lookup(cls: ast.ClassDef, method: str) -> ast.FunctionDef | None:
        for node in cls.body:
            if isinstance(node, ast.FunctionDef) and node.name == method:
                return node
        for base in cls.bases:  # depth-first is TE's MRO: single inheritance
            if isinstance(base, ast.Name) and base.id in classes:
                found = lookup(classes[base.id], method)
                if found is not None:
                    return found
        return None

    protocol = {}
    for method in TE_PROTOCOL:
        node = lookup(classes[class_name], method)
        if node is None:
            raise LookupError(f"{class_name}.{method} not found")
        args = node.args
        positional = [a.arg for a in (*args.posonlyargs, *args.args)]
        protocol[method] = Params(tuple(positional[1:]), args.kwarg is not None)
    return protocol


# ----------------------------------------------------------------------------- finding TE's source


def _candidate_sources(path: Path) -> Iterator[tuple[str, str]]:
    """``(where, text)`` of each file under ``path`` that may define the TE handler class."""
    if path.is_file() and zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as wheel:
            for member in TE_FILES:
                if member in wheel.namelist():
                    yield f"{path}!{member}", wheel.read(member).decode()
    elif path.is_file():
        yield str(path), path.read_text()
    elif path.is_dir():
        package_relative = [f.removeprefix("transformer_engine/") for f in TE_FILES]
        for relative in (*TE_FILES, *package_relative):
            if (path / relative).is_file():
                yield str(path / relative), (path / relative).read_text()


def _defining_source(candidates: Iterator[tuple[str, str]]) -> tuple[str, str] | None:
    for where, text in candidates:
        if f"class {TE_CLASS}" in text:
            return where, text
    return None


def find_te_source() -> tuple[str, str] | None:
    """``(where, text)`` of the TE file defining the handler class, or None when there is none.

    Looks at ``CHUNK_OFFLOAD_TE_SOURCE``, then at an installed ``transformer_engine``, without
    importing it: ``find_spec`` of a top-level name only locates the package.
    """
    configured = os.environ.get(TE_SOURCE_ENV)
    if configured:
        found = _defining_source(_candidate_sources(Path(configured)))
        if found is None:
            pytest.fail(f"{TE_SOURCE_ENV}={configured!r} has no {TE_CLASS} in any of {TE_FILES}")
        return found
    try:
        spec = importlib.util.find_spec("transformer_engine")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        found = _defining_source(_candidate_sources(Path(location)))
        if found is not None:
            return found
    return None


# ----------------------------------------------------------------------------- signature tests


def test_table_is_the_protocol_of_the_design() -> None:
    # The seven methods that DESIGN.md and handler.py name.
    assert set(TE_PROTOCOL) == {
        "tensor_push",
        "tensor_pop",
        "on_group_commit_forward",
        "on_group_commit_backward",
        "bulk_offload_group",
        "bulk_reload_group",
        "groupid_reset",
    }


@pytest.mark.parametrize("method", sorted(TE_PROTOCOL))
def test_handler_matches_the_table(method: str) -> None:
    assert incompatibilities(ChunkOffloadHandler, {method: TE_PROTOCOL[method]}) == []


def test_check_catches_an_incompatible_handler() -> None:
    """The check is not vacuous: each kind of mismatch is reported."""

    class Wrong:
        def tensor_push(self, t, **kwargs): ...  # renamed parameter
        def tensor_pop(self, tensor_tag): ...  # no **kwargs
        def on_group_commit_forward(self, *, group): ...  # required keyword-only
        def bulk_offload_group(self, group_to_offload, extra): ...  # an extra positional
        def bulk_reload_group(self, group_to_reload): ...
        def groupid_reset(self): ...
        # on_group_commit_backward missing

    problems = incompatibilities(Wrong, TE_PROTOCOL)
    assert [p.split(":")[0] for p in problems] == [
        "tensor_push",
        "tensor_pop",
        "on_group_commit_forward",
        "on_group_commit_backward",
        "bulk_offload_group",
    ], problems


_TE_LIKE_SOURCE = '''
class OffloadHandler:
    def tensor_push(self, tensor, **kwargs): ...
    def tensor_pop(self, tensor_tag, **kwargs): ...

class SynchronizedGroupOffloadHandler(OffloadHandler):
    def groupid_reset(self): ...
    def on_group_commit_forward(self): ...
    def on_group_commit_backward(self): ...

class AsyncDoubleBufferGroupOffloadHandler(SynchronizedGroupOffloadHandler):
    def tensor_push(self, tensor, **kwargs): ...
    def tensor_pop(self, tensor_tag, **kwargs): ...
    def bulk_offload_group(self, group_to_offload): ...
    def on_group_commit_forward(self): ...
    def bulk_reload_group(self, group_to_reload): ...
    def on_group_commit_backward(self): ...
'''


def test_source_parser_follows_bases() -> None:
    """The `ast` reader on TE's layout (groupid_reset inherited), so it is tested without TE too."""
    assert protocol_from_source(_TE_LIKE_SOURCE) == TE_PROTOCOL
    with pytest.raises(LookupError, match="bulk_reload_group"):
        protocol_from_source(_TE_LIKE_SOURCE.replace("def bulk_reload_group", "def other"))


@pytest.mark.parametrize("form", ["file", "wheel", "checkout", "package_dir"])
def test_source_locations(form: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each form `CHUNK_OFFLOAD_TE_SOURCE` accepts, with a TE-like v1 file next to a v2 file."""
    v2_text = "class OffloadableLayerState: ...\n"
    if form == "wheel":
        target = tmp_path / "transformer_engine-2.20.2-py3-none-any.whl"
        with zipfile.ZipFile(target, "w") as wheel:
            wheel.writestr(TE_FILES[0], _TE_LIKE_SOURCE)
            wheel.writestr(TE_FILES[1], v2_text)
    else:
        (tmp_path / "transformer_engine/pytorch").mkdir(parents=True)
        (tmp_path / TE_FILES[0]).write_text(_TE_LIKE_SOURCE)
        (tmp_path / TE_FILES[1]).write_text(v2_text)
        target = {
            "file": tmp_path / TE_FILES[0],
            "checkout": tmp_path,
            "package_dir": tmp_path / "transformer_engine",
        }[form]
    monkeypatch.setenv(TE_SOURCE_ENV, str(target))
    where, text = find_te_source()
    assert where.endswith("cpu_offload_v1.py") and protocol_from_source(text) == TE_PROTOCOL


def test_unusable_source_setting_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TE_SOURCE_ENV, str(tmp_path))
    with pytest.raises(pytest.fail.Exception, match=TE_CLASS):
        find_te_source()


TE_WHEEL_VERSION = "2.20.2"


def _download_te_wheel(directory: Path) -> Path | None:
    """TE's pure-Python wheel (about 1 MB, no dependencies without extras) from the package index.

    It is never installed: an installed TE without its CUDA libraries makes megatron-core's
    import fail, so the source is read from the wheel as a zip.
    """
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
         "-d", str(directory), f"transformer-engine=={TE_WHEEL_VERSION}"],
        capture_output=True, text=True, timeout=120,
    )
    wheels = sorted(directory.glob("transformer_engine-*.whl"))
    return wheels[0] if done.returncode == 0 and wheels else None


def test_handler_matches_te_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Against TE's own file: a configured or installed source, else the wheel from the package index."""
    te_was_imported = "transformer_engine" in sys.modules
    found = find_te_source()
    if found is None:
        wheel = _download_te_wheel(tmp_path)
        if wheel is None:
            pytest.skip(
                f"no Transformer Engine source and the package index is unreachable: set {TE_SOURCE_ENV} to a "
                "transformer-engine wheel (pip download --no-deps transformer-engine), a checkout or a cpu_offload_v1.py"
            )
        monkeypatch.setenv(TE_SOURCE_ENV, str(wheel))
        found = find_te_source()
    assert te_was_imported or "transformer_engine" not in sys.modules, "locating TE's source imported it"
    where, text = found
    te = protocol_from_source(text)
    assert incompatibilities(ChunkOffloadHandler, te) == [], where
    assert te == TE_PROTOCOL, f"TE_PROTOCOL in this test is out of date with {where}"
