"""Multi-Token Prediction layers in the byte model, against real megatron-core runs on CPU (issue 25 item 5).

`_measure.measure` trains one step of each case with ``mtp_num_layers`` (see its docstring): every
offload group of the step, the decoder's and those of the transformer layers inside the MTP
layers, must be predicted exactly and in order; each whole MTP layer (its transformer layer plus
what the MTP block saves: `chunk_offload.planner.mtp`) and each decoder layer too; and each
layer's matmul FLOPs. Then the planner's placement of the MTP layers on the last stage.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from chunk_offload.planner import GPTDims, PipelineConfig, StagePlanner, layer_forward_flops, layer_groups, layer_saved_bytes
from chunk_offload.planner.attention import core_attention_flops

from ._measure import ByteCase, CaseBytes, measure_or_skip
from .test_model import _dims

_CASES = {
    "mtp_dense": ByteCase(mtp_num_layers=1),
    # Two depths; Llama-style (RMSNorm, fused SwiGLU, rotary: no position embedding), SDPA, bf16.
    "mtp2_llama_sdpa_bf16": ByteCase(
        mtp_num_layers=2,
        normalization="RMSNorm",
        swiglu=True,
        bias_activation_fusion=True,
        position_embedding_type="rope",
        add_bias_linear=False,
        attention="sdpa",
        dtype=torch.bfloat16,
    ),
}
_MODULES = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1"]


def _mtp_dims(case: ByteCase) -> GPTDims:
    return dataclasses.replace(_dims(case), mtp_num_layers=case.mtp_num_layers)


@pytest.fixture(scope="module")
def measured() -> dict[str, CaseBytes]:
    return measure_or_skip(_CASES)


@pytest.mark.parametrize("name", list(_CASES))
def test_every_group_in_order_mtp_layers_included(measured: dict[str, CaseBytes], name: str) -> None:
    case, got = _CASES[name], measured[name]
    dims = _mtp_dims(case)
    predicted = [
        (layer, group, nbytes)
        for layer in range(dims.total_layers)
        for group, nbytes in layer_groups(dims, layer, _MODULES, min_offload_bytes=case.min_offload_bytes)
    ]
    assert got.calls == predicted, name
    assert {layer for layer, _, _ in got.calls} == set(range(dims.total_layers)), name


@pytest.mark.parametrize("name", list(_CASES))
def test_whole_mtp_layer_bytes(measured: dict[str, CaseBytes], name: str) -> None:
    """Decoder layers and whole MTP layers, exactly (an MTP layer's bytes exceed its transformer layer's)."""
    dims = _mtp_dims(_CASES[name])
    assert measured[name].layer_bytes == [layer_saved_bytes(dims, i) for i in range(dims.total_layers)], name
    assert layer_saved_bytes(dims, dims.num_layers) > layer_saved_bytes(dims, dims.num_layers - 1)


@pytest.mark.parametrize("name", list(_CASES))
def test_mtp_layer_flops(measured: dict[str, CaseBytes], name: str) -> None:
    """As FlopCounterMode counts them (SDPA's CPU kernel is not counted: see tests/planner/test_model.py)."""
    dims = _mtp_dims(_CASES[name])
    uncounted = core_attention_flops(dims).forward if dims.attention == "sdpa" else 0
    assert measured[name].layer_flops == [layer_forward_flops(dims, i) - uncounted for i in range(dims.total_layers)], name


def test_mtp_layers_run_at_the_end_of_the_last_stage() -> None:
    dims = GPTDims(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=1, mtp_num_layers=2)
    planner = StagePlanner(dims, PipelineConfig(pipeline_parallel=2, virtual_pipeline=2, num_microbatches=4), min_offload_bytes=1)
    assert planner.layers == [[[0, 1], [4, 5]], [[2, 3], [6, 7, 8, 9]]]
    without = StagePlanner(dataclasses.replace(dims, mtp_num_layers=None), planner.pipeline, min_offload_bytes=1)
    last = planner.estimate(["core_attn"])[1]
    assert last.group_names[1] == ["core_attn"] * 4
    assert last.activation_bytes_per_chunk[1] == sum(layer_saved_bytes(dims, i) for i in (6, 7, 8, 9))
    assert planner.activation_peaks[0] == without.activation_peaks[0] and without.activation_peaks[1] < planner.activation_peaks[1]
