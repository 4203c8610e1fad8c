"""Core attention (``core_attn``): what it saves for backward and the FLOPs it computes, per rank.

Three implementations, picked by `GPTDims`:

- ``attention="local"``: megatron-core's DotProductAttention. Saves query, key and value, the
  causal mask (bool [s, s]), the fp32 softmax [b, np', s, s] and, for bf16/fp16, its cast back
  (measured on CPU, ``tests/planner/test_model.py``).
- ``attention="sdpa"``: `chunk_offload.devkit.attention.SDPAttention`, torch's
  ``scaled_dot_product_attention``. Saves query, key and value as passed, the output
  [b, np', s, hn] and the fp32 log-sum-exp [b, np', s]. On CPU (torch's CPU flash kernel):
  measured equal in real megatron-core runs. On CUDA: from torch's source, unmeasured (see
  `_sdpa_kernel_state`).
- ``transformer_impl="transformer_engine"``: TE's DotProductAttention, `chunk_offload.planner.te`.

Query, key and value, as megatron's SelfAttention makes them from linear_qkv's output
``mixed`` [T, ng', (np'/ng' + 2) * hn] (one row per token, per group its queries, key, value):
the query is a view of ``mixed`` when np' = ng' or ng' = 1 and a reshaped copy otherwise; key
and value are views; with rotary embeddings (unfused) query and key are rotated copies. Views of
``mixed`` are moved as one span (`group_bytes`). SDPA takes key and value with ng' heads
(``enable_gqa``); the local attention copies them with ``repeat_interleave`` under grouped-query
attention (measured: 3 x T*np'*hn*d for query, key and value in every case without rotary
embeddings).

FLOPs (2 per multiply-add): the local attention computes the full square, forward
QK^T and PV, 2 x 2*b*np'*s*s*hn, backward four products (dV, dP, dQ, dK), twice the forward.
Flash-style kernels (SDPA, TE) skip the blocks above the causal diagonal, counted as the
s*(s+1)/2 query-key pairs of the lower triangle, and recompute QK^T in backward: five products.
torch's ``FlopCounterMode`` counts SDPA as the full square with that recompute
(``torch/utils/flop_counter.py``, ``sdpa_flop_count`` / ``sdpa_backward_flop_count``) and the
CPU kernel not at all.
"""

from __future__ import annotations

from typing import NamedTuple

from .dims import GPTDims
from .qkv import qkv_saved
from .saved import SavedTensor, whole
from .te import te_attention_saved

__all__ = ["AttentionFlops", "core_attention_flops", "core_attn_saved", "qkv_saved"]

_FP32 = 4
_BOOL = 1


class AttentionFlops(NamedTuple):
    """FLOPs of one core-attention call on one rank."""

    forward: int
    backward: int
    """Including the recompute of QK^T by flash-style kernels."""


def core_attn_saved(dims: GPTDims) -> list[SavedTensor]:
    """What one call of the core attention saves on one rank."""
    if dims.transformer_engine:
        return te_attention_saved(dims)
    if dims.attention == "local":
        return _local_saved(dims)
    return qkv_saved(dims) + _sdpa_kernel_state(dims)


def _local_saved(dims: GPTDims) -> list[SavedTensor]:
    s, b, d, hn = dims.seq_length, dims.micro_batch_size, dims.dtype_bytes, dims.head_dim
    heads, groups = dims.local_heads, dims.local_query_groups
    one = dims.tokens * heads * hn * d  # query, key or value, np' heads
    if dims.rope and groups == heads:
        # Rotated copies of query and key; value a view of linear_qkv's output [T, ng', (np'/ng' + 2) * hn]
        # starting after the first group's query and key, up to the output's end.
        offset = 2 * hn * d
        out = [whole("query", one), whole("key", one), SavedTensor("mixed", offset, 3 * one - offset, one)]
    else:  # views of linear_qkv's output or, under grouped-query attention, copies (measured)
        out = [whole("qkv", 3 * one)]
    probs = b * heads * s * s
    out += [whole("mask", s * s * _BOOL), whole("softmax", probs * _FP32)]
    if d != _FP32:
        out.append(whole("probs", probs * d))  # the softmax output cast back, saved by bmm
    return out


def _sdpa_kernel_state(dims: GPTDims) -> list[SavedTensor]:
    """What SDPA's kernel saves besides its inputs: the output and the log-sum-exp (and RNG state).

    CPU (measured): ``_scaled_dot_product_flash_attention_for_cpu`` saves output and logsumexp
    [b, np', s] fp32 (torchgen's derivatives.yaml, its backward's arguments).
    CUDA, from source, unmeasured (pytorch/pytorch):
    - flash (``_scaled_dot_product_flash_attention``; derivatives.yaml: backward takes query, key,
      value, output, logsumexp, cum_seq_q/k (undefined for dense inputs), rng_state, unused):
      aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp ``mha_fwd`` allocates
      ``softmax_lse`` as {batch, heads, seqlen_q} fp32, ``rng_state`` as {2} uint64 and
      ``_unused`` as {} uint64, both on the device.
    - memory-efficient (``_scaled_dot_product_efficient_attention``; backward takes query, key,
      value, attn_bias (None), output, log_sumexp, philox_seed, philox_offset):
      aten/src/ATen/native/transformers/cuda/attention.cu ``_efficient_attention_forward``
      allocates logsumexp as {B, heads, ceil_div(seqlen_q, kAlignLSE) * kAlignLSE} fp32 with
      kAlignLSE = 32; without dropout the philox seed and offset are empty host tensors, which the
      engine does not move (it moves tensors on its device only).
    """
    s, b, heads, d = dims.seq_length, dims.micro_batch_size, dims.local_heads, dims.dtype_bytes
    out = [whole("output", dims.tokens * heads * dims.head_dim * d)]
    if dims.device == "cpu" or dims.attention_kernel == "flash":
        out.append(whole("logsumexp", b * heads * s * _FP32))
    else:
        out.append(whole("logsumexp", b * heads * -(-s // 32) * 32 * _FP32))
    if dims.device == "cuda" and dims.attention_kernel == "flash":
        out += [whole("rng_state", 2 * 8), whole("unused", 8)]
    return out


def core_attention_flops(dims: GPTDims, *, causal_skip: bool = True) -> AttentionFlops:
    """Forward and backward FLOPs of one core-attention call on one rank (see the module docstring).

    ``causal_skip=False``: flash-style kernels counted over the full square, as torch's
    FlopCounterMode counts SDPA.
    """
    s, b, heads, hn = dims.seq_length, dims.micro_batch_size, dims.local_heads, dims.head_dim
    product = 2 * b * heads * s * s * hn  # one [s, hn] x [hn, s] product per head
    if dims.attention == "local" and not dims.transformer_engine:
        return AttentionFlops(forward=2 * product, backward=4 * product)
    if causal_skip:
        product = b * heads * s * (s + 1) * hn  # 2 * b * heads * (s * (s + 1) / 2) * hn
    return AttentionFlops(forward=2 * product, backward=5 * product)
