"""FLOPs of one layer's forward, backward and selective recompute, per tensor-parallel rank (2 per
multiply-add of every matmul), for the planner's copy-against-compute estimates.

Attention and MLP layers as described in `layer_forward_flops`; checked on CPU against torch's
``FlopCounterMode`` (``tests/planner/test_model.py``, NOTE [Byte model] in ``model.py``). Mamba
layers are estimated from the algorithm (`chunk_offload.planner.mamba`); MTP layers add their
``eh_proj`` (`chunk_offload.planner.mtp`).
"""

from __future__ import annotations

from .attention import core_attention_flops
from .dims import GPTDims
from .mamba import mamba_backward_flops, mamba_forward_flops
from .mtp import mtp_extra_flops

__all__ = ["layer_backward_flops", "layer_forward_flops", "layer_recompute_flops"]


def layer_forward_flops(dims: GPTDims, layer: int) -> int:
    """Forward FLOPs of one layer on one rank for one microbatch (2 per multiply-add of every matmul).

    QKV 2*T*h*(np' + 2*ng')*hn, the core attention (`core_attention_flops`: the full square for
    the local attention, the causal triangle for flash-style kernels), projection 2*T*np'*hn*h;
    dense MLP 2*T*h*(fc1 width + f'), the fc1 width 2f' with SwiGLU; a MoE layer instead has the
    router 2*T*h*E and top-k experts per token, 2*T*topk*h*(fc1 width + f). A hybrid layer has
    only its part; a Mamba layer: `chunk_offload.planner.mamba` (estimated); an MTP layer adds
    ``eh_proj`` (`chunk_offload.planner.mtp`).
    """
    if dims.is_mamba(layer):
        return mamba_forward_flops(dims)
    attention = core_attention_flops(dims).forward if dims.has_attention(layer) else 0
    return _linear_flops(dims, layer) + attention


def layer_backward_flops(dims: GPTDims, layer: int) -> int:
    """Backward FLOPs of one layer on one rank for one microbatch.

    Every linear computes its input gradient and its weight gradient: twice its forward. The core
    attention: four products without recompute (local), five with the recompute of QK^T that
    flash-style kernels do (`core_attention_flops`). A Mamba layer: estimated (`chunk_offload.planner.mamba`).
    """
    if dims.is_mamba(layer):
        return mamba_backward_flops(dims)
    attention = core_attention_flops(dims).backward if dims.has_attention(layer) else 0
    return 2 * _linear_flops(dims, layer) + attention


def layer_recompute_flops(dims: GPTDims, layer: int) -> int:
    """Forward FLOPs one layer runs again in backward under selective recompute (``dims.recompute_modules``):
    the core attention's forward for ``core_attn``; the router's and the experts' for ``moe``."""
    flops = core_attention_flops(dims).forward if dims.recomputed(layer, "core_attn") else 0
    if dims.recomputed(layer, "expert_fc1"):
        t, h = dims.tokens, dims.hidden_size
        flops += 2 * t * h * dims.num_experts + t * dims.moe_router_topk * 2 * h * (dims.fc1_width + dims.local_ffn)
    return flops


def _linear_flops(dims: GPTDims, layer: int) -> int:
    t, h = dims.tokens, dims.hidden_size
    heads, groups, hn = dims.local_heads, dims.local_query_groups, dims.head_dim
    symbols = dims.layer_symbols(layer)
    flops = 2 * t * h * (heads + 2 * groups) * hn + 2 * t * heads * hn * h if "*" in symbols else 0
    mlp = 2 * h * (dims.fc1_width + dims.local_ffn)
    if "E" in symbols:
        flops += 2 * t * h * dims.num_experts + t * dims.moe_router_topk * mlp
    elif "-" in symbols:
        flops += t * mlp
    return flops + (mtp_extra_flops(dims) if dims.is_mtp(layer) else 0)
