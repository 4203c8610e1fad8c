"""The replacement functions `cpu_compat` installs, in plain torch: the CUDA RNG on the one CPU
generator, autograd's engine entry with the device mode pushed, ``isend`` of a private copy, and
megatron's split sizes as numpy arrays on CPU.

Internal to `chunk_offload.devkit.cpu_compat`, which patches them in while its handle is enabled
(the megatron attributes they replace are named there).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..core.errors import ChunkOffloadError

__all__ = [
    "RngWarningFilter",
    "cpu_get_rng_state",
    "cpu_manual_seed",
    "cpu_set_rng_state",
    "engine_run_backward_with_mode",
    "isend_owning_buffer",
    "splits_to_numpy_on_cpu",
]

# NOTE [ One generator on CPU ]
# On a GPU, megatron keeps two random streams apart: the CPU generator and the CUDA generator,
# whose state its RNG tracker swaps in and out (`get_cuda_rng_tracker().fork()`). A CPU-only host
# has one generator that every CPU op draws from, so the "CUDA" state is redirected to the CPU
# default generator: `torch.cuda.manual_seed(s)` reseeds it, and a tracker fork saves it, installs
# the tracked state, and restores it on exit. Runs are still fully deterministic for a fixed seed,
# but random numbers differ from a GPU run with the same seed. Megatron's check that "the CPU RNG
# state did not change within the GPU RNG context" is meaningless here, so its warning is filtered
# while the handle is active.

# NOTE [ Device mode in backward ]
# A TorchFunctionMode is popped while its handler runs, and `torch.autograd.backward`,
# `torch.autograd.grad` and `Tensor.backward` are themselves torch functions. So `loss.backward()`
# under the mode reaches autograd's engine with the mode popped, the engine snapshots that
# thread-local state, and megatron's custom autograd functions then allocate in backward with
# `device=torch.cuda.current_device()` and no rewrite (e.g. `_gather_along_first_dim` in the MoE
# token dispatcher). The engine's Python entry `_engine_run_backward` is therefore wrapped to push
# the mode back for the duration of the engine run, the same seam torch's own
# `torch.compiler._patch_engine_backward` uses. Megatron's `custom_backward` (used with
# `deallocate_pipeline_outputs=True`) calls the engine directly and never lost the mode.

# NOTE [ Sends own their buffer ]
# gloo's `isend` returns before it has read the tensor; the send's work keeps a reference to the
# tensor object, not to its memory. Megatron frees each stage output once it is sent
# (`deallocate_output_tensor` sets `out.data` to a 1-element tensor), and at PP >= 2 with VPP it
# forces overlapped (asynchronous) p2p, so the send may then read freed, reused memory: runs with
# identical seeds gave different losses, once NaN. `isend` therefore sends a private copy of a CPU
# tensor, which only the send's work references. Both bindings are replaced (`torch.distributed`
# and `distributed_c10d`, whose `P2POp` and `batch_isend_irecv` compare `op is isend`).

_RNG_WARNING = "CPU RNG state changed within GPU RNG context"


class RngWarningFilter(logging.Filter):
    """Drops megatron's RNG-fork warning, meaningless with one generator (NOTE [ One generator on CPU ])."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _RNG_WARNING not in record.getMessage()


def cpu_manual_seed(seed: int) -> None:
    """``torch.cuda.manual_seed`` on the CPU generator (NOTE [ One generator on CPU ])."""
    torch.default_generator.manual_seed(int(seed))


def cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """Megatron's ``_get_cuda_rng_state`` on the CPU generator (NOTE [ One generator on CPU ])."""
    if graph_safe:
        raise ChunkOffloadError(
            "chunk_offload: graph-safe (CUDA graph) RNG states do not exist on CPU; "
            "build the RNG tracker with use_cudagraphable_rng=False"
        )
    return torch.get_rng_state()  # a fresh tensor already, so `clone` needs nothing more


def cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """Megatron's ``_set_cuda_rng_state`` on the CPU generator (NOTE [ One generator on CPU ])."""
    if graph_safe:
        raise ChunkOffloadError(
            "chunk_offload: graph-safe (CUDA graph) RNG states do not exist on CPU; "
            "build the RNG tracker with use_cudagraphable_rng=False"
        )
    torch.set_rng_state(new_state)


def engine_run_backward_with_mode(
    original: Callable[..., Any], current_mode: Callable[[], TorchFunctionMode | None]
) -> Callable[..., Any]:
    """Wrap autograd's engine entry so backward runs with the device mode (``current_mode()``) pushed.

    See NOTE [ Device mode in backward ].
    """

    @functools.wraps(original)
    def run_backward(*args: Any, **kwargs: Any) -> Any:
        mode = current_mode()
        # No public accessor for the mode stack; skip the push when the mode is still on it.
        if mode is None or mode in torch.overrides._get_current_function_mode_stack():
            return original(*args, **kwargs)
        with mode:
            return original(*args, **kwargs)

    return run_backward


def isend_owning_buffer(original: Callable[..., Any]) -> Callable[..., Any]:
    """``isend`` of a private copy of a CPU tensor. See NOTE [ Sends own their buffer ]."""

    @functools.wraps(original)
    def isend(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return original(tensor.clone() if tensor.device.type == "cpu" else tensor, *args, **kwargs)

    return isend


def splits_to_numpy_on_cpu(original: Callable[..., Any]) -> Callable[..., Any]:
    """Make megatron's ``maybe_move_tensor_to_cpu(t, as_numpy=True)`` return numpy for CPU tensors too."""

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu
