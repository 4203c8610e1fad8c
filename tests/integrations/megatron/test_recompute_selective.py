"""Offload of some modules with megatron's selective recompute of others, bit-exactly (issue 25).

One spawn trains the tiny GPTModel with each pairing below, once without and once with offload
(every chunk offloaded, threshold 1 byte), and checks on every rank that losses, every gradient
and the parameters are bit-identical to the same recompute without offload, and that every
offloaded byte came back:

- ``core_attn``: core attention recomputed, the norms and linears offloaded, PP=2 VPP=2;
- ``moe``: whole MoE layers recomputed (``moe``), the attention modules offloaded, EP=2;
- ``core_attn_ep``: core attention recomputed, the attention linears and ``expert_fc1`` offloaded, EP=2.

megatron-core 0.16.1's other selective modules do not run here: ``layernorm`` needs Transformer
Engine (its ``CheckpointWithoutOutput`` reads TE's FP8 state), and ``mlp`` does not finish on CPU
even without offload.
"""

from __future__ import annotations

import pytest

from tests._megatron import TinyGPTConfig
from tests._megatron_offload import assert_bit_identical, spawn_with_and_without

_TIMEOUT_S = 180.0

_SELECTIVE = dict(num_microbatches=4, iterations=2, recompute_granularity="selective")
_MOE = dict(num_layers=2, expert_parallel=2, num_experts=4, add_bias_linear=False)
_CASES = {
    "core_attn": (
        TinyGPTConfig(**_SELECTIVE, pipeline_parallel=2, virtual_pipeline=2, num_layers=8, recompute_modules=("core_attn",)),
        ("attn_norm", "qkv_linear", "attn_proj", "mlp_norm", "mlp_fc1"),
    ),
    "moe": (TinyGPTConfig(**_SELECTIVE, **_MOE, recompute_modules=("moe",)), ("qkv_linear", "core_attn", "attn_proj")),
    "core_attn_ep": (TinyGPTConfig(**_SELECTIVE, **_MOE, recompute_modules=("core_attn",)), ("qkv_linear", "attn_proj", "expert_fc1")),
}


@pytest.fixture(scope="module")
def spawned() -> dict[str, tuple[list, list]]:
    return spawn_with_and_without(_CASES, world_size=2, timeout_s=_TIMEOUT_S)


@pytest.mark.parametrize("name", list(_CASES))
def test_offload_with_selective_recompute_is_exact(spawned, name: str) -> None:
    assert_bit_identical(name, _CASES[name][0].iterations, *spawned[name])
