"""How the engine groups one layer's module calls, for the planner: `joined_groups` under
``OffloadConfig.group_by="module"`` (NOTE [Joined calls] in core/marks.py) and `merged_layer_group`
under ``"layer"`` (NOTE [Layer groups]); "call" keeps `model.layer_offload_groups` as they are."""

from __future__ import annotations

from typing import Sequence

from .dims import GPTDims
from .model import LayerGroup, _attention_output_is_proj_input

__all__ = ["joined_groups", "merged_layer_group"]


def merged_layer_group(dims: GPTDims, groups: Sequence[LayerGroup]) -> list[LayerGroup]:
    """A layer's groups (`layer_offload_groups`) as the one group ``OffloadConfig.group_by="layer"``
    opens (NOTE [Layer groups] in core/marks.py); none where the layer opens none.

    Its storages count once: core attention's output that attn_proj saves as its input
    (`_attention_output_is_proj_input`) is one storage of the layer group, copied once.
    """
    if not groups:
        return []
    names = [g.name for g in groups]
    nbytes = sum(g.nbytes for g in groups)
    if "core_attn" in names and "attn_proj" in names and _attention_output_is_proj_input(dims):
        nbytes -= groups[names.index("attn_proj")].nbytes  # attn_proj saves that output alone
    unique = list(dict.fromkeys(names))
    return [LayerGroup("+".join(unique), nbytes, sum(g.kept_bytes for g in groups))]


def joined_groups(dims: GPTDims, groups: Sequence[LayerGroup]) -> list[LayerGroup]:
    """A layer's groups (`layer_offload_groups`) as ``OffloadConfig.group_by="module"`` opens them:
    attn_proj's call joins core_attn's group where its saved input is core attention's saved output
    (`_attention_output_is_proj_input`; NOTE [Joined calls] in core/marks.py), copied once."""
    names = [g.name for g in groups]
    if "core_attn" in names and _attention_output_is_proj_input(dims):
        i = names.index("core_attn")
        if names[i + 1 : i + 2] == ["attn_proj"] and groups[i + 1].nbytes > 0:
            return [*groups[:i], *merged_layer_group(dims, groups[i : i + 2]), *groups[i + 2 :]]
    return list(groups)
