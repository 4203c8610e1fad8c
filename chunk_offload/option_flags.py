"""argparse from the option table: each kind's parser, for every command line that offers an option.

`argparse_keywords` turns a row of `chunk_offload.core.OPTIONS` into ``add_argument``'s
keywords: the launcher's ``--chunk-offload-*`` flags and the planner's ``--min-offload-bytes`` /
``--schedule`` are made by it, so they parse, default and explain a value the same way.

A byte count is parsed to an int (``1MiB`` is 1048576), but an error about it must quote what the
user typed: with ``keep_typed`` (the launcher's flags) each flag given also leaves its option
string and text in the namespace (`TYPED`), which `typed_flag` reads back for every message.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from .core import ChunkOffloadError, Option, parse_bytes
from .module_names import ALIASES, OFFLOAD_MODULE_NAMES, canonical_modules

__all__ = ["TYPED", "argparse_keywords", "typed_flag"]

TYPED = "chunk_offload_typed"
"""The namespace attribute of the flags given as typed: destination -> (option string, text)."""


def _byte_count(text: str) -> int:
    """argparse ``type``: a byte count >= 0 (`parse_bytes`)."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _word_or_byte_count(word: str, value: object, example: str) -> Callable[[str], int | str | None]:
    """argparse ``type``: ``word`` (meaning ``value``) or a byte count (`parse_bytes`); ``example``:
    a byte count its error message shows."""

    def parse(text: str) -> int | str | None:
        if text.strip().lower() == word:
            return value
        try:
            return parse_bytes(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {word!r} or a byte count >= 0 such as {example} or 600KiB (suffixes KiB, MiB, GiB, TiB), got {text!r}"
            ) from None

    return parse


_byte_count_or_none = _word_or_byte_count("none", None, "16MiB")  # no bound
_device_budget = _word_or_byte_count("auto", "auto", "60GiB")  # the levelled budget


def _count(text: str) -> int:
    """argparse ``type``: a count >= 1 (``--chunk-offload-verify 3``)."""
    try:
        value = int(text.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1 such as 2, got {text!r}")
    return value


def _keep_typed(namespace: argparse.Namespace, dest: str, option_string: str | None, text: str) -> None:
    typed = getattr(namespace, TYPED, None)
    if typed is None:
        typed = {}
        setattr(namespace, TYPED, typed)
    typed[dest] = (option_string or dest, text)


def typed_flag(args: argparse.Namespace, dest: str, flag: str) -> str:
    """``--flag value`` as the command line typed it (``--chunk-offload-device-budget 600KiB``); for
    a namespace built otherwise, ``flag`` and the parsed value."""
    typed = getattr(args, TYPED, None)
    if isinstance(typed, dict) and dest in typed:
        option_string, text = typed[dest]
        return f"{option_string} {text}"
    return f"{flag} {getattr(args, dest, None)}"


class _ParsedAction(argparse.Action):
    """Store ``parse(text)`` and keep the text as typed (`TYPED`); a bad value is a usage error."""

    def __init__(self, *args: Any, parse: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parse = parse

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        try:
            value = self.parse(values)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentError(self, str(e)) from None
        setattr(namespace, self.dest, value)
        _keep_typed(namespace, self.dest, option_string, values)


class _ModulesAction(argparse.Action):
    """Join the comma- or space-separated names, resolve aliases and reject unknown names at parse time."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        tokens = [values] if isinstance(values, str) else list(values)
        try:
            names = canonical_modules(",".join(tokens))
        except ChunkOffloadError as e:
            raise argparse.ArgumentError(self, str(e).removeprefix("chunk_offload: ")) from e
        setattr(namespace, self.dest, names)
        _keep_typed(namespace, self.dest, option_string, " ".join(tokens))


def _valid_names_text() -> str:
    aliases = ", ".join(f"{alias} (= {name})" for alias, name in sorted(ALIASES.items()))
    return f"{', '.join(OFFLOAD_MODULE_NAMES)}; aliases: {aliases}"


def argparse_keywords(row: Option, *, dest: str | None = None, help: str | None = None, keep_typed: bool = False) -> dict[str, Any]:
    """``add_argument``'s keywords for the option table's ``row`` (its kind sets the parser);
    ``dest`` and ``help`` replace the row's (a command line with its own naming); ``keep_typed``:
    a value given is also kept as typed (`TYPED`, read by `typed_flag`)."""
    text = (row.help if help is None else help).replace("%", "%%")
    # argparse fills in %(default)s when it prints the help: a parser that changes the default
    # (set_defaults, as examples/pretrain_gpt.py does) shows its own.
    keywords: dict[str, Any] = {"dest": dest or row.dest, "help": text.format(default="%(default)s", names=_valid_names_text())}
    if row.kind == "switch":
        return {**keywords, "action": "store_true"}
    if row.kind == "choice":
        return {**keywords, "choices": row.choices, "default": row.default}
    if row.kind == "switch_or_auto":  # the flag alone switches it on, as a plain switch does
        return {**keywords, "choices": row.choices, "default": row.default, "nargs": "?", "const": "on"}
    keywords.update(default=row.default, metavar=row.metavar)
    if row.kind == "module_names":
        return {**keywords, "nargs": "+", "action": _ModulesAction}
    parse = {"bytes_or_auto": _device_budget, "bytes": _byte_count, "bytes_or_none": _byte_count_or_none, "count": _count}.get(row.kind)
    if parse is not None and keep_typed:
        return {**keywords, "action": _ParsedAction, "parse": parse}
    if parse is not None:
        return {**keywords, "type": parse}
    return keywords  # a path
