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
from chunk_offload.integrations.megatron import modules
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


def _mtp_block(*inner: nn.Module, attribute: str) -> nn.Module:
    """``GPTModel.mtp``: MTP layers holding their transformer layer as ``attribute``."""
    block = nn.Module()
    block.layers = nn.ModuleList()
    for layer in inner:
        mtp_layer = nn.Module()
        mtp_layer.eh_proj = nn.Linear(16, 8)
        setattr(mtp_layer, attribute, layer)
        block.layers.append(mtp_layer)
    return block


@pytest.mark.parametrize("attribute", ["transformer_layer", "mtp_model_layer"])  # megatron-core 0.16, 0.19
def test_the_layers_inside_mtp_layers_resolve_after_the_decoders(attribute):
    decoder_layer, first, second = _te_layer(), _te_layer(), _te_moe_layer()
    gpt = _model(decoder_layer)
    gpt.mtp = _mtp_block(first, second, attribute=attribute)
    model = _model(wrapped=True)
    model.module = gpt
    assert transformer_layers(model) == [decoder_layer, first, second]
    assert resolve(model, "qkv_linear") == [layer.self_attention.linear_qkv for layer in (decoder_layer, first, second)]
    assert resolve(model, "expert_fc1") == [second.mlp.experts.linear_fc1]


def test_a_hybrid_stack_inside_an_mtp_layer_gives_its_layers():
    """megatron-core 0.19's hybrid MTP layers hold a HybridStack (``.layers``) as ``mtp_model_layer``."""
    mamba, attention = nn.Module(), _te_layer()
    mamba.mixer = nn.Linear(8, 8)  # MambaLayer: no offload module
    stack = nn.Module()
    stack.layers = nn.ModuleList([mamba, attention])
    gpt = _model(_te_layer())
    gpt.mtp = _mtp_block(stack, attribute="mtp_model_layer")
    assert transformer_layers(gpt)[1:] == [mamba, attention]
    assert resolve(gpt, "core_attn")[1:] == [attention.self_attention.core_attention]


class TEGroupedMLP(nn.Module):
    """Named as megatron-core's TEGroupedMLP, which the resolver recognises by its class name."""

    def __init__(self, op_fuser: bool) -> None:
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(use_transformer_engine_op_fuser=op_fuser)
        self.linear_fc1 = nn.Linear(8, 32)
        self.linear_fc2 = nn.Linear(32, 8)


def _grouped_moe_model(op_fuser: bool) -> tuple[nn.Module, nn.Module]:
    from types import SimpleNamespace

    layer = _te_moe_layer()
    layer.mlp.experts = TEGroupedMLP(op_fuser)
    model = _model(_te_layer(), layer)
    model.config = SimpleNamespace(use_transformer_engine_op_fuser=op_fuser)
    return model, layer


@pytest.fixture
def op_fuser_megatron(monkeypatch):
    """As if the installed megatron-core had TransformerConfig.use_transformer_engine_op_fuser (0.18 on)."""
    monkeypatch.setattr(modules, "_megatron_has_op_fuser", lambda: True)


def test_fused_group_mlp_resolves_to_op_fuser_experts_only(op_fuser_megatron):
    model, layer = _grouped_moe_model(op_fuser=True)
    assert resolve(model, "fused_group_mlp") == [layer.mlp.experts]
    assert resolve(_grouped_moe_model(op_fuser=False)[0], "fused_group_mlp") == []
    manager = attach([model], ["qkv_linear", "fused_group_mlp"], config=OffloadConfig(min_offload_bytes=1))
    try:
        assert manager.registered == {"qkv_linear": 2, "fused_group_mlp": 1}
    finally:
        manager.close()


def test_fused_group_mlp_without_the_op_fuser_is_refused(op_fuser_megatron):
    model, _ = _grouped_moe_model(op_fuser=False)
    with pytest.raises(chunk_offload.ChunkOffloadError, match=r"this model's config has use_transformer_engine_op_fuser=False"):
        attach([model], ["fused_group_mlp"])
    model.config.use_transformer_engine_op_fuser = True  # set, but the experts are SequentialMLP
    model.decoder.layers[1].mlp.experts = nn.Module()
    model.decoder.layers[1].mlp.experts.local_experts = nn.ModuleList([nn.Linear(8, 8)])
    with pytest.raises(chunk_offload.ChunkOffloadError, match=r"this model's experts are \['Module'\].*offload expert_fc1"):
        attach([model], ["fused_group_mlp"])


def test_expert_fc1_on_op_fuser_experts_is_refused(op_fuser_megatron):
    model, _ = _grouped_moe_model(op_fuser=True)
    with pytest.raises(chunk_offload.ChunkOffloadError, match=r"\['expert_fc1', 'moe_act'\] on experts run by .*offload fused_group_mlp instead"):
        attach([model], ["expert_fc1", "moe_act"])


def test_fused_group_mlp_names_the_installed_megatron_core_where_it_lacks_the_op_fuser(monkeypatch):
    """megatron-core 0.16 has no op fuser (the refusal as it happens there); 0.19 has it (0.18 added it) (refusal simulated)."""
    import importlib.metadata

    from packaging.version import Version

    version = importlib.metadata.version("megatron-core")
    assert modules._megatron_has_op_fuser() == (Version(version) >= Version("0.18"))
    monkeypatch.setattr(modules, "_megatron_has_op_fuser", lambda: False)
    model, _ = _grouped_moe_model(op_fuser=True)
    with pytest.raises(
        chunk_offload.ChunkOffloadError,
        match=rf"'fused_group_mlp' needs .* but the installed megatron-core {version} has no use_transformer_engine_op_fuser",
    ):
        attach([model], ["fused_group_mlp"])


def test_gdp_qkv_is_refused_with_its_reason():
    with pytest.raises(chunk_offload.ChunkOffloadError, match=r"'gdp_qkv' is not supported: .*a method and not a submodule"):
        attach([_model(_te_layer())], ["gdp_qkv"])


def _graphed_model(**graphs: object) -> nn.Module:
    """Two TE-layout layers whose megatron-core TransformerConfig has the CUDA-graph settings ``graphs``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, **graphs)
    layers = [_te_layer(), _te_layer()]
    for layer in layers:
        layer.config = config
    return _model(*layers)


@pytest.mark.parametrize(
    "graphs",
    [
        {"cuda_graph_impl": "local"},  # megatron-core's default scope, "full": the whole layer
        {"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": []},
        {"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration"},  # 0.19 names it cuda_graph_impl="full_iteration"
    ],
    ids=["local-full", "te-layer", "local-full-iteration"],
)
def test_whole_layer_cuda_graphs_are_refused_at_attach(graphs):
    """NOTE [CUDA graph capture]: a layer captured whole would run its offload modules inside a graph.
    megatron-core 0.19 renamed cuda_graph_scope to cuda_graph_modules (the old name still sets it)."""
    with pytest.raises(
        chunk_offload.ChunkOffloadError,
        match=r"cuda_graph_impl='(local|transformer_engine|full_iteration)' with cuda_graph_(scope|modules)="
        r"(the whole layer|\['full_iteration'\]): megatron-core captures every transformer layer .*offload \['qkv_linear'\]; "
        r"set --cuda-graph-impl none",
    ):
        attach([_graphed_model(**graphs)], ["qkv_linear"])


@pytest.mark.parametrize("graphs", [{"cuda_graph_impl": "none"}, {"cuda_graph_impl": "local", "cuda_graph_scope": "attn"}], ids=["none", "attn-scope"])
def test_no_or_partial_cuda_graphs_attach(graphs):
    """A partial scope is left to the engine, which refuses a group opened during a capture (tests/core/test_cuda_graph_capture.py)."""
    manager = attach([_graphed_model(**graphs)], ["qkv_linear"])
    try:
        assert manager.registered == {"qkv_linear": 2}
    finally:
        manager.close()
