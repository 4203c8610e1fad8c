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

import importlib.util

import pytest
import torch

from tests._megatron import Hooks, Run, TinyGPTConfig, spawn_runs
from tests._megatron_offload import OffloadHooks

_NO_MEGATRON = importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None
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


def _hooks(modules: tuple[str, ...]) -> Hooks:
    hooks = OffloadHooks(modules, options={"min_offload_bytes": 1, "schedule_policy": None})
    return Hooks(wrap_model=hooks.wrap_model, wrap_forward_backward=hooks.wrap_forward_backward, report=hooks.report)


@pytest.fixture(scope="module")
def spawned() -> dict[str, tuple[list, list]]:
    if _NO_MEGATRON:
        pytest.skip('megatron-core is not installed (pip install "chunk-offload[megatron]")')
    if torch.cuda.is_available():
        pytest.skip("cpu_compat is inert on a CUDA host")
    runs = []
    for cfg, modules in _CASES.values():
        runs += [Run(config=cfg), Run(config=cfg, hooks=_hooks(modules))]
    results = spawn_runs(runs, world_size=2, timeout_s=_TIMEOUT_S)
    return {name: (results[2 * i], results[2 * i + 1]) for i, name in enumerate(_CASES)}


@pytest.mark.parametrize("name", list(_CASES))
def test_offload_with_selective_recompute_is_exact(spawned, name: str) -> None:
    cfg, modules = _CASES[name]
    baseline, offloaded = spawned[name]
    for a, b in zip(baseline, offloaded, strict=True):
        assert len(a.losses) == len(b.losses) == (cfg.iterations if a.is_last_stage else 0)
        for it, (la, lb) in enumerate(zip(a.losses, b.losses)):
            for m, (x, y) in enumerate(zip(la, lb, strict=True)):
                assert torch.equal(x, y), f"{name} rank {a.rank} iteration {it} microbatch {m}: {x.item()!r} vs {y.item()!r}"
        assert a.grads.keys() == b.grads.keys()
        for key in a.grads:
            assert torch.equal(a.grads[key], b.grads[key]), f"{name} rank {a.rank}: gradient of {key}"
        assert a.param_digest() == b.param_digest(), f"{name} rank {a.rank}: parameters differ"
        extra = b.extra
        assert sum(extra["offloaded"].values()) > 0, (name, b.rank, extra)
        assert all(extra["reloaded"][n] == extra["offloaded"][n] for n in extra["offloaded"]), (name, b.rank, extra)
        assert extra["pool_in_use"] == 0 and extra["resident"] == 0 and extra["host"] == 0, (name, b.rank, extra)
