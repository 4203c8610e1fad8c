"""What kind each of a model's layers is: megatron's hybrid (Mamba) layer pattern and the Multi-Token
Prediction layers, checked for `chunk_offload.planner.GPTDims`.

A layer's kind is a string of megatron's hybrid layer symbols (megatron-core 0.19's
``models/hybrid/hybrid_layer_allocation.py``, ``Symbols``): ``M`` a Mamba layer (its norm fused
into the mixer's input projection, then the MambaMixer), ``*`` an attention layer (a
TransformerLayer without MLP), ``-`` an MLP layer (a TransformerLayer without attention), ``E`` a
MoE layer. A GPT decoder layer is attention and MLP, ``*-`` or ``*E`` (``moe_layer_freq``). The
Multi-Token Prediction layers (``mtp_num_layers``) come after the decoder's, on the last pipeline
stage's last model chunk: planner layers ``num_layers`` on, each holding a transformer layer of
the decoder's last layer's kind (megatron's ``get_gpt_mtp_block_spec`` takes the block spec's last
layer spec) plus what the MTP block itself saves (`chunk_offload.planner.mtp`).
"""

from __future__ import annotations

from typing import Protocol

from ..core.errors import ChunkOffloadError

__all__ = ["HYBRID_SYMBOLS", "LayerKindDims", "check_layer_kinds", "mamba_heads"]


class LayerKindDims(Protocol):
    """What the checks read of `chunk_offload.planner.GPTDims` (a Protocol, so that dims.py, which
    calls them, is the only one of the two files to import the other)."""

    num_layers: int
    hidden_size: int
    num_experts: int | None
    moe_layer_freq: int | tuple[int, ...]
    tensor_parallel: int
    mtp_num_layers: int | None
    hybrid_layer_pattern: str | None
    mamba_num_heads: int | None
    mamba_head_dim: int
    mamba_num_groups: int

    @property
    def transformer_engine(self) -> bool: ...

HYBRID_SYMBOLS = {"M": "Mamba", "*": "attention", "-": "MLP", "E": "MoE"}
"""The layer symbols of megatron's hybrid pattern the planner models -> the layer each stands for."""

_NOT_MODELLED = {
    "G": "GatedDeltaNet layers",
    "D": "DeepSeek sparse attention layers",
    "+": "multi-latent attention layers",
    "|": "pipeline stage boundaries in the pattern (the planner splits the layers evenly)",
    "/": "MTP layers in the pattern (hybrid Multi-Token Prediction)",
}


def mamba_heads(dims: LayerKindDims) -> int:
    """Mamba heads of the whole model: ``mamba_num_heads``, or megatron's default 2 x hidden / head dim
    (MambaMixer's ``expand=2``: d_inner = 2 x hidden)."""
    return dims.mamba_num_heads if dims.mamba_num_heads is not None else 2 * dims.hidden_size // dims.mamba_head_dim


def check_layer_kinds(dims: LayerKindDims) -> None:
    """Raise `ChunkOffloadError` for a hybrid pattern or MTP setting the planner does not model."""
    mtp = dims.mtp_num_layers
    if mtp is not None:
        if not isinstance(mtp, int) or isinstance(mtp, bool) or mtp < 1:
            raise ChunkOffloadError(f"mtp_num_layers must be None or an int >= 1, got {mtp!r}")
        if dims.tensor_parallel != 1:
            raise ChunkOffloadError(
                f"mtp_num_layers with tensor_parallel {dims.tensor_parallel} is not modelled (the MTP block's embedding "
                "saves masks under tensor parallelism; measured at tensor_parallel 1); use tensor_parallel 1"
            )
    for label in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups"):
        value = getattr(dims, label)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ChunkOffloadError(f"{label} must be an int >= 1, got {value!r}")
    heads = dims.mamba_num_heads
    if heads is not None and (not isinstance(heads, int) or isinstance(heads, bool) or heads < 1):
        raise ChunkOffloadError(f"mamba_num_heads must be None or an int >= 1, got {heads!r}")
    pattern = dims.hybrid_layer_pattern
    if pattern is None:
        return
    if not isinstance(pattern, str):
        raise ChunkOffloadError(f"hybrid_layer_pattern must be a str of {sorted(HYBRID_SYMBOLS)}, got {pattern!r}")
    unknown = sorted(set(pattern) - set(HYBRID_SYMBOLS))
    if unknown:
        why = "; ".join(f"{s!r}: {_NOT_MODELLED.get(s, 'not a layer symbol')}" for s in unknown)
        raise ChunkOffloadError(
            f"hybrid_layer_pattern {pattern!r}: symbol(s) not modelled ({why}); the planner models "
            f"{', '.join(f'{s} ({k})' for s, k in HYBRID_SYMBOLS.items())}"
        )
    if len(pattern) != dims.num_layers:
        raise ChunkOffloadError(
            f"hybrid_layer_pattern {pattern!r} has {len(pattern)} layers but num_layers is {dims.num_layers}; "
            "give one symbol per layer"
        )
    if not dims.transformer_engine:
        raise ChunkOffloadError(
            "hybrid_layer_pattern needs transformer_impl='transformer_engine': megatron's hybrid stack spec "
            "(models/hybrid/hybrid_layer_specs.py) is Transformer Engine's"
        )
    if mtp is not None:
        raise ChunkOffloadError("mtp_num_layers with hybrid_layer_pattern (hybrid Multi-Token Prediction) is not modelled")
    if "E" in pattern and dims.num_experts is None:
        raise ChunkOffloadError(f"hybrid_layer_pattern {pattern!r} has MoE layers (E): set num_experts")
    if dims.moe_layer_freq != 1:
        raise ChunkOffloadError("moe_layer_freq does not apply with hybrid_layer_pattern: its E symbols place the MoE layers")
    if "M" in pattern:
        _check_mamba(dims)


def _check_mamba(dims: LayerKindDims) -> None:
    heads, groups, tp = mamba_heads(dims), dims.mamba_num_groups, dims.tensor_parallel
    if dims.mamba_num_heads is None and (2 * dims.hidden_size) % dims.mamba_head_dim:
        raise ChunkOffloadError(
            f"2 x hidden_size ({2 * dims.hidden_size}) must be divisible by mamba_head_dim {dims.mamba_head_dim} "
            "(megatron's MambaMixer), or set mamba_num_heads"
        )
    checks = (("Mamba heads", heads, "mamba_num_groups", groups), ("Mamba heads", heads, "tensor_parallel", tp))
    for label, value, by_label, by in (*checks, ("mamba_num_groups", groups, "tensor_parallel", tp)):
        if value % by:
            raise ChunkOffloadError(f"{label} ({value}) must be divisible by {by_label} ({by}), as megatron's MambaMixer asserts")
