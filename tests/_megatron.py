"""The shared megatron-core harness (planner and integration tests): train a tiny GPTModel on CPU ranks (gloo).

The real purpose: compare a run WITH an offload manager against one without, bit for bit, under
Megatron's own schedules (PP, interleaved VPP, EP). One call spawns ``world_size`` processes and
runs every :class:`Run` in order inside them; each run re-initialises model parallelism, reseeds,
builds the model, trains, and tears down again, so runs in one call start from the same state::

    cfg = TinyGPTConfig(pipeline_parallel=2, virtual_pipeline=2)
    baseline, offloaded = spawn_runs(                  # results[run][rank] -> RankResult
        [Run(config=cfg), Run(config=cfg, hooks=Hooks(wrap_model=attach_offload))],
        world_size=2,
    )
    for a, b in zip(baseline, offloaded):              # losses live on the last stage only
        assert all(torch.equal(x, y) for la, lb in zip(a.losses, b.losses) for x, y in zip(la, lb))
        assert a.param_digest() == b.param_digest()

Hooks run inside the child processes, so they must be picklable: module-level functions,
``functools.partial`` of them, or bound methods of a picklable object. Two bound methods of one
object arrive in the child as methods of one object (the runs are pickled together), which is how
``wrap_model`` and ``wrap_forward_backward`` can share, say, an offload manager.

Every child arms ``faulthandler.dump_traceback_later``: a hang prints every thread's stack to
stderr and kills the child; the parent joins with a deadline as well and fails with the stacks.
"""

from __future__ import annotations

import hashlib
import importlib.util
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests._megatron_config import TinyGPTConfig
from tests._megatron_train import gpt_shape, named, reset_mtp_loss_tracker, train
from tests._spawn import run_ranks

__all__ = [
    "NEEDS_MEGATRON_ON_CPU",
    "Hooks",
    "RankResult",
    "Run",
    "TinyGPTConfig",
    "spawn_runs",
    "step_grads",
    "step_params",
]


NEEDS_MEGATRON_ON_CPU = [
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
        reason='megatron-core is not installed (pip install "chunk-offload[megatron]")',
    ),
    pytest.mark.skipif(torch.cuda.is_available(), reason="cpu_compat is inert on a CUDA host"),
]
"""``pytestmark`` of a module that trains on CPU ranks: megatron-core installed, no CUDA device."""

def _identity(x: Any) -> Any:
    return x


def _nothing(model_chunks: list[torch.nn.Module]) -> None:
    return None


def _no_step_record(model_chunks: list[torch.nn.Module], iteration: int) -> None:
    return None


def step_params(model_chunks: list[torch.nn.Module], iteration: int) -> dict[str, torch.Tensor]:
    """A ``Hooks.after_step`` that records every parameter after each optimizer step."""
    return named(model_chunks, lambda p: p)


def step_grads(model_chunks: list[torch.nn.Module], iteration: int) -> dict[str, torch.Tensor]:
    """A ``Hooks.before_step`` that records every gradient the optimizer is about to use.

    megatron's ``DistributedDataParallel`` keeps them in ``param.main_grad`` (its contiguous
    buffers; ``param.grad`` is None), plain training in ``param.grad``.
    """
    return named(model_chunks, lambda p: p.main_grad if getattr(p, "main_grad", None) is not None else p.grad)


@dataclass(kw_only=True, frozen=True)
class Hooks:
    """Where a run can be changed, e.g. to attach an offload manager; defaults change nothing.

    Both run in the child process, after the model is built and before training, and must be
    picklable (module-level functions or ``functools.partial`` of them).
    """

    wrap_model: Callable[[list[torch.nn.Module]], list[torch.nn.Module]] = _identity
    """Gets the rank's model chunks (one per virtual stage, ``chunk.vp_stage`` set) and returns the
    chunks to train (usually the same objects, with hooks attached)."""
    wrap_forward_backward: Callable[[Callable[..., Any]], Callable[..., Any]] = _identity
    """Gets megatron's ``get_forward_backward_func()`` result and returns the function that each
    iteration calls with the same keyword arguments."""
    report: Callable[[list[torch.nn.Module]], Any] = _nothing
    """Called after the last step with the trained chunks; its picklable return value (e.g. an
    offload manager's statistics) lands in ``RankResult.extra``."""
    after_step: Callable[[list[torch.nn.Module], int], Any] = _no_step_record
    """Called after each optimizer step with the chunks and the 0-based iteration; its picklable
    return values land in ``RankResult.steps``, one per iteration (e.g. `step_params`)."""
    before_step: Callable[[list[torch.nn.Module], int], Any] = _no_step_record
    """Called before each optimizer step, once the gradients are final (data-parallel reduced),
    with the chunks and the 0-based iteration; its picklable return values land in
    ``RankResult.before_steps`` (e.g. `step_grads`)."""


@dataclass(kw_only=True, frozen=True)
class Run:
    """One training run: a config and its hooks."""

    config: TinyGPTConfig
    hooks: Hooks = field(default_factory=Hooks)


@dataclass(kw_only=True)
class RankResult:
    """What one rank saw in one run."""

    rank: int
    pipeline_rank: int
    is_last_stage: bool
    """True when this rank computes the loss (losses are empty otherwise)."""
    losses: list[list[torch.Tensor]]
    """``losses[iteration][microbatch]``: the scalar loss tensors megatron's loss function returned."""
    params: dict[str, torch.Tensor]
    """Parameters after the last step, ``"chunk{i}.{name}"`` -> tensor."""
    grads: dict[str, torch.Tensor]
    """Gradients of the last iteration (after the data-parallel average, before the step)."""
    device_rewrites: int
    """CUDA device arguments redirected to cpu by cpu_compat during this run (> 0 proves it was active)."""
    non_cpu_tensors: int
    """Tensors any torch call returned on a device other than cpu during this run (must be 0)."""
    seconds: float
    """Wall time of the run inside the child (build + train)."""
    extra: Any = None
    """What ``Hooks.report`` returned."""
    steps: list[Any] = field(default_factory=list)
    """What ``Hooks.after_step`` returned after each optimizer step, in iteration order."""
    before_steps: list[Any] = field(default_factory=list)
    """What ``Hooks.before_step`` returned before each optimizer step, in iteration order."""
    megatron: dict[str, Any] | None = None
    """With ``TinyGPTConfig.megatron_ddp``: what megatron's wrappers really were (see
    ``tests._megatron_train.MegatronTraining.describe``), so tests can check the set-up they asked for; else None."""

    def param_digest(self) -> str:
        """SHA-256 over the parameter names and bytes, in name order."""
        h = hashlib.sha256()
        for name in sorted(self.params):
            h.update(name.encode())
            h.update(self.params[name].contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def mean_losses(self) -> list[float]:
        """Per-iteration mean loss as floats (for messages; compare ``losses`` for exactness)."""
        return [float(torch.stack(it).mean()) for it in self.losses]


def spawn_runs(
    runs: Sequence[Run],
    *,
    world_size: int,
    timeout_s: float = 120.0,
) -> list[list[RankResult]]:
    """Run ``runs`` in order in ``world_size`` spawned gloo ranks; returns ``results[run][rank]``.

    A child that hangs past ``timeout_s`` dumps every thread's stack to stderr and exits; the
    parent gives up ``timeout_s + 30`` seconds after the start, kills the children and raises.
    """
    per_rank = run_ranks(_rank_runs, (list(runs),), world_size=world_size, timeout_s=timeout_s, what="tiny GPT ranks")
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(runs))]


# --------------------------------------------------------------------------------------------
# Child side.
# --------------------------------------------------------------------------------------------


def _rank_runs(rank: int, world_size: int, runs: list[Run]) -> list[RankResult]:
    # megatron warns at import and build time that Apex / Transformer Engine are missing.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    from chunk_offload.devkit import cpu_compat

    with cpu_compat.megatron_on_cpu() as compat:
        return [_train_once(run, compat, rank) for run in runs]


class _DeviceAudit(TorchFunctionMode):
    """Counts tensors that torch calls return on any device but cpu."""

    def __init__(self) -> None:
        super().__init__()
        self.non_cpu = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                self.non_cpu += 1
        return out


def _train_once(run: Run, compat: Any, rank: int) -> RankResult:
    """Initialise model parallelism, build, train ``run.config.iterations`` steps, tear down."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    cfg = run.config
    started = time.perf_counter()
    rewrites_before = compat.device_rewrites
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tensor_parallel,
        pipeline_model_parallel_size=cfg.pipeline_parallel,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline,
        expert_model_parallel_size=cfg.expert_parallel,
    )
    reset_mtp_loss_tracker()
    try:
        with _DeviceAudit() as audit:
            torch.manual_seed(cfg.seed)
            model_parallel_cuda_manual_seed(cfg.seed)
            chunks = run.hooks.wrap_model(_build_chunks(cfg))
            losses, grads, steps, before_steps, megatron = train(cfg, run.hooks, chunks)
            params = named(chunks, lambda p: p)
            extra = run.hooks.report(chunks)
        return RankResult(
            rank=rank,
            pipeline_rank=parallel_state.get_pipeline_model_parallel_rank(),
            is_last_stage=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
            losses=losses,
            params=params,
            grads=grads,
            device_rewrites=compat.device_rewrites - rewrites_before,
            non_cpu_tensors=audit.non_cpu,
            seconds=time.perf_counter() - started,
            extra=extra,
            steps=steps,
            before_steps=before_steps,
            megatron=megatron,
        )
    finally:
        parallel_state.destroy_model_parallel()


def _build_chunks(cfg: TinyGPTConfig) -> list[torch.nn.Module]:
    from chunk_offload.devkit.gpt import build_gpt_chunks

    return build_gpt_chunks(
        gpt_shape(cfg),
        pipeline_parallel=cfg.pipeline_parallel,
        virtual_pipeline=cfg.virtual_pipeline,
        expert_parallel=cfg.expert_parallel,
        tensor_parallel=cfg.tensor_parallel,
        sequence_parallel=cfg.sequence_parallel,
        deallocate_pipeline_outputs=cfg.deallocate_pipeline_outputs,
        microbatch_group_size_per_vp_stage=cfg.microbatch_group_size_per_vp_stage,
    )
