"""Shared by the stage-replay tests: their marks and a tiny command-line run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

__all__ = ["assert_equal_tensors", "needs_megatron_on_cpu", "run_cli"]

needs_megatron_on_cpu = [
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
        reason='megatron-core is not installed (pip install "chunk-offload[megatron]")',
    ),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU accounting checks; on CUDA peaks are device memory"),
]
"""``pytestmark`` of the replay tests: they need megatron-core and run on CPU only."""


_TINY = ["--layers", "4", "--hidden", "32", "--heads", "4", "--seq", "16", "--vocab", "64", "--microbatches", "4",
         "--modules", "core_attn", "--min-offload-bytes", "1", "--iterations", "1"]  # fmt: skip


def run_cli(capsys, out: Path, *argv: str) -> tuple[str, dict]:
    """``python -m chunk_offload.replay`` of a tiny GPT with ``argv`` (pipeline and stage at least) and
    ``--json out``: what it printed and the JSON it wrote."""
    from chunk_offload.replay.__main__ import main

    assert main([*_TINY, *argv, "--json", str(out)]) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def assert_equal_tensors(a: dict, b: dict, what: str) -> None:
    """``a`` and ``b`` have the same keys, at least one, and equal tensors bit for bit (`torch.equal`)."""
    assert a.keys() == b.keys(), f"{what}: different keys"
    assert a, f"{what}: nothing to compare"
    differing = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differing, f"{what} differ: {differing[:5]}"
