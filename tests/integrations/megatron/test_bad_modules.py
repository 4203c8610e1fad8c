"""`attach(chunks, offload_modules)` with offload_modules of the wrong type: a ChunkOffloadError
naming the parameter, the value and the accepted names (before any stream starts)."""

from __future__ import annotations

import re

import pytest
from torch import nn

from chunk_offload import ChunkOffloadError
from chunk_offload.integrations.megatron import attach


@pytest.mark.parametrize("bad", [None, 5, ["attn", 3]])
def test_attach_offload_modules_must_be_str_or_list_of_str(bad):
    with pytest.raises(
        ChunkOffloadError,
        match=r"^chunk_offload: offload_modules must be a str \(comma-separated\) or a list/tuple of str, "
        + f"got {re.escape(repr(bad))}; valid names: \\[",
    ):
        attach([nn.Linear(2, 2)], bad)


def test_attach_without_plan_refuses_budgets():
    with pytest.raises(ChunkOffloadError, match=r"^chunk_offload: reload_ahead_bytes=5 needs schedule_policy='plan'"):
        attach([nn.Linear(2, 2)], "core_attn", schedule_policy=None, reload_ahead_bytes=5)
