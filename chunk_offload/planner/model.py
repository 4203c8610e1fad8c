"""Bytes each offload module of a megatron-core GPT/MoE layer saves for backward, per call.

The model follows what the engine moves (see ``chunk_offload/core/group.py``): per call of an
offloaded submodule, the tensors autograd saves inside it that are not parameters and hold at
least ``min_offload_bytes`` (numel x element size of the saved view, like
`chunk_offload.core.policy.OffloadPolicy`); views of one storage are moved once, as the span from
their lowest start (rounded down to 16 bytes) to their highest end. So every module is described
as a list of `SavedTensor` (storage, offset, span, bytes) and `group_bytes` applies those rules.

NOTE [Byte model]: what each module saves, for megatron-core 0.16.1's local (non Transformer
Engine) layer spec, tensor parallel 1, dropout 0, LayerNorm, GELU, learned absolute positions,
no attention mask passed (megatron builds its causal mask). T = seq_length x micro_batch_size
tokens, d = bytes per element of the activations, np heads of hn = hidden / np channels,
ng query groups, f the FFN size.

- ``attn_norm``, ``mlp_norm`` (torch LayerNorm): the input [s, b, h] (T*h*d) and mean and rstd
  [s, b, 1]. On CUDA mean and rstd are in the accumulate type (fp32) whatever the input dtype;
  on CPU in the input dtype (measured): ``GPTDims.device`` picks.
- ``qkv_linear``, ``mlp_fc1``: megatron's linear autograd Function saves its input [s, b, h]
  (and the weight, a parameter).
- ``attn_proj``: the same, its input is the attention context [s, b, np*hn].
- ``core_attn`` (DotProductAttention): query, key and value, 3*T*np*hn*d. With multi-head
  attention they are views of linear_qkv's output; with grouped-query attention the query is a
  reshaped copy and key and value are ``repeat_interleave`` copies, np*hn each: the same bytes
  (measured for ng = np, 1 < ng < np and ng = 1). Then the causal mask, a bool [s, s], saved by
  ``masked_fill_``; the softmax output [b, np, s, s] in fp32 (``attention_softmax_in_fp32``) and,
  for bf16/fp16, its cast back to d, which ``bmm`` saves.
- ``expert_fc1`` (alias ``router_fc1``): the tokens routed to that local expert, [t_e, h], a
  view of the permuted tokens. Routing decides t_e; with expert parallel 1 the local experts
  together get exactly T*topk tokens. With EP > 1 and the allgather dispatcher each expert gets
  EP*T*topk/E tokens only on average. The model splits T*topk tokens as evenly as integers
  allow over the local experts (`expert_tokens`): the sum per layer is exact at EP = 1, each
  expert's share is the balanced-routing expectation.
- ``moe_act``: a module only under Transformer Engine's activation (``use_te_activation_func``);
  modelled as saving its input [t_e, f] and NOT measured (no Transformer Engine on CPU).

Whole-layer saved bytes (`layer_saved_bytes`, for the memory budget) add what the layer saves
outside the offload modules: for a dense layer the GELU input and the fc2 input, [s, b, f] each;
for a MoE layer the router's input [s, b, h] and per expert the GELU input, its output (saved by
the multiplication with the routing probabilities) and the fc2 input, [t_e, f] each. Routing
metadata (top-k indices and probabilities, token maps: a few tensors of T x (E + topk)
elements) is not modelled: MoE layers are a slight underestimate.

Measured equal on CPU (``tests/planner/test_model.py``): every offload module but ``moe_act``,
fp32 and bf16, multi-head, grouped-query and multi-query attention, MoE with EP = 1 (expert_fc1
summed per layer; per expert when top-k = E), the threshold, the whole dense layer, and
`layer_forward_flops` against torch's FlopCounterMode.

Not modelled: Transformer Engine layers (fused norm + linear, flash attention, which saves no
s x s softmax), tensor/sequence/context parallelism, RMSNorm, gated MLPs (SwiGLU), rotary
embeddings (they make query and key copies before core attention), dropout > 0, recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple, Sequence

from ..core.errors import ChunkOffloadError

__all__ = [
    "DTYPE_BYTES",
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
    """Where training runs: LayerNorm saves its statistics in fp32 on CUDA, in the input dtype on CPU."""

    def __post_init__(self) -> None:
        for label in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "moe_router_topk", "expert_parallel"):
            value = getattr(self, label)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ChunkOffloadError(f"{label} must be an int >= 1, got {value!r}")
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

    # ------------------------------------------------------------------ derived sizes
    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

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
    """What one call of module ``name`` saves (``expert``: which local expert, for expert modules)."""
    name = ALIASES.get(name, name)
    t, h, d = dims.tokens, dims.hidden_size, dims.dtype_bytes
    if name in ("attn_norm", "mlp_norm"):
        stats = t * dims.norm_stats_bytes
        return [_whole("input", t * h * d), _whole("mean", stats), _whole("rstd", stats)]
    if name in ("qkv_linear", "mlp_fc1"):
        return [_whole("input", t * h * d)]
    if name == "attn_proj":
        return [_whole("input", t * dims.num_attention_heads * dims.head_dim * d)]
    if name == "core_attn":
        s, b, heads = dims.seq_length, dims.micro_batch_size, dims.num_attention_heads
        qkv = t * heads * dims.head_dim * d
        probs = b * heads * s * s
        out = [_whole("qkv", 3 * qkv), _whole("mask", s * s * _BOOL), _whole("softmax", probs * _FP32)]
        if d != _FP32:
            out.append(_whole("probs", probs * d))  # the softmax output cast back, saved by bmm
        return out
    if name in ("expert_fc1", "moe_act"):
        tokens = expert_tokens(dims)
        if not 0 <= expert < len(tokens):
            raise ChunkOffloadError(f"expert {expert} out of range: this model has {len(tokens)} local experts")
        if name == "moe_act":
            return [_whole("input", tokens[expert] * dims.ffn * d)]
        row = h * d
        view = tokens[expert] * row
        return [SavedTensor("permuted", sum(tokens[:expert]) * row, view, view)]
    raise ChunkOffloadError(f"unknown offload module {name!r}; valid names: {list(MODULE_NAMES) + sorted(ALIASES)}")


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
    """Everything one forward of layer ``layer`` saves for backward (see NOTE [Byte model]).

    Counted like one group around the whole layer with no threshold: exact for dense layers,
    routing metadata left out for MoE layers.
    """
    t, h, d, f = dims.tokens, dims.hidden_size, dims.dtype_bytes, dims.ffn
    attention = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]
    total = sum(group_bytes(saved_tensors(dims, n), min_offload_bytes=0) for n in attention)
    if not dims.is_moe(layer):
        return total + group_bytes(saved_tensors(dims, "mlp_fc1"), min_offload_bytes=0) + 2 * t * f * d
    routed = sum(expert_tokens(dims))
    # router input; permuted tokens (the expert fc1 views); per expert GELU input, GELU output, fc2 input
    return total + t * h * d + routed * h * d + 3 * routed * f * d


def layer_forward_flops(dims: GPTDims, layer: int) -> int:
    """Forward FLOPs of one layer for one microbatch (2 per multiply-add of every matmul).

    QKV 2*T*h*(np + 2*ng)*hn, scores and context 2 x 2*b*np*s*s*hn (the local attention computes
    the full square, no causal saving), projection 2*T*np*hn*h; dense MLP 2 x 2*T*h*f; a MoE
    layer instead has the router 2*T*h*E and top-k experts per token, 2 x 2*T*topk*h*f.
    """
    t, h, s, b = dims.tokens, dims.hidden_size, dims.seq_length, dims.micro_batch_size
    heads, groups, hn = dims.num_attention_heads, dims.query_groups, dims.head_dim
    attention = 2 * t * h * (heads + 2 * groups) * hn + 4 * b * heads * s * s * hn + 2 * t * heads * hn * h
    if dims.is_moe(layer):
        return attention + 2 * t * h * dims.num_experts + 4 * t * dims.moe_router_topk * h * dims.ffn
    return attention + 4 * t * h * dims.ffn
