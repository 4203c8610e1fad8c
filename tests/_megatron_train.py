"""The harness's training loop inside one rank (``tests._megatron``): a plain torch optimizer, or Megatron-LM's
set-up (``MegatronTraining``: DDP, mixed precision, megatron's optimizer), under Megatron's schedules.

The one place the tests call Megatron's schedules: `train` for whole runs, `megatron_step` for one call of
a schedule on random token batches (``tests/planner/_measure.py`` measures single steps with it). Loops
of plain modules go through ``tests/_driver.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tests._driver import snapshot
from tests._megatron_config import TinyGPTConfig

if TYPE_CHECKING:  # tests._megatron imports this module
    from tests._megatron import Hooks


def train(
    cfg: TinyGPTConfig, hooks: Hooks, chunks: list[torch.nn.Module]
) -> tuple[list[list[torch.Tensor]], dict[str, torch.Tensor], list[Any], list[Any], dict[str, Any] | None]:
    """The training loop; returns the losses (empty off the last stage), the last gradients,
    what ``hooks.after_step`` and ``hooks.before_step`` returned at each step, and with
    ``cfg.megatron_ddp`` the description of megatron's wrappers."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from chunk_offload.devkit.gpt import average_data_parallel_grads

    megatron = MegatronTraining(cfg, chunks) if cfg.megatron_ddp else None
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
        store = megatron_step(forward_backward, model, gpt_shape(cfg), num_microbatches=cfg.num_microbatches, seed=cfg.seed, iteration=iteration)
        if store:  # only the last stage computes losses
            losses.append([d["lm loss"] for d in store])
        if megatron is None:
            average_data_parallel_grads(chunks)
            grads = named(chunks, lambda p: p.grad)
            before_steps.append(hooks.before_step(chunks, iteration))
            optimizer.step()
        else:  # the schedule's finalize_model_grads reduced them already
            grads = named(chunks, lambda p: p.main_grad)
            before_steps.append(hooks.before_step(chunks, iteration))
            megatron.step()
        steps.append(hooks.after_step(chunks, iteration))
    return losses, grads, steps, before_steps, None if megatron is None else megatron.describe()


def reset_mtp_loss_tracker() -> None:
    """Empty megatron's MTP loss log before building a model: one process-wide dict
    (``MTPLossLoggingHelper.tracker``) whose ``values`` take the size of the first model's
    ``mtp_num_layers``; a later run in the same process with more MTP layers would index past it."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()


def megatron_step(
    forward_backward: Callable[..., Any],
    model: list[torch.nn.Module],
    shape: Any,
    *,
    num_microbatches: int,
    seed: int,
    iteration: int,
    forward_only: bool = False,
    forward_step_func: Callable[..., Any] | None = None,
    collect_non_loss_data: bool = False,
) -> Any:
    """One call of Megatron's schedule ``forward_backward`` (``get_forward_backward_func()``, maybe wrapped)
    over the rank's model chunks, on ``random_token_batches(shape, ...)``: a training call, or with
    ``forward_only`` a forward-only pass; what the schedule returns (on the last stage the losses, or with
    ``collect_non_loss_data`` what ``forward_step_func``'s loss function returns; None: `gpt_forward_step`)."""
    from chunk_offload.devkit.gpt import gpt_forward_step, random_token_batches

    batches = random_token_batches(shape, num_microbatches=num_microbatches, seed=seed, iteration=iteration)
    interleaved = len(model) > 1
    return forward_backward(
        forward_step_func=gpt_forward_step if forward_step_func is None else forward_step_func,
        # The interleaved schedule takes one iterator per chunk; each chunk reads every microbatch.
        data_iterator=[iter(batches) for _ in model] if interleaved else iter(batches),
        model=model if interleaved else model[0],
        num_microbatches=num_microbatches,
        seq_length=shape.seq_length,
        micro_batch_size=shape.micro_batch_size,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
    )


class MegatronTraining:
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


def named(chunks: list[torch.nn.Module], pick: Callable[[torch.nn.Parameter], Any]) -> dict[str, torch.Tensor]:
    """``{"chunk{i}.{name}": snapshot(pick(param))}``, skipping ``None``."""
    out = {}
    for i, chunk in enumerate(chunks):
        for name, param in chunk.named_parameters():
            t = pick(param)
            if t is not None:
                out[f"chunk{i}.{name}"] = snapshot(t)
    return out


def gpt_shape(cfg: TinyGPTConfig):
    from chunk_offload.devkit.gpt import GPTShape

    # Recompute and MTP options only when set, so GPTShape without them keeps working.
    recompute = {
        k: v
        for k, v in (
            ("recompute_granularity", cfg.recompute_granularity),
            ("recompute_modules", cfg.recompute_modules),
            ("recompute_method", cfg.recompute_method),
            ("recompute_num_layers", cfg.recompute_num_layers),
            ("mtp_num_layers", cfg.mtp_num_layers),
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
