"""Which submodules of a pipeline stage each offload-module name selects, and the layer each lies in.

`selectors` validates what `attach` is given, `resolve` finds the matches in each stage's
``submod`` (every name somewhere, no nesting), `layer_of` names the layer a match lies in (NOTE
[Layer groups] in core/marks.py).
"""

from __future__ import annotations

import fnmatch
from typing import Any, Mapping, Sequence, Union

from torch import nn

from ...core import ChunkOffloadError

__all__ = ["ModuleSelector", "layer_of", "resolve", "selectors"]

ModuleSelector = Union[str, type[nn.Module], list[Union[str, type[nn.Module]]], tuple[Union[str, type[nn.Module]], ...]]
"""What one offload-module name stands for: fnmatch patterns over qualified submodule names of
a stage's ``submod`` (``"layers.*.attn"``; ``*`` also matches dots) and/or module classes,
alone or in a list or tuple."""

_MAX_LISTED_NAMES = 40


def selectors(offload_modules: Sequence[str] | Mapping[str, ModuleSelector]) -> dict[str, list[str | type[nn.Module]]]:
    """Offload-module name -> its patterns and classes, validated."""
    if isinstance(offload_modules, str):
        offload_modules = [offload_modules]
    if isinstance(offload_modules, Mapping):
        items = list(offload_modules.items())
    elif isinstance(offload_modules, Sequence):
        items = [(pattern, pattern) for pattern in offload_modules]
    else:
        raise ChunkOffloadError(
            f"offload_modules must be a list of submodule name patterns or a mapping name -> patterns/classes, "
            f"got {type(offload_modules).__name__} {offload_modules!r}"
        )
    if not items:
        raise ChunkOffloadError("offload_modules is empty; name at least one submodule pattern, e.g. ['layers.*.attention']")
    result: dict[str, list[str | type[nn.Module]]] = {}
    for name, selector in items:
        if not isinstance(name, str) or not name:
            raise ChunkOffloadError(f"offload-module names must be non-empty strings, got {name!r}")
        parts = list(selector) if isinstance(selector, (list, tuple)) else [selector]
        bad = [p for p in parts if not (isinstance(p, str) and p) and not (isinstance(p, type) and issubclass(p, nn.Module))]
        if not parts or bad:
            raise ChunkOffloadError(
                f"offload module {name!r}: each selector must be a non-empty name pattern or an nn.Module subclass, "
                f"got {bad or parts!r}"
            )
        result[name] = parts
    return result


def _matches(qualified: str, module: nn.Module, parts: list[str | type[nn.Module]]) -> bool:
    return any(
        fnmatch.fnmatchcase(qualified, part) if isinstance(part, str) else isinstance(module, part) for part in parts
    )


def resolve(stages: list[Any], chosen: dict[str, list]) -> list[dict[str, list[tuple[str, nn.Module]]]]:
    """Per stage, offload-module name -> (qualified name, module) it matches in ``stage.submod``
    (``chosen``: what `selectors` returned).

    Every name must match on at least one stage of this rank, and no selected module may
    contain another selected one (offload groups cannot nest).
    """
    per_stage = []
    for stage in stages:
        named = [(q, m) for q, m in stage.submod.named_modules() if q]
        found = {name: [(q, m) for q, m in named if _matches(q, m, parts)] for name, parts in chosen.items()}
        _check_disjoint(stage, found)
        per_stage.append(found)
    missing = [name for name in chosen if not any(found[name] for found in per_stage)]
    if missing:
        names = sorted({q for stage in stages for q, _ in stage.submod.named_modules() if q})
        shown = names[:_MAX_LISTED_NAMES]
        if len(names) > _MAX_LISTED_NAMES:
            shown.append(f"... {len(names) - _MAX_LISTED_NAMES} more")
        raise ChunkOffloadError(
            f"offload modules {missing} match no submodule of this rank's stages {[s.stage_index for s in stages]}; "
            f"patterns are fnmatch patterns over these qualified names: {shown}"
        )
    return per_stage


def layer_of(root: nn.Module, qualified: str) -> nn.Module | None:
    """The layer submodule ``qualified`` of ``root`` lies in: the first module on its path that is
    an element of a ModuleList, ModuleDict or Sequential (``layers.3`` of ``layers.3.attention.wq``);
    None where none is. With ``OffloadConfig.group_by="layer"`` a layer's offload modules form one group."""
    module = root
    for part in qualified.split(".")[:-1]:
        parent, module = module, module.get_submodule(part)
        if isinstance(parent, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            return module
    return None


def _check_disjoint(stage: Any, found: dict[str, list[tuple[str, nn.Module]]]) -> None:
    owner: dict[int, tuple[str, str]] = {}
    for name, modules in found.items():
        for qualified, module in modules:
            if id(module) in owner:
                other_name, other_qualified = owner[id(module)]
                raise ChunkOffloadError(
                    f"submodule {qualified!r} of stage {stage.stage_index} is matched by offload modules "
                    f"{other_name!r} and {name!r}; make the selectors disjoint"
                )
            owner[id(module)] = (name, qualified)
    selected = {qualified: name for name, modules in found.items() for qualified, _ in modules}
    for qualified, name in selected.items():
        parts = qualified.split(".")
        for outer in (".".join(parts[:i]) for i in range(1, len(parts))):
            if outer in selected:
                raise ChunkOffloadError(
                    f"offload module {selected[outer]!r} selects {outer!r} and {name!r} selects {qualified!r} inside it "
                    f"(stage {stage.stage_index}); offload groups cannot nest: choose one of them"
                )
