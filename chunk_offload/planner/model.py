"""Bytes each offload module of a megatron-core GPT/MoE layer saves for backward, per call.

The model follows what the engine moves (see ``chunk_offload/core/group.py``): per call of an
offloaded submodule, the tensors autograd saves inside it that are not parameters and hold at
least ``min_offload_bytes`` (numel x element size of the saved view, like
`chunk_offload.core.policy.OffloadPolicy`); views of one storage are moved once, as the span from
their lowest start (rounded down to 16 bytes) to their highest end. So every module is described
as a list of `SavedTensor` (storage, offset, span, bytes) and `group_bytes` applies those rules.

NOTE [Byte model]: what each module saves, for megatron-core 0.16.1's local (non Transformer
Engine) layer spec, dropout 0, no attention mask passed (megatron builds its causal mask), per
tensor-parallel rank. T = seq_length x micro_batch_size tokens, d = bytes per element of the
activations, np heads of hn = hidden / np channels, ng query groups, f the FFN size; with
tensor parallel size tp each rank has np/tp heads, ng/tp groups and f/tp FFN channels, written
np', ng', f' below. Under sequence parallelism the norms and the column-parallel linears see
T' = T/tp tokens, everything else the whole sequence; otherwise T' = T.

- ``attn_norm``, ``mlp_norm``, LayerNorm (torch's): the input [T', h] and mean and rstd [T', 1].
  On CUDA mean and rstd are in the accumulate type (fp32) whatever the input dtype, as with
  Apex's FusedLayerNorm; on CPU in the input dtype (measured): ``GPTDims.device`` picks.
  RMSNorm (torch's): on CPU torch runs its composite rms_norm in fp32: the input as fp32 (the
  input itself, or an fp32 copy for bf16/fp16) [T', h], rstd [T', 1] and the normalised fp32
  [T', h] that the weight multiplies (measured). On CUDA torch's fused kernel saves the input
  and an fp32 rstd [T', 1] (from torch's ``_fused_rms_norm`` autograd formula; not measured,
  no GPU here), as Apex's FusedRMSNorm does.
- ``qkv_linear``, ``mlp_fc1``: megatron's linear autograd Function saves its input [T', h] (and
  the weight, a parameter): under sequence parallelism the local shard, which it gathers again
  in backward (measured).
- ``attn_proj``: the same, its input is the attention context [T, np'*hn].
- ``core_attn`` (DotProductAttention): query, key and value, 3*T*np'*hn*d. With multi-head
  attention they are views of linear_qkv's output; with grouped-query attention the query is a
  reshaped copy and key and value are ``repeat_interleave`` copies, np'*hn each: the same bytes
  (measured for ng = np, 1 < ng < np and ng = 1). With rotary embeddings (unfused, as without
  Transformer Engine) query and key are the rotated copies [T, np'*hn] each; value stays a view
  of linear_qkv's output under multi-head attention, so the span from its first element to the
  end of that output, about 3*T*np'*hn*d, is saved as well (measured; with grouped-query
  attention value is a copy as before). Then the causal mask, a bool [s, s], saved by
  ``masked_fill_``; the softmax output [b, np', s, s] in fp32 (``attention_softmax_in_fp32``)
  and, for bf16/fp16, its cast back to d, which ``bmm`` saves.
- ``expert_fc1`` (alias ``router_fc1``): the tokens routed to that local expert, [t_e, h], a
  view of the permuted tokens. Routing decides t_e; with expert parallel 1 the local experts
  together get exactly T*topk tokens. With EP > 1 and the allgather dispatcher each expert gets
  EP*T*topk/E tokens only on average. The model splits T*topk tokens as evenly as integers
  allow over the local experts (`expert_tokens`): the sum per layer is exact at EP = 1, each
  expert's share is the balanced-routing expectation.
- ``moe_act``: a module only under Transformer Engine's activation (``use_te_activation_func``);
  modelled as saving its input [t_e, f] (2f with SwiGLU) and NOT measured (no Transformer
  Engine on CPU).

Whole-layer saved bytes (`layer_saved_bytes`, for the memory budget) add what the layer saves
outside the offload modules. Rotary embeddings: the cos and sin factors [s, 1, 1, hn] in d for
query and for key, 4*s*hn*d. A dense MLP with GELU: the GELU input and the fc2 input, [T, f']
each (fused or not: megatron's bias-GELU saves its input and the bias, a parameter). SwiGLU
(``gated_linear_unit`` with SiLU, fc1 [T, 2f'] wide): megatron's fused bias-SwiGLU
(``bias_activation_fusion``, Megatron-LM's default) saves the fc1 output [T, 2f'] and fc2 its
input [T, f']; unfused, SiLU saves its half of the fc1 output (a strided view: the span
(2*T - 1)*f'*d), the product saves the SiLU output and the linear half plus
``glu_linear_offset`` (a copy), and fc2 its input, [T, f'] each (measured both ways; the
fused one eagerly, see ``tests/planner/_measure.py``). A MoE layer: the router's input [T, h]
and per expert the activation's saved tensors as above for t_e tokens plus the activation
output, which the multiplication with the routing probabilities saves (not with the fused
SwiGLU, which applies them inside). Routing metadata (top-k indices and probabilities, token
maps: a few tensors of T x (E + topk) elements) is not modelled: MoE layers are a slight
underestimate.

Measured equal on CPU (``tests/planner/test_model.py``): every offload module but ``moe_act``,
fp32 and bf16, LayerNorm and RMSNorm, GELU and SwiGLU (fused and unfused), learned and rotary
positions, multi-head, grouped-query and multi-query attention, tensor parallel 2 with and
without sequence parallelism (per rank, on gloo ranks; the local spec takes Apex's norm under
sequence parallelism, so there the measurement puts torch's in its place,
``devkit.gpt.SequenceParallelTorchNorm``), MoE with EP = 1 (expert_fc1 summed per
layer; per expert when top-k = E), the threshold, the whole dense layer, and
`layer_forward_flops` against torch's FlopCounterMode.

Not modelled: Transformer Engine layers (fused norm + linear, flash attention, which saves no
s x s softmax, fused RoPE), Apex's memory-efficient norms (they save the output), context
parallelism, MoE under tensor parallelism (refused), rotary_percent < 1, dropout > 0,
recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple, Sequence

from ..core.errors import ChunkOffloadError

__all__ = [
    "DTYPE_BYTES",
    "NORMALIZATIONS",
    "POSITION_EMBEDDINGS",
    "MODULE_NAMES",
    "ALIASES",
    "GPTDims",
    "SavedTensor",
    "canonical_modules",
    "expert_tokens",
    "group_bytes",
    "layer_groups",
    "layer_forward_flops",
    "layer_saved_bytes",
    "saved_tensors",
]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of each activation dtype the planner knows."""

MODULE_NAMES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1", "expert_fc1", "moe_act")
"""The offload module names of the Megatron integration, in the order a layer calls them."""

ALIASES = {"router_fc1": "expert_fc1"}
"""Other spellings, as in the Megatron integration."""

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
"""megatron's ``normalization`` values the planner models."""

POSITION_EMBEDDINGS = ("learned_absolute", "rope")
"""megatron's ``position_embedding_type`` values the planner models."""

_SPAN_ALIGN = 16  # the engine rounds a copied span's start down to this (chunk_offload/core/group.py)
_FP32 = 4
_BOOL = 1


def canonical_modules(names: str | Sequence[str]) -> list[str]:
    """Validate module names (a list or comma-separated string), resolve aliases, keep order, drop repeats."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    out: list[str] = []
    for name in names:
        canonical = ALIASES.get(name, name)
        if canonical not in MODULE_NAMES:
            raise ChunkOffloadError(f"unknown offload module {name!r}; valid names: {list(MODULE_NAMES) + sorted(ALIASES)}")
        if canonical not in out:
            out.append(canonical)
    if not out:
        raise ChunkOffloadError(f"no offload module given; choose from {list(MODULE_NAMES)}")
    return out


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
        self._check_tensor_parallel()
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

    def is_moe(self, layer: int) -> bool:
        """Whether global layer ``layer`` (0-based) has experts instead of a dense MLP."""
        if self.num_experts is None:
            return False
        if isinstance(self.moe_layer_freq, tuple):
            return self.moe_layer_freq[layer] == 1
        return layer % self.moe_layer_freq == 0

    def modules_of(self, layer: int) -> list[str]:
        """Offload module names layer ``layer`` has (``moe_act`` counted as present in MoE layers)."""
        dense = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]
        return dense + (["expert_fc1", "moe_act"] if self.is_moe(layer) else ["mlp_fc1"])


class SavedTensor(NamedTuple):
    """One tensor a module saves for backward."""

    storage: str
    """Which storage it views (names are local to one call)."""
    offset: int
    """Byte offset of the view's first element in the storage."""
    span: int
    """Bytes from the first element to one past the last."""
    nbytes: int
    """numel x element size: what ``min_offload_bytes`` is compared with."""


def _whole(storage: str, nbytes: int) -> SavedTensor:
    return SavedTensor(storage, 0, nbytes, nbytes)


def expert_tokens(dims: GPTDims) -> list[int]:
    """Tokens each local expert receives per microbatch (see NOTE [Byte model]: exact in sum at EP = 1)."""
    n = dims.local_experts
    if n == 0:
        return []
    total = dims.tokens * dims.moe_router_topk
    base, extra = divmod(total, n)
    return [base + (1 if e < extra else 0) for e in range(n)]


def saved_tensors(dims: GPTDims, name: str, *, expert: int = 0) -> list[SavedTensor]:
    """What one call of module ``name`` saves on one rank (``expert``: which local expert, for expert modules)."""
    name = ALIASES.get(name, name)
    t, h, d = dims.tokens, dims.hidden_size, dims.dtype_bytes
    if name in ("attn_norm", "mlp_norm"):
        return _norm_saved(dims)
    if name in ("qkv_linear", "mlp_fc1"):
        return [_whole("input", dims.norm_tokens * h * d)]
    if name == "attn_proj":
        return [_whole("input", t * dims.local_heads * dims.head_dim * d)]
    if name == "core_attn":
        return _core_attn_saved(dims)
    if name in ("expert_fc1", "moe_act"):
        tokens = expert_tokens(dims)
        if not 0 <= expert < len(tokens):
            raise ChunkOffloadError(f"expert {expert} out of range: this model has {len(tokens)} local experts")
        if name == "moe_act":
            return [_whole("input", tokens[expert] * dims.fc1_width * d)]
        row = h * d
        view = tokens[expert] * row
        return [SavedTensor("permuted", sum(tokens[:expert]) * row, view, view)]
    raise ChunkOffloadError(f"unknown offload module {name!r}; valid names: {list(MODULE_NAMES) + sorted(ALIASES)}")


def _norm_saved(dims: GPTDims) -> list[SavedTensor]:
    n, h, d = dims.norm_tokens, dims.hidden_size, dims.dtype_bytes
    if dims.normalization == "LayerNorm":
        stats = n * dims.norm_stats_bytes
        return [_whole("input", n * h * d), _whole("mean", stats), _whole("rstd", stats)]
    if dims.device == "cuda":  # torch's fused kernel (and Apex's): the input and an fp32 rstd
        return [_whole("input", n * h * d), _whole("rstd", n * _FP32)]
    # torch's composite on CPU, in fp32: the input as fp32 (itself when fp32), rstd, the normalised input
    return [_whole("input_fp32", n * h * _FP32), _whole("rstd", n * _FP32), _whole("normalized", n * h * _FP32)]


def _core_attn_saved(dims: GPTDims) -> list[SavedTensor]:
    s, b, d, hn = dims.seq_length, dims.micro_batch_size, dims.dtype_bytes, dims.head_dim
    heads, groups = dims.local_heads, dims.local_query_groups
    one = dims.tokens * heads * hn * d  # query, key or value, np' heads
    if dims.rope and groups == heads:
        # Rotated copies of query and key; value a view of linear_qkv's output [T, ng', (np'/ng' + 2) * hn]
        # starting after the first group's query and key, up to the output's end.
        offset = 2 * hn * d
        qkv = [_whole("query", one), _whole("key", one), SavedTensor("mixed_qkv", offset, 3 * one - offset, one)]
    else:
        qkv = [_whole("qkv", 3 * one)]
    probs = b * heads * s * s
    out = qkv + [_whole("mask", s * s * _BOOL), _whole("softmax", probs * _FP32)]
    if d != _FP32:
        out.append(_whole("probs", probs * d))  # the softmax output cast back, saved by bmm
    return out


def group_bytes(saved: Sequence[SavedTensor], *, min_offload_bytes: int) -> int:
    """Bytes the engine moves for one group that saved ``saved`` (threshold, dedup, 16-byte start)."""
    spans: dict[str, tuple[int, int]] = {}
    for tensor in saved:
        if tensor.nbytes < min_offload_bytes:
            continue  # stays on device
        start, end = tensor.offset, tensor.offset + tensor.span
        if tensor.storage in spans:
            low, high = spans[tensor.storage]
            start, end = min(start, low), max(end, high)
        spans[tensor.storage] = (start, end)
    return sum(max(end - start // _SPAN_ALIGN * _SPAN_ALIGN, 0) for start, end in spans.values())


def layer_groups(dims: GPTDims, layer: int, modules: Sequence[str], *, min_offload_bytes: int) -> list[tuple[str, int]]:
    """(name, bytes) of each offload group one forward of layer ``layer`` opens, in call order.

    A MoE layer calls its local experts one after the other, each fc1 then its activation.
    Modules the layer does not have are skipped; groups that move nothing are kept (0 bytes)
    because the engine opens them as well.
    """
    chosen = set(canonical_modules(modules)) if len(modules) else set()
    out: list[tuple[str, int]] = []
    per_expert = [n for n in ("expert_fc1", "moe_act") if n in chosen]
    for name in dims.modules_of(layer):
        if name in chosen and name not in per_expert:
            out.append((name, group_bytes(saved_tensors(dims, name), min_offload_bytes=min_offload_bytes)))
    if dims.is_moe(layer):
        for e in range(dims.local_experts):
            for name in per_expert:
                out.append((name, group_bytes(saved_tensors(dims, name, expert=e), min_offload_bytes=min_offload_bytes)))
    return out


def layer_saved_bytes(dims: GPTDims, layer: int) -> int:
    """Everything one forward of layer ``layer`` saves for backward on one rank (see NOTE [Byte model]).

    Counted like one group around the whole layer with no threshold: exact for dense layers,
    routing metadata left out for MoE layers.
    """
    t, h, d = dims.tokens, dims.hidden_size, dims.dtype_bytes
    attention = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]
    total = sum(group_bytes(saved_tensors(dims, n), min_offload_bytes=0) for n in attention)
    if dims.rope:
        total += 4 * dims.seq_length * dims.head_dim * d  # cos and sin, for query and for key
    if not dims.is_moe(layer):
        return total + group_bytes(saved_tensors(dims, "mlp_fc1"), min_offload_bytes=0) + _mlp_saved_bytes(dims, t)
    # Router input; permuted tokens (the expert fc1 views); per expert the activation and the fc2
    # input, and the activation's output, which the multiplication with the routing probabilities
    # saves (the fused SwiGLU applies the probabilities inside and saves only its input).
    weighted = 0 if dims.swiglu and dims.bias_swiglu_fusion else 1
    experts = sum(_mlp_saved_bytes(dims, n) + weighted * n * dims.local_ffn * d for n in expert_tokens(dims))
    return total + t * h * d + sum(expert_tokens(dims)) * h * d + experts


def _mlp_saved_bytes(dims: GPTDims, tokens: int) -> int:
    """What an MLP's activation and fc2 save for ``tokens`` tokens (outside fc1)."""
    f, d = dims.local_ffn, dims.dtype_bytes
    if not dims.swiglu:
        return 2 * tokens * f * d  # GELU input, fc2 input
    if dims.bias_swiglu_fusion:
        return 3 * tokens * f * d  # fc1 output [tokens, 2f], fc2 input
    # SiLU's input: every row's first half of fc1's output, a strided view; SiLU output, the
    # linear half plus the offset (a copy), fc2 input.
    return max(2 * tokens - 1, 0) * f * d + 3 * tokens * f * d


def layer_forward_flops(dims: GPTDims, layer: int) -> int:
    """Forward FLOPs of one layer on one rank for one microbatch (2 per multiply-add of every matmul).

    QKV 2*T*h*(np' + 2*ng')*hn, scores and context 2 x 2*b*np'*s*s*hn (the local attention
    computes the full square, no causal saving), projection 2*T*np'*hn*h; dense MLP
    2*T*h*(fc1 width + f'), the fc1 width 2f' with SwiGLU; a MoE layer instead has the router
    2*T*h*E and top-k experts per token, 2*T*topk*h*(fc1 width + f).
    """
    t, h, s, b = dims.tokens, dims.hidden_size, dims.seq_length, dims.micro_batch_size
    heads, groups, hn = dims.local_heads, dims.local_query_groups, dims.head_dim
    attention = 2 * t * h * (heads + 2 * groups) * hn + 4 * b * heads * s * s * hn + 2 * t * heads * hn * h
    mlp = 2 * h * (dims.fc1_width + dims.local_ffn)
    if dims.is_moe(layer):
        return attention + 2 * t * h * dims.num_experts + t * dims.moe_router_topk * mlp
    return attention + t * mlp
