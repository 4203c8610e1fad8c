"""Transformer Engine's layer spec: what its fused modules save for backward, per rank. UNMEASURED.

Read from TE's source (NVIDIA/TransformerEngine at d0067d0, 2026-08-22; file:line below; read,
not copied) because Transformer Engine needs CUDA and cannot run here. Nothing in this file is
measured; the planner labels its figures "from source, unmeasured". FP8 activations
(``fp8=True``: quantized saved inputs, FP8 attention) are not modelled: bf16/fp16/fp32 only.

How the offload-module names map onto megatron's TE spec (``get_gpt_layer_with_transformer_engine_spec``),
consistent with `chunk_offload.integrations.megatron.modules` and
`chunk_offload.module_names.TE_FUSED_INTO`:

- ``attn_norm`` does not exist (``input_layernorm`` is an IdentityOp): the norm runs inside
  ``qkv_linear`` (``TELayerNormColumnParallelLinear``, TE's ``LayerNormLinear``), whose group
  holds what both save.
- ``mlp_norm`` likewise runs inside ``mlp_fc1`` in dense layers; MoE layers keep a separate
  ``pre_mlp_layernorm`` (``TENorm``).
- ``attn_proj`` (``TERowParallelLinear``, TE's ``Linear``) and ``expert_fc1`` save their input.
- ``core_attn`` is TE's ``DotProductAttention``: the flash-attn backend or cuDNN's fused
  attention (``attention_kernel`` ``"flash"`` / ``"fused"``).

What each saves (T' = T/tp under sequence parallelism, else T; np', ng', hn as in NOTE [Byte model]):

- ``LayerNormLinear`` (module/layernorm_linear.py:526-536, ``prepare_for_saving(inputmat, ...,
  ln_out_to_save, mu, rsigma)``): its input [T', h] and the norm's output [T', h] in the
  activation dtype (line 469; under sequence parallelism the local shard, gathered again in
  backward: ``ln_out_needs_gather``, line 453), and the statistics: LayerNorm mu and rsigma
  [T'] fp32 (csrc/extensions/normalization.cpp:86-87), RMSNorm rsigma [T'] fp32 and no mu
  (normalization.cpp:325, 448).
- ``Linear`` (module/linear.py:619-621, ``saved_inputmat = inputmat``; line 372: "maybe
  sharded"): its input.
- ``LayerNormMLP`` (module/layernorm_mlp.py:807-822: input, norm output, fc1 output with and
  without bias, activation output, mu, rsigma; with ``checkpoint`` only the input, line 287) is
  not what megatron's TE spec builds for a dense MLP (megatron-core's
  ``get_mlp_module_spec_for_backend``: ``MLP`` of ``TELayerNormColumnParallelLinear`` and
  ``TERowParallelLinear``; ``TEFusedMLP`` only with ``use_te_op_fuser``), so it is not modelled:
  ``mlp_fc1`` is the LayerNormLinear above, the activation and fc2 save as in the local spec.
- ``DotProductAttention``, flash-attn backend: megatron's sbhd query, key and value are copied to
  bshd (attention/dot_product_attention/backends.py:941-943, ``x.transpose(0, 1).contiguous()``;
  ``_PrepareQKVForFA`` at line 937 for hn = 128, also new tensors), and flash-attn's
  ``FlashAttnFunc`` (flash_attn/flash_attn_interface.py in Dao-AILab/flash-attention, called at
  backends.py:1147-1164) saves them, the output [b, s, np', hn] and softmax_lse [b, np', s] fp32
  and rng_state [2] int64.
- ``DotProductAttention``, fused (cuDNN) backend: ``FusedAttnFunc`` (backends.py:1655-1664)
  saves query, key and value as passed (megatron's views of linear_qkv's output; rotated copies
  under RoPE), the output [s, b, np', hn], cu_seqlens [b + 1] int32 (one cached tensor for query
  and key, backends.py:2184-2194) and the aux tensors: softmax stats [b, np', s, 1] fp32
  (common/fused_attn/fused_attn_f16_arbitrary_seqlen.cu:1240-1242) and rng_state [2] int64
  (csrc/extensions/attention.cpp:234-235).
"""

from __future__ import annotations

from .dims import GPTDims
from .qkv import qkv_saved
from .saved import SavedTensor, whole

__all__ = ["te_attention_saved", "te_saved"]

_FP32 = 4
_INT64 = 8
_INT32 = 4


def te_saved(dims: GPTDims, name: str) -> list[SavedTensor] | None:
    """What ``name`` saves under Transformer Engine's spec, or None where it is as in the local spec."""
    n, h, d = dims.norm_tokens, dims.hidden_size, dims.dtype_bytes
    if name in ("qkv_linear", "mlp_fc1"):  # LayerNormLinear: the norm fused in
        return [whole("input", n * h * d), whole("ln_out", n * h * d), *_norm_stats(dims)]
    if name == "mlp_norm":  # MoE layers: a separate TENorm
        return [whole("input", n * h * d), *_norm_stats(dims)]
    if name == "core_attn":
        return te_attention_saved(dims)
    return None


def _norm_stats(dims: GPTDims) -> list[SavedTensor]:
    stats = dims.norm_tokens * _FP32
    if dims.normalization == "LayerNorm":
        return [whole("mu", stats), whole("rsigma", stats)]
    return [whole("rsigma", stats)]


def te_attention_saved(dims: GPTDims) -> list[SavedTensor]:
    """What TE's DotProductAttention saves (see the module docstring)."""
    t, b, s, d, hn = dims.tokens, dims.micro_batch_size, dims.seq_length, dims.dtype_bytes, dims.head_dim
    heads, groups = dims.local_heads, dims.local_query_groups
    out = [whole("output", t * heads * hn * d)]
    if dims.attention_kernel == "flash":
        qkv = [whole("query", t * heads * hn * d), whole("key", t * groups * hn * d), whole("value", t * groups * hn * d)]
        state = [whole("softmax_lse", b * heads * s * _FP32), whole("rng_state", 2 * _INT64)]
    else:
        qkv = qkv_saved(dims)
        state = [whole("cu_seqlens", (b + 1) * _INT32), whole("softmax_stats", b * heads * s * _FP32), whole("rng_state", 2 * _INT64)]
    return qkv + out + state
