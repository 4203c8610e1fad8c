"""The commands the docs show, found at test time, and what a test does with each.

Sources: the fenced and inline commands of README.md and docs/*.md, and the usage lines in the
docstrings of the examples, the bench scripts and the command-line modules. Each command is split
at ``&&`` into invocations; an invocation's program (``examples/pretrain_gpt.py``,
``-m chunk_offload.replay``, ``chunk-offload`` ...) names its entry in `CLIS`, whose ``mode`` says
what a test does with it:

- ``run``: run as written (output paths moved to a temporary folder), exit status 0;
- ``shrink``: parse as written through the program's own parser, then run with the size flags of
  ``shrink`` set to tiny values;
- ``parse``: parse only (GPU sizes, valgrind, a placeholder script);
- ``setup``: install and CI commands (tests/test_readme.py checks the README's).

A doc overrides the mode of a fenced block with a marker on the lines before it, and marks a
block as the printed output of the command above: see `MARKER_HELP`.
"""

from __future__ import annotations

import ast
import importlib
import re
import runpy
import shlex
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
MARKDOWN = ("README.md", "CONTRIBUTING.md", "docs/*.md")
DOCSTRINGS = ("examples/*.py", "bench/*.py", "chunk_offload/planner/cli.py", "chunk_offload/replay/__main__.py",
              "chunk_offload/megatron_lm/__init__.py")
MARKER_HELP = (
    "put a marker on the line before the fenced block: <!-- doc-test: run -->, <!-- doc-test: shrink -->, "
    "<!-- doc-test: parse-only -->, or <!-- doc-test: skip: <why> -->; a block that quotes what the command "
    "above printed: <!-- doc-test: output [; add: <flags>] [; vary: <column>, ...] -->. A new program needs "
    "its entry in CLIS in tests/_doc_commands.py (how to parse it and which size flags a test may shrink)"
)
_WORDS = ("python", "python3", "torchrun", "chunk-offload", "bash", "pip", "apt", "make")
_TORCHRUN_VALUED = {"--nproc-per-node", "--nproc_per_node", "--nnodes", "--node-rank", "--master-port", "--master-addr"}
_MARKER = re.compile(r"^\s*<!--\s*doc-test:\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Cli:
    """How a test checks one program's commands."""

    mode: str
    parse: Callable[[list[str]], object] | None = None
    """The program's own parser and checks (exit 2 on a usage error); None: the argparse parser it builds."""
    shrink: dict[str, str | Callable[[dict[str, str]], str]] = field(default_factory=dict)
    """Size flags a test may set (replaced where given, else added): a tiny value, or one computed
    from the flags the command gives."""
    outputs: tuple[str, ...] = ()
    """Flags whose value is a path the program writes: moved into a temporary folder."""
    vary: tuple[str, ...] = ()
    """Columns of its printed tables that depend on the host's timing (never compared)."""
    needs: str | None = None
    """A module the program imports (its commands are skipped without it)."""
    batch: str | None = None
    """``module:function`` taking argv and returning the exit status: its runs share one interpreter."""
    named_alone: bool = False
    """Written without flags it names the program in a sentence (it needs arguments to run)."""


@dataclass(frozen=True)
class Command:
    """One invocation as a doc writes it."""

    where: str
    program: str
    args: tuple[str, ...]
    launcher: tuple[str, ...] = ()
    """What starts it: ``python``, or torchrun's options."""
    marker: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.where}: {' '.join((*self.launcher, self.program, *self.args))}"

    @property
    def cli(self) -> Cli | None:
        return CLIS.get(self.program)

    @property
    def mode(self) -> str | None:
        kind = self.marker.get("kind")
        if kind == "skip":
            return "skip"
        if kind:
            return {"parse-only": "parse"}.get(kind, kind)
        if self.cli is not None and self.cli.named_alone and not any(a.startswith("-") for a in self.args):
            return "mention"  # `python -m chunk_offload.replay` names the program in a sentence
        return self.cli.mode if self.cli is not None else None


@dataclass(frozen=True)
class Quote:
    """A fenced block a doc marks as what a command printed."""

    where: str
    command: Command
    lines: tuple[str, ...]
    vary: tuple[str, ...]


def parse_marker(text: str) -> dict[str, str]:
    """``run``, ``skip: why``, ``output; add: --x 1; vary: copy ms, wait ms`` -> fields."""
    parts = [p.strip() for p in text.split(";")]
    kind, _, why = parts[0].partition(":")
    fields = {"kind": kind.strip(), **({"why": why.strip()} if why.strip() else {})}
    for part in parts[1:]:
        key, _, value = part.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def split_command(where: str, text: str, marker: dict[str, str] | None = None) -> list[Command]:
    """The invocations of one command line (``a && b``); [] when it is not a command."""
    text = re.sub(r"<[^<>]*>", "", text.replace("\\\n", " "))  # <Megatron-LM args>: a placeholder
    try:
        tokens = [t for t in shlex.split(text, comments=True) if not (t == "..." or t.endswith("...") or t.startswith("<"))]
    except ValueError:
        return []
    if len(tokens) < 2 or tokens[0] not in _WORDS:
        return []
    commands, part = [], []
    for token in [*tokens, "&&"]:
        if token != "&&":
            part.append(token)
            continue
        command = _command(where, part, marker or {}) if part else None
        commands += [command] if command is not None else []
        part = []
    return commands


def _command(where: str, tokens: list[str], marker: dict[str, str]) -> Command | None:
    word, rest = tokens[0], tokens[1:]
    launcher = [word]
    if word in ("python", "python3"):
        while rest and rest[0].startswith("-") and rest[0] != "-m":
            launcher.append(rest.pop(0))  # interpreter options (`python -O`: no program, a mention of the flag)
        if not rest:
            return None
    if word == "torchrun":
        while rest and rest[0].startswith("-") and rest[0] != "-m":
            launcher.append(rest.pop(0))
            if launcher[-1] in _TORCHRUN_VALUED and "=" not in launcher[-1]:
                launcher.append(rest.pop(0))
    if word in ("python", "python3", "torchrun") and rest[:1] == ["-m"]:
        return Command(where, f"-m {rest[1]}", tuple(rest[2:]), tuple(launcher), marker)
    if word in ("python", "python3", "torchrun"):
        return Command(where, rest[0], tuple(rest[1:]), tuple(launcher), marker)
    if word == "bash":
        return Command(where, f"bash {rest[0]}", tuple(rest[1:]), (), marker)
    return Command(where, word, tuple(rest), (), marker)


def _fences(lines: list[str]) -> list[tuple[int, int, str, dict[str, str]]]:
    """(first body line, end line, language, marker) of each fenced block."""
    found, i = [], 0
    while i < len(lines):
        opening = re.match(r"^\s*```(\w*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marked = _MARKER.match(before)
        found.append((i + 1, end, opening.group(1), parse_marker(marked.group(1)) if marked else {}))
        i = end + 1
    return found


def markdown_commands() -> tuple[list[Command], list[Quote]]:
    """Every command of the markdown docs, and every block marked as a command's output."""
    commands, quotes = [], []
    for path in sorted(p for pattern in MARKDOWN for p in REPO.glob(pattern)):
        lines = path.read_text(encoding="utf-8").splitlines()
        name, prose, last = path.relative_to(REPO).as_posix(), list(lines), None
        for start, end, lang, marker in _fences(lines):
            prose[start - 1 : end + 1] = [""] * (end - start + 2)
            if lang == "python":
                continue
            body = "\n".join(lines[start:end])
            if marker.get("kind") == "output":
                if last is None:
                    raise AssertionError(f"{name}:{start}: an output block with no command block above it")
                add = shlex.split(marker.get("add", ""))
                source = Command(f"{name}:{start}", last.program, (*last.args, *add), last.launcher, last.marker)
                vary = tuple(v.strip() for v in marker.get("vary", "").split(",") if v.strip())
                quotes.append(Quote(f"{name}:{start}", source, tuple(lines[start:end]), vary))
                continue
            found = [c for line in re.split(r"(?<!\\)\n", body) for c in split_command(f"{name}:{start}", line, marker)]
            commands += found
            last = found[-1] if found else last
        text = re.sub(r"<!--.*?-->", "", "\n".join(prose), flags=re.DOTALL)
        for match in re.finditer(r"`([^`]+)`", text):
            where = f"{name}:{text.count(chr(10), 0, match.start()) + 1}"
            commands += split_command(where, match.group(1).replace("\n", " "))
    return commands, quotes


def docstring_commands() -> list[Command]:
    """The usage lines (indented command lines) of the modules' docstrings."""
    commands = []
    for path in sorted(p for pattern in DOCSTRINGS for p in REPO.glob(pattern)):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=True) or ""
        lines = doc.splitlines()
        for i, line in enumerate(lines):
            indent = len(line) - len(line.lstrip())
            if indent < 4 or not line.lstrip().startswith(_WORDS):
                continue
            j, text = i, line
            while j + 1 < len(lines) and (text.endswith("\\") or len(lines[j + 1]) - len(lines[j + 1].lstrip()) > indent):
                j += 1
                text = text.rstrip("\\") + " " + lines[j].strip()
            text = re.sub(r"\[([^\[\]]*)\]", lambda m: m.group(1).split("|")[0], text)  # [--x 4|5] -> --x 4
            commands += split_command(f"{path.relative_to(REPO).as_posix()} (docstring)", text)
    return commands


def script_module(relative: str) -> dict:
    """The globals of a script, loaded without running it as ``__main__``."""
    return runpy.run_path(str(REPO / relative), run_name="doc_test")


class Parsed(Exception):
    """Raised by `capture_parser` where the program's parser returns."""

    def __init__(self, parser, namespace) -> None:
        super().__init__("parsed")
        self.parser, self.namespace = parser, namespace


def capture_parser(command: Command, args: list[str] | None) -> Parsed:
    """Start the program in this process until its argparse parser is built (``args`` None) or has
    parsed ``args`` (a usage error exits 2 as on the command line); nothing after it runs."""
    import argparse

    original, depth = argparse.ArgumentParser.parse_known_args, [0]

    def parse_known_args(self, argv=None, namespace=None):
        if args is None:
            raise Parsed(self, None)
        depth[0] += 1
        try:
            namespace, extras = original(self, argv, namespace)
        finally:
            depth[0] -= 1
        if depth[0] == 0:
            raise Parsed(self, namespace)
        return namespace, extras

    saved_argv = sys.argv
    argparse.ArgumentParser.parse_known_args = parse_known_args
    try:
        if command.program.startswith("-m "):
            sys.argv = [command.program[3:], *(args or [])]
            with warnings.catch_warnings():  # runpy's note that the module was imported before (by an earlier parse)
                warnings.simplefilter("ignore", RuntimeWarning)
                runpy.run_module(command.program[3:], run_name="__main__", alter_sys=False)
        elif command.program == "chunk-offload":
            importlib.import_module("chunk_offload.planner.cli").main(args or [])
        else:
            sys.argv = [str(REPO / command.program), *(args or [])]
            runpy.run_path(str(REPO / command.program), run_name="__main__")
    except Parsed as parsed:
        return parsed
    finally:
        argparse.ArgumentParser.parse_known_args = original
        sys.argv = saved_argv
    raise AssertionError(f"{command.program} finished without parsing a command line")


def _launcher_preflight(args: list[str]) -> object:
    from chunk_offload.megatron_lm.preflight import preflight

    return preflight(args[1:], prog="python -m chunk_offload.megatron_lm")  # args[0]: the script


def _pretrain_parse(args: list[str]) -> object:
    return script_module("examples/pretrain_gpt.py")["parse_args"](args)


def _replay_parse(args: list[str]) -> object:
    return importlib.import_module("chunk_offload.replay.__main__").parse_args(args)


CLIS: dict[str, Cli] = {
    "examples/pretrain_gpt.py": Cli(
        "run", _pretrain_parse, shrink={"--iterations": "2", "--num-layers": "2"},
        outputs=("--chunk-offload-report", "--save-state"), vary=("copy ms", "wait ms"), needs="megatron",
    ),
    "examples/core_demo.py": Cli("shrink", shrink={"--iterations": "2", "--microbatches": "4"}),
    "chunk-offload": Cli("run", outputs=("--json",), needs="megatron", batch="chunk_offload.planner.cli:main", named_alone=True),
    "-m chunk_offload.replay": Cli(
        "shrink", _replay_parse, outputs=("--json",), needs="megatron",
        shrink={"--layers": lambda given: str(int(given["--pp"]) * int(given.get("--vpp", 1))), "--hidden": "64", "--heads": "2", "--seq": "32", "--vocab": "128",
                "--iterations": "1", "--warmup": "0"},
        named_alone=True,
    ),
    "-m chunk_offload.megatron_lm": Cli("parse", _launcher_preflight, needs="megatron", named_alone=True),
    "bench/bandwidth.py": Cli("run", outputs=("--json",)),
    "bench/budget_reload.py": Cli("parse"),  # slept compute: tests/bench/test_budget_reload.py runs one configuration
    "bench/host_pool.py": Cli("shrink", shrink={"--iterations": "2"}),
    "bench/megatron_compare.py": Cli(
        "shrink", outputs=("--json",), needs="megatron",
        shrink={"--layers": "2", "--hidden": "64", "--heads": "4", "--seq": "32", "--microbatches": "2",
                "--iterations": "1", "--warmup": "1", "--processes": "one"},  # per-run processes: tests/bench
    ),
    "bench/overhead.py": Cli("shrink", shrink={"--layers": "4", "--repeats": "2"}),
    "bench/overhead_instructions.py": Cli("parse"),  # valgrind, a minute per mode
    "bench/prefetch.py": Cli(
        "shrink", needs="megatron",
        shrink={"--layers": "4", "--microbatches": "4", "--hidden": "64", "--seq": "32", "--iterations": "1"},
    ),
    "bench/sdpa_saved.py": Cli("shrink", outputs=("--json",), shrink={"--seq": "64", "--heads": "4", "--head-dim": "16"}),
    "bench/timed_refit.py": Cli("shrink", shrink={"--iterations": "2", "--ranks": "7"}),
    "bash bench/gpu_evidence.sh": Cli("run"),
    **{setup: Cli("setup") for setup in ("pip", "apt", "make", "-m pytest", "bash tests/run_megatron_019.sh", "bash .ci/run")},
}
"""Every program the docs run, by the name `split_command` gives it."""
