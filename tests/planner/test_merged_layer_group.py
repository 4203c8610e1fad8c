"""`merged_layer_group`: the planner's one group per layer under ``group_by="layer"`` (NOTE [Layer groups]).

`tests/planner/test_estimate.py` checks the merged bytes against megatron-core runs; this file
checks the rule itself on the byte model.
"""

from __future__ import annotations

import pytest

from chunk_offload.planner import GPTDims, joined_groups, layer_offload_groups, merged_layer_group
@pytest.mark.parametrize("attention", ["sdpa", "local"])
def test_a_layer_group_counts_each_storage_once(attention: str):
    """Under ``group_by="layer"`` a layer's groups are one (NOTE [Layer groups]): SDPA's output, which
    attn_proj saves as its input, is one storage of that group; the local attention saves no output.
    `tests/planner/test_estimate.py` checks the merged bytes against megatron-core runs."""
    dims = GPTDims(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2, attention=attention, device="cpu")
    modules = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_fc1"]
    groups = layer_offload_groups(dims, 0, modules, min_offload_bytes=1, receives_input=True)
    (merged,) = merged_layer_group(dims, groups)
    proj = next(g for g in groups if g.name == "attn_proj")
    shared = proj.nbytes if attention == "sdpa" else 0
    assert merged.name == "+".join(modules)
    assert merged.nbytes == sum(g.nbytes for g in groups) - shared
    assert merged.kept_bytes == sum(g.kept_bytes for g in groups) > 0  # the received input, held elsewhere
    assert merged_layer_group(dims, layer_offload_groups(dims, 0, ["core_attn"], min_offload_bytes=1))[0].nbytes == next(
        g.nbytes for g in groups if g.name == "core_attn"
    )
    assert merged_layer_group(dims, []) == []


@pytest.mark.parametrize("attention", ["sdpa", "local"])
def test_a_bound_groups_each_run_of_calls_under_it(attention: str):
    """NOTE [Bounded layer groups]: a call joins while the group holds fewer bytes than the bound;
    past it attn_proj joins core_attn's group only where it saves core attention's output (SDPA)."""
    dims = GPTDims(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2, attention=attention, device="cpu")
    modules = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1"]
    groups = layer_offload_groups(dims, 1, modules, min_offload_bytes=1)
    nbytes = {g.name: g.nbytes for g in groups}
    bound = nbytes["attn_norm"] + 1  # a norm's group under it, two calls' over it
    assert nbytes["mlp_norm"] < bound <= min(nbytes["attn_norm"] + nbytes["qkv_linear"], nbytes["core_attn"])
    bounded = merged_layer_group(dims, groups, bound)
    if attention == "sdpa":
        assert [g.name for g in bounded] == ["attn_norm+qkv_linear", "core_attn+attn_proj", "mlp_norm+mlp_fc1"]
        assert bounded[1].nbytes == nbytes["core_attn"]  # SDPA's output once
    else:
        assert [g.name for g in bounded] == ["attn_norm+qkv_linear", "core_attn", "attn_proj+mlp_norm", "mlp_fc1"]
    assert sum(g.nbytes for g in bounded) == merged_layer_group(dims, groups)[0].nbytes
    by_module = merged_layer_group(dims, groups, 1)
    assert [g.name for g in by_module] == [g.name for g in joined_groups(dims, groups)]
    assert merged_layer_group(dims, groups, 1 << 40) == merged_layer_group(dims, groups)
