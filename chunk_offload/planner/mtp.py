"""A Multi-Token Prediction layer (megatron-core's ``mtp_num_layers``): what it saves besides its
transformer layer, and its FLOPs besides that layer's, per rank.

megatron-core 0.16.1's ``MultiTokenPredictionLayer`` (transformer/multi_token_prediction.py; the
same in 0.19 with the layer as ``mtp_model_layer``) runs, for each depth, the model's embedding of
the tokens shifted by one more position (``_get_embeddings``), ``enorm`` on it and ``hnorm`` on
the previous depth's hidden states (the decoder's output at the first), ``eh_proj`` (a column
parallel linear, [T, 2h] -> [T, h]) on their concatenation (``_concat_embeddings``), its
transformer layer and ``final_layernorm`` (``_postprocess``). What those save, besides the layer:

- the embedding: the word embedding's indices, the shifted token ids [b, s] int64, and with
  learned absolute positions the position embedding's indices, the shifted position ids [b, s]
  int64 (``roll_tensor`` makes both anew);
- the three norms: each as the layer's norms save (`chunk_offload.planner.norms.norm_saved`;
  Transformer Engine's ``TENorm``: `chunk_offload.planner.te`), on the embedding's output, the
  hidden states and the layer's output;
- ``eh_proj``: its input, the concatenation [T, 2h].

Measured equal on CPU (the local spec, ``tests/planner/test_mtp.py``): each whole MTP layer as one
group against `chunk_offload.planner.model.layer_saved_bytes`. The output layer and loss of each
depth (its logits) are outside the layers, like the main output layer's: pass them as
``other_activation_bytes``. Not modelled: tensor parallelism (refused), hybrid MTP layers.
"""

from __future__ import annotations

from .dims import GPTDims
from .norms import norm_saved
from .saved import SavedTensor, whole
from .te import te_saved

__all__ = ["mtp_extra_flops", "mtp_extra_saved"]

_INT64 = 8


def mtp_extra_saved(dims: GPTDims) -> list[SavedTensor]:
    """What one MTP layer saves outside its transformer layer, on one rank (see the module docstring)."""
    t, h, d = dims.tokens, dims.hidden_size, dims.dtype_bytes
    saved = [whole("input_ids", t * _INT64)]
    if dims.position_embedding_type == "learned_absolute":
        saved.append(whole("position_ids", t * _INT64))
    norm = te_saved(dims, "mlp_norm") if dims.transformer_engine else norm_saved(dims)  # TENorm, or torch's
    for which in ("enorm", "hnorm", "final_layernorm"):
        saved += [s._replace(storage=f"{which}.{s.storage}") for s in norm]
    saved.append(whole("eh_proj.input", dims.norm_tokens * 2 * h * d))
    return saved


def mtp_extra_flops(dims: GPTDims) -> int:
    """Forward FLOPs of one MTP layer outside its transformer layer on one rank: ``eh_proj``'s 2 T 2h h."""
    return 2 * dims.tokens * 2 * dims.hidden_size * dims.hidden_size
