"""docs/glossary.md explains every header and notation the printers emit, and the printers point to it.

Each printer runs on small inputs: the per-stage report (with budgets, a rank that copied nothing
and an ``auto`` budget), the launcher's closing summary, the planner's text (MoE, a budget), the
action lists of a plan difference, and the profiler ranges of a real offloaded iteration. Their
table headers must be glossary entries, and so must the shape of every cell that is not a plain
number (``0/2``, ``core_attn:131072``, ``NO (lowest peak)``: digits and module names generalised).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import re
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from torch import nn

from chunk_offload import OffloadConfig, OffloadManager
from chunk_offload.core import NOTATION, Action, diff_actions
from chunk_offload.megatron_lm.closing import close_run
from chunk_offload.megatron_lm.summary import StageSummary
from chunk_offload.module_names import OFFLOAD_MODULE_NAMES
from chunk_offload.report import format_table

from .report._reports import sample_report

GLOSSARY = (Path(__file__).resolve().parents[1] / "docs" / "glossary.md").read_text(encoding="utf-8")
_MODULE = re.compile(r"\b(" + "|".join(sorted(OFFLOAD_MODULE_NAMES, key=len, reverse=True)) + r")\b")


def shape(text: str) -> str:
    """``core_attn:131072`` -> ``<module>:0``, ``0/2`` -> ``0/0``, ``100.00%`` -> ``0%``."""
    return re.sub(r"\d+(\.\d+)?", "0", _MODULE.sub("<module>", text.strip()))


TERMS = {shape(t) for t in re.findall(r"`([^`]+)`", GLOSSARY)}


def markdown_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """(header, rows) of each Markdown table."""
    tables, rows = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                rows.append(cells)
        elif rows:
            tables.append((rows[0], rows[1:]))
            rows = []
    return tables


def plain_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """(header, rows) of each column-aligned table whose header is underlined with dashes."""
    lines, tables = text.splitlines(), []
    for i, rule in enumerate(lines[1:], start=1):
        if "-" in rule and re.fullmatch(r"[- ]+", rule):
            spans = [m.span() for m in re.finditer(r"-+", rule)]
            cut = lambda line: [line[a:b].strip() for a, b in spans]  # noqa: E731
            inside = {k for a, b in spans for k in range(a, b)}
            body = []
            for line in lines[i + 1 :]:  # rows: text only within the columns
                if not line.strip() or len(line) > spans[-1][1] or any(c != " " for k, c in enumerate(line) if k not in inside):
                    break
                body.append(cut(line))
            tables.append((cut(lines[i - 1]), body))
    return tables


def missing_notation(tables: list[tuple[list[str], list[list[str]]]]) -> list[str]:
    """Headers and non-numeric cell shapes of ``tables`` that the glossary lacks."""
    missing = {f"header {h!r}" for header, _ in tables for h in header if shape(h) not in TERMS}
    for _, rows in tables:
        for cell in (part for row in rows for c in row for part in c.split(",")):
            if not re.fullmatch(r"-?0%?", shape(cell)) and shape(cell) not in TERMS:
                missing.add(f"cell {cell!r} (as {shape(cell)!r})")
    assert tables, "no table found in the output"
    return sorted(missing)


def test_report_tables() -> None:
    budget = dataclasses.replace(
        sample_report(0), device_budget=614400, offloaded_groups={"core_attn": 4}, budget_fits=True, host_budget=1 << 22, host_cap=1 << 22
    )
    auto = dataclasses.replace(
        sample_report(1), device_budget="auto", leveled_budget=4096, budget_fits=False, bytes_per_module={"core_attn": 0}, host_budget=1 << 22
    )
    text = format_table([budget, auto])
    assert text.splitlines()[-1] == NOTATION
    assert not missing_notation(markdown_tables(text)), missing_notation(markdown_tables(text))
    for measure in re.findall(r"^memory measure: (\w+)", text, re.M):
        assert shape(measure) in TERMS, measure


def test_launcher_summary() -> None:
    ranks = [
        StageSummary(rank=r, requested=["core_attn"], attached=True, pp_rank=r, pp_size=2, offload=True, training_calls=3,
                     bytes_per_module={"core_attn": 4096 * (1 - r)}, peak_bytes=8192, measure="cpu_saved_bytes_accounting", wait_ms=0.5)
        for r in (0, 1)
    ]  # fmt: skip
    text = close_run(ranks, report_path=None).summary
    assert not missing_notation(markdown_tables(text)), missing_notation(markdown_tables(text))


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="the planner reads megatron-core's schedule tables")
def test_planner_tables() -> None:
    from chunk_offload.planner.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        status = main(["plan", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                       "--micro-batch-size", "2", "--pp", "2", "--vpp", "2", "--num-microbatches", "4", "--num-experts", "4",
                       "--min-offload-bytes", "1", "--budget-gb", "0.0001"])  # fmt: skip
    assert status == 0
    text = out.getvalue()
    assert text.rstrip("\n").splitlines()[-1] == NOTATION
    assert len(plain_tables(text)) == 2 and not missing_notation(plain_tables(text)), missing_notation(plain_tables(text))


def test_action_lists() -> None:
    plan = [Action.parse(a) for a in ("0F0", "1F0", "0B1", "0W1", "1B0")]
    text = diff_actions(plan, [*plan[:2], plan[3], plan[2], plan[4]])
    assert NOTATION in text
    for token in re.findall(r"\[?\d+[FBW]\d+\]?|step \d+", text):
        if token.startswith("["):  # the mark: [1F0] stands for any marked action
            assert "[0F0]" in TERMS, "the mark [ ] is not in docs/glossary.md"
        assert shape(token.strip("[]")) in TERMS, f"{token!r} (as {shape(token)!r}) is not in docs/glossary.md"


def test_profiler_ranges() -> None:
    template = re.search(r"`(chunk_offload::<step>[^`]*)`", GLOSSARY).group(1)
    pattern = re.escape(template).replace(re.escape("<step>"), r"(\w+)")
    pattern = re.sub(r"<\w+>", r"\\w+", pattern.replace("\\<", "<").replace("\\>", ">"))
    manager = OffloadManager(OffloadConfig(profile_ranges=True, min_offload_bytes=1, deterministic_memory=True))
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
    manager.offload_module(model[1], "core_attn")
    manager.offload_module(model[3], "mlp_fc1")
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with manager.iteration():
                with manager.chunk(microbatch=0, vp_stage=0):
                    loss = model(torch.randn(4, 8, requires_grad=True)).sum()
                loss.backward()
    finally:
        manager.close()
    names = {e.name for e in prof.events() if e.name.startswith("chunk_offload::")}
    assert names, "no profiler range recorded"
    for name in names:
        match = re.fullmatch(pattern, name)
        assert match, f"{name!r} does not have the form docs/glossary.md gives: {template}"
        assert match.group(1) in TERMS, f"step {match.group(1)!r} of {name!r} is not in docs/glossary.md"
