"""Run megatron-core on a CPU-only host: redirect the CUDA calls it makes to CPU equivalents.

megatron-core 0.16.1 builds and trains ``GPTModel`` with the local (non-Transformer-Engine)
layer spec on CPU tensors and the ``gloo`` backend, through its own pipeline schedules (also
inside its ``DistributedDataParallel`` and ``Float16Module`` wrappers, stepped by
``get_megatron_optimizer``), once a handful of hard-wired CUDA calls are redirected. Everything
that redirects them lives here, in one reversible object::

    from chunk_offload.devkit import cpu_compat

    with cpu_compat.megatron_on_cpu():          # or: compat = cpu_compat.enable(); ...; compat.disable()
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
        model = GPTModel(...)                   # parameters land on the CPU
        get_forward_backward_func()(...)

It is for tests and CPU development only. When ``torch.cuda.is_available()`` is true it is inert:
it patches nothing and megatron-core runs on the GPU unchanged.

What is redirected, and why (one line each; see ``docs/megatron_cpu.md``):

* ``torch.cuda.current_device`` returns ``0``: megatron passes ``device=torch.cuda.current_device()``
  to tensor factories; the device mode below turns that index into ``cpu``.
* A ``TorchFunctionMode`` (this thread only) rewrites ``device="cuda"``, ``torch.device("cuda", i)``
  and bare device indices in any torch call to ``cpu``; ``Tensor.cuda()`` and ``Tensor.to("cuda")``
  return a copy, never the source, as a real device move does; ``pin_memory`` requests give plain
  host memory (the pinned allocator needs an accelerator).
  The no-argument ``Tensor.type()`` names the CUDA type (``"torch.cuda.FloatTensor"``): megatron's
  optimizers accept parameters by that name. See NOTE [ Tensor type names ].
  Autograd's engine entry is wrapped so that the mode is active in backward too (custom autograd
  functions allocate there). See NOTE [ Device mode in backward ].
* ``torch.cuda.Stream`` / ``Event`` / ``current_stream`` / ``default_stream`` / ``stream`` /
  ``synchronize`` become synchronous stand-ins: CPU kernels run in program order, so every
  ordering request is already satisfied. Megatron creates side streams (MoE shared experts and
  token dispatch, its own activation offloading) and synchronizes after batched p2p.
* ``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed`` and megatron's
  ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` act on the CPU default
  generator, so ``model_parallel_cuda_manual_seed`` and ``get_cuda_rng_tracker().fork()`` work.
  See NOTE [ One generator on CPU ].
* ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` is set to ``None`` when missing:
  without Transformer Engine the name is never bound, and the MoE router reads it.
* ``torch.distributed.isend`` sends a private copy of a CPU tensor: gloo reads the buffer after
  ``isend`` returns, and Megatron frees sent outputs at once. See NOTE [ Sends own their buffer ].
* The alltoall token dispatcher's ``maybe_move_tensor_to_cpu`` also turns CPU split sizes into
  numpy arrays: megatron converts them only when they come from the GPU, and
  ``all_to_all_single`` rejects tensors as split sizes.

Only the thread that calls :func:`enable` sees the device rewrite (torch function modes are
thread-local); the ``torch.cuda`` and megatron patches are process-wide. At most one handle is
active per process, and it must be disabled on the thread that enabled it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import ChunkOffloadError, internal_assert
from ._cpu_device import CpuEvent, CpuStream, CudaToCpuMode

try:
    import megatron.core.tensor_parallel.random as _mcore_random
    import megatron.core.transformer.moe.moe_utils as _mcore_moe_utils
    import megatron.core.transformer.moe.token_dispatcher as _mcore_token_dispatcher
except ImportError as e:
    raise ImportError(
        "chunk_offload.devkit.cpu_compat needs megatron-core (tested with 0.16.1): "
        'pip install "chunk-offload[megatron]"'
    ) from e

__all__ = ["MegatronCpuCompat", "enable", "megatron_on_cpu"]

logger = logging.getLogger(__name__)

# NOTE [ One generator on CPU ]
# On a GPU, megatron keeps two random streams apart: the CPU generator and the CUDA generator,
# whose state its RNG tracker swaps in and out (`get_cuda_rng_tracker().fork()`). A CPU-only host
# has one generator that every CPU op draws from, so the "CUDA" state is redirected to the CPU
# default generator: `torch.cuda.manual_seed(s)` reseeds it, and a tracker fork saves it, installs
# the tracked state, and restores it on exit. Runs are still fully deterministic for a fixed seed,
# but random numbers differ from a GPU run with the same seed. Megatron's check that "the CPU RNG
# state did not change within the GPU RNG context" is meaningless here, so its warning is filtered
# while the handle is active.

# NOTE [ Tensor type names ]
# megatron's optimizers pick the tensor kind by its legacy type name, `param.type()`:
# `Float16OptimizerWithFloat16Params` and the distributed optimizer accept only
# 'torch.cuda.FloatTensor', 'torch.cuda.HalfTensor' and 'torch.cuda.BFloat16Tensor' and raise on
# anything else, and `clip_grad_by_total_norm_fp32` asserts `param.grad.type() ==
# 'torch.cuda.FloatTensor'`. The device mode therefore answers the no-argument `Tensor.type()` of
# a CPU tensor with the name it would have on the GPU (dtype unchanged, only `cuda.` inserted).
# Conversions (`t.type(torch.float16)`, `t.type("torch.FloatTensor")`) pass through unchanged;
# `Tensor.is_cuda` and `Tensor.device` still say cpu.

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

# The one active handle of this process; needed to refuse a second, overlapping enable() whose
# disable() would otherwise restore the first handle's patches instead of the originals.
_active_handle: MegatronCpuCompat | None = None
_active_lock = threading.Lock()


class _RngWarningFilter(logging.Filter):
    """Drops megatron's RNG-fork warning, meaningless with one generator (NOTE [ One generator on CPU ])."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _RNG_WARNING not in record.getMessage()


# --------------------------------------------------------------------------------------------
# The handle.
# --------------------------------------------------------------------------------------------

_MISSING = object()


@dataclass(slots=True)
class _Patch:
    """One attribute replaced on a module: enough to put the original back."""

    owner: Any
    name: str
    original: Any  # _MISSING when the attribute did not exist

    @property
    def label(self) -> str:
        return f"{getattr(self.owner, '__name__', type(self.owner).__name__)}.{self.name}"


class MegatronCpuCompat:
    """An active (or inert) redirection of megatron-core's CUDA calls; undo it with :meth:`disable`.

    Built by :func:`enable` or :func:`megatron_on_cpu`, not directly. Usable as a context manager.
    """

    def __init__(self, *, active: bool) -> None:
        self._active = active
        self._patches: list[_Patch] = []
        self._mode: CudaToCpuMode | None = None
        self._rng_filter: _RngWarningFilter | None = None
        self._thread = threading.get_ident()
        self._default_stream = CpuStream()
        self._stream_stack: list[CpuStream] = []

    # -- public ---------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """True while this handle redirects calls; False once disabled, or if CUDA was available."""
        return self._active

    @property
    def device_rewrites(self) -> int:
        """How many CUDA device arguments (and ``Tensor.cuda()`` calls) were redirected to ``cpu`` so far."""
        return 0 if self._mode is None else self._mode.rewrites

    @property
    def type_names(self) -> int:
        """How many no-argument ``Tensor.type()`` calls were answered with a CUDA type name so far."""
        return 0 if self._mode is None else self._mode.type_names

    @property
    def patched(self) -> tuple[str, ...]:
        """The ``module.attribute`` names currently replaced (empty when inert or disabled)."""
        return tuple(p.label for p in self._patches)

    def disable(self) -> None:
        """Put every patched attribute back and pop the device mode. Idempotent."""
        global _active_handle
        if not self._active:
            return
        if threading.get_ident() != self._thread:
            raise ChunkOffloadError(
                "chunk_offload: cpu_compat handle disabled on another thread than the one that enabled it; "
                "call disable() (or leave the `with` block) on the enabling thread"
            )
        # The device mode is thread-local and stacked: pop it only if it is the innermost mode.
        # torch exposes no public accessor for the top of the stack.
        top = torch.overrides._get_current_function_mode()
        if top is not self._mode:
            raise ChunkOffloadError(
                f"chunk_offload: cpu_compat cannot disable while another TorchFunctionMode ({top!r}) "
                "entered after it is still active; exit that mode first"
            )
        self._mode.__exit__(None, None, None)
        self._restore()
        self._active = False
        with _active_lock:
            internal_assert(_active_handle is self, "the active cpu_compat handle changed under us")
            _active_handle = None
        logger.debug("cpu_compat disabled after %d device rewrites", self.device_rewrites)

    def __enter__(self) -> MegatronCpuCompat:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.disable()

    # -- patching -------------------------------------------------------------------------

    def _restore(self) -> None:
        """Undo the patches, newest first, and drop the RNG warning filter."""
        for patch in reversed(self._patches):
            if patch.original is _MISSING:
                delattr(patch.owner, patch.name)
            else:
                setattr(patch.owner, patch.name, patch.original)
        self._patches.clear()
        if self._rng_filter is not None:
            logging.getLogger(_mcore_random.__name__).removeFilter(self._rng_filter)
            self._rng_filter = None

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._patches.append(_Patch(owner, name, getattr(owner, name, _MISSING)))
        setattr(owner, name, value)

    def _install(self) -> None:
        cuda = torch.cuda
        # Factories get `device=torch.cuda.current_device()`; the mode maps index 0 to cpu.
        self._patch(cuda, "current_device", lambda: 0)
        # Side streams and events (MoE alltoall dispatch and shared experts, megatron offloading).
        self._patch(cuda, "Stream", CpuStream)
        self._patch(cuda, "Event", CpuEvent)
        self._patch(cuda, "current_stream", self._current_stream)
        self._patch(cuda, "default_stream", lambda device=None: self._default_stream)
        self._patch(cuda, "stream", self._stream_context)
        # p2p_communication synchronizes after batched isend/irecv.
        self._patch(cuda, "synchronize", lambda device=None: None)
        # RNG tracker: CudaRNGStatesTracker.add and model_parallel_cuda_manual_seed seed and read
        # the CUDA generator. See NOTE [ One generator on CPU ].
        self._patch(cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
        self._patch(cuda, "set_rng_state", lambda new_state, device="cuda": torch.set_rng_state(new_state))
        self._patch(cuda, "manual_seed", _cpu_manual_seed)
        # The tracker's fork reads/writes the CUDA generator through these two; the original setter
        # queues a lazy CUDA call that never runs on a CPU-only build (and piles up).
        self._patch(_mcore_random, "_get_cuda_rng_state", _cpu_get_rng_state)
        self._patch(_mcore_random, "_set_cuda_rng_state", _cpu_set_rng_state)
        # Custom autograd functions allocate on "cuda" in backward. See NOTE [ Device mode in backward ].
        engine_run_backward = _engine_run_backward_with_mode(torch.autograd.graph._engine_run_backward, self)
        self._patch(torch.autograd.graph, "_engine_run_backward", engine_run_backward)
        self._patch(torch.autograd, "_engine_run_backward", engine_run_backward)
        # Without Transformer Engine, moe_utils never binds te_general_gemm, yet the router reads it.
        if not hasattr(_mcore_moe_utils, "te_general_gemm"):
            self._patch(_mcore_moe_utils, "te_general_gemm", None)
        # The alltoall dispatcher hands split sizes to all_to_all_single as numpy arrays only
        # after a device-to-host move; on CPU they stay tensors, which the collective rejects.
        self._patch(
            _mcore_token_dispatcher,
            "maybe_move_tensor_to_cpu",
            _splits_to_numpy_on_cpu(_mcore_token_dispatcher.maybe_move_tensor_to_cpu),
        )

        # gloo's isend reads the buffer after it returns; Megatron frees a sent output at once
        # (`deallocate_output_tensor`). See NOTE [ Sends own their buffer ].
        safe_isend = _isend_owning_buffer(torch.distributed.distributed_c10d.isend)
        self._patch(torch.distributed.distributed_c10d, "isend", safe_isend)
        self._patch(torch.distributed, "isend", safe_isend)

        self._rng_filter = _RngWarningFilter()
        logging.getLogger(_mcore_random.__name__).addFilter(self._rng_filter)
        self._mode = CudaToCpuMode()
        self._mode.__enter__()

    # -- stream stand-ins bound to this handle -------------------------------------------------

    def _current_stream(self, device: Any = None) -> CpuStream:
        return self._stream_stack[-1] if self._stream_stack else self._default_stream

    @contextlib.contextmanager
    def _stream_context(self, stream: CpuStream | None) -> Iterator[None]:
        # `torch.cuda.stream(None)` is a no-op, as in torch.
        if stream is None:
            yield
            return
        self._stream_stack.append(stream)
        try:
            yield
        finally:
            self._stream_stack.pop()


def _cpu_manual_seed(seed: int) -> None:
    """``torch.cuda.manual_seed`` on the CPU generator (NOTE [ One generator on CPU ])."""
    torch.default_generator.manual_seed(int(seed))


def _engine_run_backward_with_mode(original: Callable[..., Any], handle: MegatronCpuCompat) -> Callable[..., Any]:
    """Wrap autograd's engine entry so backward runs with the device mode pushed.

    See NOTE [ Device mode in backward ].
    """

    @functools.wraps(original)
    def run_backward(*args: Any, **kwargs: Any) -> Any:
        mode = handle._mode
        # No public accessor for the mode stack; skip the push when the mode is still on it.
        if mode is None or mode in torch.overrides._get_current_function_mode_stack():
            return original(*args, **kwargs)
        with mode:
            return original(*args, **kwargs)

    return run_backward


def _isend_owning_buffer(original: Callable[..., Any]) -> Callable[..., Any]:
    """``isend`` of a private copy of a CPU tensor. See NOTE [ Sends own their buffer ]."""

    @functools.wraps(original)
    def isend(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return original(tensor.clone() if tensor.device.type == "cpu" else tensor, *args, **kwargs)

    return isend


def _splits_to_numpy_on_cpu(original: Callable[..., Any]) -> Callable[..., Any]:
    """Make megatron's ``maybe_move_tensor_to_cpu(t, as_numpy=True)`` return numpy for CPU tensors too."""

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """Megatron's ``_get_cuda_rng_state`` on the CPU generator (NOTE [ One generator on CPU ])."""
    if graph_safe:
        raise ChunkOffloadError(
            "chunk_offload: graph-safe (CUDA graph) RNG states do not exist on CPU; "
            "build the RNG tracker with use_cudagraphable_rng=False"
        )
    return torch.get_rng_state()  # a fresh tensor already, so `clone` needs nothing more


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """Megatron's ``_set_cuda_rng_state`` on the CPU generator (NOTE [ One generator on CPU ])."""
    if graph_safe:
        raise ChunkOffloadError(
            "chunk_offload: graph-safe (CUDA graph) RNG states do not exist on CPU; "
            "build the RNG tracker with use_cudagraphable_rng=False"
        )
    torch.set_rng_state(new_state)


# --------------------------------------------------------------------------------------------
# Entry points.
# --------------------------------------------------------------------------------------------


def enable() -> MegatronCpuCompat:
    """Redirect megatron-core's CUDA calls to the CPU until the returned handle's ``disable()``.

    Inert when ``torch.cuda.is_available()``: the handle's ``active`` is False and nothing is
    patched. Call it before building megatron models or process groups, on the thread that will
    run training. Raises ``ChunkOffloadError`` if another handle is already active.
    """
    global _active_handle
    if torch.cuda.is_available():
        return MegatronCpuCompat(active=False)
    with _active_lock:
        if _active_handle is not None:
            raise ChunkOffloadError(
                "chunk_offload: cpu_compat is already enabled in this process; "
                "reuse that handle or disable() it before enabling again"
            )
        handle = MegatronCpuCompat(active=True)
        _active_handle = handle
    try:
        handle._install()
    except BaseException:
        handle._restore()  # a partial install; the mode is pushed last, so it is not on the stack
        with _active_lock:
            _active_handle = None
        raise
    logger.debug("cpu_compat enabled: %s", ", ".join(handle.patched))
    return handle


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[MegatronCpuCompat]:
    """``with megatron_on_cpu() as compat:`` – :func:`enable` on entry, ``disable()`` on exit."""
    handle = enable()
    try:
        yield handle
    finally:
        handle.disable()
