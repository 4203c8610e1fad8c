"""Every command the docs show runs, or parses, as written; every output they quote is what it prints.

The commands are read from README.md, docs/*.md and the usage lines of the examples', bench
scripts' and command-line modules' docstrings when the tests run (tests/_doc_commands.py says
how each is checked). A command no rule covers fails `test_every_command_is_classified`, with
the marker that classifies it. Runs use CPU sizes: the docs' own where they are small, else the
size flags a test may shrink; Megatron runs use the example's 3 iterations or fewer.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from ._doc_commands import CLIS, MARKER_HELP, REPO, Command, capture_parser, docstring_commands, markdown_commands
from ._doc_runs import Runs, json_without, missing_lines, shrunk

_MARKDOWN, QUOTES = markdown_commands()
COMMANDS = _MARKDOWN + docstring_commands()
CHECKED = [c for c in COMMANDS if c.mode in ("run", "shrink", "parse", "mention") and c.cli is not None]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    run_mode = [c for c in COMMANDS if c.mode == "run"] + [q.command for q in QUOTES]
    return Runs(tmp_path_factory.mktemp("doc-commands"), run_mode)


def _needs(command: Command) -> None:
    if command.cli.needs and importlib.util.find_spec(command.cli.needs) is None:
        pytest.skip(f"{command.program} needs {command.cli.needs}")


def test_every_command_is_classified() -> None:
    assert len(COMMANDS) > 20 and QUOTES, "the extraction found too little: has the docs' format changed?"
    unknown = [str(c) for c in COMMANDS if c.mode is None or (c.mode != "skip" and c.cli is None)]
    assert not unknown, "commands no test checks:\n  " + "\n  ".join(unknown) + f"\nTo check one, {MARKER_HELP}."
    unexplained = [str(c) for c in COMMANDS if c.mode == "skip" and not c.marker.get("why")]
    assert not unexplained, f"a skip marker says why (<!-- doc-test: skip: <why> -->): {unexplained}"
    odd = [str(c) for c in COMMANDS if c.mode not in ("run", "shrink", "parse", "mention", "setup", "skip")]
    assert not odd, f"unknown marker kinds: {odd}; {MARKER_HELP}"


def _parse(command: Command, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Through the program's own parser and checks, in this process (a usage error exits 2)."""
    monkeypatch.chdir(tmp_path)  # paths the checks probe (a report folder) resolve here
    try:
        if command.cli.parse is not None:
            command.cli.parse(list(command.args))
        else:
            capture_parser(command, list(command.args))
    except SystemExit as e:
        pytest.fail(f"{command} does not parse (exit status {e.code}); see the usage error above")


@pytest.mark.parametrize("command", CHECKED, ids=str)
def test_command(command: Command, runs: Runs, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _needs(command)
    if command.mode == "mention":  # the program it names exists
        assert command.program.startswith(("-m ", "chunk-offload")) or (REPO / command.program.removeprefix("bash ")).is_file()
        if command.program.startswith("-m "):
            assert importlib.util.find_spec(command.program[3:]) is not None, command
        return
    if command.mode in ("parse", "shrink"):
        _parse(command, monkeypatch, tmp_path)
    if command.mode == "parse":
        return
    args = shrunk(command.args, command.cli) if command.mode == "shrink" else command.args
    done = runs.get(command, args)
    assert done.returncode == 0, done.failure()
    for written, moved in done.moved.items():  # files a documented run wrote into the repository
        committed = REPO / written
        if (committed.parent / (committed.name + ".md")).is_file():
            _compare_report_files(committed, moved, command.cli.vary)


def _compare_report_files(committed: Path, fresh: Path, vary: tuple[str, ...]) -> None:
    md = [p.parent / (p.name + ".md") for p in (committed, fresh)]
    missing = missing_lines(md[0].read_text().splitlines(), md[1].read_text(), vary)
    assert not missing, f"{md[0].relative_to(REPO)} is not what the command writes now; rerun it. Differs:\n" + "\n".join(missing)
    keys = {v.replace(" ", "_") for v in vary}
    js = [json.loads((p.parent / (p.name + ".json")).read_text()) for p in (committed, fresh)]
    assert json_without(js[0], keys) == json_without(js[1], keys), f"{committed.relative_to(REPO)}.json is stale; rerun the command"


@pytest.mark.parametrize("quote", QUOTES, ids=lambda q: q.where)
def test_quoted_output_is_what_the_command_prints(quote, runs: Runs) -> None:
    _needs(quote.command)
    assert quote.command.mode == "run", f"{quote.where}: quotes the output of {quote.command}, which is not run as written"
    done = runs.get(quote.command, quote.command.args)
    assert done.returncode == 0, done.failure()
    missing = missing_lines(list(quote.lines), done.stdout, quote.vary)
    assert not missing, (
        f"{quote.where} quotes lines that {quote.command} no longer prints (columns not compared: {quote.vary}):\n"
        + "\n".join(missing) + "\n--- it prints:\n" + done.stdout[-6000:]
    )
