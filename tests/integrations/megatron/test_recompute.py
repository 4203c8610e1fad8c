"""Offload composes with Megatron's activation recomputation under PP=2, bit-exactly.

One spawn trains the tiny GPTModel (4 layers, 2 per stage, 4 microbatches, 2 iterations) with
each recompute setup, once without and once with offload of ``qkv_linear, core_attn, attn_proj,
mlp_fc1``:

- ``selective``: ``recompute_granularity="selective"`` (core attention is checkpointed);
- ``full_uniform``: full recompute, ``recompute_method="uniform"``, ``recompute_num_layers=1``
  (every layer checkpointed);
- ``full_block``: full recompute, ``recompute_method="block"``, ``recompute_num_layers=1`` (the
  first layer of each stage checkpointed, the second not).

On every rank: losses, last gradients and parameters are bit-identical to the same recompute
setup without offload. Megatron's checkpoint (``tensor_parallel.checkpoint``, reentrant) runs
its forward without gradients and its recomputation during backward outside any chunk, so the
modules inside a checkpointed region form no group: groups and bytes per name count only the
modules that run outside one (which also proves the recomputation really was on), and
everything offloaded came back.

With selective recompute of some modules and offload of others (issue 25), the same checks:

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
_TIMEOUT_S = 120.0

_MODULES = ("qkv_linear", "core_attn", "attn_proj", "mlp_fc1")
_BASE = dict(pipeline_parallel=2, num_layers=4, num_microbatches=4, iterations=2)
_CONFIGS = {
    "selective": TinyGPTConfig(**_BASE, recompute_granularity="selective"),
    "full_uniform": TinyGPTConfig(**_BASE, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full_block": TinyGPTConfig(**_BASE, recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
}
_SELECTIVE = dict(num_microbatches=4, iterations=2, recompute_granularity="selective")
_MOE = dict(num_layers=2, expert_parallel=2, num_experts=4, add_bias_linear=False)
_CASES = {
    **{name: (cfg, _MODULES) for name, cfg in _CONFIGS.items()},
    "core_attn": (
        TinyGPTConfig(**_SELECTIVE, pipeline_parallel=2, virtual_pipeline=2, num_layers=8, recompute_modules=("core_attn",)),
        ("attn_norm", "qkv_linear", "attn_proj", "mlp_norm", "mlp_fc1"),
    ),
    "moe": (TinyGPTConfig(**_SELECTIVE, **_MOE, recompute_modules=("moe",)), ("qkv_linear", "core_attn", "attn_proj")),
    "core_attn_ep": (TinyGPTConfig(**_SELECTIVE, **_MOE, recompute_modules=("core_attn",)), ("qkv_linear", "attn_proj", "expert_fc1")),
}
_LAYERS_PER_STAGE = 2


def _expected_groups(name: str) -> dict[str, int]:
    """Groups per module name on each rank: calls outside checkpointed regions only."""
    cfg = _CONFIGS[name]
    per_layer = cfg.num_microbatches * cfg.iterations
    if name == "selective":
        return {m: _LAYERS_PER_STAGE * per_layer for m in _MODULES if m != "core_attn"}
    if name == "full_uniform":
        return {}
    return {m: (_LAYERS_PER_STAGE - cfg.recompute_num_layers) * per_layer for m in _MODULES}


def _hooks(modules: tuple[str, ...]) -> Hooks:
    # Offload every chunk (no plan policy, which keeps the last stage's chunks): the counts
    # below are of every call outside the checkpointed regions, on every rank. Module groups (not
    # the default layer groups): the counts are per module name.
    hooks = OffloadHooks(modules, options={"min_offload_bytes": 1, "schedule_policy": None, "group_by": "module"})
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
def test_recompute_with_offload_is_exact(spawned, name: str) -> None:
    cfg = _CASES[name][0]
    baseline, offloaded = spawned[name]
    for a, b in zip(baseline, offloaded, strict=True):
        assert a.non_cpu_tensors == 0 and b.non_cpu_tensors == 0
        assert len(a.losses) == (cfg.iterations if a.is_last_stage else 0)
        assert len(a.losses) == len(b.losses)
        for it, (la, lb) in enumerate(zip(a.losses, b.losses)):
            assert len(la) == len(lb) == cfg.num_microbatches
            for m, (x, y) in enumerate(zip(la, lb)):
                assert torch.equal(x, y), f"rank {a.rank} iteration {it} microbatch {m}: {x.item()!r} vs {y.item()!r}"
        assert a.grads.keys() == b.grads.keys()
        for key in a.grads:
            assert torch.equal(a.grads[key], b.grads[key]), f"rank {a.rank}: gradient of {key}"
        assert a.param_digest() == b.param_digest(), f"rank {a.rank}: parameters differ"
        extra = b.extra  # something was offloaded (full_uniform recomputes every layer: nothing), all of it came back
        assert (sum(extra["offloaded"].values()) > 0) == (name != "full_uniform") and extra["reloaded"] == extra["offloaded"], (name, b.rank, extra)
        assert extra["pool_in_use"] == 0 and extra["resident"] == 0 and extra["host"] == 0, (name, b.rank, extra)


@pytest.mark.parametrize("name", list(_CONFIGS))
def test_recomputed_modules_are_not_offloaded(spawned, name: str) -> None:
    _, offloaded = spawned[name]
    expected = _expected_groups(name)
    for result in offloaded:
        extra = result.extra
        groups = {n: g for n, g in extra["groups"].items() if g}
        assert groups == expected, (result.rank, extra["groups"])
        for n in expected:
            assert extra["offloaded"][n] > 0 and extra["reloaded"][n] == extra["offloaded"][n], (result.rank, n, extra)
        assert all(extra["offloaded"].get(n, 0) == 0 for n in _MODULES if n not in expected), (result.rank, extra)
        assert extra["pool_in_use"] == 0 and extra["resident"] == 0 and extra["host"] == 0, (result.rank, extra)
        assert extra["live_chunks"] == [], (result.rank, extra["live_chunks"])

