"""Which submodules of a megatron-core transformer layer each offload-module name means.

Resolution is by attribute path on megatron-core's `TransformerLayer` (local and Transformer
Engine specs), so nothing in Megatron is patched. `offload_submodules` registers them with the
engine; a name whose module this rank's chunks do not have (the TE spec fuses the attention norm
into ``linear_qkv``; a dense model has no experts) is a warning with a hint, not an error: every
rank gets the same names, and a stage of a mixed model may lack some.

The layers are the decoder's and, on the stage that has them, those inside the Multi-Token
Prediction block (``GPTModel.mtp``, megatron-core's ``mtp_num_layers``): each MTP layer's
transformer layer (``transformer_layer`` in megatron-core 0.16, ``mtp_model_layer`` in 0.19, a
``HybridStack`` of layers in hybrid models), so every offload module applies there too.
`check_model_support` refuses, before anything is hooked, a name the model or the installed
megatron-core cannot offload (``fused_group_mlp`` without Transformer Engine's op-fuser experts).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch.distributed as dist
from torch import nn

from ...core.errors import ChunkOffloadError
from ...module_names import ALIASES, MOE_MODULES, OFFLOAD_MODULE_NAMES, canonical_modules

if TYPE_CHECKING:
    from ...core import OffloadManager

__all__ = [
    "OFFLOAD_MODULE_NAMES",
    "ALIASES",
    "canonical_names",
    "check_model_support",
    "mtp_layers",
    "offload_submodules",
    "resolve",
    "transformer_layers",
    "whole_layer_graphs",
]

logger = logging.getLogger(__name__)

_MISSING_HINTS = {
    "attn_norm": "with the Transformer Engine spec the attention norm is fused into linear_qkv: offload qkv_linear",
    "mlp_norm": "with the Transformer Engine spec the MLP norm is fused into linear_fc1: offload mlp_fc1/expert_fc1",
    "mlp_fc1": "MoE layers have no dense MLP: offload expert_fc1",
    "expert_fc1": "dense layers have no experts, and GroupedMLP has no fc1 module: use SequentialMLP or TEGroupedMLP",
    "moe_act": "the expert activation is a plain function in this model, not a module",
    "fused_group_mlp": "dense layers have no experts",
}


def canonical_names(names: str | list[str] | tuple[str, ...]) -> list[str]:
    """Validate ``names`` (a list or a comma-separated string), resolve aliases, keep order, drop repeats."""
    return canonical_modules(names)


def _present(module: nn.Module | None) -> bool:
    return module is not None and type(module).__name__ != "IdentityOp"


def _attention(layer: nn.Module) -> nn.Module | None:
    return getattr(layer, "self_attention", None)


def _experts(layer: nn.Module) -> Iterator[nn.Module]:
    """The expert MLPs of a MoE layer: each local expert (SequentialMLP) or the grouped one."""
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    if experts is None:
        return
    local = getattr(experts, "local_experts", None)
    yield from (local if local is not None else [experts])


def _fused_experts(layer: nn.Module) -> list[nn.Module]:
    """The layer's experts when Transformer Engine's op fuser runs them as one fused grouped MLP."""
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    return [experts] if experts is not None and _op_fuser(experts) else []


def _op_fuser(experts: nn.Module) -> bool:
    """Whether ``experts`` is megatron-core's TEGroupedMLP with ``use_transformer_engine_op_fuser``
    (megatron-core 0.19's experts.py: its forward then runs ``_fused_forward``, not its fc1 and activation)."""
    config = getattr(experts, "config", None)
    return type(experts).__name__ == "TEGroupedMLP" and getattr(config, "use_transformer_engine_op_fuser", False) is True


def _mlp(layer: nn.Module) -> nn.Module | None:
    mlp = getattr(layer, "mlp", None)
    return None if mlp is None or hasattr(mlp, "experts") else mlp


_RESOLVERS: dict[str, Callable[[nn.Module], list[nn.Module | None]]] = {
    "attn_norm": lambda layer: [getattr(layer, "input_layernorm", None)],
    "qkv_linear": lambda layer: [getattr(_attention(layer), "linear_qkv", None)],
    "core_attn": lambda layer: [getattr(_attention(layer), "core_attention", None)],
    "attn_proj": lambda layer: [getattr(_attention(layer), "linear_proj", None)],
    "mlp_norm": lambda layer: [getattr(layer, "pre_mlp_layernorm", None)],
    "mlp_fc1": lambda layer: [getattr(_mlp(layer), "linear_fc1", None)],
    "expert_fc1": lambda layer: [getattr(e, "linear_fc1", None) for e in _experts(layer)],
    "moe_act": lambda layer: [
        a for e in _experts(layer) if isinstance(a := getattr(e, "activation_func", None), nn.Module)
    ],
    "fused_group_mlp": _fused_experts,
}


def transformer_layers(model_chunk: nn.Module) -> list[nn.Module]:
    """The `TransformerLayer`s of one model chunk, in forward order: the decoder's, then those inside
    its Multi-Token Prediction layers (`mtp_layers`)."""
    decoder = getattr(getattr(model_chunk, "module", model_chunk), "decoder", None)
    if decoder is None:
        # Wrapped (DDP, Float16Module): look for the decoder anywhere below.
        decoder = next((m for n, m in model_chunk.named_modules() if n.endswith("decoder")), None)
    if decoder is None or not hasattr(decoder, "layers"):
        raise ChunkOffloadError(
            f"no megatron-core TransformerBlock (`.decoder.layers`) found in {type(model_chunk).__name__}; "
            "attach expects GPTModel chunks (possibly wrapped in DDP/Float16Module)."
        )
    layers = list(decoder.layers)
    for mtp_layer in mtp_layers(model_chunk):
        # megatron-core 0.16: transformer_layer; 0.19: mtp_model_layer, a HybridStack in hybrid models
        inner = getattr(mtp_layer, "transformer_layer", None) or getattr(mtp_layer, "mtp_model_layer", None)
        if inner is not None:
            layers += list(inner.layers) if isinstance(getattr(inner, "layers", None), nn.ModuleList) else [inner]
    return layers


def mtp_layers(model_chunk: nn.Module) -> list[nn.Module]:
    """The Multi-Token Prediction layers of one model chunk (``GPTModel.mtp.layers``), in forward
    order; empty where the chunk has none (megatron builds them on the last pipeline stage only)."""
    block = next((m for n, m in model_chunk.named_modules() if n == "mtp" or n.endswith(".mtp")), None)
    return list(getattr(block, "layers", None) or [])


def resolve(model_chunk: nn.Module, name: str) -> list[nn.Module]:
    """The submodules of ``model_chunk`` that offload name ``name`` (canonical) stands for.

    Empty when the chunk has no layer with such a module (e.g. ``expert_fc1`` on a dense
    stage of a mixed model); `offload_submodules` warns when a name matches nowhere on the rank.
    """
    return [m for layer in transformer_layers(model_chunk) for m in _layer_modules(layer, name)]


def _layer_modules(layer: nn.Module, name: str) -> list[nn.Module]:
    """The submodules of one transformer layer that offload name ``name`` (canonical) stands for."""
    return [m for m in _RESOLVERS[name](layer) if _present(m)]


def check_model_support(chunks: Sequence[nn.Module], names: Sequence[str]) -> None:
    """Raise `ChunkOffloadError` for a name (canonical) that these chunks or the installed
    megatron-core cannot offload; called by ``attach`` before anything is hooked.

    ``fused_group_mlp`` needs megatron-core's TransformerConfig.use_transformer_engine_op_fuser
    (megatron-core 0.18 on; megatron's own offloading names the group so from 0.19), set on the
    model, and TEGroupedMLP experts. ``expert_fc1`` / ``moe_act`` are refused on such experts: the fused grouped MLP runs instead of their fc1 and activation modules, and
    megatron calls those modules' forward pre-hooks with no input (experts.py,
    ``_make_fused_impl_pre_forward_hook``).
    A model configured to capture whole transformer layers in CUDA graphs is refused too (`_refuse_layer_graphs`).
    """
    _refuse_layer_graphs(chunks, names)
    if not MOE_MODULES & set(names):
        return
    layers = [layer for chunk in chunks for layer in transformer_layers(chunk)]
    experts = [e for layer in layers if (e := getattr(getattr(layer, "mlp", None), "experts", None)) is not None]
    fused = [e for e in experts if _op_fuser(e)]
    if "fused_group_mlp" in names:
        config = getattr(chunks[0], "config", None)
        needed = (
            "TEGroupedMLP experts run by Transformer Engine's op fuser: TransformerConfig(use_transformer_engine_op_fuser="
            "True, moe_grouped_gemm=True) with the Transformer Engine spec (Megatron-LM: --use-transformer-engine-op-fuser "
            "--moe-grouped-gemm --transformer-impl transformer_engine)"
        )
        if not _megatron_has_op_fuser():
            raise ChunkOffloadError(
                f"offload module 'fused_group_mlp' needs {needed}, but the installed megatron-core "
                f"{_megatron_version()} has no use_transformer_engine_op_fuser (megatron-core 0.18 added it); "
                "upgrade megatron-core, or offload expert_fc1 (and moe_act) instead"
            )
        if getattr(config, "use_transformer_engine_op_fuser", False) is not True and not fused:
            raise ChunkOffloadError(
                f"offload module 'fused_group_mlp' needs {needed}; this model's config has "
                f"use_transformer_engine_op_fuser={getattr(config, 'use_transformer_engine_op_fuser', None)!r} "
                f"(megatron-core {_megatron_version()}); set it, or offload expert_fc1 (and moe_act) instead"
            )
        unfused = sorted({type(e).__name__ for e in experts if not _op_fuser(e)})
        if unfused:
            raise ChunkOffloadError(
                f"offload module 'fused_group_mlp' needs {needed}; this model's experts are {unfused} "
                f"(megatron-core {_megatron_version()}), which do not run a fused grouped MLP; offload expert_fc1 "
                "(and moe_act) instead"
            )
    partial = [n for n in ("expert_fc1", "moe_act") if n in names]
    if partial and fused:
        raise ChunkOffloadError(
            f"offload module(s) {partial} on experts run by Transformer Engine's op fuser (TEGroupedMLP with "
            "use_transformer_engine_op_fuser): the fused grouped MLP runs instead of their fc1 and activation "
            f"modules; offload fused_group_mlp instead (megatron-core {_megatron_version()})"
        )


def whole_layer_graphs(impl: str | None, scopes: Sequence[str], *, enable_cuda_graph: bool = False,
                       external_cuda_graph: bool = False) -> str | None:  # fmt: skip
    """The CUDA-graph implementation if megatron-core's settings capture every transformer layer
    whole, else None: ``cuda_graph_impl`` ``impl`` ("local" or "transformer_engine"; before
    megatron-core 0.14 ``enable_cuda_graph`` or ``external_cuda_graph``) with an empty capture scope
    ``scopes`` (the whole layer; "full" before megatron-core turns it into []) or "full_iteration"
    (a scope before megatron-core 0.19, an ``impl`` from it). Read from a model's config at attach
    (`check_model_support`) and from the launcher's command line (`chunk_offload.megatron_lm.preflight`)."""
    if impl in (None, "none"):
        impl = "local" if enable_cuda_graph else "transformer_engine" if external_cuda_graph else "none"
    if impl == "none":
        return None
    whole = impl == "full_iteration" or not scopes or bool({"full", "full_iteration"} & set(scopes))
    return impl if whole else None


def _refuse_layer_graphs(chunks: Sequence[nn.Module], names: Sequence[str]) -> None:
    """Refuse a model whose TransformerConfig captures every transformer layer in a CUDA graph
    (`whole_layer_graphs`): no offload group may run inside one (NOTE [CUDA graph capture] in
    core/streams/base.py). The scope is ``cuda_graph_scope``, ``cuda_graph_modules`` where
    megatron-core has renamed it; a partial one (attn, mlp, moe, ...) is left to the engine, which
    refuses a group that opens during a capture."""
    config = getattr(next((layer for chunk in chunks for layer in transformer_layers(chunk)), None), "config", None)
    field = "cuda_graph_modules" if hasattr(config, "cuda_graph_modules") else "cuda_graph_scope"
    scope = getattr(config, field, None) or []
    scopes = [getattr(s, "name", s) for s in (scope if isinstance(scope, (list, tuple)) else [scope])]
    impl = whole_layer_graphs(getattr(config, "cuda_graph_impl", None), scopes, enable_cuda_graph=getattr(config, "enable_cuda_graph", False),
                              external_cuda_graph=getattr(config, "external_cuda_graph", False))  # fmt: skip
    if impl is not None:
        raise ChunkOffloadError(
            f"the model's TransformerConfig has cuda_graph_impl={impl!r} with {field}={scopes or 'the whole layer'}: "
            f"megatron-core captures every transformer layer in a CUDA graph, whose replays run without the hooks that "
            f"offload {list(names)}; set --cuda-graph-impl none, or a --{field.replace('_', '-')} that leaves the "
            "offloaded modules out (e.g. moe_router when offloading dense or attention modules), or do not offload them"
        )


def _megatron_has_op_fuser() -> bool:
    try:
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError:
        return False
    return "use_transformer_engine_op_fuser" in {f.name for f in dataclasses.fields(TransformerConfig)}


def _megatron_version() -> str:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


_JOINS = {"attn_proj": "core_attn"}
"""Offload module -> the module of the same layer whose group it joins (NOTE [Joined calls] in core/marks.py)."""


def offload_submodules(engine: OffloadManager, chunks: Sequence[nn.Module], names: Sequence[str]) -> dict[str, int]:
    """Protect each chunk's parameters and register the submodules of each name (canonical) with
    ``engine``, each with its transformer layer (NOTE [Layer groups] in core/marks.py); attn_proj
    joins core_attn's group where the layer offloads both (NOTE [Joined calls]: SDPA's output is
    core_attn's saved output and attn_proj's saved input, copied once so).

    Returns name -> submodules registered on this rank; a name matching none is left out, with a warning.
    """
    registered: dict[str, int] = {}
    for chunk in chunks:
        engine.protect_module(chunk)
        for layer in transformer_layers(chunk):  # each layer's modules: one group with OffloadConfig.group_by="layer"
            joins = {name: _JOINS[name] for name in names if _JOINS.get(name) in names and _layer_modules(layer, _JOINS[name])}
            for name in names:
                for module in _layer_modules(layer, name):
                    engine.offload_module(module, name, layer=layer, joins=joins.get(name))
                    registered[name] = registered.get(name, 0) + 1
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0  # ranks log alike: say which
    for name in names:
        if name not in registered:
            logger.warning(
                "chunk_offload: offload module %r matches no submodule on rank %d (%s); nothing of it is offloaded there.",
                name,
                rank,
                _MISSING_HINTS.get(name, "not present in this model"),
            )
    return registered
