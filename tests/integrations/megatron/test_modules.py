"""Offload-module names resolve to the right submodules for both megatron layer layouts.

The local spec is exercised end to end by test_attach.py. The Transformer Engine spec cannot be
built without CUDA, so its layout (norms fused into the linears: `input_layernorm` and
`pre_mlp_layernorm` are megatron's IdentityOp) is rebuilt here from plain modules with megatron's
attribute names; resolution only looks at those names and types.
"""

from __future__ import annotations

import importlib.util
import logging

import pytest
from torch import nn

import chunk_offload
from chunk_offload import OffloadConfig
from chunk_offload.integrations.megatron import attach
from chunk_offload.integrations.megatron.modules import resolve, transformer_layers

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
    reason='megatron-core is not installed (pip install "chunk-offload[megatron]")',
)


def _te_layer() -> nn.Module:
    from megatron.core.transformer.identity_op import IdentityOp

    layer = nn.Module()
    layer.input_layernorm = IdentityOp()
    layer.self_attention = nn.Module()
    layer.self_attention.linear_qkv = nn.Linear(8, 24)  # TELayerNormColumnParallelLinear in the real spec
    layer.self_attention.core_attention = nn.Identity()  # TEDotProductAttention
    layer.self_attention.linear_proj = nn.Linear(8, 8)
    layer.pre_mlp_layernorm = IdentityOp()
    layer.mlp = nn.Module()
    layer.mlp.linear_fc1 = nn.Linear(8, 32)
    layer.mlp.linear_fc2 = nn.Linear(32, 8)
    return layer


def _te_moe_layer() -> nn.Module:
    layer = _te_layer()
    layer.pre_mlp_layernorm = nn.LayerNorm(8)  # MoE layers keep a separate norm
    layer.mlp = nn.Module()
    layer.mlp.router = nn.Linear(8, 4)
    layer.mlp.experts = nn.Module()  # TEGroupedMLP: one fc1 module for all local experts
    layer.mlp.experts.linear_fc1 = nn.Linear(8, 32)
    layer.mlp.experts.activation_func = nn.GELU()
    return layer


def _model(*layers: nn.Module, wrapped: bool = False) -> nn.Module:
    gpt = nn.Module()
    gpt.decoder = nn.Module()
    gpt.decoder.layers = nn.ModuleList(layers)
    if not wrapped:
        return gpt
    wrapper = nn.Module()  # DDP / Float16Module keep the model as `.module`
    wrapper.module = gpt
    return wrapper


def test_te_layout_resolves_fused_norms_to_nothing():
    dense, moe = _te_layer(), _te_moe_layer()
    model = _model(dense, moe, wrapped=True)
    assert transformer_layers(model) == [dense, moe]
    assert resolve(model, "attn_norm") == []
    assert resolve(model, "qkv_linear") == [dense.self_attention.linear_qkv, moe.self_attention.linear_qkv]
    assert resolve(model, "core_attn") == [dense.self_attention.core_attention, moe.self_attention.core_attention]
    assert resolve(model, "attn_proj") == [dense.self_attention.linear_proj, moe.self_attention.linear_proj]
    assert resolve(model, "mlp_norm") == [moe.pre_mlp_layernorm]
    assert resolve(model, "mlp_fc1") == [dense.mlp.linear_fc1]
    assert resolve(model, "expert_fc1") == [moe.mlp.experts.linear_fc1]
    assert resolve(model, "moe_act") == [moe.mlp.experts.activation_func]


def test_attach_warns_about_a_fused_norm_and_offloads_the_rest(caplog):
    model = _model(_te_layer(), _te_layer())
    with caplog.at_level(logging.WARNING, logger="chunk_offload.integrations.megatron.modules"):
        manager = attach([model], ["attn_norm", "qkv_linear"], config=OffloadConfig(min_offload_bytes=1))
    try:
        assert manager.registered == {"qkv_linear": 2}
        assert any("'attn_norm' matches no submodule" in r.getMessage() and "offload qkv_linear" in r.getMessage() for r in caplog.records)
    finally:
        manager.close()


def test_a_model_without_a_decoder_is_refused():
    with pytest.raises(chunk_offload.ChunkOffloadError, match="no megatron-core TransformerBlock"):
        attach([nn.Linear(2, 2)], ["core_attn"])
