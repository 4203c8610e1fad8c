"""`GPTDims`: the dimensions and layer options of a megatron-core GPT/MoE model, as the planner sees them.

Validated on construction (every error a `ChunkOffloadError` naming the field); the derived sizes
(per tensor-parallel rank heads, groups and FFN width, tokens) are properties. What each layer
saves is in `chunk_offload.planner.model` (NOTE [Byte model]) and, for core attention,
`chunk_offload.planner.attention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..core.errors import ChunkOffloadError
from .layer_kinds import check_layer_kinds

__all__ = [
    "RECOMPUTE_MODULES",
    "ATTENTIONS",
    "DTYPE_BYTES",
    "NORMALIZATIONS",
    "POSITION_EMBEDDINGS",
    "ATTENTION_KERNELS",
    "TRANSFORMER_IMPLS",
    "GPTDims",
]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of each activation dtype the planner knows."""

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
"""megatron's ``normalization`` values the planner models."""

POSITION_EMBEDDINGS = ("learned_absolute", "rope")
"""megatron's ``position_embedding_type`` values the planner models."""

RECOMPUTE_MODULES = ("core_attn", "moe")
"""megatron's selective recompute modules the byte model knows (measured on CPU, NOTE [Byte model])."""
ATTENTIONS = ("sdpa", "local")
"""Core attentions of the local layer spec: ``"sdpa"`` (torch's scaled_dot_product_attention,
`chunk_offload.devkit.attention.SDPAttention`) or ``"local"`` (megatron's DotProductAttention,
which saves the s x s softmax)."""

ATTENTION_KERNELS = {"local": ("flash", "efficient"), "transformer_engine": ("flash", "fused")}
"""Per ``transformer_impl``, the CUDA kernels of the flash-style core attention: torch's flash or
memory-efficient SDPA kernel (local spec with ``attention="sdpa"``), flash-attn or cuDNN's fused
attention (Transformer Engine). On CPU torch's CPU flash kernel runs whatever this says."""

TRANSFORMER_IMPLS = ("local", "transformer_engine")
"""megatron's ``transformer_impl``: the local layer spec or Transformer Engine's."""

_FP32 = 4

@dataclass(kw_only=True, frozen=True, slots=True)
class GPTDims:
    """Dimensions of a GPT or MoE model (the whole model, before pipeline splitting)."""

    num_layers: int
    """Transformer layers of the whole model."""
    hidden_size: int
    """Hidden size h."""
    num_attention_heads: int
    """Attention heads np."""
    seq_length: int
    """Tokens per sequence s."""
    micro_batch_size: int
    """Sequences per microbatch b."""
    ffn_hidden_size: int | None = None
    """MLP and expert hidden size f; None for 4 x h."""
    num_query_groups: int | None = None
    """Key/value heads ng for grouped-query attention; None for multi-head attention (ng = np)."""
    num_experts: int | None = None
    """Experts per MoE layer; None for a dense model."""
    moe_router_topk: int = 2
    """Experts per token."""
    moe_layer_freq: int | tuple[int, ...] = 1
    """Which layers are MoE when ``num_experts`` is set: every N-th from the first, or one 0/1 per layer."""
    expert_parallel: int = 1
    """Expert-parallel size: each rank holds ``num_experts / expert_parallel`` local experts."""
    dtype: Literal["fp32", "bf16", "fp16"] = "bf16"
    """Activation dtype."""
    device: Literal["cuda", "cpu"] = "cuda"
    """Where training runs: torch's norms save different statistics on CUDA and on CPU (NOTE [Byte model])."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """megatron's ``normalization``."""
    swiglu: bool = False
    """SwiGLU MLPs and experts (megatron's ``gated_linear_unit`` with SiLU, Megatron-LM's ``--swiglu``): fc1 is 2f wide."""
    bias_swiglu_fusion: bool = True
    """With ``swiglu``: megatron's fused bias-SwiGLU (``bias_activation_fusion``; Megatron-LM's
    default, off with ``--no-bias-swiglu-fusion``), which saves only its input."""
    position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute"
    """megatron's ``position_embedding_type``; ``"rope"``: unfused rotary embeddings, rotary_percent 1."""
    tensor_parallel: int = 1
    """Tensor-parallel size tp: heads, query groups and the FFN are split over tp ranks."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (needs ``tensor_parallel`` >= 2): norms see s/tp tokens."""
    attention: Literal["sdpa", "local"] = "sdpa"
    """The local spec's core attention, one of `ATTENTIONS` (ignored under Transformer Engine,
    whose DotProductAttention is modelled instead)."""
    attention_kernel: Literal["flash", "efficient", "fused"] = "flash"
    """On CUDA, the kernel of the flash-style core attention, one of ``ATTENTION_KERNELS[transformer_impl]``
    (see `chunk_offload.planner.attention` and `chunk_offload.planner.te`)."""
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    """megatron's ``transformer_impl``, one of `TRANSFORMER_IMPLS` (Transformer Engine: modelled from
    its source, unmeasured; FP8 activations are not modelled)."""
    recompute_modules: tuple[str, ...] = ()
    """megatron's selective recompute (``--recompute-granularity selective --recompute-modules``),
    of `RECOMPUTE_MODULES`: a recomputed module's forward runs without saving, its inputs are saved."""
    mtp_num_layers: int | None = None
    """megatron's Multi-Token Prediction layers, after the decoder on the last stage's last chunk
    (planner layers ``num_layers`` on, `chunk_offload.planner.layer_kinds`); None for none."""
    hybrid_layer_pattern: str | None = None
    """megatron's hybrid layer pattern (megatron-core 0.19's ``hybrid_layer_pattern``, formerly
    ``hybrid_override_pattern``), one symbol per layer: ``M`` Mamba, ``*`` attention, ``-`` MLP,
    ``E`` MoE, e.g. ``"M*M-"``; None for a GPT model. Needs Transformer Engine's spec; Mamba layers
    are modelled from source, unmeasured (`chunk_offload.planner.mamba`)."""
    mamba_state_dim: int = 128
    """megatron's ``mamba_state_dim``: the SSM state size N."""
    mamba_head_dim: int = 64
    """megatron's ``mamba_head_dim``: channels per Mamba head P."""
    mamba_num_groups: int = 8
    """megatron's ``mamba_num_groups``: B/C groups."""
    mamba_num_heads: int | None = None
    """megatron's ``mamba_num_heads``; None for 2 x hidden / ``mamba_head_dim``."""

    def __post_init__(self) -> None:
        for label in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "seq_length",
            "micro_batch_size",
            "moe_router_topk",
            "expert_parallel",
            "tensor_parallel",
        ):
            value = getattr(self, label)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ChunkOffloadError(f"{label} must be an int >= 1, got {value!r}")
        for label in ("swiglu", "bias_swiglu_fusion", "sequence_parallel"):
            if not isinstance(getattr(self, label), bool):
                raise ChunkOffloadError(f"{label} must be True or False, got {getattr(self, label)!r}")
        for label in ("ffn_hidden_size", "num_query_groups", "num_experts"):
            value = getattr(self, label)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ChunkOffloadError(f"{label} must be None or an int >= 1, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ChunkOffloadError(
                f"hidden_size {self.hidden_size} must be divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.query_groups:
            raise ChunkOffloadError(
                f"num_attention_heads {self.num_attention_heads} must be divisible by num_query_groups {self.query_groups}"
            )
        if self.dtype not in DTYPE_BYTES:
            raise ChunkOffloadError(f"unknown dtype {self.dtype!r}; valid: {sorted(DTYPE_BYTES)}")
        if self.device not in ("cuda", "cpu"):
            raise ChunkOffloadError(f"unknown device {self.device!r}; valid: ['cpu', 'cuda']")
        if self.normalization not in NORMALIZATIONS:
            raise ChunkOffloadError(f"unknown normalization {self.normalization!r}; valid: {list(NORMALIZATIONS)}")
        if self.position_embedding_type not in POSITION_EMBEDDINGS:
            raise ChunkOffloadError(
                f"unknown position_embedding_type {self.position_embedding_type!r}; valid: {list(POSITION_EMBEDDINGS)}"
            )
        for label, valid in (("attention", ATTENTIONS), ("transformer_impl", TRANSFORMER_IMPLS)):
            if getattr(self, label) not in valid:
                raise ChunkOffloadError(f"unknown {label} {getattr(self, label)!r}; valid: {list(valid)}")
        kernels = ATTENTION_KERNELS[self.transformer_impl]
        if self.attention_kernel not in kernels:
            raise ChunkOffloadError(
                f"unknown attention_kernel {self.attention_kernel!r} for transformer_impl {self.transformer_impl!r}; valid: {list(kernels)}"
            )
        self._check_tensor_parallel()
        self._check_recompute()
        check_layer_kinds(self)
        if self.num_experts is not None:
            if self.num_experts % self.expert_parallel:
                raise ChunkOffloadError(
                    f"num_experts {self.num_experts} must be divisible by expert_parallel {self.expert_parallel}"
                )
            if self.moe_router_topk > self.num_experts:
                raise ChunkOffloadError(f"moe_router_topk {self.moe_router_topk} exceeds num_experts {self.num_experts}")
        elif self.expert_parallel != 1:
            raise ChunkOffloadError(f"expert_parallel {self.expert_parallel} needs num_experts")
        freq = self.moe_layer_freq
        if isinstance(freq, tuple):
            if len(freq) != self.num_layers or set(freq) - {0, 1}:
                raise ChunkOffloadError(f"moe_layer_freq {freq} must hold one 0 or 1 per layer ({self.num_layers})")
        elif not isinstance(freq, int) or freq < 1:
            raise ChunkOffloadError(f"moe_layer_freq must be an int >= 1 or a tuple of 0/1 per layer, got {freq!r}")

    def _check_recompute(self) -> None:
        modules = self.recompute_modules
        if isinstance(modules, str) or not all(isinstance(m, str) for m in modules):
            raise ChunkOffloadError(f"recompute_modules must be a tuple of names of {RECOMPUTE_MODULES}, got {modules!r}")
        unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
        if unknown:
            raise ChunkOffloadError(
                f"recompute_modules {unknown} not modelled; the planner knows {list(RECOMPUTE_MODULES)} (megatron's "
                "layernorm recompute needs Transformer Engine, mlp and the others are not measured)"
            )
        if "moe" in modules and self.num_experts is None:
            raise ChunkOffloadError("recompute_modules 'moe' needs num_experts: the model has no MoE layer")
        object.__setattr__(self, "recompute_modules", tuple(modules))

    def recomputed(self, layer: int, name: str) -> bool:
        """Whether offload module ``name`` of layer ``layer`` runs inside a recomputed region (it saves
        nothing and opens no offload group): ``core_attn`` under ``core_attn``, the experts under ``moe``."""
        if name == "core_attn":
            return "core_attn" in self.recompute_modules and self.has_attention(layer)
        return name in ("expert_fc1", "moe_act") and "moe" in self.recompute_modules and self.is_moe(layer)

    def _check_tensor_parallel(self) -> None:
        tp = self.tensor_parallel
        if self.sequence_parallel and tp < 2:
            raise ChunkOffloadError(f"sequence_parallel needs tensor_parallel >= 2, got tensor_parallel {tp}")
        if tp == 1:
            return
        if self.num_experts is not None:
            raise ChunkOffloadError(
                f"MoE with tensor_parallel {tp} is not modelled (expert tensor parallelism); use tensor_parallel 1 for MoE models"
            )
        split = (("num_attention_heads", self.num_attention_heads), ("num_query_groups", self.query_groups), ("ffn_hidden_size", self.ffn))
        for label, value in split:
            if value % tp:
                raise ChunkOffloadError(f"{label} {value} must be divisible by tensor_parallel {tp}")
        if self.sequence_parallel and self.seq_length % tp:
            raise ChunkOffloadError(
                f"seq_length {self.seq_length} must be divisible by tensor_parallel {tp} with sequence_parallel"
            )

    # ------------------------------------------------------------------ derived sizes
    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def local_heads(self) -> int:
        """Attention heads of one tensor-parallel rank."""
        return self.num_attention_heads // self.tensor_parallel

    @property
    def local_query_groups(self) -> int:
        """Query groups of one tensor-parallel rank."""
        return self.query_groups // self.tensor_parallel

    @property
    def local_ffn(self) -> int:
        """FFN channels of one tensor-parallel rank (the fc2 input width)."""
        return self.ffn // self.tensor_parallel

    @property
    def fc1_width(self) -> int:
        """fc1's output width on one rank: 2 x ``local_ffn`` with SwiGLU."""
        return 2 * self.local_ffn if self.swiglu else self.local_ffn

    @property
    def norm_tokens(self) -> int:
        """Tokens the norms and the column-parallel linears' saved inputs hold on one rank: T/tp under sequence parallelism."""
        return self.tokens // self.tensor_parallel if self.sequence_parallel else self.tokens

    @property
    def query_groups(self) -> int:
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def tokens(self) -> int:
        """T = s x b."""
        return self.seq_length * self.micro_batch_size

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def norm_stats_bytes(self) -> int:
        """Bytes per element of LayerNorm's saved mean and rstd."""
        return _FP32 if self.device == "cuda" else self.dtype_bytes

    @property
    def rope(self) -> bool:
        return self.position_embedding_type == "rope"

    @property
    def local_experts(self) -> int:
        return 0 if self.num_experts is None else self.num_experts // self.expert_parallel

    def layer_symbols(self, layer: int) -> str:
        """What layer ``layer`` (0-based; from ``num_layers`` on an MTP layer) holds, in megatron's hybrid
        symbols (`chunk_offload.planner.layer_kinds`): ``M``, ``*``, ``-`` or ``E`` for a hybrid layer,
        ``*-`` or ``*E`` for a GPT layer. An MTP layer holds a layer of the decoder's last layer's kind."""
        layer = min(layer, self.num_layers - 1)
        if self.hybrid_layer_pattern is not None:
            return self.hybrid_layer_pattern[layer]
        if self.num_experts is None:
            return "*-"
        if isinstance(self.moe_layer_freq, tuple):
            return "*E" if self.moe_layer_freq[layer] == 1 else "*-"
        return "*E" if layer % self.moe_layer_freq == 0 else "*-"

    @property
    def total_layers(self) -> int:
        """``num_layers`` plus the MTP layers."""
        return self.num_layers + (self.mtp_num_layers or 0)

    def is_mtp(self, layer: int) -> bool:
        """Whether planner layer ``layer`` is a Multi-Token Prediction layer."""
        return layer >= self.num_layers

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has experts instead of a dense MLP."""
        return "E" in self.layer_symbols(layer)

    def is_mamba(self, layer: int) -> bool:
        """Whether layer ``layer`` is a Mamba layer of a hybrid model."""
        return self.layer_symbols(layer) == "M"

    def has_attention(self, layer: int) -> bool:
        """Whether layer ``layer`` has self-attention (GPT and MTP layers, a hybrid model's ``*``)."""
        return "*" in self.layer_symbols(layer)

    @property
    def transformer_engine(self) -> bool:
        return self.transformer_impl == "transformer_engine"

    def modules_of(self, layer: int) -> list[str]:
        """Offload module names layer ``layer`` has (``moe_act`` counted as present in MoE layers; a
        Mamba layer has none).

        Under Transformer Engine the norms before a linear are fused into it
        (`chunk_offload.module_names.TE_FUSED_INTO`); a MoE layer keeps its separate pre-MLP norm.
        """
        symbols = self.layer_symbols(layer)
        names = ["attn_norm", "qkv_linear", "core_attn", "attn_proj"] if "*" in symbols else []
        names += ["mlp_norm", "expert_fc1", "moe_act"] if "E" in symbols else ["mlp_norm", "mlp_fc1"] if "-" in symbols else []
        if self.transformer_engine:
            names = [n for n in names if n != "attn_norm" and not (n == "mlp_norm" and "-" in symbols)]
        return names
