"""Hybrid (Mamba) layers in the byte model (issue 25 item 5), and the planner's refusals.

Mamba layers cannot run here (mamba_ssm's Triton kernels, causal_conv1d and Transformer Engine
need CUDA), so `chunk_offload.planner.mamba` is checked against the tensors its docstring reads
from the sources, written out again here one by one; the layer pattern, the offload groups each
layer kind opens and the refusals are checked as rules. Nothing here is a measurement.
"""

from __future__ import annotations

import pytest

from chunk_offload.core.errors import ChunkOffloadError
from chunk_offload.planner import (
    GPTDims,
    PipelineConfig,
    StagePlanner,
    group_bytes,
    layer_backward_flops,
    layer_forward_flops,
    layer_groups,
    layer_offload_groups,
    layer_saved_bytes,
    saved_tensors,
)
from chunk_offload.planner.cli import main as planner_main
from chunk_offload.planner.mamba import mamba_saved

_HYBRID = dict(
    num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=512, micro_batch_size=2,
    transformer_impl="transformer_engine", normalization="RMSNorm", hybrid_layer_pattern="M*M-",
)  # fmt: skip


def _hybrid(**overrides) -> GPTDims:
    return GPTDims(**{**_HYBRID, **overrides})


@pytest.mark.parametrize(("dtype", "tp", "sp"), [("bf16", 1, False), ("fp32", 1, False), ("bf16", 2, True)])
def test_a_mamba_layer_saves_what_the_sources_say(dtype: str, tp: int, sp: bool) -> None:
    """hidden 256, 2 x 256 / 64 = 8 heads of 64 channels (d_inner 512), 8 groups, state 128, T = 1024."""
    dims = _hybrid(dtype=dtype, tensor_parallel=tp, sequence_parallel=sp, mamba_num_groups=8)
    d, t, h = dims.dtype_bytes, 1024, 256
    heads, inner, groups, state = 8 // tp, 512 // tp, 8 // tp, 128
    norm_t = t // tp if sp else t
    expected = {
        "in_proj.input": norm_t * h * d,  # TE's LayerNormLinear: input, norm output, rsigma (RMSNorm)
        "in_proj.ln_out": norm_t * h * d,
        "in_proj.rsigma": norm_t * 4,
        "exp_A_log": heads * 4,  # -exp(A_log.float()): exp's result and A, fp32
        "A": heads * 4,
        "zxBCdt": t * (2 * inner + 2 * groups * state + heads) * d,  # the combined kernel's input, a copy
        "out_x": t * inner * d,  # the scan's output before the gate
        "norm.input": t * inner * d,  # the gated RMSNorm: its input and one rstd per group and token
        "norm.rstd": groups * t * 4,
        "out_proj.input": t * inner * d,  # TE's Linear, row parallel: the whole sequence
    }
    if d != 4:
        expected["dt_bias_fp32"] = heads * 4  # dt_bias.float() copies a half-precision parameter
    assert {s.storage: s.nbytes for s in mamba_saved(dims)} == expected
    assert layer_saved_bytes(dims, 0) == layer_saved_bytes(dims, 2) == sum(expected.values())


def test_layer_kinds_modules_and_groups() -> None:
    dims = _hybrid(hybrid_layer_pattern="M*-E", num_experts=4, moe_router_topk=2)
    assert [dims.layer_symbols(i) for i in range(4)] == ["M", "*", "-", "E"]
    assert [dims.modules_of(i) for i in range(4)] == [
        [],  # a Mamba layer opens no offload group
        ["qkv_linear", "core_attn", "attn_proj"],  # the attention norm fused into linear_qkv
        ["mlp_fc1"],  # the MLP norm fused into linear_fc1
        ["mlp_norm", "expert_fc1", "moe_act"],  # MoE layers keep their TENorm
    ]
    every = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1", "expert_fc1"]
    assert [[n for n, _ in layer_groups(dims, i, every, min_offload_bytes=1)] for i in range(4)] == [
        [], ["qkv_linear", "core_attn", "attn_proj"], ["mlp_fc1"], ["mlp_norm", "expert_fc1", "expert_fc1", "expert_fc1", "expert_fc1"]
    ]
    gpt = GPTDims(**{**_HYBRID, "hybrid_layer_pattern": None})
    # The hybrid layers' parts add up to a GPT layer's (same norm, attention and MLP modules).
    assert layer_saved_bytes(dims, 1) + layer_saved_bytes(_hybrid(hybrid_layer_pattern="M*M-"), 3) == layer_saved_bytes(gpt, 0)
    assert layer_forward_flops(dims, 1) + layer_forward_flops(_hybrid(), 3) == layer_forward_flops(gpt, 0)
    assert layer_backward_flops(dims, 1) + layer_backward_flops(_hybrid(), 3) == layer_backward_flops(gpt, 0)


def test_mamba_flops_from_the_algorithm() -> None:
    dims = _hybrid(seq_length=200)  # 2 sequences of 200 tokens: 2 chunks of 128 each for the scan
    t, h, heads, inner, groups, state = 400, 256, 8, 512, 8, 128
    linears = 2 * t * h * (2 * inner + 2 * groups * state + heads) + 2 * t * inner * h
    conv = 2 * t * (inner + 2 * groups * state) * 4
    scan = 2 * 512 * (128 * state * groups + 128 * inner + 2 * state * inner)
    assert layer_forward_flops(dims, 0) == linears + conv + scan
    assert layer_backward_flops(dims, 0) == 2 * (linears + conv + scan) + conv


def test_a_chunk_starting_with_an_mlp_layer_holds_its_received_input() -> None:
    """The first module of a chunk's first layer saves the received input (NOTE [Storages held elsewhere])."""
    dims = _hybrid(hybrid_layer_pattern="M*-*")
    (group,) = layer_offload_groups(dims, 2, ["mlp_fc1"], min_offload_bytes=1, receives_input=True)
    input_bytes = dims.tokens * dims.hidden_size * dims.dtype_bytes
    assert group.kept_bytes == input_bytes and group.nbytes > input_bytes
    assert layer_offload_groups(dims, 0, ["mlp_fc1"], min_offload_bytes=1, receives_input=True) == []


def test_the_planner_counts_mamba_layers_in_the_peak_but_offloads_none() -> None:
    dims = _hybrid(hybrid_layer_pattern="MM*-")
    planner = StagePlanner(dims, PipelineConfig(pipeline_parallel=2, num_microbatches=4), min_offload_bytes=1)
    first, second = planner.estimate(["qkv_linear", "mlp_fc1"])
    assert first.group_names == {0: []} and first.drop == 0
    assert first.activation_bytes_per_chunk == {0: 2 * group_bytes(mamba_saved(dims), min_offload_bytes=0)}
    assert second.group_names == {0: ["qkv_linear", "mlp_fc1"]} and min(second.group_bytes[0]) > 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hybrid_layer_pattern": "M*G-"}, r"symbol\(s\) not modelled \('G': GatedDeltaNet layers\)"),
        ({"hybrid_layer_pattern": "M*|M-", "num_layers": 5}, r"'\|': pipeline stage boundaries"),
        ({"hybrid_layer_pattern": "M*M"}, "has 3 layers but num_layers is 4"),
        ({"transformer_impl": "local"}, "hybrid_layer_pattern needs transformer_impl='transformer_engine'"),
        ({"hybrid_layer_pattern": "M*ME"}, r"has MoE layers \(E\): set num_experts"),
        ({"num_experts": 2, "moe_layer_freq": 2}, "moe_layer_freq does not apply with hybrid_layer_pattern"),
        ({"mtp_num_layers": 1}, "hybrid Multi-Token Prediction"),
        ({"mamba_head_dim": 48}, r"2 x hidden_size \(512\) must be divisible by mamba_head_dim 48"),
        ({"mamba_num_heads": 6}, r"Mamba heads \(6\) must be divisible by mamba_num_groups \(8\)"),
        ({"mamba_num_groups": 1, "tensor_parallel": 2}, r"mamba_num_groups \(1\) must be divisible by tensor_parallel \(2\)"),
        ({"mamba_state_dim": 0}, "mamba_state_dim must be an int >= 1, got 0"),
    ],
)
def test_what_the_planner_does_not_model_is_refused(overrides: dict, message: str) -> None:
    with pytest.raises(ChunkOffloadError, match=message):
        _hybrid(**overrides)


def test_fused_group_mlp_is_refused_by_the_planner(capsys) -> None:
    dims = GPTDims(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=1, num_experts=2)
    planner = StagePlanner(dims, PipelineConfig(num_microbatches=2), min_offload_bytes=1)
    with pytest.raises(ChunkOffloadError, match="'fused_group_mlp' is not modelled by the planner: .*plan with expert_fc1"):
        planner.estimate(["core_attn", "fused_group_mlp"])
    with pytest.raises(ChunkOffloadError, match="'fused_group_mlp' is not modelled"):
        saved_tensors(dims, "fused_group_mlp")
    argv = ["plan", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--num-microbatches", "2", "--num-experts", "2", "--modules", "fused_group_mlp"]  # fmt: skip
    assert planner_main(argv) == 2
    assert "'fused_group_mlp' is not modelled by the planner" in capsys.readouterr().err


def test_the_command_line_takes_the_hybrid_pattern_and_mtp_layers(capsys) -> None:
    argv = ["plan", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "512",
            "--num-microbatches", "4", "--pp", "2", "--transformer-impl", "transformer_engine",
            "--hybrid-override-pattern", "M*M-", "--mamba-num-groups", "4"]  # fmt: skip
    assert planner_main(argv) == 0
    assert "hybrid layers M*M- on Transformer Engine's spec: Mamba layers (M) from megatron-core's" in capsys.readouterr().out
    argv = ["plan", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--num-microbatches", "4", "--pp", "2", "--mtp-num-layers", "1", "--tp", "2"]  # fmt: skip
    assert planner_main(argv) == 2
    assert "--mtp-num-layers with --tp 2 is not modelled" in capsys.readouterr().err
