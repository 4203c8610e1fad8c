"""Per-stage estimates: layer placement, chunks in flight, and the predicted drop against real runs.

The drop test trains a tiny megatron-core GPT on CPU ranks under Megatron's own schedules
(PP=2, PP=2 VPP=2, PP=4 and EP=2 MoE with torch's SDPA core attention, PP=2 with megatron's own;
harness ``tests._megatron.spawn_runs``) with every dense module offloaded (the attention modules and the
norm before the experts in the MoE model), once with the plan policy and once offloading every
chunk, and compares, per stage
and per iteration, the manager's record of the iteration with the planner's prediction: bytes
of every group of every chunk, the peak of saved bytes without offload, the peak with offload,
the host bytes at the saved peak and the bytes copied, and the bytes each group kept on device as
held elsewhere (NOTE [Storages held elsewhere]: the engine copies them until a chunk of the vp
stage learned them; `_kept_as_learned`). All equal, so R = measured drop / predicted drop = 1.0
exactly.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import pytest
import torch

from chunk_offload.core.errors import ChunkOffloadError
from chunk_offload.planner import GPTDims, Hardware, PipelineConfig, StagePlanner, estimate_stages, layer_forward_flops, stage_layers
from chunk_offload.core import ChunkKey
from chunk_offload.core.actions import ActionKind
from chunk_offload.core.schedule_policy import SchedulePolicy
from chunk_offload.schedule import PlanPolicy, choose_offload, megatron_plan, simulate
from tests._megatron import Hooks, Run, TinyGPTConfig, spawn_runs

from ._stage_hooks import RecordHooks

_NO_MEGATRON = importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None
_DENSE = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1")
_SCHEDULES = {"plan": "plan", "group-start": None}  # planner schedule -> attach's schedule_policy


def _dims(cfg: TinyGPTConfig, attention: str = "local") -> GPTDims:
    """The harness model's dimensions (fp32 on CPU, FFN 4 x hidden, multi-head attention)."""
    return GPTDims(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        seq_length=cfg.seq_length,
        micro_batch_size=cfg.micro_batch_size,
        num_experts=cfg.num_experts,
        moe_router_topk=cfg.moe_router_topk,
        expert_parallel=cfg.expert_parallel,
        dtype="fp32",
        device="cpu",
        attention=attention,
    )


def _pipeline(cfg: TinyGPTConfig) -> PipelineConfig:
    return PipelineConfig(
        pipeline_parallel=cfg.pipeline_parallel, virtual_pipeline=cfg.virtual_pipeline, num_microbatches=cfg.num_microbatches
    )


@dataclass(frozen=True)
class _Case:
    config: TinyGPTConfig
    world_size: int
    attention: str = "sdpa"
    modules: tuple[str, ...] = _DENSE
    group_by: str = "module"
    layer_group_bytes: int | None = None


_MOE = TinyGPTConfig(expert_parallel=2, num_experts=4, num_layers=2, num_microbatches=2, iterations=2, add_bias_linear=False)
_CASES = {
    "pp2": _Case(TinyGPTConfig(pipeline_parallel=2, num_microbatches=4, iterations=2), 2),
    "pp2_local": _Case(TinyGPTConfig(pipeline_parallel=2, num_microbatches=4, iterations=2), 2, attention="local"),
    # NOTE [Joined calls]: every call its own group, SDPA's output copied by core_attn's and attn_proj's.
    "pp2_call": _Case(TinyGPTConfig(pipeline_parallel=2, num_microbatches=4, iterations=2), 2, group_by="call"),
    "pp2_vpp2": _Case(TinyGPTConfig(pipeline_parallel=2, virtual_pipeline=2, num_microbatches=4, iterations=2), 2),
    "ep2_moe": _Case(_MOE, 2, modules=_DENSE[:-1]),
    # 4 layers per stage: with 2, a stage's lowest reachable peak (its kept tail and the group it reloads
    # ahead, core_attn+attn_proj by NOTE [Joined calls]) is above the budgets the test takes, and under
    # layer groups the last stage keeps one layer and reloads the other ahead (no drop).
    "pp4": _Case(TinyGPTConfig(pipeline_parallel=4, num_layers=16, num_microbatches=6, iterations=2), 4),
    # NOTE [Layer groups]: one group per layer; SDPA's output, which attn_proj saves too, counts once.
    "pp2_vpp2_layer": _Case(TinyGPTConfig(pipeline_parallel=2, virtual_pipeline=2, num_microbatches=4, iterations=2), 2, group_by="layer"),
    "pp4_layer": _Case(TinyGPTConfig(pipeline_parallel=4, num_layers=16, num_microbatches=6, iterations=2), 4, group_by="layer"),
    # NOTE [Bounded layer groups]: a norm's call (4352 bytes) stays under 6000 and the next joins it;
    # core_attn's is over, and attn_proj joins it past the bound: attn_norm+qkv_linear, core_attn+attn_proj, mlp_norm+mlp_fc1.
    "pp2_bounded": _Case(TinyGPTConfig(pipeline_parallel=2, num_microbatches=4, iterations=2), 2, group_by="layer", layer_group_bytes=6000),
}


def _runs(case: _Case) -> list[Run]:
    runs = []
    cfg = case.config
    for schedule_policy in _SCHEDULES.values():
        options = {"min_offload_bytes": 1, "schedule_policy": schedule_policy, "group_by": case.group_by, "layer_group_bytes": case.layer_group_bytes}
        hooks = RecordHooks(case.modules, options=options, attention=case.attention)
        runs.append(Run(config=cfg, hooks=Hooks(wrap_model=hooks.wrap_model, wrap_forward_backward=hooks.wrap_forward_backward, after_step=hooks.after_step)))
    return runs


@pytest.fixture(scope="module")
def measured() -> dict[str, list]:
    """case -> results[policy run][rank]; the two world-size-2 cases share one spawn."""
    if _NO_MEGATRON:
        pytest.skip('megatron-core is not installed (pip install "chunk-offload[megatron]")')
    if torch.cuda.is_available():
        pytest.skip("cpu_compat is inert on a CUDA host")
    out = {}
    for world_size in sorted({c.world_size for c in _CASES.values()}):
        names = [n for n, c in _CASES.items() if c.world_size == world_size]
        runs = [run for n in names for run in _runs(_CASES[n])]
        results = spawn_runs(runs, world_size=world_size, timeout_s=240.0)
        for i, name in enumerate(names):
            out[name] = results[i * len(_SCHEDULES) : (i + 1) * len(_SCHEDULES)]
    return out


def _kept_as_learned(stage, policy: SchedulePolicy, learned: set[tuple[int, int]]) -> dict[tuple[int, int], list[int]]:
    """The bytes each chunk of one iteration keeps on device as held elsewhere, as the engine
    learns them (NOTE [Storages held elsewhere]): a group keeps `StageEstimate.group_kept_bytes`
    once a chunk of its vp stage copied the group at that place and ended its forward; before, it
    copies them. ``learned``: the (vp stage, group index) places learned, updated in place."""
    out = {}
    for action in stage.simulation.plan.actions:
        if action.kind is ActionKind.FORWARD:
            mb, vp = chunk = action.chunk
            kept = stage.group_kept_bytes[vp]
            out[chunk] = [k if (vp, g) in learned else 0 for g, k in enumerate(kept)]
            key = ChunkKey(mb, vp)
            if policy.offload_chunk(key):
                learned.update((vp, g) for g, k in enumerate(kept) if k and policy.offload_group(key, g))
    return out


@pytest.mark.parametrize("name", list(_CASES))
def test_predicted_drop_equals_measured(measured, name: str):
    case = _CASES[name]
    cfg = case.config
    for (schedule, _), ranks in zip(_SCHEDULES.items(), measured[name], strict=True):
        planner = StagePlanner(_dims(cfg, case.attention), _pipeline(cfg), min_offload_bytes=1, schedule=schedule, group_by=case.group_by,
                               layer_group_bytes=case.layer_group_bytes)  # fmt: skip
        stages = planner.estimate(case.modules)
        if case.layer_group_bytes is not None:
            assert {n for s in stages for names in s.group_names.values() for n in names} == {
                "attn_norm+qkv_linear", "core_attn+attn_proj", "mlp_norm+mlp_fc1"}  # fmt: skip
        steady_steps = 0
        for result in ranks:
            stage = stages[result.pipeline_rank]
            what = f"{name} schedule={schedule} stage {result.pipeline_rank}"
            assert len(result.steps) == cfg.iterations
            plan = stage.simulation.plan
            # The first step does not know the groups yet: chunks whose backward follows at once
            # (the last stage's) stay whole; the planner predicts the steady state (NOTE [Kept tail]),
            # which the later steps run unless a measured timing keeps more groups of those chunks.
            # Nor which storages are held elsewhere: a chunk copies them until one of its vp stage
            # copied them (NOTE [Storages held elsewhere]); the planner predicts all learned.
            heads = PlanPolicy(plan, group_bytes=stage.group_bytes).copied_head
            learned: set[tuple[int, int]] = set()
            for number, step in enumerate(result.steps):
                assert step["plan"] == [str(a) for a in plan.actions], what
                assert step["group_bytes"] == {c: stage.group_bytes[c[1]] for c in plan.chunks}, what
                got = (step["peak_saved_bytes"], step["peak_resident_bytes"], step["host_bytes_at_saved_peak"], step["bytes_offloaded"])
                ran = step["policy"] if number else PlanPolicy(plan) if schedule == "plan" else SchedulePolicy()
                before = set(learned)
                kept = _kept_as_learned(stage, ran, learned)
                assert step["group_kept_bytes"] == kept, what
                steady = number > 0 and learned == before and (schedule == "group-start" or ran.copied_head == heads)
                steady_steps += steady
                predicted = stage.simulation if steady else simulate(plan, stage.group_bytes, policy=ran, kept_bytes=kept)
                want = (predicted.peak_saved_bytes, predicted.peak_resident_bytes, predicted.host_bytes_at_saved_peak, predicted.bytes_offloaded)
                assert got == want, what
                measured_drop = step["peak_saved_bytes"] - step["peak_resident_bytes"]
                assert stage.drop > 0 and measured_drop == predicted.drop, what  # R = 1
                if number == 0:
                    first = predicted
            if schedule == "plan" and result.pipeline_rank == cfg.pipeline_parallel - 1 and cfg.virtual_pipeline is None:
                assert first.drop == 0 < stage.drop, what  # every chunk kept, then all groups but the last copied
        assert steady_steps > 0, f"{name} schedule={schedule}: no step ran the planner's steady state"


@pytest.mark.parametrize("name", ["pp2", "pp2_vpp2", "pp4", "pp4_layer"])
def test_budget_choice_from_predicted_bytes_equals_the_one_from_measured_bytes(measured, name: str):
    """`chunk-offload plan --budget-gb` chooses before launch what training chooses from the
    baseline's measured bytes: `choose_offload` on the planner's bytes == on the measured ones."""
    case = _CASES[name]
    cfg = case.config
    stages = StagePlanner(_dims(cfg, case.attention), _pipeline(cfg), min_offload_bytes=1, group_by=case.group_by).estimate(case.modules)
    first, last = stages[0].peak_saved_bytes, stages[-1].peak_saved_bytes
    for result in measured[name][0]:
        stage = stages[result.pipeline_rank]
        plan = stage.simulation.plan
        learned = result.steps[-1]["group_kept_bytes"]  # NOTE [Storages held elsewhere]: as the integrations pass them
        for budget in (last, (last + first) // 2):
            predicted = choose_offload(plan, stage.group_bytes, budget, kept_bytes=stage.group_kept_bytes)
            assert choose_offload(plan, result.steps[0]["group_bytes"], budget, kept_bytes=learned) == predicted
            assert predicted.fits and predicted.baseline_peak_bytes == result.steps[0]["peak_saved_bytes"]


def test_module_groups_save_the_sdpa_output_once(measured):
    """NOTE [Joined calls]: under module groups attn_proj's call joins core_attn's group, whose SDPA
    output it saves as its input; as groups of their own ("call") both account and copy it. Per
    chunk: one group fewer per layer, one SDPA output [s, b, h] (fp32) fewer saved per layer."""
    cfg = _CASES["pp2"].config
    sdpa_output = cfg.seq_length * cfg.micro_batch_size * cfg.hidden_size * 4
    layers = cfg.num_layers // cfg.pipeline_parallel
    for joined, by_call in zip(measured["pp2"][1], measured["pp2_call"][1], strict=True):  # every chunk offloaded
        for step_joined, step_call in zip(joined.steps, by_call.steps, strict=True):
            assert step_joined["group_bytes"].keys() == step_call["group_bytes"].keys()
            for chunk, sizes in step_joined["group_bytes"].items():
                assert len(step_call["group_bytes"][chunk]) - len(sizes) == layers
                assert sum(step_call["group_bytes"][chunk]) - sum(sizes) == layers * sdpa_output
        assert joined.steps[-1]["bytes_offloaded"] < by_call.steps[-1]["bytes_offloaded"]


def test_plan_policy_copies_all_but_the_last_group_on_the_last_stage():
    """Under 1F1B the last stage runs each backward right after its forward: the plan's steady state
    copies every group of its chunks but the last (NOTE [Kept tail])."""
    cfg = _CASES["pp2"].config
    stages = estimate_stages(_dims(cfg), _pipeline(cfg), _DENSE, min_offload_bytes=1, group_by="module")  # a group per module
    last = stages[-1]
    # Less the first layer's input, which attn_norm saves and the schedule holds (NOTE [Storages held elsewhere]).
    moved = [b - k for b, k in zip(last.group_bytes[0], last.group_kept_bytes[0])]
    assert last.group_kept_bytes[0] == [cfg.seq_length * cfg.micro_batch_size * cfg.hidden_size * 4] + [0] * (len(moved) - 1)
    assert last.kept_chunks == [] and last.bytes_offloaded == cfg.num_microbatches * sum(moved[:-1])
    assert 0 < last.drop < last.peak_saved_bytes
    assert stages[0].kept_chunks == [] and stages[0].drop > 0


# --------------------------------------------------------------------------------------------
# Without spawning (megatron's schedule tables are still read for the plans).
# --------------------------------------------------------------------------------------------

_TINY = GPTDims(num_layers=8, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=2, dtype="fp32")


def test_stage_layers_follow_megatrons_offsets():
    """Chunk v of stage r holds layers from v * L / vp + r * L / (p * vp) on."""
    assert stage_layers(_TINY, PipelineConfig(pipeline_parallel=2, num_microbatches=2), 1) == [[4, 5, 6, 7]]
    interleaved = PipelineConfig(pipeline_parallel=2, virtual_pipeline=2, num_microbatches=4)
    assert [stage_layers(_TINY, interleaved, r) for r in range(2)] == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]


@pytest.mark.skipif(_NO_MEGATRON, reason="megatron_plan reads megatron-core's schedule tables")
def test_chunks_in_flight():
    # 1F1B: stage r of p holds min(p - r, m) microbatches at its peak.
    for p, m in ((4, 8), (4, 2), (2, 4)):
        stages = estimate_stages(_TINY, PipelineConfig(pipeline_parallel=p, num_microbatches=m), ["core_attn"])
        assert [s.chunks_in_flight_peak for s in stages] == [min(p - r, m) for r in range(p)]
    # Interleaved: the plan's own count, more than 1F1B's on the first stage.
    pipeline = PipelineConfig(pipeline_parallel=2, virtual_pipeline=2, num_microbatches=4)
    stages = estimate_stages(_TINY, pipeline, ["core_attn"])
    assert [s.chunks_in_flight_peak for s in stages] == [max(megatron_plan(pp_size=2, pp_rank=r, num_microbatches=4, vp_size=2).in_flight()) for r in range(2)]
    assert stages[0].chunks_in_flight_peak > 2


@pytest.mark.skipif(_NO_MEGATRON, reason="megatron_plan reads megatron-core's schedule tables")
def test_bytes_per_module_layer_and_chunk():
    pipeline = PipelineConfig(pipeline_parallel=2, virtual_pipeline=2, num_microbatches=4)
    stage = estimate_stages(_TINY, pipeline, ["qkv_linear", "core_attn"], min_offload_bytes=1, group_by="module")[0]
    qkv = _TINY.tokens * _TINY.hidden_size * 4
    assert stage.module_bytes_per_layer["qkv_linear"] == qkv
    assert stage.chunk_module_bytes == {v: {"qkv_linear": 2 * qkv, "core_attn": 2 * stage.module_bytes_per_layer["core_attn"]} for v in (0, 1)}
    assert stage.group_bytes[0] == [qkv, stage.module_bytes_per_layer["core_attn"]] * 2


@pytest.mark.skipif(_NO_MEGATRON, reason="megatron_plan reads megatron-core's schedule tables")
def test_copy_against_compute():
    pipeline = PipelineConfig(pipeline_parallel=2, num_microbatches=4)
    fast = Hardware(host_bandwidth_gbs=1000.0, device_tflops=1e-3)
    slow = Hardware(host_bandwidth_gbs=1e-3, device_tflops=1000.0)
    for hardware, hides in ((fast, True), (slow, False)):
        stage = estimate_stages(_TINY, pipeline, ["core_attn"], hardware=hardware, min_offload_bytes=1)[0]
        # SDPA's output stays: attn_proj, not offloaded, holds it (NOTE [Storages held elsewhere]).
        per_layer = stage.module_bytes_per_layer["core_attn"] - _TINY.tokens * _TINY.hidden_size * 4
        assert stage.group_kept_bytes[0] == [_TINY.tokens * _TINY.hidden_size * 4] * 4
        assert stage.copy_seconds_per_layer == per_layer / (hardware.host_bandwidth_gbs * 1e9)
        assert stage.compute_seconds_per_layer == layer_forward_flops(_TINY, 0) / (hardware.device_tflops * 1e12)
        assert stage.hides is hides


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"pipeline_parallel": 1, "virtual_pipeline": 2, "num_microbatches": 4}, "virtual_pipeline=2 needs pipeline_parallel >= 2, got 1"),
        ({"pipeline_parallel": 4, "virtual_pipeline": 2, "num_microbatches": 2}, r"pipeline_parallel \(4\) <= microbatch group size \(4\) <= num_microbatches \(2\)"),
        ({"pipeline_parallel": 4, "virtual_pipeline": 2, "num_microbatches": 6}, r"num_microbatches \(6\) to be a multiple of the microbatch group size \(4\)"),
        ({"pipeline_parallel": 0, "num_microbatches": 4}, "pipeline_parallel must be an int >= 1, got 0"),
        ({"pipeline_parallel": 2, "num_microbatches": 0}, "num_microbatches must be an int >= 1, got 0"),
    ],
)
def test_invalid_pipeline(fields, message):
    with pytest.raises(ChunkOffloadError, match=message):
        PipelineConfig(**fields)


def test_layers_must_split_evenly():
    with pytest.raises(ChunkOffloadError, match=r"num_layers 8 must split evenly over 2 stages x 3 model chunks \(a multiple of 6\)"):
        stage_layers(_TINY, PipelineConfig(pipeline_parallel=2, virtual_pipeline=3, num_microbatches=4), 0)


def test_invalid_hardware():
    with pytest.raises(ChunkOffloadError, match="host_bandwidth_gbs must be a finite number > 0, got 0"):
        Hardware(host_bandwidth_gbs=0)
    with pytest.raises(ChunkOffloadError, match="h2d_gbps must be a finite number > 0, got inf"):
        Hardware(h2d_gbps=float("inf"))


def test_each_direction_of_the_link_rates_its_copies():
    hardware = Hardware(host_bandwidth_gbs=10.0, d2h_gbps=50.0)
    assert (hardware.copy_seconds(10**9), hardware.reload_seconds(10**9)) == (1 / 50, 1 / 10)
    assert Hardware(host_bandwidth_gbs=10.0).copy_seconds(10**9) == Hardware(host_bandwidth_gbs=10.0).reload_seconds(10**9) == 0.1


def test_a_slow_reload_link_does_not_hide_what_a_fast_offload_link_does():
    dims = GPTDims(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=256, micro_batch_size=1)
    pipeline = PipelineConfig(pipeline_parallel=1, num_microbatches=2)
    fast = StagePlanner(dims, pipeline, hardware=Hardware(host_bandwidth_gbs=1000.0), min_offload_bytes=1).estimate(["mlp_fc1"])[0]
    slow = StagePlanner(dims, pipeline, hardware=Hardware(host_bandwidth_gbs=1000.0, h2d_gbps=1e-3), min_offload_bytes=1).estimate(["mlp_fc1"])[0]
    assert fast.hides and fast.copy_seconds_per_layer == slow.copy_seconds_per_layer
    assert not slow.hides and slow.reload_seconds_per_layer == 1000 * 1000 * fast.reload_seconds_per_layer
