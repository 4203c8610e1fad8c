"""A hybrid model's Mamba layer (``M``): what it saves for backward and its FLOPs, per rank. UNMEASURED.

Read from the sources (read, not copied) because mamba_ssm's Triton kernels, causal_conv1d and
Transformer Engine need CUDA and cannot run here: megatron-core 0.19.2 (the wheel; file:line
below, under ``megatron/core``) and state-spaces/mamba at e9594ce (2026-07-23). The planner labels
these figures "from source, unmeasured".

What is modelled: megatron's hybrid stack spec (``models/hybrid/hybrid_layer_specs.py:93-104``):
``MambaLayer`` with no separate norm (``MambaLayerSubmodules.norm`` defaults to IdentityOp,
``ssm/mamba_layer.py``), ``MambaMixer`` with ``in_proj`` Transformer Engine's
``TELayerNormColumnParallelLinear`` (the layer's norm fused in) and ``out_proj``
``TERowParallelLinear``, trained on megatron's default memory-efficient path
(``use_mamba_mem_eff_path``, ``ssm/mamba_mixer.py:_ssm_training``), ``rmsnorm=True``,
``norm_before_gate=False``, ``expand=2``, ``chunk_size=128``, context parallel 1, no packed
sequences, dropout 0. With T tokens (T' = T/tp for the norm under sequence parallelism), hidden
h, activation bytes d, per tensor-parallel rank nh' heads of P channels (d_inner' = nh' x P),
ng' groups, state size N:

- ``in_proj`` (``ssm/mamba_mixer.py:498``), TE's LayerNormLinear: its input [T', h] and the
  norm's output [T', h] in d, and the norm's statistics [T'] fp32 (``chunk_offload.planner.te``,
  TE's module/layernorm_linear.py:526-536). Its output zxBCdt is [T, 2 d_inner' + 2 ng' N + nh'].
- ``rearrange(zxBCdt, "l b d -> b l d").contiguous()`` (mamba_mixer.py:739) copies it; ``A =
  -torch.exp(A_log.float())`` (:742): exp saves its result and A is a new tensor, [nh'] fp32 each;
  ``dt_bias.float()`` (:759) is a new fp32 [nh'] tensor unless the parameters are fp32 (then the
  parameter itself, which the engine never moves). D and the convolution's weight and bias are
  parameters (or views of them).
- ``mamba_split_conv1d_scan_combined`` (mamba_mixer.py:755-770; mamba_ssm
  ops/triton/ssd_combined.py:983-1003) runs ``MambaSplitConv1dScanCombinedFn`` (:820), which
  with no ``rmsnorm_weight`` saves (:888) the contiguous zxBCdt, the parameters above, A,
  dt_bias and ``out_x`` [b, l, nh', P] in d (the scan's output before the z gate,
  ops/triton/ssd_chunk_scan.py:1278). The convolution's output is not saved: backward recomputes it.
- ``rearrange(y, "b l d -> l b d").contiguous()`` (mamba_mixer.py:775) copies the gated output;
  ``self.norm(y)`` (:779), mamba_ssm's gated RMSNorm with no z (ops/triton/layernorm_gated.py:433
  -> ``LayerNormFn``, :341-366), saves that copy [T, d_inner'] in d and rstd [ng' x T] fp32 (:130,
  one per group of d_inner'/ng' channels).
- ``out_proj`` (mamba_mixer.py:513), TE's Linear: its input, the norm's output [T, d_inner'] in d
  (TE's module/linear.py:619-621; row parallel: the whole sequence).
- The bias-dropout-add after the mixer saves nothing with dropout 0.

FLOPs (2 per multiply-add): in_proj 2 T h (2 d_inner' + 2 ng' N + nh'), out_proj 2 T d_inner' h,
the depthwise convolution 2 T (d_inner' + 2 ng' N) x 4, and the chunked scan (ssd_combined.py:386-387;
chunks of Q = 128 tokens, T rounded up to whole chunks per sequence): C B^T within each chunk
2 T Q N ng' (ssd_bmm.py ``_bmm_chunk_fwd``), the chunk states 2 T N d_inner'
(ssd_chunk_state.py ``_chunk_state_fwd``), the intra-chunk output 2 T Q d_inner' and the
contribution of the states 2 T N d_inner' (ssd_chunk_scan.py ``_chunk_scan_fwd``). Backward is
estimated as twice the forward, plus the convolution computed again.
"""

from __future__ import annotations

from .dims import GPTDims
from .layer_kinds import mamba_heads
from .saved import SavedTensor, whole
from .te import te_saved

__all__ = ["mamba_backward_flops", "mamba_forward_flops", "mamba_saved"]

_FP32 = 4
_D_CONV = 4  # MambaMixer's d_conv
_CHUNK = 128  # MambaMixer's chunk_size


def _local(dims: GPTDims) -> tuple[int, int, int, int]:
    """(nh', d_inner', ng', N) of one tensor-parallel rank."""
    heads = mamba_heads(dims) // dims.tensor_parallel
    return heads, heads * dims.mamba_head_dim, dims.mamba_num_groups // dims.tensor_parallel, dims.mamba_state_dim


def mamba_saved(dims: GPTDims) -> list[SavedTensor]:
    """What one Mamba layer's forward saves on one rank (see the module docstring)."""
    t, d = dims.tokens, dims.dtype_bytes
    heads, inner, groups, state = _local(dims)
    in_proj = 2 * inner + 2 * groups * state + heads
    # in_proj, TE's LayerNormLinear: its input, the norm's output and statistics
    saved = [s._replace(storage=f"in_proj.{s.storage}") for s in te_saved(dims, "qkv_linear")]
    saved += [whole("exp_A_log", heads * _FP32), whole("A", heads * _FP32)]
    if d != _FP32:
        saved.append(whole("dt_bias_fp32", heads * _FP32))
    saved += [whole("zxBCdt", t * in_proj * d), whole("out_x", t * inner * d)]
    saved += [whole("norm.input", t * inner * d), whole("norm.rstd", groups * t * _FP32)]
    saved.append(whole("out_proj.input", t * inner * d))
    return saved


def mamba_forward_flops(dims: GPTDims) -> int:
    """Forward FLOPs of one Mamba layer on one rank for one microbatch (see the module docstring)."""
    t, h = dims.tokens, dims.hidden_size
    heads, inner, groups, state = _local(dims)
    linears = 2 * t * h * (2 * inner + 2 * groups * state + heads) + 2 * t * inner * h
    padded = dims.micro_batch_size * -(-dims.seq_length // _CHUNK) * _CHUNK
    scan = 2 * padded * (_CHUNK * state * groups + _CHUNK * inner + 2 * state * inner)
    return linears + _conv_flops(dims) + scan


def mamba_backward_flops(dims: GPTDims) -> int:
    """Backward FLOPs of one Mamba layer: an estimate, twice the forward plus the convolution recomputed."""
    return 2 * mamba_forward_flops(dims) + _conv_flops(dims)


def _conv_flops(dims: GPTDims) -> int:
    _, inner, groups, state = _local(dims)
    return 2 * dims.tokens * (inner + 2 * groups * state) * _D_CONV
