"""The layering rules of CONTRIBUTING.md, enforced by walking every import of the package.

- ``chunk_offload.core`` imports nothing of chunk_offload outside core, and never megatron or
  transformer_engine (not even inside a function);
- the integrations import core only through public names: no underscored core module, and every
  name taken from core is in that module's ``__all__``;
- the product (core, schedule, report, planner, integrations) never imports the devkit.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "chunk_offload"
FORBIDDEN_IN_CORE = ("megatron", "transformer_engine")
PRODUCT = ("core", "schedule", "report", "planner", "integrations")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(absolute module, imported names, line) of every import statement in ``path``."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.extend((alias.name, [], node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((module, [alias.name for alias in node.names], node.lineno))
    return found


def _files(subpackage: str) -> list[Path]:
    return sorted((PACKAGE / subpackage).rglob("*.py"))


@pytest.mark.parametrize("path", _files("core"), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_core_imports_nothing_above_it(path: Path) -> None:
    for module, _names, line in _imports(path):
        top = module.split(".")[0]
        assert top not in FORBIDDEN_IN_CORE, f"{path}:{line} imports {module}"
        if top == "chunk_offload":
            assert module == "chunk_offload.core" or module.startswith("chunk_offload.core."), f"{path}:{line} imports {module}"


@pytest.mark.parametrize("path", _files("integrations"), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_integrations_use_core_public_names_only(path: Path) -> None:
    for module, names, line in _imports(path):
        if not (module == "chunk_offload.core" or module.startswith("chunk_offload.core.")):
            continue
        assert not any(part.startswith("_") for part in module.split(".")), f"{path}:{line} imports private {module}"
        public = set(importlib.import_module(module).__all__)
        private = [name for name in names if name.startswith("_") or name not in public]
        assert not private, f"{path}:{line} imports {private} from {module}, not in its __all__"


@pytest.mark.parametrize("subpackage", PRODUCT)
def test_the_product_never_imports_the_devkit(subpackage: str) -> None:
    for path in _files(subpackage):
        for module, _names, line in _imports(path):
            assert not module.startswith("chunk_offload.devkit"), f"{path}:{line} imports {module}"


def test_the_walk_sees_relative_imports() -> None:
    """The walk resolves ``from ...core import X`` to chunk_offload.core (else the rules above check nothing)."""
    imports = _imports(PACKAGE / "integrations" / "attached.py")
    assert any(module == "chunk_offload.core" for module, _, _ in imports)
    assert any(module == "chunk_offload.integrations.session" for module, _, _ in imports)
