"""The offload-module names have one definition, shared by the Megatron integration and the planner."""

from __future__ import annotations

import importlib.util

import pytest

from chunk_offload import module_names
from chunk_offload.planner import OFFLOAD_MODULE_NAMES, GPTDims


def test_one_definition_for_integration_and_planner():
    from chunk_offload.integrations.megatron import ALIASES, OFFLOAD_MODULE_NAMES as integration_names
    from chunk_offload.integrations.megatron.modules import _RESOLVERS

    assert integration_names is module_names.OFFLOAD_MODULE_NAMES is OFFLOAD_MODULE_NAMES
    assert ALIASES is module_names.ALIASES
    assert list(_RESOLVERS) == list(OFFLOAD_MODULE_NAMES)  # every name resolves, in call order
    assert set(module_names.DESCRIPTIONS) == set(OFFLOAD_MODULE_NAMES)
    # Every name the planner's layers list is an offload-module name, in the same order.
    dims = GPTDims(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=1, num_experts=2, moe_layer_freq=(0, 1))
    for layer in range(2):
        names = dims.modules_of(layer)
        assert names == [n for n in OFFLOAD_MODULE_NAMES if n in names]


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_te_fused_names_match_megatrons_te_spec():
    """Under megatron's TE spec the norms are IdentityOps and the next linear is TE's LayerNormLinear wrapper."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    try:
        spec = get_gpt_layer_with_transformer_engine_spec()
    except Exception as e:  # noqa: BLE001 - without Transformer Engine the spec cannot be built
        pytest.skip(f"Transformer Engine's spec needs Transformer Engine: {e}")
    sub = spec.submodules
    assert sub.input_layernorm.__name__ == "IdentityOp" and "LayerNorm" in sub.self_attention.submodules.linear_qkv.__name__
    assert sub.pre_mlp_layernorm.__name__ == "IdentityOp" and "LayerNorm" in sub.mlp.submodules.linear_fc1.__name__
