"""`merged_layer_group`: the planner's one group per layer under ``group_by="layer"`` (NOTE [Layer groups]).

`tests/planner/test_estimate.py` checks the merged bytes against megatron-core runs; this file
checks the rule itself on the byte model.
"""

from __future__ import annotations

import pytest

from chunk_offload.planner import GPTDims, layer_offload_groups, merged_layer_group
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
