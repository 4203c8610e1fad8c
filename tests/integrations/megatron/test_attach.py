"""`attach` under megatron-core's own pipeline schedules, on CPU ranks (gloo): PP, VPP, EP, MoE.

Each case spawns its ranks once and trains the same tiny GPTModel several times in them (see
``tests._megatron.spawn_runs``): first without offload, then with each offload set (``tests._megatron_offload``),
3 iterations with an optimizer step each. For every offload run, on every rank:

- losses, last gradients and parameters are bit-identical to the run without offload;
- bytes really moved: offloaded == reloaded > 0 for each module name present, and nothing is
  left behind (pool in use, resident and host bytes 0, no live chunk);
- groups per name = layers on the rank x microbatches x iterations (expert_fc1: calls of the
  local experts' fc1, counted by a plain forward pre-hook);
- the chunk order recorded in the last iteration is megatron's schedule for that rank;
- offloaded bytes plus the bytes kept on device because another reference holds them (NOTE
  [Storages held elsewhere]) per name equal the bytes of what those modules save for backward,
  computed from the shapes (see ``tests.integrations.megatron._attach_expect``);
- an evaluation (``forward_only=True`` under ``torch.no_grad()``) after each training call
  changes nothing and adds no group.

All runs use the local (non-TE) spec in fp32 with ``min_offload_bytes=1``: every saved tensor that
is not a parameter is offloaded. All use ``group_by="module"`` (one group per call of an offload
module, named by it): the library default, bounded layer groups, would merge a tiny layer's modules
into one group (``tests/integrations/megatron/test_layer_groups.py`` tests those).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import pytest
import torch

from chunk_offload.core.errors import ChunkOffloadError
from chunk_offload.integrations.megatron import ALIASES, OFFLOAD_MODULE_NAMES, attach, canonical_names

from tests._megatron import Hooks, RankResult, Run, TinyGPTConfig, spawn_runs
from tests._megatron_offload import OffloadHooks
from tests.integrations.megatron._attach_expect import (
    F32,
    bytes_per_call,
    expected_order,
    held_elsewhere_per_chunk,
    is_moe,
    module_counts,
    received_chunks,
)

_NO_MEGATRON = importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None
_TIMEOUT_S = 150.0  # hang guard per spawn (a case takes ~10-30 s on 2 cores)

_CORE = ("core_attn",)
_ATTN = ("qkv_linear", "core_attn", "attn_proj")
_DENSE = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1")


@dataclass(frozen=True)
class _Offload:
    modules: tuple[str, ...]
    evaluate_between: bool = False


@dataclass(frozen=True)
class _Case:
    config: TinyGPTConfig
    world_size: int
    runs: tuple[_Offload, ...]


_CASES = {
    "pp2": _Case(
        TinyGPTConfig(pipeline_parallel=2, iterations=3),
        world_size=2,
        runs=(_Offload(_CORE), _Offload(_ATTN), _Offload(_DENSE), _Offload(_DENSE, evaluate_between=True)),
    ),
    "pp2_vpp2": _Case(
        TinyGPTConfig(pipeline_parallel=2, virtual_pipeline=2, iterations=3),
        world_size=2,
        runs=(_Offload(_CORE), _Offload(_ATTN), _Offload(_DENSE), _Offload(_DENSE, evaluate_between=True)),
    ),
    "pp4_vpp2": _Case(
        TinyGPTConfig(pipeline_parallel=4, virtual_pipeline=2, num_layers=8, iterations=3),
        world_size=4,
        runs=(_Offload(_CORE), _Offload(_DENSE, evaluate_between=True)),
    ),
    "ep2_moe4": _Case(
        TinyGPTConfig(expert_parallel=2, num_experts=4, iterations=3),
        world_size=2,
        # router_fc1 is the alias of expert_fc1: statistics come under the canonical name.
        runs=(_Offload(("expert_fc1",)), _Offload(("router_fc1", *_ATTN), evaluate_between=True)),
    ),
    # Layers 0 and 3 MoE, 1 and 2 dense: each stage has one of each, in opposite order, so
    # mlp_fc1 and expert_fc1 both apply on every rank. No bias: see TinyGPTConfig.add_bias_linear.
    "pp2_moe_mixed": _Case(
        TinyGPTConfig(
            pipeline_parallel=2, num_experts=4, moe_layer_freq=(1, 0, 0, 1), add_bias_linear=False, iterations=3
        ),
        world_size=2,
        runs=(_Offload(("mlp_fc1", "expert_fc1")), _Offload((*_DENSE, "expert_fc1"), evaluate_between=True)),
    ),
}


def test_every_module_set_runs_under_pp_and_vpp():
    """The table above covers each module set under plain 1F1B and under the interleaved schedule."""
    for modules in (_CORE, _ATTN, _DENSE):
        for interleaved in (False, True):
            assert any(
                set(run.modules) == set(modules)
                for case in _CASES.values()
                if (case.config.virtual_pipeline is not None) == interleaved and case.config.pipeline_parallel > 1
                for run in case.runs
            ), (modules, interleaved)


# --------------------------------------------------------------------------------------------
# Spawning: one spawn per case, shared by the tests of that case.
# --------------------------------------------------------------------------------------------


@dataclass
class _Spawned:
    name: str
    case: _Case
    baseline: list[RankResult]
    offloaded: list[tuple[_Offload, list[RankResult]]]


def _hooks(offload: _Offload) -> Hooks:
    # Reload at group start and offload every chunk (no plan policy): the byte formulas of _attach_expect
    # count every call on every rank. The plan policy is tested in test_schedule.py. Module groups (not
    # the default layer groups): the counts and bytes here are per module name.
    hooks = OffloadHooks(
        offload.modules,
        options={"min_offload_bytes": 1, "schedule_policy": None, "group_by": "module"},
        evaluate_between=offload.evaluate_between,
    )
    return Hooks(wrap_model=hooks.wrap_model, wrap_forward_backward=hooks.wrap_forward_backward, report=hooks.report)


@pytest.fixture(scope="module", params=list(_CASES), ids=list(_CASES))
def spawned(request) -> _Spawned:
    if _NO_MEGATRON:
        pytest.skip('megatron-core is not installed (pip install "chunk-offload[megatron]")')
    if torch.cuda.is_available():
        pytest.skip("cpu_compat is inert on a CUDA host")
    case = _CASES[request.param]
    runs = [Run(config=case.config)] + [Run(config=case.config, hooks=_hooks(o)) for o in case.runs]
    results = spawn_runs(runs, world_size=case.world_size, timeout_s=_TIMEOUT_S)
    return _Spawned(request.param, case, results[0], list(zip(case.runs, results[1:], strict=True)))


def _each_offload_rank(spawned: _Spawned):
    for offload, ranks in spawned.offloaded:
        for result in ranks:
            yield offload, result


# --------------------------------------------------------------------------------------------
# Tests on the spawned runs.
# --------------------------------------------------------------------------------------------


def _assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: different names"
    differing = [name for name in a if not torch.equal(a[name], b[name])]
    assert not differing, f"{what} differ: {differing[:5]}"


def test_offload_is_bit_identical(spawned: _Spawned):
    cfg = spawned.case.config
    for offload, ranks in spawned.offloaded:
        for base, off in zip(spawned.baseline, ranks, strict=True):
            what = f"{spawned.name} {offload.modules} rank {off.rank}"
            assert off.non_cpu_tensors == 0
            if base.is_last_stage:
                assert len(base.losses) == cfg.iterations
                assert all(len(it) == cfg.num_microbatches for it in base.losses)
            assert len(off.losses) == len(base.losses)
            for i, (la, lb) in enumerate(zip(base.losses, off.losses, strict=True)):
                assert all(torch.equal(x, y) for x, y in zip(la, lb, strict=True)), (
                    f"{what} iteration {i}: losses {base.mean_losses()} vs {off.mean_losses()}"
                )
            assert base.grads, what
            _assert_same_tensors(base.grads, off.grads, f"{what} gradients")
            _assert_same_tensors(base.params, off.params, f"{what} parameters")
            assert base.param_digest() == off.param_digest()


def test_bytes_move_and_nothing_is_left(spawned: _Spawned):
    cfg = spawned.case.config
    for offload, r in _each_offload_rank(spawned):
        what = f"{spawned.name} {offload.modules} rank {r.rank}"
        names = set(module_counts(cfg, r.pipeline_rank, offload.modules))
        stats = r.extra
        assert set(stats["offloaded"]) == names, what
        for name in names:
            assert stats["offloaded"][name] > 0, (what, name)
            assert stats["reloaded"][name] == stats["offloaded"][name], (what, name, stats)
        assert stats["pool_in_use"] == 0, what
        assert stats["resident"] == 0, what
        assert stats["host"] == 0, what
        assert stats["live_chunks"] == [], what


def test_group_counts(spawned: _Spawned):
    """One group per call: layers on the rank x microbatches x iterations; evaluation adds none."""
    cfg = spawned.case.config
    calls = cfg.num_microbatches * cfg.iterations
    for offload, r in _each_offload_rank(spawned):
        what = f"{spawned.name} {offload.modules} rank {r.rank}"
        modules = module_counts(cfg, r.pipeline_rank, offload.modules)
        assert r.extra["registered"] == modules, what
        assert r.extra["groups"] == {name: n * calls for name, n in modules.items()}, what
        if "expert_fc1" in modules:
            # SequentialMLP calls every local expert once per MoE layer and microbatch.
            assert r.extra["expert_fc1_calls"] == modules["expert_fc1"] * calls, what


def test_observed_order_is_megatrons_schedule(spawned: _Spawned):
    cfg = spawned.case.config
    for offload, r in _each_offload_rank(spawned):
        expected = expected_order(cfg, r.pipeline_rank)
        assert len(expected) == 2 * cfg.num_microbatches * (cfg.virtual_pipeline or 1)
        assert r.extra["observed_order"] == expected, f"{spawned.name} {offload.modules} rank {r.rank}"


def test_offloaded_bytes_match_saved_tensor_shapes(spawned: _Spawned):
    """What the modules save = what moved + what was kept on device because another reference holds
    it. A storage held elsewhere is copied once per virtual stage (the first microbatch of the first
    iteration, whose forward end learns it) and kept on device in every later chunk."""
    cfg = spawned.case.config
    calls = cfg.num_microbatches * cfg.iterations
    expert_bytes: dict[tuple[str, ...], int] = {}
    for offload, r in _each_offload_rank(spawned):
        what = f"{spawned.name} {offload.modules} rank {r.rank}"
        offloaded, kept, copied = (r.extra[k] for k in ("offloaded", "kept_held_elsewhere", "copied_held_elsewhere"))
        for name, n in module_counts(cfg, r.pipeline_rank, offload.modules).items():
            if name == "expert_fc1":
                # Tokens routed to the local experts, recorded by a pre-hook on each expert's
                # linear_fc1 (the [tokens, h] input it saves; each is a view of the permuted
                # tokens at a multiple of h * 4 = 128 bytes, so 16-byte aligned). Which of them
                # another reference holds, and how many tokens each chunk routes there, depends on
                # the routing: only the sum is known.
                expected = r.extra["expert_fc1_input_bytes"]
                expert_bytes[offload.modules] = expert_bytes.get(offload.modules, 0) + expected
                assert copied[name] <= offloaded[name], (what, name, copied[name], offloaded[name])
            else:
                expected = bytes_per_call(cfg, name) * n * calls
                held = held_elsewhere_per_chunk(cfg, r.pipeline_rank, name) * received_chunks(cfg, r.pipeline_rank)
                assert (copied[name], kept[name]) == (held, held * (calls - 1)), (what, name, copied[name], kept[name])
            assert offloaded[name] + kept[name] == expected, (what, name, offloaded[name], kept[name], expected)
    # The recorded routing itself: each token goes to top-k experts; the allgather dispatcher
    # gives each expert-parallel rank the tokens of all ranks, so summed over the ranks, the
    # experts of one MoE layer see EP x s x b x k tokens per microbatch.
    if cfg.num_experts is not None:
        moe_layers = sum(is_moe(cfg, i) for i in range(cfg.num_layers))
        tokens = cfg.expert_parallel * cfg.seq_length * cfg.micro_batch_size * cfg.moe_router_topk
        # Summed over all ranks = over the EP ranks and the pipeline stages (each holds its own
        # layers), as long as no expert is replicated (expert data parallel 1).
        assert spawned.case.world_size == cfg.pipeline_parallel * cfg.expert_parallel
        for modules, total in expert_bytes.items():
            assert total == moe_layers * tokens * cfg.hidden_size * F32 * calls, (modules, total)


def test_evaluation_between_iterations_changes_nothing(spawned: _Spawned):
    """forward_only calls after each step: same numbers as without offload (see the parity test),
    no extra groups (see the group test), and they really ran through every chunk."""
    cfg = spawned.case.config
    evaluated = [(o, ranks) for o, ranks in spawned.offloaded if o.evaluate_between]
    assert evaluated, f"{spawned.name} has no run with evaluate_between"
    for offload, ranks in evaluated:
        for base, r in zip(spawned.baseline, ranks, strict=True):
            assert r.extra["evaluations"] == cfg.iterations
            assert r.extra["evaluation_forwards"] == cfg.iterations * cfg.num_microbatches * (cfg.virtual_pipeline or 1)
            assert all(torch.equal(x, y) for la, lb in zip(base.losses, r.losses) for x, y in zip(la, lb))
            assert base.param_digest() == r.param_digest()
    for offload, ranks in spawned.offloaded:
        if not offload.evaluate_between:
            assert all(r.extra["evaluation_forwards"] == 0 for r in ranks)


# --------------------------------------------------------------------------------------------
# Names (in process, no spawn).
# --------------------------------------------------------------------------------------------


def test_unknown_module_name_lists_the_valid_names():
    with pytest.raises(ChunkOffloadError, match="unknown offload module 'qkv'") as info:
        canonical_names(["core_attn", "qkv"])
    assert str(info.value).startswith("chunk_offload: ")
    for name in (*OFFLOAD_MODULE_NAMES, "router_fc1"):
        assert repr(name) in str(info.value)
    with pytest.raises(ChunkOffloadError, match="unknown offload module 'mlp_fc2'"):
        canonical_names("core_attn, mlp_fc2")
    # attach checks the names before it looks at the model.
    with pytest.raises(ChunkOffloadError, match="unknown offload module 'attention'.*valid names"):
        attach(torch.nn.Linear(2, 2), ["attention"])


def test_router_fc1_is_expert_fc1():
    assert ALIASES == {"router_fc1": "expert_fc1"}
    assert canonical_names(["router_fc1"]) == ["expert_fc1"]
    assert canonical_names("router_fc1, core_attn, expert_fc1") == ["expert_fc1", "core_attn"]
    assert canonical_names(("expert_fc1", "router_fc1")) == ["expert_fc1"]
