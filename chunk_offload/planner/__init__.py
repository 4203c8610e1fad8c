"""The analytic planner: activation bytes per offload module, per-stage drop, copy against compute.

- `GPTDims` (``dims.py``), `saved_tensors`, `group_bytes`, `layer_groups`, `layer_offload_groups`
  (with `held_elsewhere`, the bytes kept on device; ``grouping.py``: `joined_groups` and
  `merged_layer_group`, a layer's groups under ``OffloadConfig.group_by`` "module" and "layer"), `layer_saved_bytes`,
  `layer_forward_flops`, `layer_backward_flops`: the byte and FLOP model of megatron-core GPT/MoE
  layers, per tensor-parallel rank (``model.py``, NOTE [Byte model] says what is exact and what is
  estimated; core attention in ``attention.py``, Transformer Engine's spec in ``te.py``, from
  its source and unmeasured; hybrid models' Mamba layers in ``mamba.py``, from source and
  unmeasured; Multi-Token Prediction layers in ``mtp.py``; layer kinds in ``layer_kinds.py``);
- `PipelineConfig`, `Hardware`, `StagePlanner`, `estimate_stages`, `StageEstimate`: per stage,
  the offload groups of a chunk, chunks in flight, the predicted peaks and drop (replayed on
  Megatron's schedule with `chunk_offload.schedule.simulate`) and copy against compute time;
- `recommend`, `Recommendation`: per stage, the cheapest module set that fits a budget without
  stalling;
- `choose_groups`, `GroupChoice`: per stage, the groups (of single chunks) to offload for a
  budget, as `chunk_offload.schedule.choose_offload` will choose them at run time;
- ``chunk-offload plan`` (`chunk_offload.planner.cli.main`): all of it on the command line.

Megatron is imported only to build plans (`chunk_offload.schedule.megatron_plan`).
"""

from .estimate import GB, Hardware, PipelineConfig, StageEstimate, StagePlanner, estimate_stages, stage_layers
from ..module_names import ALIASES, OFFLOAD_MODULE_NAMES, canonical_modules
from .attention import AttentionFlops, core_attention_flops
from .dims import ATTENTION_KERNELS, ATTENTIONS, DTYPE_BYTES, NORMALIZATIONS, POSITION_EMBEDDINGS, TRANSFORMER_IMPLS, GPTDims
from .model import (
    LayerGroup,
    expert_tokens,
    held_elsewhere,
    layer_backward_flops,
    layer_forward_flops,
    layer_groups,
    layer_offload_groups,
    layer_saved_bytes,
    saved_tensors,
)
from .grouping import joined_groups, merged_layer_group
from .saved import SavedTensor, group_bytes
from .recommend import Recommendation, recommend
from .group_choice import GroupChoice, choose_groups

__all__ = [
    "ALIASES",
    "ATTENTIONS",
    "ATTENTION_KERNELS",
    "AttentionFlops",
    "DTYPE_BYTES",
    "GB",
    "GPTDims",
    "GroupChoice",
    "Hardware",
    "LayerGroup",
    "OFFLOAD_MODULE_NAMES",
    "NORMALIZATIONS",
    "POSITION_EMBEDDINGS",
    "PipelineConfig",
    "Recommendation",
    "SavedTensor",
    "StageEstimate",
    "StagePlanner",
    "TRANSFORMER_IMPLS",
    "canonical_modules",
    "choose_groups",
    "core_attention_flops",
    "estimate_stages",
    "expert_tokens",
    "group_bytes",
    "held_elsewhere",
    "joined_groups",
    "layer_backward_flops",
    "layer_forward_flops",
    "layer_groups",
    "layer_offload_groups",
    "layer_saved_bytes",
    "merged_layer_group",
    "recommend",
    "saved_tensors",
    "stage_layers",
]
