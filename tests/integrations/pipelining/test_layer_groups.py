"""``group_by="layer"`` under torch.distributed.pipelining: each Block's offload modules one group.

`chunk_offload.integrations.pipelining.attach` registers each matched submodule with the layer it
lies in (the element of the stage's Sequential, ModuleList or ModuleDict on its path), so with
``OffloadConfig(group_by="layer")`` a Block's norms, qkv_linear, core_attn and mlp_fc1 form one
group. One spawn of 2 gloo ranks trains 1F1B and interleaved 1F1B with random copy-stream delays:
losses and every gradient bit-identical to the baseline, one group per Block call, every byte
back, nothing left after each step.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed import pipelining

from ._pipe import ITERATIONS, LAYERS, MICROBATCHES, Case, spawn_cases

SCHEDULES = ("Schedule1F1B", "ScheduleInterleaved1F1B")
# The Block's calls in forward order: attn_norm (a LayerNorm), qkv_linear, core_attn, mlp_norm (a LayerNorm), mlp_fc1.
LAYER_GROUP = "norm+qkv_linear+core_attn+mlp_fc1"


@pytest.fixture(scope="module")
def results():
    present = [name for name in SCHEDULES if hasattr(pipelining, name)]
    cases = [Case(schedule=name, max_delay_s=0.002, seed=i, group_by="layer") for i, name in enumerate(present)]
    return dict(zip(present, spawn_cases(cases, world_size=2)))


@pytest.mark.parametrize("name", SCHEDULES)
def test_layer_groups_bit_identical_and_whole(results, name) -> None:
    if name not in results:
        pytest.skip(f"torch {torch.__version__} has no torch.distributed.pipelining.{name}")
    for r in results[name]:
        what = f"{name} rank {r.rank}"
        for lb, lo in zip(r.losses["baseline"], r.losses["offload"], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(lb, lo, strict=True)), what
        for gb, go in zip(r.grads["baseline"], r.grads["offload"], strict=True):
            assert gb.keys() == go.keys() and gb, what
            assert [p for p in gb if not torch.equal(gb[p], go[p])] == [], what
        assert list(r.groups) == [LAYER_GROUP], what
        blocks = LAYERS // 2  # this rank's Blocks: half the model, over its one or two stages
        assert r.groups[LAYER_GROUP]["groups"] == ITERATIONS * MICROBATCHES * blocks, what
        assert 0 < r.groups[LAYER_GROUP]["bytes_offloaded"] == r.groups[LAYER_GROUP]["bytes_reloaded"], what
        assert r.leaks == [dict(live_chunks=[], resident_bytes=0, host_bytes=0, pool_in_use=0, fallback_in_use=0)] * ITERATIONS, what
