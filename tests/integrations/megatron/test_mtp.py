"""Offload inside Multi-Token Prediction layers (megatron-core's ``mtp_num_layers``), bit-exactly (issue 25 item 5).

One spawn trains the tiny GPTModel with MTP layers, once without and once with offload (every chunk
offloaded, threshold 1 byte), and checks on every rank that losses, every gradient and the
parameters are bit-identical, that every offloaded byte came back, and that the offload modules of
the transformer layers inside the MTP layers were registered too (the MTP block is on the last
pipeline stage only):

- ``pp2``: PP=2, two MTP layers, every dense module;
- ``moe_ep2``: MoE layers with EP=2, one MTP layer (a MoE layer as well), the attention modules
  and ``expert_fc1``.
"""

from __future__ import annotations

import pytest

from tests._megatron import TinyGPTConfig
from tests._megatron_offload import assert_bit_identical, spawn_with_and_without

_TIMEOUT_S = 240.0

_DENSE = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1")
_CASES = {
    "pp2": (TinyGPTConfig(pipeline_parallel=2, num_layers=4, mtp_num_layers=2, num_microbatches=4), _DENSE),
    "moe_ep2": (
        TinyGPTConfig(num_layers=2, expert_parallel=2, num_experts=4, add_bias_linear=False, mtp_num_layers=1, num_microbatches=2),
        ("qkv_linear", "core_attn", "attn_proj", "expert_fc1"),
    ),
}


@pytest.fixture(scope="module")
def spawned() -> dict[str, tuple[list, list]]:
    # Module groups (not the default layer groups): the tests count groups and bytes per module name.
    return spawn_with_and_without(_CASES, world_size=2, timeout_s=_TIMEOUT_S, options={"group_by": "module"})


@pytest.mark.parametrize("name", list(_CASES))
def test_offload_inside_mtp_layers_is_exact(spawned, name: str) -> None:
    cfg, modules = _CASES[name]
    baseline, offloaded = spawned[name]
    assert_bit_identical(name, cfg.iterations, baseline, offloaded)
    for a, b in zip(baseline, offloaded, strict=True):
        assert any(".mtp." in key for key in a.grads) == a.is_last_stage, (name, a.rank)
        assert all(b.extra["offloaded"][n] > 0 for n in modules), (name, b.rank, b.extra)


@pytest.mark.parametrize("name", list(_CASES))
def test_the_transformer_layers_of_the_mtp_layers_are_offloaded(spawned, name: str) -> None:
    """Per rank, one submodule per name and layer: the decoder's layers of the stage, plus on the last
    stage one per MTP layer (a MoE layer's ``expert_fc1``: one per local expert)."""
    cfg, modules = _CASES[name]
    for result in spawned[name][1]:
        layers = cfg.num_layers // cfg.pipeline_parallel + (cfg.mtp_num_layers if result.is_last_stage else 0)
        experts = (cfg.num_experts or 0) // cfg.expert_parallel
        expected = {m: layers * (experts if m == "expert_fc1" else 1) for m in modules}
        assert result.extra["registered"] == expected, (name, result.rank)
        per_microbatch = {m: n // (cfg.iterations * cfg.num_microbatches) for m, n in result.extra["groups"].items()}
        assert per_microbatch == expected, (name, result.rank, result.extra["groups"])
