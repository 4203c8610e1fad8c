"""Build the megatron-core GPTModel chunks of this pipeline rank, and feed them random tokens.

Shared by the pretraining example, the test harness and the stage replay, so that all of them train
the very same model: local layer spec (no Transformer Engine) with megatron's core attention or
torch's scaled_dot_product_attention (``GPTShape.attention``), fused CUDA kernels off, dropout 0,
deterministic on CPU. Model parallelism must be initialised first (``initialize_model_parallel``).

The shape also picks Llama-style options of the local spec (RMSNorm, SwiGLU fused or not, rotary
positions) and Multi-Token Prediction layers. Sequence parallelism with the local spec needs
Apex's norm; without Apex (CPU hosts) torch's stands in for it, see `SequenceParallelTorchNorm`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
import torch.nn.functional as F

from ..core.errors import ChunkOffloadError

__all__ = [
    "ATTENTIONS",
    "GPTShape",
    "SequenceParallelTorchNorm",
    "build_gpt_chunks",
    "random_token_batches",
    "gpt_forward_step",
    "average_data_parallel_grads",
]

_NORMALIZATIONS = ("LayerNorm", "RMSNorm")
_POSITION_EMBEDDINGS = ("learned_absolute", "rope")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ATTENTIONS = ("sdpa", "local")
"""Core attentions the builder puts into megatron's local layer spec: ``"sdpa"`` is
`chunk_offload.devkit.attention.SDPAttention` (torch's flash-style kernels), ``"local"`` megatron's
own ``DotProductAttention`` (materialises the s x s softmax)."""


@dataclass(kw_only=True, frozen=True)
class GPTShape:
    """Dimensions of a GPT model (the whole model, before pipeline splitting)."""

    num_layers: int = 4
    """Transformer layers of the whole model."""
    hidden_size: int = 64
    """Hidden size."""
    ffn_hidden_size: int | None = None
    """MLP (and expert) hidden size; default 4 x hidden."""
    num_attention_heads: int = 4
    """Attention heads."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention; None for multi-head attention."""
    vocab_size: int = 128
    """Vocabulary size."""
    seq_length: int = 32
    """Tokens per sequence."""
    micro_batch_size: int = 2
    """Sequences per microbatch."""
    num_experts: int | None = None
    """Experts per MoE layer (every layer is MoE when set); None for dense MLPs."""
    moe_layer_freq: int | tuple[int, ...] = 1
    """Which layers are MoE when ``num_experts`` is set: every N-th, or one 0/1 per layer."""
    moe_router_topk: int = 2
    """Experts per token."""
    moe_token_dispatcher: str = "allgather"
    """megatron's ``moe_token_dispatcher_type``."""
    add_bias_linear: bool = True
    """megatron's ``add_bias_linear`` (False for MoE at EP=TP=1 in megatron-core 0.16.1: fc2's bias is added in place onto a view)."""
    dtype: torch.dtype = torch.float32
    """Parameter and activation dtype (fp32, bf16 or fp16); in a half dtype every parameter and buffer
    is cast, as Megatron-LM's ``Float16Module`` does (see NOTE [ Half-precision chunks ])."""
    recompute_granularity: str | None = None
    """megatron's activation recomputation: ``"selective"`` or ``"full"``; None for none."""
    recompute_modules: tuple[str, ...] | None = None
    """With selective recomputation: megatron's ``recompute_modules`` (None: its default, core_attn)."""
    recompute_method: str | None = None
    """With full recomputation: ``"uniform"`` or ``"block"``."""
    recompute_num_layers: int | None = None
    """With full recomputation: layers per checkpointed group (uniform) or checkpointed layers per chunk (block)."""
    normalization: str = "LayerNorm"
    """megatron's ``normalization``: ``"LayerNorm"`` or ``"RMSNorm"`` (torch's, in the local spec without Apex)."""
    swiglu: bool = False
    """SwiGLU MLPs (and experts): megatron's ``gated_linear_unit=True`` with ``activation_func=F.silu``;
    fc1 is 2 x ffn wide."""
    bias_activation_fusion: bool = False
    """megatron's ``bias_activation_fusion``: the fused bias-GELU / bias-SwiGLU autograd functions
    (``torch.compile``-d in megatron-core 0.16.1) instead of plain torch ops. GELU without SwiGLU
    needs ``add_bias_linear``."""
    position_embedding_type: str = "learned_absolute"
    """GPTModel's ``position_embedding_type``: ``"learned_absolute"`` or ``"rope"`` (unfused rotary
    embedding of query and key, ``rotary_percent`` 1)."""
    attention: str = "local"
    """Core attention, one of `ATTENTIONS`: ``"sdpa"`` (torch's scaled_dot_product_attention) or
    ``"local"`` (megatron's DotProductAttention)."""
    mtp_num_layers: int | None = None
    """megatron's Multi-Token Prediction layers (``mtp_num_layers``), built on the last stage's last
    chunk with megatron's ``get_gpt_mtp_block_spec``; None for none."""

    def __post_init__(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ChunkOffloadError(f"attention must be one of {list(ATTENTIONS)}, got {self.attention!r}")
        if self.dtype not in _DTYPES:
            raise ChunkOffloadError(f"dtype must be one of {list(_DTYPES)}, got {self.dtype!r}")
        if self.normalization not in _NORMALIZATIONS:
            raise ChunkOffloadError(f"normalization must be one of {list(_NORMALIZATIONS)}, got {self.normalization!r}")
        if self.position_embedding_type not in _POSITION_EMBEDDINGS:
            raise ChunkOffloadError(f"position_embedding_type must be one of {list(_POSITION_EMBEDDINGS)}, got {self.position_embedding_type!r}")


class SequenceParallelTorchNorm:
    """torch's ``LayerNorm`` / ``RMSNorm`` (by ``config.normalization``) that accepts sequence parallelism.

    megatron-core's local spec takes Apex's ``FusedLayerNorm`` when Apex is installed and
    otherwise torch's norm through ``WrappedTorchNorm``, which refuses ``sequence_parallel``. The
    norm itself is the same computation under sequence parallelism (each rank normalises its own
    tokens); only its parameters' gradients must be summed over the tensor-parallel ranks, which
    megatron does for parameters marked ``sequence_parallel`` (as ``FusedLayerNorm`` marks them).
    Used by `build_gpt_chunks` only for sequence parallelism on hosts without Apex (CPU tests).
    """

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> torch.nn.Module:
        norm_class = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_class(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def build_gpt_chunks(
    shape: GPTShape,
    *,
    pipeline_parallel: int = 1,
    virtual_pipeline: int | None = None,
    expert_parallel: int = 1,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    deallocate_pipeline_outputs: bool = True,
    microbatch_group_size_per_vp_stage: int | None = None,
    device: torch.device | str | None = None,
    config_overrides: Mapping[str, Any] | None = None,
) -> list[torch.nn.Module]:
    """This rank's model chunks, one per virtual stage, as megatron's schedules expect them.

    ``microbatch_group_size_per_vp_stage``: megatron's interleaved-schedule option (None: the
    pipeline size). ``config_overrides``: further ``TransformerConfig`` fields, e.g. megatron's own
    fine-grained activation offloading (``fine_grained_activation_offloading``, ``offload_modules``).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer import TransformerConfig

    moe: dict[str, Any] = {}
    if shape.num_experts is not None:
        moe = dict(
            num_moe_experts=shape.num_experts,
            moe_router_topk=shape.moe_router_topk,
            moe_token_dispatcher_type=shape.moe_token_dispatcher,
            moe_aux_loss_coeff=1e-2,
            moe_grouped_gemm=False,
            moe_layer_freq=list(shape.moe_layer_freq) if isinstance(shape.moe_layer_freq, tuple) else shape.moe_layer_freq,
        )
    config = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size or 4 * shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        tensor_model_parallel_size=tensor_parallel,
        sequence_parallel=sequence_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        virtual_pipeline_model_parallel_size=virtual_pipeline,
        expert_model_parallel_size=expert_parallel,
        pipeline_dtype=shape.dtype,
        params_dtype=shape.dtype,
        bf16=shape.dtype == torch.bfloat16,
        fp16=shape.dtype == torch.float16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Fused kernels are CUDA (or torch.compile) paths; the unfused ones are plain torch.
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        deallocate_pipeline_outputs=deallocate_pipeline_outputs,
        microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage,
        add_bias_linear=shape.add_bias_linear,
        recompute_granularity=shape.recompute_granularity,
        recompute_modules=None if shape.recompute_modules is None else list(shape.recompute_modules),
        recompute_method=shape.recompute_method,
        recompute_num_layers=shape.recompute_num_layers,
        mtp_num_layers=shape.mtp_num_layers,
        normalization=shape.normalization,
        gated_linear_unit=shape.swiglu,
        activation_func=F.silu if shape.swiglu else F.gelu,
        bias_activation_fusion=shape.bias_activation_fusion,
        **moe,
        **(config_overrides or {}),
    )
    chunks = []
    for vp_stage in range(virtual_pipeline or 1):
        vp = vp_stage if virtual_pipeline is not None else None
        if sequence_parallel and not _have_apex():
            # megatron's block spec (one layer spec per layer of this chunk, dense or MoE by
            # moe_layer_freq) with every norm replaced; see SequenceParallelTorchNorm.
            spec = _with_norm(
                get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=shape.normalization, vp_stage=vp),
                SequenceParallelTorchNorm,
            )
        elif shape.num_experts is not None and shape.moe_layer_freq != 1:
            # Dense and MoE layers mixed: megatron's block spec picks each layer's spec from
            # moe_layer_freq and slices out this stage's (and chunk's) layers.
            spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=shape.normalization, vp_stage=vp)
        else:
            spec = get_gpt_layer_local_spec(
                num_experts=shape.num_experts, moe_grouped_gemm=False, normalization=shape.normalization
            )
        if shape.attention == "sdpa":
            spec = _with_sdpa(spec)
        # None off the last stage's last chunk (megatron's get_mtp_num_layers_to_build)
        mtp = None if shape.mtp_num_layers is None else get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp)
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=shape.vocab_size,
            max_sequence_length=shape.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=False,
            position_embedding_type=shape.position_embedding_type,
            vp_stage=vp,
            mtp_block_spec=mtp,
        )
        chunk = chunk.to(device) if device is not None else chunk
        chunks.append(_cast_like_float16_module(chunk, shape.dtype))
    return chunks


# NOTE [ Half-precision chunks ]
# Megatron-LM trains in bf16 / fp16 by wrapping each chunk in ``Float16Module`` (megatron-core
# 0.16.1 and 0.19.2 alike, megatron/core/transformer/module.py): its constructor casts the whole
# chunk with ``module.bfloat16()`` / ``module.half()``, which turns every floating-point parameter
# and buffer into the half dtype, including those built fp32 whatever ``params_dtype`` says
# (torch's norms, the learned position embedding, the MoE router's weight). Its forward then
# converts fp32 tensor inputs to the half dtype on the first chunk of the first stage and the
# outputs to fp32 on the last chunk of the last stage. `build_gpt_chunks` does the cast itself
# rather than returning the wrapper: the integrations walk GPTModel chunks (hooks on their layers,
# ``set_input_tensor``, ``pre_process`` / ``post_process``), and callers that want Megatron-LM's
# wrapper around them (tests/_megatron.py) still can, its cast is then a no-op. The forward's
# conversions change nothing for these chunks: their inputs are integer tokens and positions and
# no mask (nothing fp32 to convert), what the previous stage sends is already in the half dtype,
# and the loss is fp32 (megatron's cross entropy upcasts the logits; `gpt_forward_step` and the
# stage replay also take ``.float()`` of it). What megatron keeps fp32 on purpose stays so either
# way: the MoE router casts its ``expert_bias`` buffer back to fp32 on every forward.


def _cast_like_float16_module(chunk: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``chunk`` cast as ``Float16Module`` casts it for ``dtype``; unchanged for fp32. See NOTE [ Half-precision chunks ]."""
    if dtype == torch.bfloat16:
        return chunk.bfloat16()
    if dtype == torch.float16:
        return chunk.half()
    return chunk


def _have_apex() -> bool:
    import importlib.util

    return importlib.util.find_spec("apex") is not None


def _with_sdpa(spec: Any) -> Any:
    """A layer spec or block spec with `SDPAttention` as every layer's core attention."""
    from dataclasses import replace
    from .attention import sdpa_layer_spec

    if hasattr(spec, "layer_specs"):
        return replace(spec, layer_specs=[sdpa_layer_spec(layer) for layer in spec.layer_specs])
    return sdpa_layer_spec(spec)


def _with_norm(block_spec: Any, norm: type) -> Any:
    """``block_spec`` (megatron's TransformerBlockSubmodules) with ``norm`` for every norm of its layers and its final norm."""
    from dataclasses import replace
    layers = [
        replace(spec, submodules=replace(spec.submodules, input_layernorm=norm, pre_mlp_layernorm=norm))
        for spec in block_spec.layer_specs
    ]
    return replace(block_spec, layer_specs=layers, layer_norm=norm)


def random_token_batches(
    shape: GPTShape, *, num_microbatches: int, seed: int, iteration: int, device: torch.device | str | None = None
) -> list[dict[str, torch.Tensor]]:
    """One iteration's microbatches: the same on every stage of a pipeline, different per data-parallel rank."""
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank()
    gen = torch.Generator().manual_seed(seed * 1_000_003 + dp_rank * 1_009 + iteration)
    b, s = shape.micro_batch_size, shape.seq_length
    batches = []
    for _ in range(num_microbatches):
        seq = torch.randint(0, shape.vocab_size, (b, s + 1), generator=gen)
        batch = {
            "tokens": seq[:, :-1].contiguous(),
            "labels": seq[:, 1:].contiguous(),
            "position_ids": torch.arange(s).expand(b, -1).contiguous(),
        }
        batches.append({k: v.to(device) for k, v in batch.items()} if device is not None else batch)
    return batches


def gpt_forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module):
    """megatron's ``forward_step_func``: next batch through ``model``; the loss is the mean token loss."""
    batch = next(data_iterator)
    # attention_mask=None: the local attention builds megatron's default causal mask.
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, _mean_token_loss


def _mean_token_loss(per_token_loss: torch.Tensor):
    loss = per_token_loss.float().mean()
    return loss, {"lm loss": loss.detach().clone()}  # the schedule divides `loss` in place


def average_data_parallel_grads(chunks: list[torch.nn.Module]) -> None:
    """Average gradients over data-parallel replicas in a fixed order (what megatron's DDP would do).

    Expert parameters (``allreduce=False``) average over the expert-data-parallel group.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    groups = {
        True: parallel_state.get_data_parallel_group(),
        False: parallel_state.get_expert_data_parallel_group(),
    }
    for chunk in chunks:
        for _, param in sorted(chunk.named_parameters()):
            if param.grad is None:
                continue
            group = groups[getattr(param, "allreduce", True)]
            size = dist.get_world_size(group)
            if size > 1:
                dist.all_reduce(param.grad, group=group)
                param.grad.div_(size)
