"""`qkv_saved`: query, key and value as the core attention receives them from ``linear_qkv``.

Shared by the attention byte models of `chunk_offload.planner.attention` (SDPA) and
`chunk_offload.planner.te` (TE's fused attention), so neither imports the other. How the views of
``linear_qkv``'s output are laid out is in `chunk_offload.planner.attention`'s docstring.
"""

from __future__ import annotations

from .dims import GPTDims
from .saved import SavedTensor, whole

__all__ = ["qkv_saved"]


def qkv_saved(dims: GPTDims) -> list[SavedTensor]:
    """Query, key and value as SDPA (or TE's attention) receives them (see `chunk_offload.planner.attention`'s docstring)."""
    t, d, hn = dims.tokens, dims.dtype_bytes, dims.head_dim
    heads, groups = dims.local_heads, dims.local_query_groups
    per = heads // groups
    row = groups * (per + 2) * hn  # elements of one token's row of linear_qkv's output
    last = (t - 1) * row + (groups - 1) * (per + 2) * hn  # where the last row's last group starts
    saved = []
    if dims.rope or (per > 1 and groups > 1):
        saved.append(whole("query", t * heads * hn * d))
    else:
        saved.append(SavedTensor("mixed", 0, (last + per * hn) * d, t * heads * hn * d))
    kv = t * groups * hn * d
    if dims.rope:
        saved.append(whole("key", kv))
    else:
        saved.append(SavedTensor("mixed", per * hn * d, (last + hn) * d, kv))
    value_start = (per + 1) * hn
    saved.append(SavedTensor("mixed", value_start * d, (t * row - value_start) * d, kv))
    return saved
