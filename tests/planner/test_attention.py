"""Core attention and Transformer Engine's spec in the planner, without megatron.

What SDPA saves on CPU is measured against real megatron-core runs in ``test_model.py``; here:
the FLOP model against torch's own counting, the CUDA kernels' and Transformer Engine's
from-source figures against the measured parts they share, and the issue's 70B-like job.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from chunk_offload.core.errors import ChunkOffloadError
from chunk_offload.planner import (
    GPTDims,
    Hardware,
    PipelineConfig,
    StagePlanner,
    core_attention_flops,
    group_bytes,
    layer_backward_flops,
    layer_forward_flops,
    saved_tensors,
)

from tests.bench._scripts import load_bench_script

_B, _S, _NP, _HN = 2, 16, 4, 8


def _tiny(**overrides) -> GPTDims:
    fields = dict(num_layers=2, hidden_size=_NP * _HN, num_attention_heads=_NP, seq_length=_S, micro_batch_size=_B, dtype="bf16")
    return GPTDims(**{**fields, **overrides})


def _bytes(dims: GPTDims, name: str) -> int:
    return group_bytes(saved_tensors(dims, name), min_offload_bytes=1)


@pytest.mark.parametrize("groups", [4, 2, 1])
def test_flash_flops_over_the_full_square_are_torchs_count(groups):
    """torch counts SDPA as the full square, forward 2 products, backward 5 (the QK^T recompute)."""
    dims = _tiny(num_query_groups=groups)
    q, kv = (_B, _NP, _S, _HN), (_B, groups, _S, _HN)
    full = core_attention_flops(dims, causal_skip=False)
    assert full.forward == sdpa_flop_count(q, kv, kv)
    assert full.backward == sdpa_backward_flop_count(q, q, kv, kv)
    # Causal: the s * (s + 1) / 2 pairs of the lower triangle.
    causal = core_attention_flops(dims)
    assert causal.forward * 2 * _S == full.forward * (_S + 1) and causal.backward * 2 * _S == full.backward * (_S + 1)


def test_local_attention_flops_are_what_its_matmuls_count():
    """The local attention: QK^T and PV over the full square; backward four products, no recompute."""
    dims = _tiny(attention="local", dtype="fp32")
    q, k, v = (torch.randn(_B * _NP, _S, _HN, requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False) as forward:
        out = torch.bmm(torch.softmax(torch.bmm(q, k.transpose(1, 2)), dim=-1), v)
    with FlopCounterMode(display=False) as backward:
        out.sum().backward()
    assert core_attention_flops(dims) == (forward.get_total_flops(), backward.get_total_flops())


def test_layer_backward_flops_double_the_linears_and_count_the_recompute():
    for attention in ("sdpa", "local"):
        dims = _tiny(attention=attention)
        attn = core_attention_flops(dims)
        assert layer_backward_flops(dims, 0) - attn.backward == 2 * (layer_forward_flops(dims, 0) - attn.forward)


def test_sdpa_on_cuda_from_source():
    """The CUDA kernels save what the measured CPU kernel saves, plus their RNG state (flash) or a padded log-sum-exp."""
    cpu, flash = _tiny(device="cpu"), _tiny()
    efficient = _tiny(attention_kernel="efficient", seq_length=33)
    assert _bytes(flash, "core_attn") == _bytes(cpu, "core_attn") + 2 * 8 + 8  # rng_state [2], unused [] (uint64)
    lse = [x.nbytes for x in saved_tensors(efficient, "core_attn") if x.storage == "logsumexp"]
    assert lse == [_B * _NP * 64 * 4]  # 33 rows padded to kAlignLSE = 32
    with pytest.raises(ChunkOffloadError, match=r"unknown attention_kernel 'fused' for transformer_impl 'local'; valid: \['flash', 'efficient'\]"):
        _tiny(attention_kernel="fused")


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_te_layernorm_linear_saves_what_the_local_norm_and_linear_save_on_cuda(normalization):
    """TE's LayerNormLinear: input, norm output, fp32 statistics = torch's CUDA norm + the linear's input."""
    local, te = _tiny(normalization=normalization), _tiny(normalization=normalization, transformer_impl="transformer_engine")
    for norm, linear in (("attn_norm", "qkv_linear"), ("mlp_norm", "mlp_fc1")):
        assert _bytes(te, linear) == _bytes(local, norm) + _bytes(local, linear)
    assert _bytes(te, "attn_proj") == _bytes(local, "attn_proj")
    assert te.modules_of(0) == ["qkv_linear", "core_attn", "attn_proj", "mlp_fc1"]
    with pytest.raises(ChunkOffloadError, match=r"'attn_norm' does not exist under Transformer Engine's spec: it is fused into 'qkv_linear'"):
        saved_tensors(te, "attn_norm")
    moe = _tiny(transformer_impl="transformer_engine", num_experts=2)
    assert "mlp_norm" in moe.modules_of(0)  # MoE layers keep a separate TENorm


def test_te_attention_backends():
    """cuDNN's fused attention saves megatron's q, k, v views like SDPA; the flash-attn backend copies them."""
    sdpa = _tiny(num_query_groups=2)
    fused = _tiny(num_query_groups=2, transformer_impl="transformer_engine", attention_kernel="fused")
    flash = _tiny(num_query_groups=2, transformer_impl="transformer_engine")
    state = 2 * 8 + (_B + 1) * 4  # rng_state [2] int64, cu_seqlens [b + 1] int32
    assert _bytes(fused, "core_attn") == _bytes(sdpa, "core_attn") - 3 * 8 + state
    t, d = _B * _S, 2
    qkv = t * _NP * _HN * d + 2 * t * 2 * _HN * d
    assert _bytes(flash, "core_attn") == qkv + t * _NP * _HN * d + _B * _NP * _S * 4 + 2 * 8


_JOB_70B = dict(
    num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64, num_query_groups=8,
    seq_length=8192, micro_batch_size=1, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
    tensor_parallel=8, sequence_parallel=True,
)  # fmt: skip


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron_plan reads megatron-core's schedule tables")
def test_the_issues_70b_like_job():
    """Issue 11: the local spec holds ~3.3 GB per layer in core_attn and cannot hide its copy; SDPA tens of MB and hides."""
    pipeline = PipelineConfig(pipeline_parallel=8, virtual_pipeline=5, num_microbatches=64)
    hardware = Hardware(host_bandwidth_gbs=50, device_tflops=700)
    modules = ["qkv_linear", "core_attn", "attn_proj", "mlp_fc1"]
    stage0 = {}
    for attention in ("local", "sdpa"):
        dims = GPTDims(**_JOB_70B, attention=attention)
        stage0[attention] = StagePlanner(dims, pipeline, hardware=hardware).estimate(modules)[0]
    local, sdpa = stage0["local"], stage0["sdpa"]
    assert 3.2e9 < local.module_bytes_per_layer["core_attn"] < 3.4e9 and not local.hides
    assert 10e6 < sdpa.module_bytes_per_layer["core_attn"] < 100e6 and sdpa.hides
    assert sdpa.activation_peak_bytes < local.activation_peak_bytes / 10
    te = dataclasses.replace(GPTDims(**_JOB_70B), transformer_impl="transformer_engine")
    assert StagePlanner(te, pipeline, hardware=hardware).estimate(modules)[0].hides


@pytest.mark.parametrize(("groups", "dtype"), [(4, torch.float32), (2, torch.bfloat16), (1, torch.bfloat16)])
def test_bench_sdpa_saved_agrees_with_the_cpu_model(groups, dtype):
    """``bench/sdpa_saved.py`` (the GPU session's probe) lists on CPU what the measured model predicts."""
    bench = load_bench_script("sdpa_saved")
    result = bench.saved_by_sdpa(s=_S, b=_B, heads=_NP, groups=groups, hn=_HN, dtype=dtype, backend=None)
    spans: dict[str, tuple[int, int]] = {}
    for i, t in enumerate(result["saved"]):  # the engine's rule: one span per storage
        key = "mixed" if t["views_linear_qkv_output"] else f"own{i}"
        start = t["storage_offset_bytes"] // 16 * 16
        end = t["view_end_bytes"]
        low, high = spans.get(key, (start, end))
        spans[key] = (min(low, start), max(high, end))
    measured = sum(high - low for low, high in spans.values())
    dims = _tiny(num_query_groups=groups, device="cpu", dtype={torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype])
    assert measured == _bytes(dims, "core_attn")
