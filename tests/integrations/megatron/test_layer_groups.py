"""``group_by="layer"`` under megatron-core's schedules on CPU ranks: one group per TransformerLayer.

`offload_submodules` registers each module with its TransformerLayer, so with
``OffloadConfig(group_by="layer")`` a layer's offload modules form one group (NOTE [Layer groups]
in core/marks.py). Each case trains without offload, with per-module groups (``group_by="module"``)
and with layer groups (unbounded, ``layer_group_bytes=None``, every chunk offloaded as in
test_attach.py; then the defaults, bounded layer groups under the plan policy, whose 16 MiB bound a
tiny layer never reaches), in one spawn:

- every layer-group run is bit-identical to the run without offload (losses, gradients, parameters);
- the layer groups account the same saved bytes as the per-module groups and copy no more, all
  back, nothing left;
- one group per layer call: layers on the rank x microbatches x iterations, named by its modules;
- bounded at one byte (``layer_group_bytes=1``), the groups and bytes of per-module groups.
"""

from __future__ import annotations


import pytest
import torch

from tests._megatron import NEEDS_MEGATRON_ON_CPU, Hooks, Run, TinyGPTConfig, spawn_runs
from tests._megatron_offload import OffloadHooks
from tests.integrations.megatron._attach_expect import module_counts

pytestmark = NEEDS_MEGATRON_ON_CPU

_TIMEOUT_S = 150.0
_CASES = {
    "pp2_vpp2": (TinyGPTConfig(pipeline_parallel=2, virtual_pipeline=2, iterations=2), ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1")),
    # Each MoE layer calls every local expert's fc1: the calls of one layer join its group too.
    "ep2_moe4": (TinyGPTConfig(expert_parallel=2, num_experts=4, iterations=2), ("qkv_linear", "core_attn", "expert_fc1")),
    # Selective recompute of core_attn: its checkpoint runs between qkv_linear and attn_proj with no
    # hook of ours active, so what it saves stays outside the layer group, as outside module groups.
    "pp2_recompute": (
        TinyGPTConfig(pipeline_parallel=2, recompute_granularity="selective", recompute_modules=("core_attn",), iterations=2),
        ("attn_norm", "qkv_linear", "attn_proj", "mlp_norm", "mlp_fc1"),
    ),
}


def _hooks(modules: tuple[str, ...], **options) -> Hooks:
    hooks = OffloadHooks(modules, options={"min_offload_bytes": 1, **options})
    return Hooks(wrap_model=hooks.wrap_model, wrap_forward_backward=hooks.wrap_forward_backward, report=hooks.report)


@pytest.fixture(scope="module", params=list(_CASES), ids=list(_CASES))
def spawned(request):
    config, modules = _CASES[request.param]
    runs = [
        Run(config=config),
        Run(config=config, hooks=_hooks(modules, schedule_policy=None, group_by="module")),
        Run(config=config, hooks=_hooks(modules, schedule_policy=None, group_by="layer", layer_group_bytes=None)),
        Run(config=config, hooks=_hooks(modules)),
        Run(config=config, hooks=_hooks(modules, schedule_policy=None, group_by="layer", layer_group_bytes=1)),
    ]
    return config, modules, spawn_runs(runs, world_size=2, timeout_s=_TIMEOUT_S)


def test_layer_groups_are_bit_identical(spawned) -> None:
    _, _, (baseline, _, every_chunk, planned, bounded) = spawned
    for run_name, run in (("every chunk", every_chunk), ("plan policy", planned), ("bounded", bounded)):
        for base, off in zip(baseline, run, strict=True):
            what = f"{run_name} rank {off.rank}"
            assert len(base.losses) == len(off.losses), what
            for la, lb in zip(base.losses, off.losses, strict=True):
                assert all(torch.equal(x, y) for x, y in zip(la, lb, strict=True)), what
            assert base.grads.keys() == off.grads.keys(), what
            assert [n for n in base.grads if not torch.equal(base.grads[n], off.grads[n])] == [], what
            assert base.param_digest() == off.param_digest(), what


def test_layer_groups_move_the_module_groups_bytes(spawned) -> None:
    config, modules, (_, by_module, by_layer, _, _) = spawned
    calls = config.num_microbatches * config.iterations
    for module_rank, layer_rank in zip(by_module, by_layer, strict=True):
        what = f"rank {layer_rank.rank}"
        stats = layer_rank.extra
        present = [m for m in modules if m in module_counts(config, layer_rank.pipeline_rank, modules)]
        name = "+".join(present)
        assert list(stats["groups"]) == [name], what
        layers = module_counts(config, layer_rank.pipeline_rank, ("qkv_linear",))["qkv_linear"]
        assert stats["groups"][name] == layers * calls, what
        # The same saved bytes are accounted. A layer group copies at most what the module groups
        # moved: a storage one module's group keeps on device (a kept view holds it whole) is not
        # copied by another module's group of the layer, where the module groups copy it once to
        # learn it is held elsewhere (NOTE [Storages held elsewhere]).
        assert stats["last_iteration_saved_bytes"] == module_rank.extra["last_iteration_saved_bytes"], what
        moved = sum(module_rank.extra["offloaded"].values()) + sum(module_rank.extra["kept_held_elsewhere"].values())
        assert 0 < stats["offloaded"][name] + stats["kept_held_elsewhere"][name] <= moved, what
        assert stats["offloaded"][name] > 0 and stats["reloaded"][name] == stats["offloaded"][name], what
        assert (stats["pool_in_use"], stats["resident"], stats["host"], stats["live_chunks"]) == (0, 0, 0, []), what


def test_a_one_byte_bound_gives_the_module_groups(spawned) -> None:
    """NOTE [Bounded layer groups]: past the bound a call opens its own group, and attn_proj still
    joins core_attn's where it saves its output: the groups, and the bytes, of ``group_by="module"``.
    Except the experts: a call that copied nothing (an expert given no token) is joined by the next,
    whose group then copies once a storage both save, which module groups copy twice."""
    _, _, (_, by_module, _, _, bounded) = spawned
    for module_rank, bounded_rank in zip(by_module, bounded, strict=True):
        what = f"rank {bounded_rank.rank}"
        ours, theirs = bounded_rank.extra, module_rank.extra
        assert ours["groups"].keys() == theirs["groups"].keys(), what
        for name in ours["groups"]:
            if name == "expert_fc1":
                assert 0 < ours["groups"][name] <= theirs["groups"][name], what
                moved = lambda extra: extra["offloaded"][name] + extra["kept_held_elsewhere"][name]  # noqa: E731
                assert 0 < moved(ours) <= moved(theirs), what
                continue
            for key in ("groups", "offloaded", "reloaded", "kept_held_elsewhere"):
                assert ours[key][name] == theirs[key][name], (what, name, key)
        assert ours["reloaded"] == ours["offloaded"], what
        assert (ours["pool_in_use"], ours["resident"], ours["live_chunks"]) == (0, 0, []), what
