"""Forward-only passes between training iterations change nothing (NOTE [Forward-only passes]).

Under Megatron's own schedules (spawned gloo ranks, see ``_forward_only.py``): after every
training call, forward-only passes over 2 or 6 microbatches (training runs 4): an evaluation
through the wrapped function with gradients enabled (``iterations="wrap"``), Megatron-LM's
evaluation under ``torch.no_grad()``, an RL log-probability pass under ``torch.no_grad()`` and
under inference mode, and a ``forward_only=True`` call with gradients enabled inside
``manager.forward_only()``. Per mode (``"wrap"``, ``"auto"``), the run with passes against the
same run without them (PP=2 with a device budget ``"auto"`` and a node host budget; PP=2 VPP=2
without budgets, where the plan policy learns the groups):

- losses, every gradient before every step and the parameters are bit-identical (``torch.equal``),
  and equal to training without offload;
- after each complete training iteration, whenever it closes: the training calls, the baseline
  records, the record itself, the observed order, the plan, the schedule policy, the budgets and
  the host cap are identical;
- across each pass nothing is copied, counted or left live, no action is recorded, and it opens
  no iteration; only in auto mode may the first pass close the finished training iteration;
- every pass ran through every chunk; no chunk_offload warning.

In one process: ``manager.forward_only()`` in both modes, and what auto mode does without it (the
session's rule itself: ``tests/integrations/test_session.py``).
"""

from __future__ import annotations

import importlib.util
import re
import warnings

import pytest
import torch

from chunk_offload.core.errors import ChunkOffloadError
from tests._megatron import Hooks, Run, TinyGPTConfig, spawn_runs, step_grads
from tests.integrations.megatron._auto_iterations import comparable, microbatch, train_step
from tests.integrations.megatron._forward_only import PASS_KINDS, PassHooks, pass_state

_NO_MEGATRON = importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None
pytestmark = pytest.mark.skipif(_NO_MEGATRON, reason='megatron-core is not installed (pip install "chunk-offload[megatron]")')

_TIMEOUT_S = 150.0
_BUDGETS = {"device_budget_bytes": "auto", "host_budget_bytes": 1 << 20}
_CASES = {  # config, offloaded modules, budgets
    "pp2_budgets": (TinyGPTConfig(pipeline_parallel=2, iterations=3), ("qkv_linear", "core_attn", "attn_proj", "mlp_fc1"), _BUDGETS),
    "pp2_vpp2": (
        TinyGPTConfig(pipeline_parallel=2, virtual_pipeline=2, iterations=3),
        ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1"),
        {},
    ),
}
_MODES = {"wrap": {}, "auto": {"iterations": "auto", "num_microbatches": 4}}


def _hooks(cfg: TinyGPTConfig, modules: tuple[str, ...], budgets: dict, mode: str, passes: bool) -> Hooks:
    options = {"min_offload_bytes": 1, "baseline_iterations": 1, **budgets, **_MODES[mode]}
    kinds = tuple(k for k in PASS_KINDS if mode == "wrap" or k != "evaluate") if passes else ()
    h = PassHooks(modules, options=options, wrap_schedule=mode == "wrap", config=cfg, passes=kinds)
    return Hooks(wrap_model=h.wrap_model, wrap_forward_backward=h.wrap_forward_backward, report=h.report, before_step=step_grads)


@pytest.fixture(scope="module", params=list(_CASES))
def spawned(request):
    if torch.cuda.is_available():
        pytest.skip("cpu_compat is inert on a CUDA host")
    cfg, modules, budgets = _CASES[request.param]
    names = [(mode, passes) for mode in _MODES for passes in (False, True)]
    runs = [Run(config=cfg, hooks=Hooks(before_step=step_grads))]
    runs += [Run(config=cfg, hooks=_hooks(cfg, modules, budgets, mode, passes)) for mode, passes in names]
    results = spawn_runs(runs, world_size=2, timeout_s=_TIMEOUT_S)
    return cfg, results[0], dict(zip(names, results[1:], strict=True))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("mode", list(_MODES))
def test_numerics_identical_with_and_without_passes(spawned, mode: str):
    cfg, none, runs = spawned
    for reference, plain, passed in zip(none, runs[mode, False], runs[mode, True], strict=True):
        what = f"{mode} rank {passed.rank}"
        for other in (reference, plain):
            assert len(other.losses) == len(passed.losses), what
            for i, (la, lb) in enumerate(zip(other.losses, passed.losses, strict=True)):
                assert all(torch.equal(x, y) for x, y in zip(la, lb, strict=True)), f"{what} losses of iteration {i}"
            assert other.param_digest() == passed.param_digest(), what
        for i, (a, b) in enumerate(zip(plain.before_steps, passed.before_steps, strict=True)):
            assert _same(a, b) and _same(a, reference.before_steps[i]), f"{what} gradients of iteration {i}"


@pytest.mark.parametrize("mode", list(_MODES))
def test_training_state_identical_with_and_without_passes(spawned, mode: str):
    cfg, _, runs = spawned
    for plain, passed in zip(runs[mode, False], runs[mode, True], strict=True):
        what = f"{mode} rank {passed.rank}"
        a, b = plain.extra["iterations"], passed.extra["iterations"]
        assert len(a) == len(b) == cfg.iterations, what
        assert [s["training_calls"] for s in b] == list(range(1, cfg.iterations + 1)), what
        assert b[-1]["baseline_records"] == [False, True], what  # one baseline, the passes consumed none
        for i, (sa, sb) in enumerate(zip(a, b, strict=True)):
            assert sa == sb, f"{what} after iteration {i}: {[k for k in sa if sa[k] != sb[k]]}"
        if cfg.virtual_pipeline is None:  # the budgets decided something, and the same
            assert b[-1]["budgets"]["leveled_budget"] is not None and b[-1]["budgets"]["host_cap"] is not None, what
        for key in ("offloaded", "reloaded", "groups", "pool_in_use", "resident", "host", "live_chunks"):
            assert plain.extra[key] == passed.extra[key], f"{what} {key}"
        assert sum(passed.extra["offloaded"].values()) > 0 or passed.pipeline_rank == 1, what
        assert plain.extra["warned"] == passed.extra["warned"] == [], what
    if cfg.virtual_pipeline is not None:  # without a budget the plan policy learned kept tails, the same
        assert any(r.extra["iterations"][-1]["policy"][3] for r in runs[mode, True])


@pytest.mark.parametrize("mode", list(_MODES))
def test_passes_offload_nothing_and_record_nothing(spawned, mode: str):
    cfg, _, runs = spawned
    chunks = cfg.virtual_pipeline or 1
    for r in runs[mode, True]:
        log = r.extra["passes"]
        kinds = [p["kind"] for p in log]
        per_call = [k for k in PASS_KINDS if mode == "wrap" or k != "evaluate"]
        assert kinds == per_call * cfg.iterations, r.rank
        assert {p["microbatches"] for p in log} == {2, 6}
        for i, p in enumerate(log):
            what = f"{mode} rank {r.rank} pass {i} ({p['kind']}, {p['microbatches']} microbatches)"
            (state_before, calls_before, order_before), (state_after, calls_after, order_after) = p["before"], p["after"]
            assert p["forwards"] == p["microbatches"] * chunks, what
            if r.is_last_stage:
                assert p["outputs"] == p["microbatches"], what
            assert not state_after["in_iteration"] and state_after["live_chunks"] == [], what
            assert order_after == order_before, what
            # In auto mode the first pass after a training call closes that (complete) iteration, as
            # any chunk forward would; nothing else changes.
            closes = mode == "auto" and i % len(per_call) == 0
            assert state_before["in_iteration"] == closes and calls_after == calls_before + closes, what
            assert state_after == {**state_before, "in_iteration": False}, what


# --------------------------------------------------------------------------------------------
# In one process (the `managed` fixture: one GPTLikeChunk, megatron's pipeline of one stage).
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(_MODES))
def test_a_forward_with_gradients_inside_forward_only_is_no_training(managed, mode: str):
    """Between two steps, forwards with gradients enabled inside ``forward_only()`` (3 of them, the
    steps run 2) leave the steps' gradients, records and counts as without them, and warn nothing."""
    options = _MODES[mode] if mode == "wrap" else {"iterations": "auto", "num_microbatches": 2}
    results = []
    for passes in (False, True):
        chunk, manager = managed(**options)
        step = (lambda **kw: train_step(chunk, 2)) if mode == "auto" else manager.wrap(lambda **kw: train_step(chunk, 2))
        grads = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                chunk.zero_grad(set_to_none=True)
                step(num_microbatches=2)
                grads.append([p.grad.clone() for p in chunk.parameters()])
                if passes:
                    with manager.forward_only():
                        outputs = [chunk(microbatch(10 + k)) for k in range(3)]
                    assert all(o.requires_grad for o in outputs) and manager.live_chunks() == []
            if mode == "auto":
                manager.end_iteration()
        assert [str(w.message) for w in caught] == []
        results.append((grads, manager.training_calls, comparable(manager.last_iteration), pass_state(manager)))
    (grads_a, *rest_a), (grads_b, *rest_b) = results
    assert all(torch.equal(x, y) for ga, gb in zip(grads_a, grads_b, strict=True) for x, y in zip(ga, gb, strict=True))
    assert rest_a == rest_b and rest_a[0] == 2


def test_without_the_scope_auto_takes_a_forward_with_gradients_for_training(managed):
    """What the scope is for: the hooks see no ``forward_only=True``; the error names the fix."""
    chunk, manager = managed(iterations="auto", num_microbatches=2)
    train_step(chunk, 2)
    outputs = [chunk(microbatch(10)), chunk(microbatch(11))]  # a forward-only pass with gradients: an iteration
    assert manager.training_calls == 1 and manager.engine.in_iteration
    with pytest.raises(ChunkOffloadError, match=re.escape("run evaluation under torch.no_grad() or inside manager.forward_only()")):
        chunk(microbatch(12))
    del outputs
    manager.end_iteration(discard=True)


def test_a_wrapped_call_without_gradients_builds_no_plan(managed):
    chunk, manager = managed()
    wrapped = manager.wrap(lambda **kw: [chunk(microbatch(k)) for k in range(kw["num_microbatches"])])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            wrapped(num_microbatches=3)
        wrapped(num_microbatches=5, forward_only=True)  # gradients enabled: no training forward outside an iteration
    assert manager.plan is None and manager.training_calls == 0 and manager.stats().groups == {}
