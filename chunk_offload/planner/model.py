"""Bytes each offload module of a megatron-core GPT/MoE layer saves for backward, per call.

Every module is described as a list of `SavedTensor` (storage, offset, span, bytes) and
`group_bytes` applies the engine's rules (``saved.py``). Core attention is modelled in
``attention.py``, Transformer Engine's fused modules in ``te.py``, the norms in ``norms.py``,
Mamba layers in ``mamba.py``, what an MTP layer adds in ``mtp.py``, the FLOPs in ``flops.py``
(re-exported here); this file has the rest.

NOTE [Byte model]: what each module saves, for megatron-core 0.16.1's local (non Transformer
Engine) layer spec (Transformer Engine's: ``te.py``, from its source, unmeasured), dropout 0,
no attention mask passed (megatron builds its causal mask), per tensor-parallel rank. T = seq_length x micro_batch_size tokens, d = bytes per element of the
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
- ``core_attn``: see ``attention.py`` (megatron's DotProductAttention with its s x s softmax,
  or torch's SDPA: query, key, value, output and log-sum-exp).
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
outside the offload modules, once per storage (SDPA's output is also attn_proj's input, see
``_attention_output_is_proj_input``). Rotary embeddings: the cos and sin factors [s, 1, 1, hn] in d for
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
positions, multi-head, grouped-query and multi-query attention, megatron's attention and torch's
SDPA (one and two sequences per microbatch), tensor parallel 2 with and
without sequence parallelism (per rank, on gloo ranks; the local spec takes Apex's norm under
sequence parallelism, so there the measurement puts torch's in its place,
``devkit.gpt.SequenceParallelTorchNorm``), MoE with EP = 1 (expert_fc1 summed per
layer; per expert when top-k = E), the threshold, the whole dense layer, and
`layer_forward_flops` against torch's FlopCounterMode (which does not count SDPA's CPU kernel;
`core_attention_flops` is checked against torch's SDPA formulas instead).

Held elsewhere (NOTE [Storages held elsewhere], ``core/held_elsewhere.py``): a saved storage
another reference keeps on device stays there, counted as saved but never moved; `held_elsewhere`
names them, measured with the stage replay on CPU (``tests/planner/test_held_elsewhere.py``): (a) core
attention's output when it is attn_proj's saved input (`_attention_output_is_proj_input`: SDPA,
not the local attention, which saves no output) and attn_proj is not offloaded (offloaded, both
groups copy it); (b) the input of the first layer of a chunk that receives it from a previous
stage or chunk, which the schedule keeps until the chunk's backward: saved by ``attn_norm`` (under
Transformer Engine by ``qkv_linear``, from source), but not by the CPU RMSNorm in bf16/fp16,
which saves an fp32 copy. No other module's storage (mlp_norm, mlp_fc1, qkv_linear, expert_fc1)
is held elsewhere.

Selective recompute (``GPTDims.recompute_modules``, megatron's reentrant ``tensor_parallel.checkpoint``):
the recomputed forward runs without saving and opens no offload group; the checkpoint saves its
tensor inputs. ``core_attn``: query, key and value as passed (`qkv_saved`) and the mask type, an
int32 [1] made on the host; the output is then attn_proj's alone. ``moe``: the MoE layer's input
[T, h] only. Measured equal on CPU (``tests/planner/test_model.py``, the ``recompute_*`` cases).

Layer kinds (``GPTDims.layer_symbols``, ``layer_kinds.py``): a hybrid model's attention layer
(``*``) saves the attention part above, its MLP layer (``-``) the dense MLP's and its MoE layer
(``E``) the MoE layer's (norm included); a Mamba layer (``M``) saves what ``mamba.py`` lists (from
source, unmeasured) and opens no offload group. A Multi-Token Prediction layer (``mtp_num_layers``,
after the decoder on the last stage) saves its transformer layer's bytes plus the MTP block's
(``mtp.py``: the embedding's indices, three norms, ``eh_proj``'s input; measured on CPU).
``fused_group_mlp`` is refused (`NOT_MODELLED`).

Not modelled: FP8 activations (Transformer Engine), Apex's memory-efficient norms (they save the
output), context parallelism, MoE under tensor parallelism (refused), rotary_percent < 1,
dropout > 0, full recompute, selective recompute of ``layernorm`` (it needs Transformer Engine),
``mlp`` and the other modules.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from ..core.errors import ChunkOffloadError
from ..module_names import ALIASES, OFFLOAD_MODULE_NAMES, TE_FUSED_INTO, canonical_modules
from .attention import core_attn_saved
from .qkv import qkv_saved
from .dims import GPTDims
from .flops import layer_backward_flops, layer_forward_flops, layer_recompute_flops
from .mamba import mamba_saved
from .mtp import mtp_extra_saved
from .norms import norm_saved
from .saved import SavedTensor, group_bytes, storage_bytes, whole
from .te import te_saved

__all__ = [
    "LayerGroup",
    "NOT_MODELLED",
    "check_modelled",
    "expert_tokens",
    "held_elsewhere",
    "layer_backward_flops",
    "layer_forward_flops",
    "layer_groups",
    "layer_offload_groups",
    "layer_recompute_flops",
    "layer_saved_bytes",
    "saved_tensors",
]

_INT32 = 4


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
    check_modelled([name])
    if dims.transformer_engine:
        if name in TE_FUSED_INTO and not (name == "mlp_norm" and dims.num_experts is not None):
            raise ChunkOffloadError(
                f"offload module {name!r} does not exist under Transformer Engine's spec: it is fused into "
                f"{TE_FUSED_INTO.get(name, '?')!r} (chunk_offload.module_names.TE_FUSED_INTO)"
            )
        fused = te_saved(dims, name)
        if fused is not None:
            return fused
    if name in ("attn_norm", "mlp_norm"):
        return norm_saved(dims)
    if name in ("qkv_linear", "mlp_fc1"):
        return [whole("input", dims.norm_tokens * h * d)]
    if name == "attn_proj":
        return [whole("input", t * dims.local_heads * dims.head_dim * d)]
    if name == "core_attn":
        return core_attn_saved(dims)
    if name in ("expert_fc1", "moe_act"):
        tokens = expert_tokens(dims)
        if not 0 <= expert < len(tokens):
            raise ChunkOffloadError(f"expert {expert} out of range: this model has {len(tokens)} local experts")
        if name == "moe_act":
            return [whole("input", tokens[expert] * dims.fc1_width * d)]
        row = h * d
        view = tokens[expert] * row
        return [SavedTensor("permuted", sum(tokens[:expert]) * row, view, view)]
    raise ChunkOffloadError(f"unknown offload module {name!r}; valid names: {list(OFFLOAD_MODULE_NAMES) + sorted(ALIASES)}")


NOT_MODELLED = {
    "fused_group_mlp": (
        "what Transformer Engine's op-fuser grouped MLP saves depends on how TE fuses it (its basic ops, or one "
        "fused kernel on sm100 GPUs) and is not modelled; plan with expert_fc1 for its input, or measure it with "
        "the stage replay"
    ),
}
"""Offload modules the planner refuses -> why."""


def check_modelled(modules: Sequence[str]) -> None:
    """Raise `ChunkOffloadError` for a module (canonical) of `NOT_MODELLED`."""
    for name in modules:
        if name in NOT_MODELLED:
            raise ChunkOffloadError(f"offload module {name!r} is not modelled by the planner: {NOT_MODELLED[name]}")


class LayerGroup(NamedTuple):
    """One offload group a layer's forward opens."""

    name: str
    """Its module name."""
    nbytes: int
    """Bytes it saves (the engine's `IterationRecord.group_bytes`)."""
    kept_bytes: int
    """Of those, bytes held elsewhere: kept on device even when the group is copied
    (`IterationRecord.group_kept_bytes`, `held_elsewhere`)."""


def held_elsewhere(dims: GPTDims, layer: int, name: str, chosen: set[str], *, receives_input: bool) -> set[str]:
    """Storages (`SavedTensor.storage`) of one call of module ``name`` that another reference keeps on device.

    The planner's one rule for NOTE [Storages held elsewhere] (NOTE [Byte model] lists the cases):
    core attention's output when attn_proj saves it too and is not offloaded (``chosen``: the
    offloaded modules); the layer's input, which ``layer``'s first module saves when the layer is
    the first of a chunk that receives it (``receives_input``) and the schedule holds it.
    """
    held = set()
    if name == "core_attn" and "attn_proj" not in chosen and _attention_output_is_proj_input(dims):
        held.add("output")
    if receives_input and name in dims.modules_of(layer)[:1]:  # attn_norm; qkv_linear under TE
        held.add("input")
    return held


def layer_offload_groups(
    dims: GPTDims, layer: int, modules: Sequence[str], *, min_offload_bytes: int, receives_input: bool = False
) -> list[LayerGroup]:
    """Each offload group one forward of layer ``layer`` opens, in call order.

    A MoE layer calls its local experts one after the other, each fc1 then its activation.
    Modules the layer does not have are skipped; groups that move nothing are kept (0 bytes)
    because the engine opens them as well. ``receives_input``: the layer is the first of a chunk
    whose input came from a previous stage or chunk (`held_elsewhere`).
    """
    chosen = set(canonical_modules(modules)) if len(modules) else set()
    calls: list[tuple[str, int]] = []
    per_expert = [n for n in ("expert_fc1", "moe_act") if n in chosen]
    for name in dims.modules_of(layer):
        if name in chosen and name not in per_expert and not dims.recomputed(layer, name):
            calls.append((name, 0))
    if dims.is_moe(layer):
        calls += [(name, e) for e in range(dims.local_experts) for name in per_expert if not dims.recomputed(layer, name)]
    out = []
    for name, expert in calls:
        spans = storage_bytes(saved_tensors(dims, name, expert=expert), min_offload_bytes=min_offload_bytes)
        held = held_elsewhere(dims, layer, name, chosen, receives_input=receives_input)
        out.append(LayerGroup(name, sum(spans.values()), sum(n for s, n in spans.items() if s in held)))
    return out


def layer_groups(dims: GPTDims, layer: int, modules: Sequence[str], *, min_offload_bytes: int) -> list[tuple[str, int]]:
    """(name, bytes) of each offload group one forward of layer ``layer`` opens (`layer_offload_groups`)."""
    return [(g.name, g.nbytes) for g in layer_offload_groups(dims, layer, modules, min_offload_bytes=min_offload_bytes)]


def layer_saved_bytes(dims: GPTDims, layer: int) -> int:
    """Everything one forward of layer ``layer`` saves for backward on one rank (see NOTE [Byte model]).

    Counted like one group around the whole layer with no threshold: exact for dense layers,
    routing metadata left out for MoE layers. A Mamba layer: `chunk_offload.planner.mamba`; an MTP
    layer adds what the MTP block saves (`chunk_offload.planner.mtp`).
    """
    if dims.is_mamba(layer):
        return group_bytes(mamba_saved(dims), min_offload_bytes=0)
    total = _attention_saved_bytes(dims, layer) if dims.has_attention(layer) else 0
    total += _mlp_layer_saved_bytes(dims, layer)
    if dims.is_mtp(layer):
        total += group_bytes(mtp_extra_saved(dims), min_offload_bytes=0)
    return total


def _attention_saved_bytes(dims: GPTDims, layer: int) -> int:
    t, d = dims.tokens, dims.dtype_bytes
    names = ("attn_norm", "qkv_linear", "core_attn", "attn_proj")
    attention = [n for n in names if n in dims.modules_of(layer) and not dims.recomputed(layer, n)]
    total = sum(group_bytes(saved_tensors(dims, n), min_offload_bytes=0) for n in attention)
    if dims.rope:
        total += 4 * dims.seq_length * dims.head_dim * d  # cos and sin, for query and for key
    if dims.recomputed(layer, "core_attn"):
        # The checkpoint saves its inputs: query, key, value and the mask type, an int32 [1] made
        # on the host (on the device only on CPU). No output is saved: attn_proj's input is its own.
        return total + group_bytes(qkv_saved(dims), min_offload_bytes=0) + (_INT32 if dims.device == "cpu" else 0)
    if _attention_output_is_proj_input(dims):
        total -= t * dims.local_heads * dims.head_dim * d  # one storage, saved by both
    return total


def _mlp_layer_saved_bytes(dims: GPTDims, layer: int) -> int:
    """What the layer's MLP part saves: its norm (when separate), the dense MLP or the MoE layer; 0 without."""
    t, h, d = dims.tokens, dims.hidden_size, dims.dtype_bytes
    symbols = dims.layer_symbols(layer)
    if "-" not in symbols and "E" not in symbols:
        return 0
    total = group_bytes(saved_tensors(dims, "mlp_norm"), min_offload_bytes=0) if "mlp_norm" in dims.modules_of(layer) else 0
    if dims.recomputed(layer, "expert_fc1"):
        return total + t * h * d  # the checkpointed MoE layer saves its input only
    if not dims.is_moe(layer):
        return total + group_bytes(saved_tensors(dims, "mlp_fc1"), min_offload_bytes=0) + _mlp_saved_bytes(dims, t)
    # Router input; permuted tokens (the expert fc1 views); per expert the activation and the fc2
    # input, and the activation's output, which the multiplication with the routing probabilities
    # saves (the fused SwiGLU applies the probabilities inside and saves only its input).
    weighted = 0 if dims.swiglu and dims.bias_swiglu_fusion else 1
    experts = sum(_mlp_saved_bytes(dims, n) + weighted * n * dims.local_ffn * d for n in expert_tokens(dims))
    return total + t * h * d + sum(expert_tokens(dims)) * h * d + experts


def _attention_output_is_proj_input(dims: GPTDims) -> bool:
    """Whether attn_proj's saved input is a view of the output the core attention saved.

    SDPAttention's [b, np', s, hn] output is [b, s, np', hn] in memory: permuted to
    [s, b, np', hn] it reshapes to [s, b, np' * hn] as a view (measured). TE's fused attention
    returns sbhd, viewed as [s, b, h]; its flash-attn backend transposes bshd back with
    ``.contiguous()``, a copy unless there is one sequence (from source).
    """
    if dims.transformer_engine:
        return dims.attention_kernel == "fused" or dims.micro_batch_size == 1
    return dims.attention == "sdpa"


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
