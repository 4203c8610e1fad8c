"""The planner's storages held elsewhere (`chunk_offload.planner.model.held_elsewhere`) against the
engine's record of a stage replay on CPU (NOTE [Storages held elsewhere]).

Each case replays one stage of a tiny megatron-core GPT (PP=4, fp32 unless named) for two
iterations and compares, for every chunk of the last one, the bytes each group kept on device
because another reference held them (`IterationRecord.group_kept_bytes`) with the planner's
`StageEstimate.group_kept_bytes`: core attention's output under SDPA when attn_proj is not
offloaded, the received input that the first layer's attn_norm saves on every chunk but the
model's first, nothing else (local attention, mlp_norm, qkv_linear, mlp_fc1, expert_fc1, and the
bf16 RMSNorm's fp32 copy of its input).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from chunk_offload import OffloadConfig
from chunk_offload.planner import GPTDims, PipelineConfig, StagePlanner

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
        reason='megatron-core is not installed (pip install "chunk-offload[megatron]")',
    ),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU accounting checks; on CUDA the bytes differ"),
]

_DENSE = "attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm,mlp_fc1"
_SHAPE = {"num_layers": 8, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16, "micro_batch_size": 2}
_BF16_RMS = {"dtype": "bf16", "normalization": "RMSNorm"}
_MOE = {"num_experts": 4}
_GROUP_BY = "module"  # a group per module call: the places below are (vp stage, module group)

# (attention, pp_rank, vp_size, modules, model options, the (vp stage, group index) places held elsewhere)
_CASES = {
    "sdpa_dense": ("sdpa", 1, 1, _DENSE, {}, {(0, 0)}),  # the received input only: attn_proj is offloaded
    "sdpa_no_proj": ("sdpa", 1, 1, "qkv_linear,core_attn", {}, {(0, 1), (0, 3)}),  # core attention's output
    "local_no_proj": ("local", 1, 1, "attn_norm,core_attn,mlp_norm", {}, {(0, 0)}),  # the received input only
    "first_stage_vpp": ("sdpa", 0, 2, "attn_norm,core_attn", {}, {(0, 1), (1, 0), (1, 1)}),  # input on chunk 1
    "bf16_rmsnorm": ("sdpa", 1, 1, "attn_norm,core_attn,mlp_norm", _BF16_RMS, {(0, 1), (0, 4)}),  # fp32 copy of the input
    "moe": ("sdpa", 1, 1, "attn_norm,mlp_norm,expert_fc1", _MOE, {(0, 0)}),
}

def _replay(attention: str, pp_rank: int, vp_size: int, modules: list[str], options: dict[str, Any]):
    from chunk_offload.devkit.gpt import GPTShape
    from chunk_offload.replay import megatron_stage, replay

    dtype = {"bf16": torch.bfloat16}.get(options.get("dtype", ""), torch.float32)
    extra = {k: v for k, v in options.items() if k != "dtype"}
    if "num_experts" in extra:
        extra["add_bias_linear"] = False  # megatron-core 0.16.1 with EP=1 and TP=1
    shape = GPTShape(vocab_size=64, attention=attention, dtype=dtype, **_SHAPE, **extra)
    with megatron_stage(shape, pp_size=4, pp_rank=pp_rank, vp_size=vp_size) as stage:
        return replay(stage, modules=modules, num_microbatches=8, iterations=2, warmup=1, config=OffloadConfig(min_offload_bytes=1, group_by=_GROUP_BY)).offload.last


@pytest.mark.parametrize("name", list(_CASES))
def test_kept_bytes_equal_the_engines(name: str):
    attention, pp_rank, vp_size, modules, options, places = _CASES[name]
    modules = modules.split(",")
    record = _replay(attention, pp_rank, vp_size, modules, options)
    dims = GPTDims(**_SHAPE, attention=attention, device="cpu", **{"dtype": "fp32", **options})
    pipeline = PipelineConfig(pipeline_parallel=4, virtual_pipeline=vp_size if vp_size > 1 else None, num_microbatches=8)
    stage = StagePlanner(dims, pipeline, min_offload_bytes=1, group_by=_GROUP_BY).estimate(modules)[pp_rank]
    assert {(vp, g) for vp, kept in stage.group_kept_bytes.items() for g, k in enumerate(kept) if k} == places
    assert set(record.group_bytes) == set(stage.simulation.plan.chunks)
    for mb, vp in record.group_bytes:
        assert record.group_names[(mb, vp)] == stage.group_names[vp]
        assert record.kept_bytes_of(mb, vp) == stage.group_kept_bytes[vp], (name, mb, vp)
        if "num_experts" not in options:  # the routing decides each expert's bytes
            assert record.group_bytes[(mb, vp)] == stage.group_bytes[vp], (name, mb, vp)
