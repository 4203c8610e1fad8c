"""A flash-style core attention for megatron-core's local layer spec, on ``scaled_dot_product_attention``.

megatron-core's local ``DotProductAttention`` materialises the b x np x s x s softmax (and saves
it for backward); nobody trains that way. `SDPAttention` takes the same constructor and forward
arguments (it is a drop-in ``core_attention`` of ``SelfAttentionSubmodules``) and calls
``torch.nn.functional.scaled_dot_product_attention`` with ``is_causal`` and ``enable_gqa``, so
torch picks its flash or memory-efficient kernel on CUDA and its CPU flash kernel on CPU: what is
saved for backward is query, key, value, the output and the fp32 log-sum-exp (see the planner's
``chunk_offload/planner/attention.py``). Use `sdpa_layer_spec` to put it into a layer spec, or
`use_sdpa` to swap it into built model chunks (it has no parameters, so nothing else changes).

Supported: causal self-attention (megatron's default ``AttnMaskType.causal``, any attention mask
passed is then ignored, as Transformer Engine does), multi-head, grouped-query and multi-query
attention, tensor parallelism, attention dropout, ``softmax_scale`` and query-key layer scaling.
Refused with a `ChunkOffloadError`: packed sequences, attention bias, sliding windows, softmax
types other than ``"vanilla"``, non-causal masks, context parallelism.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from ..core.errors import ChunkOffloadError

__all__ = ["SDPAttention", "sdpa_layer_spec", "use_sdpa"]


class SDPAttention(MegatronModule):
    """megatron-core core attention (``[s, b, np, hn]`` in, ``[s, b, np * hn]`` out) on torch's SDPA."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ChunkOffloadError(f"SDPAttention: context_parallel_size must be 1, got {config.context_parallel_size!r}")
        if attn_mask_type != AttnMaskType.causal:
            raise ChunkOffloadError(f"SDPAttention: attn_mask_type must be AttnMaskType.causal, got {attn_mask_type!r}")
        if config.softmax_type != "vanilla":
            raise ChunkOffloadError(f"SDPAttention: softmax_type must be 'vanilla', got {config.softmax_type!r}")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise ChunkOffloadError(f"SDPAttention: window_size must be None (no sliding window), got {config.window_size!r}")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        head_dim = config.kv_channels
        self.hidden_size_per_partition = head_dim * config.num_attention_heads // tp
        self.heads_per_partition = config.num_attention_heads // tp
        # Query-key layer scaling changes nothing here: the local attention divides the scores by
        # layer_number and its fp32 softmax multiplies them back, the net scale is softmax_scale.
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """Causal attention of query ``[sq, b, np', hn]`` over key and value ``[sk, b, ng', hn]``."""
        if packed_seq_params is not None:
            raise ChunkOffloadError("SDPAttention: packed_seq_params must be None (packed sequences are not supported)")
        if attention_bias is not None:
            raise ChunkOffloadError("SDPAttention: attention_bias must be None")
        if attn_mask_type is not None and attn_mask_type != AttnMaskType.causal:
            raise ChunkOffloadError(f"SDPAttention: attn_mask_type must be causal, got {attn_mask_type!r}")
        # [s, b, n, hn] -> [b, n, s, hn]: views; the kernels take strided inputs.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout = self.dropout_p if self.training else 0.0
        if dropout > 0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = self._attend(q, k, v, dropout)
        else:
            out = self._attend(q, k, v, dropout)
        # [b, np', s, hn] -> [s, b, np' * hn]
        return out.permute(2, 0, 1, 3).reshape(out.size(2), out.size(0), self.hidden_size_per_partition)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=True, scale=self.softmax_scale, enable_gqa=k.size(1) != q.size(1)
        )


def sdpa_layer_spec(layer_spec: Any) -> Any:
    """``layer_spec`` (a megatron ModuleSpec of a TransformerLayer) with `SDPAttention` as its core attention."""
    attention = layer_spec.submodules.self_attention
    submodules = replace(attention.submodules, core_attention=SDPAttention)
    return replace(layer_spec, submodules=replace(layer_spec.submodules, self_attention=replace(attention, submodules=submodules)))


def use_sdpa(chunks: list[torch.nn.Module]) -> int:
    """Replace megatron's core attention by `SDPAttention` in every transformer layer of ``chunks``.

    Call before attaching offload hooks or optimizers. Returns how many modules were replaced.
    """
    replaced = 0
    for chunk in chunks:
        for module in chunk.modules():
            old = getattr(module, "core_attention", None)
            if old is None or isinstance(old, SDPAttention):
                continue
            module.core_attention = SDPAttention(
                config=old.config,
                layer_number=old.layer_number,
                attn_mask_type=old.attn_mask_type,
                attention_type=old.attention_type,
                pg_collection=getattr(old, "pg_collection", None),
            ).to(next((p.device for p in module.parameters()), None))
            replaced += 1
    return replaced
