"""Which submodules of a megatron-core transformer layer each offload-module name means.

Resolution is by attribute path on megatron-core's `TransformerLayer` (local and Transformer
Engine specs), so nothing in Megatron is patched. `offload_submodules` registers them with the
engine; a name whose module this rank's chunks do not have (the TE spec fuses the attention norm
into ``linear_qkv``; a dense model has no experts) is a warning with a hint, not an error: every
rank gets the same names, and a stage of a mixed model may lack some.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch.distributed as dist
from torch import nn

from ...core.errors import ChunkOffloadError
from ...module_names import ALIASES, OFFLOAD_MODULE_NAMES, canonical_modules

if TYPE_CHECKING:
    from ...core import OffloadManager

__all__ = ["OFFLOAD_MODULE_NAMES", "ALIASES", "canonical_names", "offload_submodules", "resolve"]

logger = logging.getLogger(__name__)

_MISSING_HINTS = {
    "attn_norm": "with the Transformer Engine spec the attention norm is fused into linear_qkv: offload qkv_linear",
    "mlp_norm": "with the Transformer Engine spec the MLP norm is fused into linear_fc1: offload mlp_fc1/expert_fc1",
    "mlp_fc1": "MoE layers have no dense MLP: offload expert_fc1",
    "expert_fc1": "dense layers have no experts, and GroupedMLP has no fc1 module: use SequentialMLP or TEGroupedMLP",
    "moe_act": "the expert activation is a plain function in this model, not a module",
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
}


def transformer_layers(model_chunk: nn.Module) -> list[nn.Module]:
    """The `TransformerLayer`s of one model chunk, in forward order."""
    decoder = getattr(getattr(model_chunk, "module", model_chunk), "decoder", None)
    if decoder is None:
        # Wrapped (DDP, Float16Module): look for the decoder anywhere below.
        decoder = next((m for n, m in model_chunk.named_modules() if n.endswith("decoder")), None)
    if decoder is None or not hasattr(decoder, "layers"):
        raise ChunkOffloadError(
            f"no megatron-core TransformerBlock (`.decoder.layers`) found in {type(model_chunk).__name__}; "
            "attach expects GPTModel chunks (possibly wrapped in DDP/Float16Module)."
        )
    return list(decoder.layers)


def resolve(model_chunk: nn.Module, name: str) -> list[nn.Module]:
    """The submodules of ``model_chunk`` that offload name ``name`` (canonical) stands for.

    Empty when the chunk has no layer with such a module (e.g. ``expert_fc1`` on a dense
    stage of a mixed model); `offload_submodules` warns when a name matches nowhere on the rank.
    """
    modules: list[nn.Module] = []
    for layer in transformer_layers(model_chunk):
        modules += [m for m in _RESOLVERS[name](layer) if _present(m)]
    return modules


def offload_submodules(engine: OffloadManager, chunks: Sequence[nn.Module], names: Sequence[str]) -> dict[str, int]:
    """Protect each chunk's parameters and register the submodules of each name (canonical) with ``engine``.

    Returns name -> submodules registered on this rank; a name matching none is left out, with a warning.
    """
    registered: dict[str, int] = {}
    for chunk in chunks:
        engine.protect_module(chunk)
        for name in names:
            for module in resolve(chunk, name):
                engine.offload_module(module, name)
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
