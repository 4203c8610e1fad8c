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
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from tests._spawn import run_ranks

__all__ = [
    "Hooks",
    "RankResult",
    "Run",
    "TinyGPTConfig",
    "spawn_runs",
    "step_grads",
    "step_params",
]


def _identity(x: Any) -> Any:
    return x


def _nothing(model_chunks: list[torch.nn.Module]) -> None:
    return None


def _no_step_record(model_chunks: list[torch.nn.Module], iteration: int) -> None:
    return None


def step_params(model_chunks: list[torch.nn.Module], iteration: int) -> dict[str, torch.Tensor]:
    """A ``Hooks.after_step`` that records every parameter after each optimizer step."""
    return _named(model_chunks, lambda p: p)


def step_grads(model_chunks: list[torch.nn.Module], iteration: int) -> dict[str, torch.Tensor]:
    """A ``Hooks.before_step`` that records every gradient the optimizer is about to use.

    megatron's ``DistributedDataParallel`` keeps them in ``param.main_grad`` (its contiguous
    buffers; ``param.grad`` is None), plain training in ``param.grad``.
    """
    return _named(model_chunks, lambda p: p.main_grad if getattr(p, "main_grad", None) is not None else p.grad)


@dataclass(kw_only=True, frozen=True, slots=True)
class TinyGPTConfig:
    """Shape, parallelism and training length of one tiny GPT run."""

    tensor_parallel: int = 1
    """``tensor_model_parallel_size`` (not covered by the tests in this directory)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (needs ``tensor_parallel > 1``; not covered by the tests in
    this directory: their gradient averaging does not sum sequence-parallel norm gradients over
    the tensor-parallel ranks)."""
    pipeline_parallel: int = 1
    """Pipeline stages (``pipeline_model_parallel_size``)."""
    virtual_pipeline: int | None = None
    """Model chunks per rank for the interleaved schedule; None for plain 1F1B."""
    expert_parallel: int = 1
    """``expert_model_parallel_size``; needs ``num_experts``."""
    num_experts: int | None = None
    """MoE experts per MoE layer (which layers are MoE: ``moe_layer_freq``); None for a dense MLP."""
    moe_layer_freq: int | tuple[int, ...] = 1
    """Megatron's ``moe_layer_freq`` when ``num_experts`` is set: ``N`` makes every N-th layer MoE
    (from the first), a tuple of 0/1 per layer (1: MoE) sets the pattern; 1: every layer is MoE."""
    moe_router_topk: int = 2
    """Experts per token."""
    moe_token_dispatcher: str = "allgather"
    """Megatron's ``moe_token_dispatcher_type``: ``"allgather"`` or ``"alltoall"``."""
    add_bias_linear: bool = True
    """Megatron's ``add_bias_linear``. MoE with ``expert_parallel=1`` and ``tensor_parallel=1`` needs
    False: with a bias, megatron-core 0.16.1's local expert MLP adds the fc2 bias in place to the
    output of ``reduce_from_tensor_model_parallel_region``, which at TP=1 returns its input as-is
    (a view made by a custom Function), and autograd refuses that in-place update."""
    num_layers: int = 4
    """Transformer layers in the whole model (split across stages and chunks)."""
    hidden_size: int = 32
    """Hidden size; FFN is 4x."""
    num_attention_heads: int = 4
    """Attention heads."""
    vocab_size: int = 64
    """Vocabulary size (tokens are drawn uniformly from it)."""
    seq_length: int = 16
    """Tokens per sequence."""
    micro_batch_size: int = 2
    """Sequences per microbatch."""
    num_microbatches: int = 4
    """Microbatches per iteration (a multiple of ``pipeline_parallel`` for VPP)."""
    iterations: int = 2
    """Optimizer steps."""
    seed: int = 1234
    """Seeds the model init (megatron RNG tracker) and the data."""
    optimizer: str = "adam"
    """``"adam"`` or ``"sgd"``."""
    lr: float = 1e-2
    """Learning rate."""
    microbatch_group_size_per_vp_stage: int | None = None
    """Megatron's interleaved-schedule option: microbatches per virtual stage before switching (None: PP size)."""
    deallocate_pipeline_outputs: bool = True
    """Megatron's option (Megatron-LM turns it on for training): a stage frees the data of each
    output it sent downstream and runs backward through ``custom_backward``."""
    recompute_granularity: str | None = None
    """Megatron's activation recomputation: ``"selective"`` (core attention by default) or
    ``"full"`` (whole layers, see ``recompute_method``); None for none."""
    recompute_method: str | None = None
    """With ``recompute_granularity="full"``: ``"uniform"`` (every layer, in groups of
    ``recompute_num_layers``) or ``"block"`` (the first ``recompute_num_layers`` layers of each chunk)."""
    recompute_num_layers: int | None = None
    """With ``recompute_granularity="full"``: see ``recompute_method``."""
    megatron_ddp: bool = False
    """Train as Megatron-LM's ``train_step`` does: each chunk wrapped in megatron-core's
    ``DistributedDataParallel`` (contiguous gradient buffers, ``param.main_grad``, gradient
    accumulation hooks; inside ``Float16Module`` with ``bf16``), stepped by
    ``get_megatron_optimizer``, with ``finalize_model_grads_func`` and ``grad_scale_func`` (and
    under ``overlap_grad_reduce`` ``no_sync_func`` / ``grad_sync_func``) set on the model config
    as Megatron-LM's ``train`` sets them; ``RankResult.grads`` are then the ``main_grad`` buffers
    after ``finalize_model_grads``. False: a plain torch optimizer and `average_data_parallel_grads`."""
    overlap_grad_reduce: bool = False
    """With ``megatron_ddp``: ``DistributedDataParallelConfig.overlap_grad_reduce`` (bucketed
    asynchronous reduction started by the gradient hooks and the schedule's ``grad_sync_func``)."""
    use_distributed_optimizer: bool = False
    """With ``megatron_ddp``: megatron's distributed optimizer (gradients reduce-scattered, each
    data-parallel rank steps its shard of the fp32 main parameters, parameters all-gathered)."""
    grad_reduce_in_fp32: bool = False
    """With ``megatron_ddp``: ``DistributedDataParallelConfig.grad_reduce_in_fp32`` (fp32 ``main_grad``
    buffers for bf16 parameters)."""
    bucket_size: int | None = None
    """With ``megatron_ddp``: ``DistributedDataParallelConfig.bucket_size`` in elements (None:
    megatron's default; only used with ``overlap_grad_reduce``, on the first pipeline stage's first chunk)."""
    bf16: bool = False
    """With ``megatron_ddp``: bf16 parameters and activations (``Float16Module``, megatron's mixed
    precision optimizer with fp32 main parameters)."""

    def __post_init__(self) -> None:
        pp, vp = self.pipeline_parallel, self.virtual_pipeline
        if self.sequence_parallel and self.tensor_parallel < 2:
            raise ValueError(f"sequence_parallel needs tensor_parallel >= 2, got {self.tensor_parallel}")
        if vp is not None:
            if pp < 2:
                raise ValueError(f"virtual_pipeline={vp} needs pipeline_parallel >= 2, got {pp}")
            if self.num_microbatches % pp:
                raise ValueError(
                    f"num_microbatches={self.num_microbatches} must be a multiple of pipeline_parallel={pp} "
                    "for the interleaved schedule"
                )
        if self.num_layers % (pp * (vp or 1)):
            raise ValueError(
                f"num_layers={self.num_layers} must split evenly over {pp} stages x {vp or 1} chunks"
            )
        if self.expert_parallel > 1 and (self.num_experts is None or self.num_experts % self.expert_parallel):
            raise ValueError(
                f"expert_parallel={self.expert_parallel} needs num_experts divisible by it, got {self.num_experts}"
            )
        if isinstance(self.moe_layer_freq, tuple) and (
            len(self.moe_layer_freq) != self.num_layers or set(self.moe_layer_freq) - {0, 1}
        ):
            raise ValueError(
                f"moe_layer_freq={self.moe_layer_freq} must hold one 0 or 1 per layer ({self.num_layers})"
            )
        if self.iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {self.iterations}")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.recompute_granularity not in (None, "selective", "full"):
            raise ValueError(f"recompute_granularity must be None, 'selective' or 'full', got {self.recompute_granularity!r}")
        if (self.recompute_granularity == "full") != (self.recompute_method is not None and self.recompute_num_layers is not None):
            raise ValueError("recompute_granularity='full' needs recompute_method and recompute_num_layers, and only it takes them")
        ddp_options = {
            "overlap_grad_reduce": self.overlap_grad_reduce,
            "use_distributed_optimizer": self.use_distributed_optimizer,
            "grad_reduce_in_fp32": self.grad_reduce_in_fp32,
            "bucket_size": self.bucket_size is not None,
            "bf16": self.bf16,
        }
        if not self.megatron_ddp and any(ddp_options.values()):
            raise ValueError(f"{[k for k, v in ddp_options.items() if v]} need megatron_ddp=True")


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
    ``_MegatronTraining.describe``), so tests can check the set-up they asked for; else None."""

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
    try:
        with _DeviceAudit() as audit:
            torch.manual_seed(cfg.seed)
            model_parallel_cuda_manual_seed(cfg.seed)
            chunks = run.hooks.wrap_model(_build_chunks(cfg))
            losses, grads, steps, before_steps, megatron = _train(cfg, run.hooks, chunks)
            params = _named(chunks, lambda p: p)
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


def _train(
    cfg: TinyGPTConfig, hooks: Hooks, chunks: list[torch.nn.Module]
) -> tuple[list[list[torch.Tensor]], dict[str, torch.Tensor], list[Any], list[Any], dict[str, Any] | None]:
    """The training loop; returns the losses (empty off the last stage), the last gradients,
    what ``hooks.after_step`` and ``hooks.before_step`` returned at each step, and with
    ``cfg.megatron_ddp`` the description of megatron's wrappers."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from chunk_offload.devkit.gpt import average_data_parallel_grads, gpt_forward_step, random_token_batches

    megatron = _MegatronTraining(cfg, chunks) if cfg.megatron_ddp else None
    if megatron is None:
        optimizer_class = torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.SGD
        optimizer = optimizer_class([p for chunk in chunks for p in chunk.parameters()], lr=cfg.lr)
    model = chunks if megatron is None else megatron.model  # what the schedule calls
    forward_backward = hooks.wrap_forward_backward(get_forward_backward_func())
    losses: list[list[torch.Tensor]] = []
    grads: dict[str, torch.Tensor] = {}
    steps: list[Any] = []
    before_steps: list[Any] = []
    for iteration in range(cfg.iterations):
        if megatron is None:
            optimizer.zero_grad(set_to_none=True)
        else:
            megatron.zero_grad()
        batches = random_token_batches(_shape(cfg), num_microbatches=cfg.num_microbatches, seed=cfg.seed, iteration=iteration)
        interleaved = len(chunks) > 1
        store = forward_backward(
            forward_step_func=gpt_forward_step,
            # The interleaved schedule takes one iterator per chunk; each chunk reads every microbatch.
            data_iterator=[iter(batches) for _ in chunks] if interleaved else iter(batches),
            model=model if interleaved else model[0],
            num_microbatches=cfg.num_microbatches,
            seq_length=cfg.seq_length,
            micro_batch_size=cfg.micro_batch_size,
            forward_only=False,
        )
        if store:  # only the last stage computes losses
            losses.append([d["lm loss"] for d in store])
        if megatron is None:
            average_data_parallel_grads(chunks)
            grads = _named(chunks, lambda p: p.grad)
            before_steps.append(hooks.before_step(chunks, iteration))
            optimizer.step()
        else:  # the schedule's finalize_model_grads reduced them already
            grads = _named(chunks, lambda p: p.main_grad)
            before_steps.append(hooks.before_step(chunks, iteration))
            megatron.step()
        steps.append(hooks.after_step(chunks, iteration))
    return losses, grads, steps, before_steps, None if megatron is None else megatron.describe()


class _MegatronTraining:
    """Megatron-LM's training set-up around the rank's chunks (``TinyGPTConfig.megatron_ddp``).

    As Megatron-LM's ``get_model``, ``setup_model_and_optimizer``, ``train`` and ``train_step``
    do it: ``Float16Module`` (bf16) inside megatron's ``DistributedDataParallel``, bucketing for
    the first chunk only, ``get_megatron_optimizer``, the schedule hooks on the shared model
    config, and per step ``zero_grad_buffer`` + ``optimizer.zero_grad()`` then ``optimizer.step()``.
    """

    def __init__(self, cfg: TinyGPTConfig, chunks: list[torch.nn.Module]) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        config = chunks[0].config  # one TransformerConfig, shared by the rank's chunks
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=cfg.grad_reduce_in_fp32,
            overlap_grad_reduce=cfg.overlap_grad_reduce,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
            bucket_size=cfg.bucket_size,
        )
        modules = [Float16Module(config, chunk) for chunk in chunks] if cfg.bf16 else list(chunks)
        self.model = [
            DistributedDataParallel(config=config, ddp_config=ddp_config, module=module, disable_bucketing=i > 0)
            for i, module in enumerate(modules)
        ]
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer=cfg.optimizer,
                lr=cfg.lr,
                bf16=cfg.bf16,
                params_dtype=torch.bfloat16 if cfg.bf16 else torch.float32,
                use_distributed_optimizer=cfg.use_distributed_optimizer,
            ),
            self.model,
        )
        self.grad_norms: list[float] = []
        config.grad_scale_func = self.optimizer.scale_loss
        config.finalize_model_grads_func = finalize_model_grads
        if cfg.overlap_grad_reduce:  # Megatron-LM's default align_grad_reduce=True
            no_sync = [m.no_sync for m in self.model]
            grad_sync = [m.start_grad_sync for m in self.model]
            config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
            config.grad_sync_func = grad_sync if len(grad_sync) > 1 else grad_sync[0]

    def zero_grad(self) -> None:
        for module in self.model:
            module.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> None:
        succeeded, grad_norm, _ = self.optimizer.step()
        if not succeeded:
            raise RuntimeError("megatron's optimizer skipped the step (inf/nan gradients)")
        self.grad_norms.append(grad_norm)

    def describe(self) -> dict[str, Any]:
        """The wrappers as built: per chunk the module classes from DDP inwards, buckets, gradient
        buffer dtypes; the optimizer classes; the schedule hooks set on the config; grad norms."""
        optimizers = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        config = self.model[0].config
        return {
            "wrappers": [[type(m).__name__ for m in _wrapper_chain(ddp)] for ddp in self.model],
            "buckets": [sum(len(g.buckets) for g in ddp.bucket_groups) for ddp in self.model],
            "grad_dtypes": [sorted({str(b.grad_dtype) for b in ddp.buffers}) for ddp in self.model],
            "overlap_grad_reduce": [ddp.ddp_config.overlap_grad_reduce for ddp in self.model],
            "optimizers": [type(o).__name__ for o in optimizers],
            "no_sync_func": config.no_sync_func is not None,
            "grad_sync_func": config.grad_sync_func is not None,
            "finalize_model_grads_func": config.finalize_model_grads_func is not None,
            "grad_norms": list(self.grad_norms),
        }


def _wrapper_chain(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module``, ``module.module``, ... down to the first module without a ``module`` child."""
    chain = [module]
    while isinstance(getattr(chain[-1], "module", None), torch.nn.Module):
        chain.append(chain[-1].module)
    return chain


def _named(chunks: list[torch.nn.Module], pick: Callable[[torch.nn.Parameter], Any]) -> dict[str, torch.Tensor]:
    """``{"chunk{i}.{name}": pick(param).detach().clone()}``, skipping ``None``."""
    out = {}
    for i, chunk in enumerate(chunks):
        for name, param in chunk.named_parameters():
            t = pick(param)
            if t is not None:
                out[f"chunk{i}.{name}"] = t.detach().clone()
    return out


def _build_chunks(cfg: TinyGPTConfig) -> list[torch.nn.Module]:
    from chunk_offload.devkit.gpt import build_gpt_chunks

    return build_gpt_chunks(
        _shape(cfg),
        pipeline_parallel=cfg.pipeline_parallel,
        virtual_pipeline=cfg.virtual_pipeline,
        expert_parallel=cfg.expert_parallel,
        tensor_parallel=cfg.tensor_parallel,
        sequence_parallel=cfg.sequence_parallel,
        deallocate_pipeline_outputs=cfg.deallocate_pipeline_outputs,
        microbatch_group_size_per_vp_stage=cfg.microbatch_group_size_per_vp_stage,
    )


def _shape(cfg: TinyGPTConfig):
    from chunk_offload.devkit.gpt import GPTShape

    # Recompute options only when set, so GPTShape without them keeps working.
    recompute = {
        k: v
        for k, v in (
            ("recompute_granularity", cfg.recompute_granularity),
            ("recompute_method", cfg.recompute_method),
            ("recompute_num_layers", cfg.recompute_num_layers),
        )
        if v is not None
    }
    return GPTShape(
        **recompute,
        **({"dtype": torch.bfloat16} if cfg.bf16 else {}),
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        vocab_size=cfg.vocab_size,
        seq_length=cfg.seq_length,
        micro_batch_size=cfg.micro_batch_size,
        num_experts=cfg.num_experts,
        moe_layer_freq=cfg.moe_layer_freq,
        moe_router_topk=cfg.moe_router_topk,
        moe_token_dispatcher=cfg.moe_token_dispatcher,
        add_bias_linear=cfg.add_bias_linear,
    )
