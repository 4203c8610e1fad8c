"""The stage replay on CPU: a stage's real megatron-core chunks run its plan with and without offload.

For stage 0 and the last stage of PP=4, and stage 0 of PP=4 x VPP=2 (tiny GPT, fp32, every saved
tensor above one byte offloaded):

- the chunks are the stage's (embedding only on the first chunk of stage 0, output layer only on
  the last chunk of the last stage, num_layers / (pp x vp) layers each);
- the plan replayed is megatron's schedule for the stage, and the manager saw exactly that order;
- losses, chunk outputs, parameter gradients and the gradients of the received activations of
  the offload replay equal those of the baseline bit for bit (and are not all zero);
- bytes: offloaded == reloaded == the saved bytes of the groups of the chunks the policy
  offloads (`PlanPolicy` keeps those whose backward follows at once: all of the last stage's
  under 1F1B), nothing copied by the baseline;
- the measured drop of the peak equals the accounting drop and the drop that
  `chunk_offload.schedule.simulate` predicts from the baseline's bytes per group: R == 1.0
  (> 0 on stage 0; 0 on the last stage under `PlanPolicy`).

In bf16 and fp16 (stage 0 and the last stage of PP=2, and the CLI's ``--dtype``) every parameter,
every received activation, chunk output and gradient and every offloaded saved tensor has the dtype
(but the fp32 log-sum-exp of SDPA), the losses are fp32, and the offload replay equals the baseline
bit for bit.

Bad arguments raise `ChunkOffloadError` naming the value and the fix.
"""

from __future__ import annotations


import pytest
import torch

from chunk_offload import OffloadConfig
from chunk_offload.core.errors import ChunkOffloadError
from chunk_offload.devkit.gpt import GPTShape

from ._common import assert_equal_tensors, needs_megatron_on_cpu, run_cli
from chunk_offload.schedule.megatron import megatron_plan

pytestmark = needs_megatron_on_cpu

# torch's SDPA core attention, the replay's default.
_SHAPE = GPTShape(
    num_layers=8, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16, micro_batch_size=2, attention="sdpa"
)
_MODULES = ("core_attn", "qkv_linear")
_MICROBATCHES = 8


def _replay(
    pp: int, stage: int, vp: int, policy, shape: GPTShape = _SHAPE, microbatches: int = _MICROBATCHES, iterations: int = 1, **config: object
):
    """The stage's structure, its parameters' dtypes by name and the replay's result; ``config``:
    `OffloadConfig` fields besides ``min_offload_bytes=1``."""
    from chunk_offload.replay import megatron_stage, replay

    with megatron_stage(shape, pp_size=pp, pp_rank=stage, vp_size=vp) as built:
        structure = [
            (c.pre_process, c.post_process, len(c.decoder.layers), hasattr(c, "embedding"), hasattr(c, "output_layer"))
            for c in built.chunks
        ]
        dtypes = {f"chunk{vp}.{name}": p.dtype for vp, c in enumerate(built.chunks) for name, p in c.named_parameters()}
        result = replay(
            built, modules=_MODULES, num_microbatches=microbatches, schedule_policy=policy, iterations=iterations, keep_tensors=True,
            config=OffloadConfig(min_offload_bytes=1, **config),
        )  # fmt: skip
    return structure, dtypes, result


@pytest.mark.parametrize(
    ("pp", "stage", "vp", "policy"),
    [(4, 0, 1, "plan"), (4, 3, 1, None), (4, 3, 1, "plan"), (4, 0, 2, "plan")],
    ids=["pp4_stage0", "pp4_stage3_group_start", "pp4_stage3", "pp4_vpp2_stage0"],
)
def test_replay_matches_baseline_and_theory(pp: int, stage: int, vp: int, policy) -> None:
    # Module groups: one group per offload module call (the default joins a layer's calls:
    # test_replay_with_layer_groups).
    structure, dtypes, result = _replay(pp, stage, vp, policy, group_by="module")

    # The stage's chunks.
    layers = _SHAPE.num_layers // (pp * vp)
    expected = [
        (stage == 0 and v == 0, stage == pp - 1 and v == vp - 1, layers, stage == 0 and v == 0, stage == pp - 1 and v == vp - 1)
        for v in range(vp)
    ]
    assert structure == expected
    assert set(dtypes.values()) == {torch.float32}

    # The plan is megatron's; the manager saw it run (checked on every iteration inside replay too).
    plan = megatron_plan(pp_size=pp, pp_rank=stage, num_microbatches=_MICROBATCHES, vp_size=vp if vp > 1 else None)
    assert result.plan == plan
    for mode in (result.baseline, result.offload):
        assert plan.diff(mode.last.order) is None

    # Bit-identical results, and not trivially so.
    base, off = result.baseline, result.offload
    last_stage = stage == pp - 1
    assert len(base.losses) == len(off.losses) == (_MICROBATCHES if last_stage else 0)
    assert all(torch.equal(x, y) for x, y in zip(base.losses, off.losses, strict=True))
    assert_equal_tensors(base.grads, off.grads, "parameter gradients")
    assert sum(int(g.count_nonzero()) for g in base.grads.values()) > 0
    received = {c for c in plan.chunks if not (stage == 0 and c[1] == 0)}
    assert set(base.input_grads) == received
    if received:
        assert_equal_tensors(base.input_grads, off.input_grads, "gradients of the received activations")
    sent = {c for c in plan.chunks if not (last_stage and c[1] == vp - 1)}
    assert set(base.outputs) == sent
    if sent:
        assert_equal_tensors(base.outputs, off.outputs, "chunk outputs")

    # Bytes: the offload iteration moves every saved byte of the groups of the chunks it
    # offloads there and back; the baseline tracks the same groups and copies nothing.
    kept = result.schedule_policy.kept_chunks() if policy == "plan" else []
    assert result.simulation.kept == kept
    assert base.last.group_bytes == off.last.group_bytes
    assert set(off.last.group_bytes) == set(plan.chunks)
    # Copied per chunk: every group, or where the backward follows the forward at once its first
    # groups (the plan knows the groups from a first baseline, as training does: NOTE [Kept tail]).
    heads = result.schedule_policy.copied_head if policy == "plan" else {}
    if policy == "plan" and stage == pp - 1 and vp == 1:  # 1F1B on the last stage: every backward follows its forward
        assert kept == [] and heads == {chunk: len(off.last.group_bytes[chunk]) - 1 for chunk in plan.chunks}
    # Less what each group keeps on device, held by another reference: core attention's output,
    # saved by linear_proj too (NOTE [Storages held elsewhere]).
    moved = sum(sum(b[: heads.get(chunk, len(b))]) - sum(off.last.kept_bytes_of(*chunk)[: heads.get(chunk, len(b))])
                for chunk, b in off.last.group_bytes.items() if chunk not in kept)  # fmt: skip
    held = sum(g.bytes_kept_held_elsewhere for g in off.last.groups.values())
    assert held == sum(sum(off.last.kept_bytes_of(*chunk)) for chunk in plan.chunks)
    assert set(off.last.groups) == set(_MODULES)
    assert sum(g.bytes_offloaded for g in off.last.groups.values()) == moved == result.simulation.bytes_offloaded
    assert sum(g.bytes_reloaded for g in off.last.groups.values()) == moved
    assert sum(g.bytes_offloaded for g in base.last.groups.values()) == 0
    assert off.bytes_offloaded == moved
    assert (off.offload_time_s > 0) == (moved > 0)

    # Peaks on CPU are the accounting's: the baseline's resident peak is its saved peak, which
    # the offload iteration shares; the drop is the accounting drop and what the plan predicts.
    assert base.peak_bytes == base.last.peak_resident_bytes == base.last.peak_saved_bytes
    assert off.last.peak_saved_bytes == base.last.peak_saved_bytes
    assert result.measured_drop == result.accounting_drop == base.peak_bytes - off.peak_bytes
    assert result.theoretical_drop == result.measured_drop
    if moved:
        assert result.measured_drop > 0
        assert result.ratio == 1.0
    else:  # one definition of R (the StageReport's): None when the plan predicts no drop
        assert result.measured_drop == 0 and result.ratio is None
    assert (result.report.ratio, result.report.theoretical_drop) == (result.ratio, result.simulation.drop)
    if stage == 0:
        assert moved > 0

    table = result.format()
    assert ("R = n/a (the plan predicts no drop)" if result.ratio is None else f"R = {result.ratio:.4f}") in table
    assert "step time (ms)" in table


def test_replay_with_layer_groups() -> None:
    """``group_by="layer"`` (the default, NOTE [Layer groups]; a tiny layer's two modules stay under the
    default layer_group_bytes): one group per layer in every chunk, the same numbers, and the plan's
    prediction met (R = 1 on the CPU accounting)."""
    _, _, result = _replay(4, 0, 2, "plan", group_by="layer")
    base, off = result.baseline, result.offload
    assert_equal_tensors(base.grads, off.grads, "parameter gradients")
    assert_equal_tensors(base.outputs, off.outputs, "chunk outputs")
    layers = _SHAPE.num_layers // 8
    assert {chunk: len(names) for chunk, names in off.last.group_names.items()} == {c: layers for c in result.plan.chunks}
    assert set(off.last.groups) == {"qkv_linear+core_attn"}  # in call order
    assert off.bytes_offloaded == result.simulation.bytes_offloaded > 0
    assert result.measured_drop == result.theoretical_drop > 0 and result.ratio == 1.0


def test_replay_with_bounded_layer_groups() -> None:
    """``layer_group_bytes`` (NOTE [Bounded layer groups]): at one byte each call past it opens its own
    group, so the layer's two modules are two groups again; the same numbers, R = 1."""
    _, _, result = _replay(4, 0, 2, "plan", group_by="layer", layer_group_bytes=1)
    base, off = result.baseline, result.offload
    assert_equal_tensors(base.grads, off.grads, "parameter gradients")
    layers = _SHAPE.num_layers // 8
    assert {chunk: len(names) for chunk, names in off.last.group_names.items()} == {c: 2 * layers for c in result.plan.chunks}
    assert set(off.last.groups) == {"qkv_linear", "core_attn"}
    assert result.measured_drop == result.theoretical_drop > 0 and result.ratio == 1.0


@pytest.mark.parametrize(("flag", "dtype"), [(None, "float32"), ("bf16", "bfloat16"), ("fp16", "float16")])
def test_cli_prints_table_and_writes_json(tmp_path, capsys, flag: str | None, dtype: str) -> None:
    dtype_args = ["--dtype", flag] if flag else []
    printed, summary = run_cli(capsys, tmp_path / "replay.json", "--pp", "2", "--stage", "0", *dtype_args)
    assert summary["stage"] == "stage 0 of 2" and summary["modules"] == ["core_attn"]
    assert summary["R"] == 1.0 and summary["measured_drop_bytes"] > 0
    assert f"R = {summary['R']:.4f}" in printed
    assert "sdpa attention" in printed and summary["args"]["attention"] == "sdpa"
    assert f"micro batch 1, torch.{dtype}, sdpa" in printed and summary["args"]["dtype"] == flag


@pytest.mark.parametrize("stage", [0, 1], ids=["first_stage", "last_stage"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_replay_in_half_precision(monkeypatch, dtype: torch.dtype, stage: int) -> None:
    from chunk_offload.core.tensor_filter import TensorFilter

    offloaded: list[tuple[torch.dtype, tuple[int, ...]]] = []
    decide = TensorFilter.decide

    def recording(self, tensor, inputs=()):
        decision = decide(self, tensor, inputs)
        if decision[0]:
            offloaded.append((tensor.dtype, tuple(tensor.shape)))
        return decision

    monkeypatch.setattr(TensorFilter, "decide", recording)
    shape = GPTShape(**{**_SHAPE.__dict__, "num_layers": 4, "dtype": dtype})
    _, dtypes, result = _replay(2, stage, 1, None, shape=shape, microbatches=2, iterations=1)

    base, off = result.baseline, result.offload
    assert set(dtypes.values()) == {dtype}
    # Every saved tensor the offload iterations copied (warm-up and measured) is in the dtype,
    # but SDPA's log-sum-exp [b, heads, s], which torch keeps in fp32.
    lse = (torch.float32, (shape.micro_batch_size, shape.num_attention_heads, shape.seq_length))
    assert off.bytes_offloaded > 0 and {t for t in offloaded if t[0] != dtype} == {lse}
    assert len(base.losses) == len(off.losses) == (2 if stage == 1 else 0)
    assert all(x.dtype == torch.float32 and torch.equal(x, y) for x, y in zip(base.losses, off.losses, strict=True))
    assert_equal_tensors(base.grads, off.grads, "parameter gradients")
    assert base.grads.keys() == dtypes.keys() and {g.dtype for g in base.grads.values()} == {dtype}
    for what, tensors in (("outputs", (base.outputs, off.outputs)), ("input_grads", (base.input_grads, off.input_grads))):
        if tensors[0]:
            assert_equal_tensors(*tensors, what)
            assert {t.dtype for t in tensors[0].values()} == {dtype}, what
    assert set(base.outputs) == ({(0, 0), (1, 0)} if stage == 0 else set())
    assert set(base.input_grads) == ({(0, 0), (1, 0)} if stage == 1 else set())


_CLI = ["--pp", "2", "--stage", "0", "--modules", "core_attn"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--stage", "2"], "--stage must be in 0..1 (--pp 2), got 2"),
        (["--pp", "0"], "--pp must be an integer >= 1, got 0"),
        (["--layers", "3"], "--layers must be a multiple of --pp x --vpp (2 x 1), got 3"),
        (["--microbatches", "0"], "--microbatches must be an integer >= 1, got 0"),
        (["--link-gbps", "0"], "--link-gbps must be a finite number > 0 (GB/s), got 0.0"),
        (["--link-gbps", "nan"], "--link-gbps must be a finite number > 0 (GB/s), got nan"),
        (["--h2d-gbps", "-1"], "--h2d-gbps must be a finite number > 0 (GB/s), got -1.0"),
        (["--warmup", "-1"], "--warmup must be an integer >= 0, got -1"),
        (["--seq", "0"], "--seq must be an integer >= 1, got 0"),
        (["--hidden", "0"], "--hidden must be an integer >= 1, got 0"),
        (["--hidden", "48", "--heads", "5"], "--hidden must be divisible by the attention heads (5), got 48"),
        (["--vpp", "2", "--microbatches", "3"], "--microbatches: chunk_offload: the interleaved schedule needs num_microbatches (3)"),
        (["--modules", "mlp_fc2"], "--modules: chunk_offload: unknown offload module 'mlp_fc2'"),
        (["--attention", "flash"], "argument --attention: invalid choice: 'flash'"),
        (["--group-by", "block"], "argument --group-by: invalid choice: 'block' (choose from 'call', 'module', 'layer')"),
        (["--group-by", "module", "--layer-group-bytes", "4096"], "--layer-group-bytes 4096 bounds layer groups: add --group-by layer"),
        (["--group-by", "layer", "--layer-group-bytes", "-1"], "argument --layer-group-bytes: expected 'none' or a byte count >= 0"),
    ],
)
def test_cli_usage_errors(capsys, argv: list[str], message: str) -> None:
    from chunk_offload.replay.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main([*_CLI, *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(pp_size=4, pp_rank=4), r"stage 4 does not exist in a 4-stage pipeline; choose a stage in 0\.\.3"),
        (dict(pp_size=4, pp_rank=-1), r"pp_rank as an int >= 0, got -1"),
        (dict(pp_size=1, pp_rank=0, vp_size=2), r"vp_size=2 \(interleaved schedule\) needs pp_size >= 2, got 1"),
        (dict(pp_size=3, pp_rank=0), r"num_layers=8 does not split evenly over 3 stages x 1 chunks; use a multiple of 3"),
        (dict(pp_size=4, pp_rank=0, vp_size=4), r"num_layers=8 does not split evenly over 4 stages x 4 chunks; use a multiple of 16"),
    ],
)
def test_bad_stage_arguments(kwargs: dict, match: str) -> None:
    from chunk_offload.replay import megatron_stage

    with pytest.raises(ChunkOffloadError, match=match):
        with megatron_stage(_SHAPE, **kwargs):
            pass


def test_bad_replay_arguments() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from chunk_offload.replay import megatron_stage, replay

    with megatron_stage(_SHAPE, pp_size=2, pp_rank=0) as stage:
        with pytest.raises(ChunkOffloadError, match=r"unknown offload module 'mlp_fc2'; valid names: \['attn_norm'"):
            replay(stage, modules="core_attn,mlp_fc2")
        other = megatron_plan(pp_size=2, pp_rank=1, num_microbatches=4)
        with pytest.raises(ChunkOffloadError, match=r"is for stage 1 of 2 with 1 chunk\(s\), but the stage is 0 of 2 with 1"):
            replay(stage, modules="core_attn", plan=other)
        with pytest.raises(ChunkOffloadError, match="takes num_microbatches or plan, not both"):
            replay(stage, modules="core_attn", plan=stage.plan(4), num_microbatches=4)
        with pytest.raises(ChunkOffloadError, match="iterations as an int >= 1, got 0"):
            replay(stage, modules="core_attn", iterations=0)
        with pytest.raises(ChunkOffloadError, match="already initialised"):
            with megatron_stage(_SHAPE, pp_size=2, pp_rank=1):
                pass
    # Everything the stage set up is torn down again.
    assert not parallel_state.model_parallel_is_initialized()
    assert not dist.is_initialized()


def test_links_that_differ_by_direction(capsys, tmp_path) -> None:
    """--d2h-gbps and --h2d-gbps simulate each direction on the CPU copy streams; the replay measures each."""
    out, data = run_cli(capsys, tmp_path / "r.json", "--pp", "2", "--stage", "0", "--d2h-gbps", "0.01", "--h2d-gbps", "0.001")
    to_host, back = data["host_bandwidth_bytes_per_s"], data["reload_bandwidth_bytes_per_s"]
    assert 0.005e9 < to_host <= 0.01e9 and 0.0005e9 < back <= 0.001e9, (to_host, back)
    assert f"({to_host / 1e9:.2f} GB/s to host, {back / 1e9:.2f} GB/s back)" in out
