"""Running the docs' commands: argv, output paths, shrinking, one run per distinct command, and
comparing what a doc quotes with what the command prints."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ._doc_commands import REPO, Cli, Command, capture_parser

TIMEOUT_S = 300
_BATCH = """
import contextlib, importlib, json, sys
module, _, name = sys.argv[1].partition(":")
main = getattr(importlib.import_module(module), name)
for i, argv in enumerate(json.loads(sys.argv[2])):
    with open(f"{sys.argv[3]}/{i}.out", "w") as out, open(f"{sys.argv[3]}/{i}.err", "w") as err:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(argv)
            except SystemExit as e:
                status = e.code
    print(status if isinstance(status, int) else int(status is not None), flush=True)
"""


@dataclass(frozen=True)
class Done:
    """A finished run: exit status, output, and where each output path of the doc went."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    moved: dict[str, Path]

    def failure(self) -> str:
        return f"exit status {self.returncode} of {' '.join(self.argv)}\n{self.stdout[-3000:]}\n{self.stderr[-3000:]}"


def shrunk(args: tuple[str, ...], cli: Cli) -> tuple[str, ...]:
    """``args`` with the size flags of ``cli.shrink`` set to their tiny values."""
    out = list(args)
    given = {out[i]: out[i + 1] for i in range(len(out) - 1) if out[i].startswith("--")}
    for flag, tiny in cli.shrink.items():
        value = tiny(given) if callable(tiny) else tiny
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return tuple(out)


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)  # this checkout
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


class Runs:
    """One run per distinct command line, in a temporary folder; a batched program's commands
    share one interpreter (``Cli.batch``)."""

    def __init__(self, tmp: Path, commands: list[Command]) -> None:
        self.tmp, self.commands, self.done = tmp, commands, {}

    def _args(self, command: Command, args: tuple[str, ...]) -> tuple[list[str], dict[str, Path]]:
        """``args`` with every output path moved into a folder of its own."""
        folder = self.tmp / f"run{len(self.done)}-{abs(hash(args)) % 10**8}"
        folder.mkdir(parents=True, exist_ok=True)
        args, moved = list(args), {}
        for i, arg in enumerate(args[:-1]):
            if arg in command.cli.outputs:
                moved[args[i + 1]] = folder / Path(args[i + 1]).name
                args[i + 1] = str(moved[args[i + 1]])
        return args, moved

    @staticmethod
    def _head(command: Command) -> list[str]:
        program = command.program
        if command.launcher[:1] == ("torchrun",):  # a free port: other runs may be listening on the default
            head = [sys.executable, "-m", "torch.distributed.run", "--standalone", *command.launcher[1:]]
            return head + (["-m", program[3:]] if program.startswith("-m ") else [str(REPO / program)])
        if program.startswith("bash "):
            return ["bash", str(REPO / program[5:])]
        options = list(command.launcher[1:])  # the interpreter's (python -X ...)
        return [sys.executable, *options, *(["-m", program[3:]] if program.startswith("-m ") else [str(REPO / program)])]

    @staticmethod
    def _key(command: Command, args: tuple[str, ...]) -> tuple:
        """Commands that parse to the same values run once (a usage line that spells out the defaults)."""
        if command.cli.batch or command.program.startswith("bash "):
            return (command.launcher, command.program, args)
        try:
            parsed = capture_parser(command, list(args)).namespace
        except SystemExit:
            return (command.launcher, command.program, args)
        return (command.launcher, command.program, tuple(sorted((k, repr(v)) for k, v in vars(parsed).items())))

    def get(self, command: Command, args: tuple[str, ...]) -> Done:
        key = self._key(command, args)
        if key not in self.done:
            if command.cli.batch:
                self._batch(command)
            else:
                args_, moved = self._args(command, args)
                argv = self._head(command) + args_
                done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, env=_env(), cwd=REPO)
                self.done[key] = Done(tuple(argv), done.returncode, done.stdout, done.stderr, moved)
        return self.done[key]

    def _batch(self, command: Command) -> None:
        """Every run-mode command of this program in the docs, in one interpreter."""
        keys = list(dict.fromkeys((c.launcher, c.program, c.args) for c in self.commands if c.program == command.program))
        keys = [k for k in keys if k not in self.done]
        folder = self.tmp / f"batch-{command.program.replace(' ', '_')}"
        folder.mkdir(parents=True, exist_ok=True)
        runs = [self._args(command, k[2]) for k in keys]
        done = subprocess.run(
            [sys.executable, "-c", _BATCH, command.cli.batch, json.dumps([args for args, _ in runs]), str(folder)],
            capture_output=True, text=True, timeout=TIMEOUT_S, env=_env(), cwd=REPO,
        )
        statuses = [int(s) for s in done.stdout.split()]
        assert done.returncode == 0 and len(statuses) == len(keys), done.stderr[-3000:]
        for i, (key, (args, moved)) in enumerate(zip(keys, runs)):
            out, err = ((folder / f"{i}.{s}").read_text() for s in ("out", "err"))
            self.done[key] = Done((command.program, *args), statuses[i], out, err, moved)


def _cells(line: str) -> list[str] | None:
    """A Markdown table row's cells (None: not a row, [] a rule line)."""
    if not line.strip().startswith("|"):
        return None
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    return [] if all(re.fullmatch(r":?-+:?", c) for c in cells) else cells


def _key(line: str, masked: set[int]) -> str | None:
    cells = _cells(line)
    if cells is None:
        return " ".join(line.split()) or None
    return " | ".join("*" if i in masked else c for i, c in enumerate(cells)) if cells else None


def missing_lines(quoted: list[str], printed: str, vary: tuple[str, ...]) -> list[str]:
    """The quoted lines that the printed text does not have, in order; table cells under a ``vary``
    column are not compared. A header that names no ``vary`` column is an error (a typo)."""
    lines, at, missing, masked, previous, used = printed.splitlines(), 0, [], set(), None, set()
    for line in quoted:
        cells = _cells(line)
        if cells and previous is None:  # a header row starts a table
            masked = {i for i, c in enumerate(cells) for v in vary if c == v or c.startswith(v + " (")}
            used |= {v for v in vary for c in cells if c == v or c.startswith(v + " (")}
        previous = cells
        key = _key(line, masked)
        if key is None:
            continue
        found = next((j for j in range(at, len(lines)) if _key(lines[j], masked) == key), None)
        if found is None:
            missing.append(line)
        else:
            at = found + 1
    assert used == set(vary), f"no table has the column(s) {sorted(set(vary) - used)} that vary names"
    return missing


def json_without(data: object, keys: set[str]) -> object:
    """``data`` without the dict entries named ``keys``, at any depth."""
    if isinstance(data, dict):
        return {k: json_without(v, keys) for k, v in data.items() if k not in keys}
    if isinstance(data, list):
        return [json_without(v, keys) for v in data]
    return data
