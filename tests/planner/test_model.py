"""The byte and FLOP model against real megatron-core runs on CPU, and its rules in isolation.

`_measure.measure` trains one step of each case below in one spawned process (see its
docstring) and returns, per offload group of the step, the module that opened it and the
bytes the engine accounted for it. The planner must predict every group's bytes exactly, in
the same order; the whole-layer bytes of dense layers and each layer's matmul FLOPs too.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from chunk_offload.core.errors import ChunkOffloadError
from chunk_offload.planner import (
    OFFLOAD_MODULE_NAMES,
    GPTDims,
    SavedTensor,
    canonical_modules,
    core_attention_flops,
    expert_tokens,
    group_bytes,
    layer_forward_flops,
    layer_groups,
    layer_saved_bytes,
    saved_tensors,
)

from ._measure import ByteCase, CaseBytes, measure_or_skip

_CASES = {
    "dense": ByteCase(),
    "gqa": ByteCase(num_query_groups=2),
    "mqa": ByteCase(num_query_groups=1),
    "moe": ByteCase(num_experts=4, moe_router_topk=2, add_bias_linear=False),
    # top-k = E: every token goes to every expert, so each expert's share is exact too.
    "mixed_moe_all_experts": ByteCase(num_experts=2, moe_router_topk=2, moe_layer_freq=(0, 1), add_bias_linear=False),
    "other_shape": ByteCase(hidden_size=48, ffn_hidden_size=72, num_attention_heads=6, seq_length=24, micro_batch_size=3),
    "bf16": ByteCase(dtype=torch.bfloat16),
    # 300 bytes: the causal mask (16 x 16 bools) and LayerNorm's mean and rstd (32 fp32 each) stay.
    "threshold": ByteCase(num_query_groups=2, min_offload_bytes=300),
    # Llama-style: RMSNorm, unfused SwiGLU, rotary embeddings (value stays a view), no biases.
    "llama": ByteCase(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False),
    # Megatron-LM's fused bias-SwiGLU, grouped-query attention with rotary embeddings, bf16.
    "llama_fused_gqa_bf16": ByteCase(
        normalization="RMSNorm",
        swiglu=True,
        bias_activation_fusion=True,
        position_embedding_type="rope",
        num_query_groups=2,
        dtype=torch.bfloat16,
    ),
    "moe_swiglu": ByteCase(num_experts=2, moe_router_topk=2, swiglu=True, normalization="RMSNorm", add_bias_linear=False),
    "moe_swiglu_fused_bf16": ByteCase(
        num_experts=2, moe_router_topk=2, swiglu=True, bias_activation_fusion=True, add_bias_linear=False, dtype=torch.bfloat16
    ),
    # Tensor parallel 2 on two gloo ranks (per-rank bytes), with and without sequence parallelism.
    "tp2_rope": ByteCase(tensor_parallel=2, position_embedding_type="rope"),
    "tp2_sp_llama_gqa_bf16": ByteCase(
        tensor_parallel=2,
        sequence_parallel=True,
        normalization="RMSNorm",
        swiglu=True,
        bias_activation_fusion=True,
        num_query_groups=2,
        add_bias_linear=False,
        dtype=torch.bfloat16,
    ),
    "tp2_sp_layernorm_swiglu_rope": ByteCase(
        tensor_parallel=2, sequence_parallel=True, swiglu=True, position_embedding_type="rope"
    ),
    # torch's SDPA core attention (the example's default): query, key, value, output, log-sum-exp.
    "sdpa_dense": ByteCase(attention="sdpa"),
    "sdpa_gqa": ByteCase(attention="sdpa", num_query_groups=2),
    "sdpa_mqa": ByteCase(attention="sdpa", num_query_groups=1),
    "sdpa_moe": ByteCase(attention="sdpa", num_experts=4, moe_router_topk=2, add_bias_linear=False),
    "sdpa_llama": ByteCase(attention="sdpa", normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False),
    # One sequence per microbatch: attn_proj's input is a view of SDPA's output.
    "sdpa_one_sequence_rope_gqa": ByteCase(attention="sdpa", micro_batch_size=1, num_query_groups=2, position_embedding_type="rope"),
    "sdpa_one_sequence": ByteCase(attention="sdpa", micro_batch_size=1),
    # 300 bytes: the log-sum-exp (2 x 4 x 16 fp32 = 512 B) moves, LayerNorm's mean and rstd stay.
    "sdpa_threshold": ByteCase(attention="sdpa", num_query_groups=2, min_offload_bytes=300),
    "sdpa_tp2_rope": ByteCase(attention="sdpa", tensor_parallel=2, position_embedding_type="rope"),
    "sdpa_tp2_gqa": ByteCase(attention="sdpa", tensor_parallel=2, num_query_groups=2),
    # Selective recompute: the checkpointed module opens no group; its inputs are saved instead.
    "recompute_core_attn": ByteCase(recompute_modules=("core_attn",)),
    "recompute_core_attn_gqa_rope": ByteCase(num_query_groups=2, position_embedding_type="rope", recompute_modules=("core_attn",)),
    "sdpa_recompute_core_attn_one_sequence": ByteCase(attention="sdpa", micro_batch_size=1, recompute_modules=("core_attn",)),
    "recompute_moe": ByteCase(num_experts=4, moe_router_topk=2, add_bias_linear=False, recompute_modules=("moe",)),
    "sdpa_recompute_both_mixed_moe": ByteCase(
        attention="sdpa", num_experts=2, moe_router_topk=2, moe_layer_freq=(0, 1), add_bias_linear=False, recompute_modules=("core_attn", "moe")
    ),
}
# The same Llama-style bf16 cases (fused SwiGLU, GQA; RoPE, or TP=2 with SP) with SDPA.
_CASES.update({f"sdpa_{n}": dataclasses.replace(_CASES[n], attention="sdpa") for n in ("llama_fused_gqa_bf16", "tp2_sp_llama_gqa_bf16")})


def _dims(case: ByteCase) -> GPTDims:
    return GPTDims(
        num_layers=case.num_layers,
        hidden_size=case.hidden_size,
        ffn_hidden_size=case.ffn_hidden_size,
        num_attention_heads=case.num_attention_heads,
        num_query_groups=case.num_query_groups,
        seq_length=case.seq_length,
        micro_batch_size=case.micro_batch_size,
        num_experts=case.num_experts,
        moe_router_topk=case.moe_router_topk,
        moe_layer_freq=case.moe_layer_freq,
        dtype={torch.float32: "fp32", torch.bfloat16: "bf16"}[case.dtype],
        device="cpu",
        normalization=case.normalization,
        swiglu=case.swiglu,
        bias_swiglu_fusion=case.bias_activation_fusion,
        position_embedding_type=case.position_embedding_type,
        tensor_parallel=case.tensor_parallel,
        sequence_parallel=case.sequence_parallel,
        attention=case.attention,
        recompute_modules=case.recompute_modules,
    )


@pytest.fixture(scope="module")
def measured() -> dict[str, CaseBytes]:
    return measure_or_skip(_CASES)


def test_cases_cover_the_issue():
    """Dense, GQA, MoE and another seq/hidden shape at least, and both dtypes the model has."""
    dims = {name: _dims(case) for name, case in _CASES.items()}
    assert any(d.num_experts is None and d.query_groups == d.num_attention_heads for d in dims.values())
    assert any(1 < d.query_groups < d.num_attention_heads for d in dims.values())
    assert any(d.num_experts for d in dims.values())
    assert len({(d.seq_length, d.hidden_size) for d in dims.values()}) > 1
    assert {d.dtype for d in dims.values()} == {"fp32", "bf16"}
    # Llama-style options, each with the other choices, and tensor parallelism with and without SP.
    assert {d.normalization for d in dims.values()} == {"LayerNorm", "RMSNorm"}
    assert {(d.swiglu, d.bias_swiglu_fusion) for d in dims.values() if d.swiglu} == {(True, True), (True, False)}
    assert any(d.rope and d.query_groups == d.num_attention_heads for d in dims.values())
    assert any(d.rope and d.query_groups < d.num_attention_heads for d in dims.values())
    assert {(d.tensor_parallel, d.sequence_parallel) for d in dims.values()} == {(1, False), (2, False), (2, True)}
    assert any(d.swiglu and d.num_experts for d in dims.values())
    # The SDPA core attention: dense, GQA, MQA, MoE, RoPE, bf16, TP=2 with and without SP, b = 1.
    sdpa = [d for d in dims.values() if d.attention == "sdpa"]
    assert {d.local_query_groups == d.local_heads for d in sdpa} == {True, False}
    assert any(d.query_groups == 1 for d in sdpa) and any(d.num_experts for d in sdpa)
    assert any(d.rope for d in sdpa) and any(d.dtype == "bf16" for d in sdpa)
    assert {(d.tensor_parallel, d.sequence_parallel) for d in sdpa} == {(1, False), (2, False), (2, True)}
    assert {d.micro_batch_size for d in sdpa} == {1, 2}


@pytest.mark.parametrize("name", list(_CASES))
def test_every_rank_measured_the_same(measured: dict[str, CaseBytes], name: str):
    """Tensor-parallel ranks hold the same shapes, so the per-rank model is every rank's."""
    assert measured[name].same_on_every_rank, name


@pytest.mark.parametrize("name", list(_CASES))
def test_every_group_in_order(measured: dict[str, CaseBytes], name: str):
    """Each group of the step: same module, same layer, same bytes, same order (experts: summed)."""
    case, got = _CASES[name], measured[name]
    dims = _dims(case)
    modules = [m for m in OFFLOAD_MODULE_NAMES if m != "moe_act"]  # no module in the local spec
    predicted = [
        (layer, group, nbytes)
        for layer in range(dims.num_layers)
        for group, nbytes in layer_groups(dims, layer, modules, min_offload_bytes=case.min_offload_bytes)
    ]
    assert [(layer, g) for layer, g, _ in got.calls] == [(layer, g) for layer, g, _ in predicted], name
    routed = dims.num_experts is not None and dims.moe_router_topk < dims.num_experts
    exact = [c for c in got.calls if not (routed and c[1] == "expert_fc1")]
    assert exact == [p for p in predicted if not (routed and p[1] == "expert_fc1")], name
    # Expert fc1 groups: routing decides each expert's share; at EP = 1 their sum per layer is exact.
    for layer in range(dims.num_layers):
        measured_experts = [b for l, g, b in got.calls if l == layer and g == "expert_fc1"]
        predicted_experts = [b for l, g, b in predicted if l == layer and g == "expert_fc1"]
        assert sum(measured_experts) == sum(predicted_experts), (name, layer)
        experts = dims.local_experts if dims.is_moe(layer) and not dims.recomputed(layer, "expert_fc1") else 0
        assert len(measured_experts) == len(predicted_experts) == experts
    # The per-name totals of the manager's statistics, one microbatch.
    totals: dict[str, int] = {}
    for _, g, b in predicted:
        totals[g] = totals.get(g, 0) + b
    assert got.totals == totals, name


@pytest.mark.parametrize("name", [n for n, c in _CASES.items() if c.min_offload_bytes <= 1])
def test_whole_layer_bytes(measured: dict[str, CaseBytes], name: str):
    """Dense layers exactly; MoE layers miss only the routing metadata, a few T x (E + topk) tensors."""
    dims = _dims(_CASES[name])
    for layer, got in enumerate(measured[name].layer_bytes):
        model = layer_saved_bytes(dims, layer)
        if not dims.is_moe(layer) or dims.recomputed(layer, "expert_fc1"):  # a recomputed MoE saves no routing
            assert got == model, (name, layer)
        else:
            # Routing metadata: indices (int64), probabilities, maps; at most 8 tensors of
            # T x (E + topk) elements of 8 bytes each, by reading megatron's router and dispatcher.
            bound = 8 * dims.tokens * (dims.num_experts + dims.moe_router_topk) * 8
            assert 0 < got - model < bound, (name, layer, got, model)


@pytest.mark.parametrize("name", list(_CASES))
def test_layer_flops(measured: dict[str, CaseBytes], name: str):
    """Matmul FLOPs of every layer's forward, as torch's FlopCounterMode counts them.

    FlopCounterMode has no formula for torch's CPU flash kernel (it counts SDPA's CUDA kernels,
    see tests/planner/test_attention.py): with SDPA everything but the core attention is compared.
    """
    dims = _dims(_CASES[name])
    uncounted = core_attention_flops(dims).forward if dims.attention == "sdpa" else 0
    assert measured[name].layer_flops == [layer_forward_flops(dims, i) - uncounted for i in range(dims.num_layers)], name


# --------------------------------------------------------------------------------------------
# Rules, without megatron.
# --------------------------------------------------------------------------------------------


def _tiny(**overrides) -> GPTDims:
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=2, dtype="fp32", attention="local")
    return GPTDims(**{**fields, **overrides})


def test_group_bytes_threshold_dedup_and_alignment():
    a = SavedTensor("x", 0, 100, 100)
    b = SavedTensor("x", 200, 100, 100)  # another view of the same storage: one span 0..300
    assert group_bytes([a, b], min_offload_bytes=0) == 300
    assert group_bytes([a, b], min_offload_bytes=101) == 0  # both views below the threshold stay
    # A view starting at byte 40: the copied span starts at 32 (rounded down to 16).
    assert group_bytes([SavedTensor("y", 40, 64, 64)], min_offload_bytes=1) == 64 + 8
    # Views of different storages are counted separately.
    assert group_bytes([a, SavedTensor("z", 0, 100, 100)], min_offload_bytes=1) == 200
    # The threshold compares the view's own bytes, not its storage's: a small view stays.
    assert group_bytes([a, SavedTensor("x", 500, 8, 8)], min_offload_bytes=50) == 100


def test_norm_statistics_follow_the_device():
    """LayerNorm keeps mean and rstd in fp32 on CUDA (accumulate type), in the input dtype on CPU."""
    t = 32
    cuda, cpu = _tiny(dtype="bf16"), _tiny(dtype="bf16", device="cpu")
    stats = lambda d: [s.nbytes for s in saved_tensors(d, "attn_norm") if s.storage != "input"]  # noqa: E731
    assert stats(cuda) == [t * 4, t * 4]
    assert stats(cpu) == [t * 2, t * 2]


def test_rmsnorm_saves_fp32_on_cpu_and_the_input_with_an_fp32_rstd_on_cuda():
    """CPU: torch's composite in fp32 (measured above); CUDA: the fused kernel's input and rstd (torch's formula)."""
    t, h = 32, 32
    saved = lambda d: sorted(x.nbytes for x in saved_tensors(d, "mlp_norm"))  # noqa: E731
    assert saved(_tiny(dtype="bf16", normalization="RMSNorm", device="cpu")) == [t * 4, t * h * 4, t * h * 4]
    assert saved(_tiny(dtype="bf16", normalization="RMSNorm")) == [t * 4, t * h * 2]
    # Under sequence parallelism each of tp ranks normalises s/tp of the tokens.
    sp = _tiny(dtype="bf16", normalization="RMSNorm", tensor_parallel=2, sequence_parallel=True)
    assert saved(sp) == [t // 2 * 4, t // 2 * h * 2]


def test_tensor_parallel_splits_heads_and_ffn_and_sequence_parallel_the_norm_tokens():
    base = _tiny(swiglu=True, position_embedding_type="rope")
    tp = _tiny(swiglu=True, position_embedding_type="rope", tensor_parallel=2)
    sp = _tiny(swiglu=True, position_embedding_type="rope", tensor_parallel=2, sequence_parallel=True)
    one = lambda d, n: group_bytes(saved_tensors(d, n), min_offload_bytes=1)  # noqa: E731
    assert one(tp, "attn_proj") * 2 == one(base, "attn_proj")
    assert one(tp, "qkv_linear") == one(base, "qkv_linear")  # the whole (replicated) input
    assert one(sp, "qkv_linear") * 2 == one(base, "qkv_linear")  # the local shard
    assert one(sp, "attn_norm") * 2 == one(base, "attn_norm")
    assert one(sp, "core_attn") == one(tp, "core_attn")  # attention sees the whole sequence
    assert layer_forward_flops(tp, 0) * 2 == layer_forward_flops(base, 0)


def test_rope_value_view_spans_the_rest_of_linear_qkv_output():
    """Multi-head attention with RoPE: rotated query and key copies, value a view from 2*hn on."""
    dims = _tiny(position_embedding_type="rope")  # hn = 8, fp32: value starts at byte 64
    one = dims.tokens * dims.hidden_size * 4
    qkv = [x for x in saved_tensors(dims, "core_attn") if x.storage in ("query", "key", "mixed")]
    assert qkv == [SavedTensor("query", 0, one, one), SavedTensor("key", 0, one, one), SavedTensor("mixed", 64, 3 * one - 64, one)]
    # A threshold above one view keeps all three on device, though the value view spans ~3 of them.
    assert group_bytes(qkv, min_offload_bytes=one + 1) == 0


def test_expert_tokens_split_evenly_and_sum_to_tokens_times_topk():
    dims = _tiny(num_experts=6, moe_router_topk=2, expert_parallel=2)
    assert expert_tokens(dims) == [22, 21, 21]
    assert sum(expert_tokens(dims)) == dims.tokens * dims.moe_router_topk
    assert expert_tokens(_tiny()) == []
    # Each local expert's fc1 input is a view of the permuted tokens, after the previous experts'.
    views = [saved_tensors(dims, "expert_fc1", expert=e)[0] for e in range(3)]
    assert [v.offset for v in views] == [0, 22 * 32 * 4, 43 * 32 * 4]


def test_layer_groups_order_and_aliases():
    moe = _tiny(num_experts=2, moe_layer_freq=(1, 0))
    names = [n for n, _ in layer_groups(moe, 0, ["moe_act", "router_fc1", "attn_norm"], min_offload_bytes=1)]
    assert names == ["attn_norm", "expert_fc1", "moe_act", "expert_fc1", "moe_act"]
    assert [n for n, _ in layer_groups(moe, 1, ["expert_fc1", "mlp_fc1"], min_offload_bytes=1)] == ["mlp_fc1"]
    assert layer_groups(moe, 1, [], min_offload_bytes=1) == []


def test_unknown_module_names_the_valid_ones():
    with pytest.raises(ChunkOffloadError, match=r"unknown offload module 'qkv'; valid names: \['attn_norm'.*'router_fc1'\]"):
        canonical_modules("core_attn,qkv")
    with pytest.raises(ChunkOffloadError, match="no offload module given"):
        canonical_modules(" , ")
    assert canonical_modules(["router_fc1", "expert_fc1", "core_attn"]) == ["expert_fc1", "core_attn"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_size": 30}, "hidden_size 30 must be divisible by num_attention_heads 4"),
        ({"num_query_groups": 3}, "num_attention_heads 4 must be divisible by num_query_groups 3"),
        ({"dtype": "fp8"}, r"unknown dtype 'fp8'; valid: \['bf16', 'fp16', 'fp32'\]"),
        ({"num_experts": 6, "expert_parallel": 4}, "num_experts 6 must be divisible by expert_parallel 4"),
        ({"expert_parallel": 2}, "expert_parallel 2 needs num_experts"),
        ({"num_experts": 2, "moe_router_topk": 3}, "moe_router_topk 3 exceeds num_experts 2"),
        ({"num_experts": 2, "moe_layer_freq": (1, 0, 1)}, r"moe_layer_freq \(1, 0, 1\) must hold one 0 or 1 per layer \(2\)"),
        ({"seq_length": 0}, "seq_length must be an int >= 1, got 0"),
        ({"device": "tpu"}, "unknown device 'tpu'"),
        ({"normalization": "L2Norm"}, r"unknown normalization 'L2Norm'; valid: \['LayerNorm', 'RMSNorm'\]"),
        (
            {"position_embedding_type": "yarn"},
            r"unknown position_embedding_type 'yarn'; valid: \['learned_absolute', 'rope'\]",
        ),
        ({"swiglu": 1}, "swiglu must be True or False, got 1"),
        ({"sequence_parallel": True}, "sequence_parallel needs tensor_parallel >= 2, got tensor_parallel 1"),
        ({"tensor_parallel": 0}, "tensor_parallel must be an int >= 1, got 0"),
        ({"tensor_parallel": 3}, "num_attention_heads 4 must be divisible by tensor_parallel 3"),
        ({"tensor_parallel": 4, "num_query_groups": 2}, "num_query_groups 2 must be divisible by tensor_parallel 4"),
        ({"tensor_parallel": 2, "ffn_hidden_size": 33}, "ffn_hidden_size 33 must be divisible by tensor_parallel 2"),
        (
            {"tensor_parallel": 4, "sequence_parallel": True, "seq_length": 18},
            "seq_length 18 must be divisible by tensor_parallel 4 with sequence_parallel",
        ),
        ({"tensor_parallel": 2, "num_experts": 2}, "MoE with tensor_parallel 2 is not modelled"),
    ],
)
def test_invalid_dimensions(overrides, message):
    with pytest.raises(ChunkOffloadError, match=message):
        _tiny(**overrides)
