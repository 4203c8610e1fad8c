"""How the engine groups one layer's module calls, for the planner: `joined_groups` under
``OffloadConfig.group_by="module"`` (NOTE [Joined calls] in core/marks.py) and `merged_layer_group`
under ``"layer"`` (NOTE [Layer groups], [Bounded layer groups]); "call" keeps `model.layer_offload_groups` as they are."""

from __future__ import annotations

from typing import Sequence

from ..core import joins_layer_group, layer_group_name
from .dims import GPTDims
from .model import LayerGroup, _attention_output_is_proj_input

__all__ = ["joined_groups", "merged_layer_group"]


def merged_layer_group(dims: GPTDims, groups: Sequence[LayerGroup], bound: int | None = None) -> list[LayerGroup]:
    """A layer's groups (`layer_offload_groups`) as ``OffloadConfig.group_by="layer"`` opens them: one
    group (NOTE [Layer groups] in core/marks.py), or with ``bound`` (``layer_group_bytes``) one per run
    of calls that `joins_layer_group` lets join, attn_proj joining core_attn's past it where it saves
    its output (NOTE [Bounded layer groups]); none where the layer opens none.

    A group's storages count once: core attention's output that attn_proj saves as its input
    (`_attention_output_is_proj_input`) is one storage of their group, copied once.
    """
    runs: list[list[LayerGroup]] = []
    for group in groups:
        if runs and (joins_layer_group(_one_group(dims, runs[-1]).nbytes, bound) or _joins_past_bound(dims, runs[-1][-1], group)):
            runs[-1].append(group)
        else:
            runs.append([group])
    return [_one_group(dims, run) for run in runs]


def _joins_past_bound(dims: GPTDims, last: LayerGroup, group: LayerGroup) -> bool:
    """Whether ``group``'s call joins ``last``'s as a registered joiner (the Megatron integration's attn_proj)."""
    return last.name == "core_attn" and group.name == "attn_proj" and group.nbytes > 0 and _attention_output_is_proj_input(dims)


def _one_group(dims: GPTDims, groups: Sequence[LayerGroup]) -> LayerGroup:
    """Consecutive calls of a layer as one group: named by `layer_group_name`, each storage once."""
    names = [g.name for g in groups]
    nbytes = sum(g.nbytes for g in groups)
    if "core_attn" in names and "attn_proj" in names and _attention_output_is_proj_input(dims):
        nbytes -= groups[names.index("attn_proj")].nbytes  # attn_proj saves that output alone
    unique = list(dict.fromkeys(names))
    return LayerGroup(layer_group_name(unique), nbytes, sum(g.kept_bytes for g in groups))


def joined_groups(dims: GPTDims, groups: Sequence[LayerGroup]) -> list[LayerGroup]:
    """A layer's groups (`layer_offload_groups`) as ``OffloadConfig.group_by="module"`` opens them:
    attn_proj's call joins core_attn's group where its saved input is core attention's saved output
    (`_attention_output_is_proj_input`; NOTE [Joined calls] in core/marks.py), copied once."""
    names = [g.name for g in groups]
    if "core_attn" in names and _attention_output_is_proj_input(dims):
        i = names.index("core_attn")
        if names[i + 1 : i + 2] == ["attn_proj"] and groups[i + 1].nbytes > 0:
            return [*groups[:i], _one_group(dims, groups[i : i + 2]), *groups[i + 2 :]]
    return list(groups)
