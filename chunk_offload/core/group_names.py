"""How a group's name says which modules' calls it collects: one module's name, or a layer group's
members joined by '+' (NOTE [Layer groups] in marks.py). The engine names its groups so, the planner
its predicted layer groups; `group_members` reads a name (a record's, a report's) back."""

from __future__ import annotations

from typing import Sequence

__all__ = ["group_members", "layer_group_name"]


def layer_group_name(members: Sequence[str]) -> str:
    """The name of a group that ``members`` (module names, each once, in call order) collect into:
    joined by '+' (a module group's: its module's name)."""
    return "+".join(members)


def group_members(name: str) -> list[str]:
    """The module names a group's ``name`` joins (`layer_group_name`'s inverse): one for a module group."""
    return name.split("+")
