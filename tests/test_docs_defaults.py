"""Defaults the docs and the --help texts state are the ones the code uses.

Three places state defaults: a flag's help (``(default: 1048576)``, ``'plan' (default)``), a usage
line's optional flag (``[--layers 4]``), and the prose of README.md and docs/*.md
(```--chunk-offload-min-offload-bytes` (default 1 MiB)``). Each statement is compared with the
parser that program builds (the launcher's flags: `add_arguments`, whose defaults are the option
table's) or with the library's default (`OffloadConfig`, the option table).
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import re
import shlex

import pytest

from chunk_offload.core import OPTIONS, OffloadConfig, parse_bytes
from chunk_offload.integrations.megatron import add_arguments

from ._doc_commands import CLIS, DOCSTRINGS, MARKDOWN, REPO, Command, capture_parser, split_command

PROGRAMS = [p for p, cli in CLIS.items() if cli.mode != "setup" and not p.startswith("bash ") and p != "-m chunk_offload.megatron_lm"]
LAUNCHER = "--chunk-offload-* flags"


@functools.cache
def actions(program: str) -> dict[str, argparse.Action]:
    """Option string -> action of the program's parser and its sub-commands' parsers."""
    if program in (LAUNCHER, "-m chunk_offload.megatron_lm"):  # the launcher parses our flags with add_arguments
        parser = add_arguments(argparse.ArgumentParser())
    else:
        needs = CLIS[program].needs
        if needs and importlib.util.find_spec(needs) is None:
            pytest.skip(f"{program} needs {needs}")
        parser = capture_parser(Command("", program, ()), None).parser
    found, parsers = {}, [parser]
    while parsers:
        p = parsers.pop()
        for action in p._actions:  # argparse has no public list of a parser's actions
            found.update({s: (p, action) for s in action.option_strings})
            if isinstance(action, argparse._SubParsersAction):
                parsers += list(action.choices.values())
    return found


def _value(text: str, action: argparse.Action) -> object:
    """A stated default as the parser would hold it; None for words that describe one."""
    text = text.strip().strip("'\"")
    if action.choices and text in action.choices:
        return text
    if re.fullmatch(r"-?\d+(\.\d+)?", text):
        return float(text)
    if re.fullmatch(r"\d+ ?[KMGT]iB", text):
        return float(parse_bytes(text.replace(" ", "")))
    return {"True": True, "False": False}.get(text)


def _agrees(stated: object, default: object) -> bool:
    if isinstance(stated, float) and isinstance(default, (int, float)) and not isinstance(default, bool):
        return stated == float(default)
    return stated == default


def help_statements(help_text: str) -> list[str]:
    """``default: X`` / ``(default X)`` / ``'X' (default)`` / ``X (...; default)`` in a help text."""
    found = [m.group(1) for m in re.finditer(r"\bdefault:?\s+([^\s,;)]+)", help_text, re.I)]
    found += [m.group(1) for m in re.finditer(r"'?([\w-]+)'?\s+\((?:[^()]*;\s*)?default\)", help_text)]
    return [f.rstrip(".") for f in found]


@pytest.mark.parametrize("program", [*PROGRAMS, LAUNCHER])
def test_help_states_the_parsers_defaults(program: str) -> None:
    wrong = []
    for flag, (parser, action) in actions(program).items():
        if not action.help or flag != action.option_strings[-1] or action.help == argparse.SUPPRESS:
            continue
        text = parser._get_formatter()._expand_help(action)  # the text --help prints
        for stated in help_statements(text):
            value = _value(stated, action)
            if value is not None and action.default is not None and not _agrees(value, action.default):
                wrong.append(f"{flag}: help says default {stated!r}, the parser's default is {action.default!r}")
    assert not wrong, f"{program} --help:\n" + "\n".join(wrong)


def test_help_texts_state_defaults_at_all() -> None:
    """The patterns still find statements (the help texts' wording has not drifted away from them)."""
    texts = [p._get_formatter()._expand_help(a) for p, a in actions(LAUNCHER).values() if a.help]
    assert sum(len(help_statements(t)) for t in texts) >= 6


def _usage_brackets() -> list[tuple[str, str, list[str]]]:
    """(where, program, tokens) of each one-flag ``[--flag value]`` in the docstrings' usage lines."""
    found = []
    for path in sorted(p for pattern in DOCSTRINGS for p in REPO.glob(pattern)):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        for line in doc.splitlines():
            head = split_command(path.name, re.sub(r"\[.*", "", line))
            for m in re.finditer(r"\[([^\[\]]+)\]", line) if head else ():
                tokens = shlex.split(m.group(1))
                if sum(t.startswith("--") for t in tokens) == 1 and tokens[0].startswith("--"):
                    found.append((f"{path.relative_to(REPO)}: [{m.group(1)}]", head[0].program, tokens))
    return found


@pytest.mark.parametrize("where,program,tokens", _usage_brackets(), ids=lambda x: x if isinstance(x, str) else "")
def test_usage_line_states_the_parsers_default(where: str, program: str, tokens: list[str]) -> None:
    parser, action = actions(program)[tokens[0]]
    if action.default is None:
        return  # an example value, not a default (``[--json out/x.json]``)
    alternatives = tokens[1].split("|") if len(tokens) == 2 else [tokens[1:]]
    convert = action.type or str
    values = [[convert(v) for v in alt] if isinstance(alt, list) else convert(alt) for alt in alternatives]
    if action.choices:
        flat = [x for v in values for x in (v if isinstance(v, list) else [v])]
        assert all(v in action.choices for v in flat), f"{where}: not every value is one of {action.choices}"
    assert values[0] == action.default, f"{where} states {values[0]!r}; the default of {tokens[0]} is {action.default!r}"


def _flag_defaults(flag: str) -> list[tuple[str, object, argparse.Action]]:
    programs = [LAUNCHER] if flag.startswith("--chunk-offload-") else PROGRAMS
    return [(p, actions(p)[flag][1].default, actions(p)[flag][1]) for p in programs if flag in actions(p)]


def _library_default(name: str) -> object:
    rows = [row.default for row in OPTIONS if row.field_name == name]
    return rows[0] if rows else getattr(OffloadConfig(), name)


_FLAG_PATTERNS = (r"`(--[\w-]+)`\s+\(default ([^)]+)\)", r"`(--[\w-]+) ([^`]+)`,? the default")
_FIELD_PATTERNS = (r"`(\w+)=([^`]+)`\s+\(the default\)", r"default `(\w+)=\"?([^`\"]+)\"?`")


def test_docs_state_the_code_defaults() -> None:
    found, wrong = 0, []
    for path in sorted(p for pattern in MARKDOWN for p in REPO.glob(pattern)):
        text = re.sub(r"\s*\n\s*", " ", path.read_text(encoding="utf-8"))
        statements = [(m.group(1), m.group(2)) for pattern in _FLAG_PATTERNS for m in re.finditer(pattern, text)]
        for m in re.finditer(r"`([\w-]+)`\s+\(default\)", text):  # a choice: the flag is the last one named before
            flags = re.findall(r"`(--[\w-]+)`", text[max(0, m.start() - 300) : m.start()])
            assert flags, f"{path.name}: {m.group(0)!r}: name the flag within the 300 characters before it"
            statements.append((flags[-1], m.group(1)))
        for flag, stated in statements:
            defaults = _flag_defaults(flag)
            assert defaults, f"{path.name}: {flag} (stated default {stated!r}) is no flag of any program"
            found += 1
            wrong += [f"{path.name}: {flag} default {stated!r}, {p}: {d!r}" for p, d, a in defaults if not _agrees(_value(stated, a), d)]
        for pattern in _FIELD_PATTERNS:
            for m in re.finditer(pattern, text):
                found += 1
                value, default = m.group(2).strip('"'), _library_default(m.group(1))
                if str(default) != value:
                    wrong.append(f"{path.name}: {m.group(1)}={value} stated as the default; the library's is {default!r}")
    assert found >= 4, f"only {found} stated defaults found in the docs: have the patterns drifted?"
    assert not wrong, "\n".join(wrong)
