"""One pipeline stage of a large job, built in one process: its real megatron-core chunks.

Megatron builds a stage's model chunks from ``parallel_state``: stage ``s`` of ``p`` gets
``num_layers / (p * vp)`` layers per virtual chunk, the embedding on ``s == 0, vp == 0`` and the
output layer and loss on ``s == p - 1, vp == vp_size - 1``. `megatron_stage` initialises
model parallelism in a world of one process, then tells ``parallel_state`` that this process
is pipeline rank ``s`` of ``p`` (with megatron's own setters, the ones its unit tests use),
so that `build_gpt_chunks` builds exactly that stage's chunks. See NOTE [ One rank of p ].

What the other stages would send is synthetic: a received activation ``[seq, batch, hidden]``
per forward and a received gradient per backward, drawn from generators seeded by
(seed, iteration, microbatch, vp_stage), so that two replays see identical inputs.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch

from ..core.errors import ChunkOffloadError
from ..devkit.gpt import GPTShape, build_gpt_chunks, random_token_batches
from ..schedule.megatron import megatron_plan
from ..schedule.plan import Plan

__all__ = ["MegatronStage", "device_bytes_left", "megatron_stage"]

logger = logging.getLogger(__name__)

# NOTE [ One rank of p ]
# A world of one process can only form pipeline groups of size 1. The stage's position is
# therefore set with `parallel_state.set_pipeline_model_parallel_world_size(p)` /
# `set_pipeline_model_parallel_rank(s)` / `set_virtual_pipeline_model_parallel_world_size(vp)`
# after `initialize_model_parallel()`: `is_pipeline_first_stage` / `is_pipeline_last_stage`
# then answer for stage s, and the model config says `pipeline_model_parallel_size=p`, so each
# chunk gets the stage's layer count, embedding and output layer. megatron-core 0.16.1 numbers
# the layers from the rank of the pipeline *process group* (size 1, rank 0), so layer numbers
# are stage 0's; they only matter for checkpoint names and `apply_query_key_layer_scaling`
# (off in `build_gpt_chunks`), not for memory or time. Nothing in a chunk's forward or backward
# communicates over the pipeline group. `megatron.core.parallel_state.destroy_model_parallel`
# clears the overrides on exit.

_GRAD_SCALE = 1e-2  # received gradients: small, like gradients of a mean loss


@dataclass(kw_only=True)
class MegatronStage:
    """Stage ``pp_rank`` of a ``pp_size``-stage pipeline (``vp_size`` chunks each) on one device."""

    shape: GPTShape
    """The whole model's dimensions."""
    pp_size: int
    """Pipeline stages of the job being replayed."""
    pp_rank: int
    """The stage replayed here."""
    vp_size: int
    """Model chunks (virtual stages) per stage; 1 for plain 1F1B."""
    chunks: list[torch.nn.Module]
    """The stage's megatron-core GPTModel chunks, one per virtual stage."""
    device: torch.device
    """Where the chunks live."""
    seed: int
    """Seeds the model init, the token batches and the synthetic received tensors."""

    def is_first(self, vp_stage: int) -> bool:
        """Whether chunk ``vp_stage`` holds the embedding (it reads tokens, receives nothing)."""
        return self.pp_rank == 0 and vp_stage == 0

    def is_last(self, vp_stage: int) -> bool:
        """Whether chunk ``vp_stage`` holds the output layer and the loss."""
        return self.pp_rank == self.pp_size - 1 and vp_stage == self.vp_size - 1

    def plan(self, num_microbatches: int, *, microbatch_group_size_per_vp_stage: int | None = None) -> Plan:
        """Megatron's schedule for this stage: the actions a replay runs."""
        return megatron_plan(
            pp_size=self.pp_size,
            pp_rank=self.pp_rank,
            num_microbatches=num_microbatches,
            vp_size=self.vp_size if self.vp_size > 1 else None,
            microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage,
        )

    @property
    def recompute_modules(self) -> list[str]:
        """The modules megatron's selective recompute covers in the chunks (their TransformerConfig); [] without."""
        config = self.chunks[0].config
        return list(config.recompute_modules or []) if config.recompute_granularity == "selective" else []

    @property
    def activation_shape(self) -> tuple[int, int, int]:
        """``[seq, micro batch, hidden]``: what a chunk sends to the next stage."""
        return (self.shape.seq_length, self.shape.micro_batch_size, self.shape.hidden_size)

    def token_batches(self, num_microbatches: int, *, iteration: int) -> list[dict[str, torch.Tensor]]:
        """The iteration's token batches (used by the first and the last chunk only)."""
        return random_token_batches(
            self.shape, num_microbatches=num_microbatches, seed=self.seed, iteration=iteration, device=self.device
        )

    def received_activation(self, *, iteration: int, microbatch: int, vp_stage: int) -> torch.Tensor:
        """What the previous stage would send for this forward: a leaf that requires grad."""
        x = self._random(0, iteration, microbatch, vp_stage)
        return x.requires_grad_(True)

    def received_grad(self, *, iteration: int, microbatch: int, vp_stage: int) -> torch.Tensor:
        """What the next stage would send for this backward: the gradient of the chunk's output."""
        return self._random(1, iteration, microbatch, vp_stage).mul_(_GRAD_SCALE)

    def _random(self, kind: int, iteration: int, microbatch: int, vp_stage: int) -> torch.Tensor:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(((self.seed * 1_000_003 + iteration) * 1_009 + microbatch) * 101 + vp_stage * 2 + kind)
        return torch.randn(self.activation_shape, generator=gen, device=self.device, dtype=self.shape.dtype)


def _check(shape: GPTShape, pp_size: int, pp_rank: int, vp_size: int) -> None:
    for label, value, low in (("pp_size", pp_size, 1), ("vp_size", vp_size, 1), ("pp_rank", pp_rank, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ChunkOffloadError(f"stage replay needs {label} as an int >= {low}, got {value!r}")
    if pp_rank >= pp_size:
        raise ChunkOffloadError(
            f"stage replay: stage {pp_rank} does not exist in a {pp_size}-stage pipeline; choose a stage in 0..{pp_size - 1}"
        )
    if vp_size > 1 and pp_size < 2:
        raise ChunkOffloadError(f"stage replay: vp_size={vp_size} (interleaved schedule) needs pp_size >= 2, got {pp_size}")
    if shape.num_layers % (pp_size * vp_size):
        raise ChunkOffloadError(
            f"stage replay: num_layers={shape.num_layers} does not split evenly over {pp_size} stages x {vp_size} chunks; "
            f"use a multiple of {pp_size * vp_size}"
        )


@contextlib.contextmanager
def megatron_stage(
    shape: GPTShape,
    *,
    pp_size: int,
    pp_rank: int,
    vp_size: int = 1,
    seed: int = 1234,
    device: torch.device | str | None = None,
    config_overrides: Mapping[str, Any] | None = None,
) -> Iterator[MegatronStage]:
    """Build stage ``pp_rank`` of ``pp_size`` (``vp_size`` chunks) in this process; tear down on exit.

    Starts a one-process ``torch.distributed`` world (gloo on CPU, NCCL on CUDA) unless one is
    already running with world size 1, and megatron's model parallelism; on a CPU-only host
    megatron's CUDA calls are redirected (`cpu_compat`) while the stage is alive. ``device``:
    default the current CUDA device, else the CPU. ``config_overrides``: further
    ``TransformerConfig`` fields for `build_gpt_chunks` (megatron's built-in offload needs its
    flags at build time).
    """
    _check(shape, pp_size, pp_rank, vp_size)
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda") or (device.type == "cuda") != cuda:
        raise ChunkOffloadError(
            f"stage replay runs on the CUDA device when CUDA is available, else on the CPU; got device {device} "
            f"(CUDA available: {cuda})"
        )
    with contextlib.ExitStack() as stack:
        if cuda:
            torch.cuda.set_device(device)
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")  # no TE / Apex
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
            stack.callback(dist.destroy_process_group)
        elif dist.get_world_size() != 1:
            raise ChunkOffloadError(
                f"stage replay runs in one process, but torch.distributed has world size {dist.get_world_size()}; "
                "run it outside torchrun (it starts its own one-process world)"
            )
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        if parallel_state.model_parallel_is_initialized():
            raise ChunkOffloadError(
                "stage replay initialises megatron's model parallelism itself, but it is already initialised; "
                "call parallel_state.destroy_model_parallel() first"
            )
        if not cuda:
            from ..devkit import cpu_compat

            stack.enter_context(cpu_compat.megatron_on_cpu())
        parallel_state.initialize_model_parallel()
        stack.callback(parallel_state.destroy_model_parallel)
        # See NOTE [ One rank of p ].
        parallel_state.set_pipeline_model_parallel_world_size(pp_size)
        parallel_state.set_pipeline_model_parallel_rank(pp_rank)
        if vp_size > 1:
            parallel_state.set_virtual_pipeline_model_parallel_world_size(vp_size)
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        chunks = build_gpt_chunks(
            shape,
            pipeline_parallel=pp_size,
            virtual_pipeline=vp_size if vp_size > 1 else None,
            device=device,
            config_overrides=config_overrides,
        )
        logger.info(
            "stage %d of %d: %d chunk(s) of %d layer(s) on %s",
            pp_rank, pp_size, len(chunks), shape.num_layers // (pp_size * vp_size), device,
        )
        yield MegatronStage(
            shape=shape, pp_size=pp_size, pp_rank=pp_rank, vp_size=vp_size, chunks=chunks, device=device, seed=seed
        )


def device_bytes_left() -> int:
    """Device bytes still allocated after a garbage collection (0 without CUDA).

    Taken before a build, what the builds before it left behind: several builds in one process
    compare peaks (``torch.cuda.max_memory_allocated``) and budgets only over what each found.
    On the H200 on 2026-11-27 the build after a chunk-offload build still found that model's
    parameters and gradients allocated (bench/results/2026-11-27-h200).
    """
    gc.collect()
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    # cuBLAS keeps a workspace per handle (one per thread) and stream once a matmul ran there: let
    # each build allocate its own, as the first one does, rather than count the earlier ones' as left.
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()
