"""The offload-module names of a megatron-core transformer layer, in one place.

Used by the Megatron integration (`chunk_offload.integrations.megatron.modules` resolves each name
to submodules) and by the planner (`chunk_offload.planner` models what each saves). The names are
the same under every layer spec; under Transformer Engine's spec two of them live inside fused
modules (`TE_FUSED_INTO`). ``fused_group_mlp`` exists only where megatron-core has Transformer
Engine's op-fuser grouped MLP (megatron-core 0.18 on); Megatron-LM main's ``gdp_qkv`` is refused with its reason
(`UNSUPPORTED`). Importing this module imports neither megatron nor torch.
"""

from __future__ import annotations

from typing import Sequence

from .core.errors import ChunkOffloadError

__all__ = [
    "ALIASES",
    "DESCRIPTIONS",
    "MOE_MODULES",
    "OFFLOAD_MODULE_NAMES",
    "TE_FUSED_INTO",
    "UNSUPPORTED",
    "canonical_modules",
    "check_combination",
    "combination_problem",
]

OFFLOAD_MODULE_NAMES = (
    "attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1", "expert_fc1", "moe_act", "fused_group_mlp",
)  # fmt: skip
"""Every offload-module name, in the order a layer calls the modules (``fused_group_mlp`` runs where
``expert_fc1`` and ``moe_act`` would: a model has one or the other)."""

ALIASES = {"router_fc1": "expert_fc1"}
"""Other spellings of a name -> the name."""

DESCRIPTIONS = {
    "attn_norm": "the layer's input norm (input_layernorm)",
    "qkv_linear": "the query/key/value projection (self_attention.linear_qkv)",
    "core_attn": "the core attention (self_attention.core_attention): softmax(QK^T)V",
    "attn_proj": "the attention output projection (self_attention.linear_proj)",
    "mlp_norm": "the norm before the MLP (pre_mlp_layernorm)",
    "mlp_fc1": "the dense MLP's first linear (mlp.linear_fc1)",
    "expert_fc1": "each local expert's first linear (mlp.experts.local_experts[i].linear_fc1)",
    "moe_act": "each local expert's activation, when it is a module (Transformer Engine's activation)",
    "fused_group_mlp": "the whole grouped expert MLP run by Transformer Engine's op fuser (mlp.experts, a TEGroupedMLP "
    "with use_transformer_engine_op_fuser; megatron-core >= 0.18)",
}
"""What each name stands for in megatron-core's TransformerLayer."""

TE_FUSED_INTO = {"attn_norm": "qkv_linear", "mlp_norm": "mlp_fc1"}
"""Under Transformer Engine's layer spec the norms are fused into the next linear
(``TELayerNormColumnParallelLinear``): the layer has no separate norm module, and what the norm
saves is saved by the fused linear, offloaded under the linear's name."""


UNSUPPORTED = {
    "gdp_qkv": (
        "Megatron-LM main's gdp_qkv offloads the causal convolution and query/key/value preparation inside "
        "GatedDeltaProductMixer._gdp_chunk_forward (megatron/core/ssm/gated_delta_product.py), a method and not a "
        "submodule (with causal_conv1d installed no module is called there at all); chunk_offload offloads "
        "submodules through their module hooks and does not patch megatron, so it cannot offload that region"
    ),
}
"""Offload names of Megatron-LM that chunk_offload knows but cannot offload -> why (`canonical_modules` raises it)."""


def canonical_modules(names: str | Sequence[str]) -> list[str]:
    """Validate module names (a list or comma-separated string), resolve aliases, keep order, drop repeats."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    elif not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ChunkOffloadError(
            f"offload_modules must be a str (comma-separated) or a list/tuple of str, got {names!r}; "
            f"valid names: {list(OFFLOAD_MODULE_NAMES) + sorted(ALIASES)}"
        )
    out: list[str] = []
    for name in names:
        canonical = ALIASES.get(name, name)
        if canonical in UNSUPPORTED:
            raise ChunkOffloadError(f"offload module {name!r} is not supported: {UNSUPPORTED[canonical]}")
        if canonical not in OFFLOAD_MODULE_NAMES:
            raise ChunkOffloadError(
                f"unknown offload module {name!r}; valid names: {list(OFFLOAD_MODULE_NAMES) + sorted(ALIASES)}"
            )
        if canonical not in out:
            out.append(canonical)
    if not out:
        raise ChunkOffloadError(f"no offload module given; choose from {list(OFFLOAD_MODULE_NAMES)}")
    return out


MOE_MODULES = frozenset({"expert_fc1", "moe_act", "fused_group_mlp"})
"""The offload modules inside a MoE layer's experts."""


def combination_problem(modules: Sequence[str], recompute_modules: Sequence[str] = ()) -> str | None:
    """Why Megatron's rules refuse offloading ``modules`` (canonical names) while selective recompute
    covers ``recompute_modules``, or None when they allow it. The rules of megatron-core 0.19's
    `TransformerConfig` for its own offloading, which hold for ours for the same reasons:

    - ``attn_proj`` needs ``core_attn`` offloaded or recomputed: attn_proj saves core attention's
      output, which core attention's backward needs as well (flash attention saves it), so
      offloading attn_proj alone moves nothing off the device (megatron-core asks for core_attn
      offloaded; a recomputed core attention saves no output either, so we accept it too);
    - MoE modules (``fused_group_mlp`` included) are not offloaded while ``moe`` is recomputed: the
      recompute checkpoints the whole MoE forward, so nothing inside it is saved to offload;
    - ``fused_group_mlp`` is not combined with ``expert_fc1`` or ``moe_act``: it offloads the whole
      fused grouped MLP, which runs instead of those modules.

    Whether the model has op-fuser experts at all is the model's business: the Megatron integration
    checks it at ``attach`` (`chunk_offload.integrations.megatron.modules.check_model_support`).
    """
    if "attn_proj" in modules and "core_attn" not in modules and "core_attn" not in recompute_modules:
        return (
            "attn_proj is offloaded without core_attn: attn_proj saves core attention's output, which core "
            "attention's backward needs too, so attn_proj alone frees nothing (megatron-core refuses it as well); "
            "add core_attn (offloaded, or recomputed with --recompute-modules core_attn) or drop attn_proj"
        )
    partial = [m for m in ("expert_fc1", "moe_act") if m in modules]
    if "fused_group_mlp" in modules and partial:
        return (
            f"fused_group_mlp is offloaded with {','.join(partial)}: fused_group_mlp offloads the whole grouped expert "
            "MLP that Transformer Engine's op fuser runs instead of the experts' fc1 and activation modules "
            f"(megatron-core refuses it as well); drop {','.join(partial)} or fused_group_mlp"
        )
    inside_moe = sorted(MOE_MODULES & set(modules))
    if inside_moe and "moe" in recompute_modules:
        return (
            f"{','.join(inside_moe)} cannot be offloaded while the MoE layer is recomputed ('moe' in the recompute "
            "modules): the recompute checkpoints the whole MoE forward, so nothing inside it is saved to offload "
            "(megatron-core refuses it as well); drop 'moe' from the recompute modules or drop "
            f"{','.join(inside_moe)}"
        )
    return None


def check_combination(
    modules: Sequence[str], recompute_modules: Sequence[str] = (), *, modules_flag: str, recompute_flag: str
) -> None:
    """Raise `ChunkOffloadError` naming the flags as typed (``--chunk-offload-modules`` and
    ``--recompute-modules``, or the library's arguments) when `combination_problem` finds one."""
    problem = combination_problem(modules, recompute_modules)
    if problem is not None:
        given = f"{modules_flag} {','.join(modules)}"
        if "recompute modules" in problem:
            given += f" with {recompute_flag} {' '.join(recompute_modules)}"
        raise ChunkOffloadError(f"{given}: {problem}")
