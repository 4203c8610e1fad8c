"""argparse from the option table: each kind's parser, for every command line that offers an option.

`argparse_keywords` turns a row of `chunk_offload.core.OPTIONS` into ``add_argument``'s
keywords: the launcher's ``--chunk-offload-*`` flags and the planner's ``--min-offload-bytes`` /
``--schedule`` are made by it, so they parse, default and explain a value the same way.
"""

from __future__ import annotations

import argparse
from typing import Any

from .core import ChunkOffloadError, Option, parse_bytes
from .module_names import ALIASES, OFFLOAD_MODULE_NAMES, canonical_modules

__all__ = ["argparse_keywords"]


def _byte_count(text: str) -> int:
    """argparse ``type``: a byte count >= 0 (`parse_bytes`)."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _device_budget(text: str) -> int | str:
    """argparse ``type``: ``auto`` or a byte count (`_byte_count`)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 'auto' or a byte count >= 0 such as 60GiB or 600KiB (suffixes KiB, MiB, GiB, TiB), got {text!r}"
        ) from None


def _count(text: str) -> int:
    """argparse ``type``: a count >= 1 (``--chunk-offload-verify 3``)."""
    try:
        value = int(text.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1 such as 2, got {text!r}")
    return value


class _ModulesAction(argparse.Action):
    """Join the comma- or space-separated names, resolve aliases and reject unknown names at parse time."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        tokens = [values] if isinstance(values, str) else list(values)
        try:
            names = canonical_modules(",".join(tokens))
        except ChunkOffloadError as e:
            raise argparse.ArgumentError(self, str(e).removeprefix("chunk_offload: ")) from e
        setattr(namespace, self.dest, names)


def _valid_names_text() -> str:
    aliases = ", ".join(f"{alias} (= {name})" for alias, name in sorted(ALIASES.items()))
    return f"{', '.join(OFFLOAD_MODULE_NAMES)}; aliases: {aliases}"


def argparse_keywords(row: Option, *, dest: str | None = None, help: str | None = None) -> dict[str, Any]:
    """``add_argument``'s keywords for the option table's ``row`` (its kind sets the parser);
    ``dest`` and ``help`` replace the row's (a command line with its own naming)."""
    text = (row.help if help is None else help).replace("%", "%%")
    # argparse fills in %(default)s when it prints the help: a parser that changes the default
    # (set_defaults, as examples/pretrain_gpt.py does) shows its own.
    keywords: dict[str, Any] = {"dest": dest or row.dest, "help": text.format(default="%(default)s", names=_valid_names_text())}
    if row.kind == "switch":
        return {**keywords, "action": "store_true"}
    if row.kind == "choice":
        return {**keywords, "choices": row.choices, "default": row.default}
    keywords.update(default=row.default, metavar=row.metavar)
    if row.kind == "module_names":
        return {**keywords, "nargs": "+", "action": _ModulesAction}
    if row.kind == "bytes_or_auto":
        return {**keywords, "type": _device_budget}
    if row.kind in ("bytes", "bytes_or_none"):
        return {**keywords, "type": _byte_count}
    if row.kind == "count":
        return {**keywords, "type": _count}
    return keywords  # a path
