"""`norm_saved`: what one norm module of megatron's local layer spec saves for backward, per rank.

Shared by the layers' norms (``attn_norm``, ``mlp_norm``: `chunk_offload.planner.model`) and the
Multi-Token Prediction block's (`chunk_offload.planner.mtp`); see NOTE [Byte model] in
``model.py`` for what is measured. Transformer Engine's ``TENorm`` is `chunk_offload.planner.te`'s.
"""

from __future__ import annotations

from .dims import GPTDims
from .saved import SavedTensor, whole

__all__ = ["norm_saved"]

_FP32 = 4


def norm_saved(dims: GPTDims) -> list[SavedTensor]:
    """What torch's LayerNorm or RMSNorm (``dims.normalization``) saves for its [T', h] input (NOTE [Byte model])."""
    n, h, d = dims.norm_tokens, dims.hidden_size, dims.dtype_bytes
    if dims.normalization == "LayerNorm":
        stats = n * dims.norm_stats_bytes
        return [whole("input", n * h * d), whole("mean", stats), whole("rstd", stats)]
    if dims.device == "cuda":  # torch's fused kernel (and Apex's): the input and an fp32 rstd
        return [whole("input", n * h * d), whole("rstd", n * _FP32)]
    # torch's composite on CPU, in fp32: the input as fp32 (itself when fp32, else a copy), rstd, the normalised input
    as_fp32 = "input" if d == _FP32 else "input_fp32"
    return [whole(as_fp32, n * h * _FP32), whole("rstd", n * _FP32), whole("normalized", n * h * _FP32)]
