"""`attach` under Megatron-LM's own training wrappers, on CPU ranks (gloo).

Megatron-LM never trains bare GPTModel chunks: each is wrapped in megatron-core's
``DistributedDataParallel`` (contiguous gradient buffers in ``param.main_grad``, gradient
accumulation hooks, optionally bucketed asynchronous reduction with ``overlap_grad_reduce``) and,
in bf16, in ``Float16Module``; ``get_megatron_optimizer`` steps it, optionally as the distributed
optimizer; the schedule calls ``no_sync_func``, ``grad_sync_func`` and ``finalize_model_grads``.
The harness builds exactly that with ``TinyGPTConfig(megatron_ddp=True, ...)`` (see
``tests._megatron_train.MegatronTraining``), and `attach` hooks the inner GPTModel chunks, as Megatron-LM's
model provider would.

Each spawn trains every config twice in the same ranks, without offload and with every dense
module offloaded under the default plan policy, 3 iterations each, and requires, on every rank:

- the wrappers are the ones asked for (module chain, optimizer class, buckets, gradient buffer
  dtype, schedule hooks on the config);
- losses, the gradients the optimizer used (``main_grad``) before every step, every parameter
  after every step, and megatron's gradient norms are bit-identical to the run without offload;
- bytes were offloaded on the first stage, each module's bytes came back, and after every step
  and at the end no chunk is live and no byte is resident, on host or in use in the pool.

With data parallel 2 and the distributed optimizer, the data-parallel replicas hold equal
parameters after every step (the all-gather worked) while their ``main_grad`` buffers differ
(each rank reduced only its own shard: with an all-reduce they would be equal).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass

import pytest
import torch

from chunk_offload.schedule import megatron_plan

from tests._megatron import Hooks, RankResult, Run, TinyGPTConfig, spawn_runs, step_grads, step_params
from tests._megatron_offload import OffloadHooks

_NO_MEGATRON = importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None
_TIMEOUT_S = 150.0  # hang guard per spawn

_DENSE = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1")

# bucket_size (elements) applies to the first chunk of the first stage only (megatron's rule);
# that chunk has about 15k parameters, so this gives it several buckets.
_BUCKET = 4000
_BASE = dict(pipeline_parallel=2, virtual_pipeline=2, iterations=3, megatron_ddp=True)
_BF16_DISTOPT = dict(bf16=True, grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=_BUCKET)


@dataclass(frozen=True)
class _Spawn:
    world_size: int
    configs: dict[str, TinyGPTConfig]


_SPAWNS = {
    "pp2_vpp2": _Spawn(
        world_size=2,
        configs={
            # Megatron-LM's defaults: one bucket per chunk, reduced in finalize_model_grads.
            "fp32": TinyGPTConfig(**_BASE),
            "fp32_overlap": TinyGPTConfig(**_BASE, overlap_grad_reduce=True, bucket_size=_BUCKET),
            "bf16_distopt_overlap": TinyGPTConfig(**_BASE, **_BF16_DISTOPT),
        },
    ),
    "dp2_pp2_vpp2": _Spawn(
        world_size=4,
        configs={
            "fp32_distopt_overlap": TinyGPTConfig(
                **_BASE, use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=_BUCKET
            ),
            "bf16_distopt_overlap": TinyGPTConfig(**_BASE, **_BF16_DISTOPT),
        },
    ),
}


@dataclass
class _Spawned:
    name: str
    spawn: _Spawn
    pairs: dict[str, tuple[list[RankResult], list[RankResult]]]
    """config name -> (ranks without offload, ranks with offload)."""


def _offload_hooks() -> Hooks:
    # Default options of OffloadHooks: min_offload_bytes=1 and attach's default plan policy.
    return dataclasses.replace(OffloadHooks(_DENSE).with_steps(), before_step=step_grads)


@pytest.fixture(scope="module", params=list(_SPAWNS), ids=list(_SPAWNS))
def spawned(request) -> _Spawned:
    if _NO_MEGATRON:
        pytest.skip('megatron-core is not installed (pip install "chunk-offload[megatron]")')
    if torch.cuda.is_available():
        pytest.skip("cpu_compat is inert on a CUDA host")
    spawn = _SPAWNS[request.param]
    runs = []
    for cfg in spawn.configs.values():
        runs.append(Run(config=cfg, hooks=Hooks(after_step=step_params, before_step=step_grads)))
        runs.append(Run(config=cfg, hooks=_offload_hooks()))
    results = spawn_runs(runs, world_size=spawn.world_size, timeout_s=_TIMEOUT_S)
    pairs = {name: (results[2 * i], results[2 * i + 1]) for i, name in enumerate(spawn.configs)}
    return _Spawned(request.param, spawn, pairs)


def _assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a, f"{what}: nothing recorded"
    assert a.keys() == b.keys(), f"{what}: different names"
    differing = [name for name in a if not torch.equal(a[name], b[name])]
    assert not differing, f"{what} differ: {differing[:5]}"


def _params_after(result: RankResult, step: int) -> dict[str, torch.Tensor]:
    """Parameters after ``step``: `step_params` in runs without offload, `OffloadHooks.after_step` with."""
    record = result.steps[step]
    return record["params"] if isinstance(result.extra, dict) and "offloaded" in result.extra else record


def _each_pair(spawned: _Spawned):
    for name, (baseline, offloaded) in spawned.pairs.items():
        cfg = spawned.spawn.configs[name]
        for base, off in zip(baseline, offloaded, strict=True):
            yield cfg, f"{spawned.name} {name} rank {off.rank}", base, off


def test_the_wrappers_are_megatrons(spawned: _Spawned):
    for cfg, what, base, off in _each_pair(spawned):
        meta = base.megatron
        assert meta is not None, what
        inner = ["Float16Module", "GPTModel"] if cfg.bf16 else ["GPTModel"]
        assert meta["wrappers"] == [["DistributedDataParallel", *inner]] * cfg.virtual_pipeline, what
        if cfg.use_distributed_optimizer:
            optimizer = "DistributedOptimizer"
        else:
            optimizer = "Float16OptimizerWithFloat16Params" if cfg.bf16 else "FP32Optimizer"
        assert meta["optimizers"] == [optimizer], what
        grad_dtype = "torch.float32" if cfg.grad_reduce_in_fp32 or not cfg.bf16 else "torch.bfloat16"
        assert meta["grad_dtypes"] == [[grad_dtype]] * cfg.virtual_pipeline, what
        assert meta["overlap_grad_reduce"] == [cfg.overlap_grad_reduce] * cfg.virtual_pipeline, what
        # Megatron-LM's train(): no_sync and grad_sync hooks only with overlap_grad_reduce.
        assert (meta["no_sync_func"], meta["grad_sync_func"]) == (cfg.overlap_grad_reduce,) * 2, what
        assert meta["finalize_model_grads_func"], what
        bucketed = cfg.overlap_grad_reduce and cfg.bucket_size is not None and off.pipeline_rank == 0
        assert (meta["buckets"][0] > 1) == bucketed, (what, meta["buckets"])
        assert meta["buckets"][1:] == [1] * (cfg.virtual_pipeline - 1), what
        assert len(meta["grad_norms"]) == cfg.iterations, what
        # The offload run was wrapped the same way.
        assert {k: v for k, v in off.megatron.items() if k != "grad_norms"} == {
            k: v for k, v in meta.items() if k != "grad_norms"
        }, what
        # Gradients live in megatron's buffers, one per parameter, in the buffer's dtype.
        for step in base.before_steps:
            assert step.keys() == base.params.keys(), what
            assert {str(g.dtype) for g in step.values()} == {grad_dtype}, what
        param_dtype = torch.bfloat16 if cfg.bf16 else torch.float32
        assert {p.dtype for p in base.params.values()} == {param_dtype}, what
        assert base.non_cpu_tensors == off.non_cpu_tensors == 0, what


def test_offload_is_bit_identical(spawned: _Spawned):
    for cfg, what, base, off in _each_pair(spawned):
        if base.is_last_stage:
            assert len(base.losses) == cfg.iterations
            assert all(len(it) == cfg.num_microbatches for it in base.losses)
        assert len(off.losses) == len(base.losses), what
        for i, (la, lb) in enumerate(zip(base.losses, off.losses, strict=True)):
            assert all(torch.equal(x, y) for x, y in zip(la, lb, strict=True)), (
                f"{what} iteration {i}: losses {base.mean_losses()} vs {off.mean_losses()}"
            )
        assert len(base.before_steps) == len(off.before_steps) == cfg.iterations, what
        assert len(base.steps) == len(off.steps) == cfg.iterations, what
        for i in range(cfg.iterations):
            _assert_same_tensors(base.before_steps[i], off.before_steps[i], f"{what} step {i} main_grad")
            _assert_same_tensors(_params_after(base, i), _params_after(off, i), f"{what} step {i} parameters")
        _assert_same_tensors(base.grads, off.grads, f"{what} last gradients")
        _assert_same_tensors(base.params, off.params, f"{what} parameters")
        assert base.megatron["grad_norms"] == off.megatron["grad_norms"], what


def test_bytes_move_and_nothing_is_left(spawned: _Spawned):
    for cfg, what, base, off in _each_pair(spawned):
        stats = off.extra
        if off.pipeline_rank == 0:
            assert sum(stats["offloaded"].values()) > 0, (what, stats["offloaded"])
        for name, offloaded in stats["offloaded"].items():
            assert stats["reloaded"][name] == offloaded, (what, name, stats)
        for i, step in enumerate(off.steps):
            memory = step["memory"]
            left = (memory["live_chunks"], memory["resident_bytes"], memory["host_bytes"], memory["pool_in_use_bytes"])
            assert left == (0, 0, 0, 0), (what, i, memory)
        assert stats["live_chunks"] == [], what
        assert (stats["resident"], stats["host"], stats["pool_in_use"]) == (0, 0, 0), (what, stats)
        # The wrappers call the hooked inner chunks in megatron's schedule order, so the plan
        # policy decided from the right plan.
        plan = megatron_plan(
            pp_size=cfg.pipeline_parallel, pp_rank=off.pipeline_rank, num_microbatches=cfg.num_microbatches, vp_size=cfg.virtual_pipeline
        )
        assert stats["observed_order"] == [(a.kind.value, a.microbatch, a.vp_stage) for a in plan.actions], what


def test_distributed_optimizer_keeps_replicas_equal_and_gradients_sharded(spawned: _Spawned):
    for name, (baseline, offloaded) in spawned.pairs.items():
        cfg = spawned.spawn.configs[name]
        data_parallel = spawned.spawn.world_size // cfg.pipeline_parallel
        if data_parallel == 1 or not cfg.use_distributed_optimizer:
            continue
        for ranks in (baseline, offloaded):
            by_stage: dict[int, list[RankResult]] = {}
            for r in ranks:
                by_stage.setdefault(r.pipeline_rank, []).append(r)
            for stage, replicas in by_stage.items():
                assert len(replicas) == data_parallel
                first, *others = replicas
                what = f"{spawned.name} {name} stage {stage}"
                for other in others:
                    for i in range(cfg.iterations):
                        _assert_same_tensors(
                            _params_after(first, i), _params_after(other, i), f"{what} step {i} replicas' parameters"
                        )
                        assert any(
                            not torch.equal(first.before_steps[i][n], g) for n, g in other.before_steps[i].items()
                        ), f"{what} step {i}: replicas' main_grad buffers are equal; were they all-reduced?"


def test_tensor_type_names_the_cuda_type_under_cpu_compat():
    """megatron's optimizers accept parameters by ``param.type()`` (NOTE [ Tensor type names ])."""
    if _NO_MEGATRON:
        pytest.skip('megatron-core is not installed (pip install "chunk-offload[megatron]")')
    if torch.cuda.is_available():
        pytest.skip("cpu_compat is inert on a CUDA host")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron warns that Apex / TE are missing
        from chunk_offload.devkit import cpu_compat

    t = torch.ones(2)
    with cpu_compat.megatron_on_cpu() as compat:
        assert t.type() == "torch.cuda.FloatTensor"
        assert t.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert t.half().type() == "torch.cuda.HalfTensor"
        assert compat.type_names == 3
        # Conversions are not names: they pass through and stay on the CPU.
        converted = t.type(torch.float64)
        assert (converted.dtype, converted.device.type) == (torch.float64, "cpu")
        assert t.type("torch.DoubleTensor").dtype == torch.float64
        assert not t.is_cuda and t.device.type == "cpu"
        assert compat.type_names == 3
    assert t.type() == "torch.FloatTensor"
    assert compat.type_names == 3
