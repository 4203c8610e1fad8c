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

What is redirected, and why (one line each; see ``docs/megatron_cpu.md``). The NOTEs stand next to
the code they explain: the device mode and the stream stand-ins in ``_cpu_device.py``, the
replacement functions in ``_cpu_replacements.py``; this module installs and removes them:

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
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import ChunkOffloadError, internal_assert
from ._cpu_device import CpuEvent, CpuStream, CudaToCpuMode
from ._cpu_replacements import (
    RngWarningFilter,
    cpu_get_rng_state,
    cpu_manual_seed,
    cpu_set_rng_state,
    engine_run_backward_with_mode,
    isend_owning_buffer,
    splits_to_numpy_on_cpu,
)

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

# The one active handle of this process; needed to refuse a second, overlapping enable() whose
# disable() would otherwise restore the first handle's patches instead of the originals.
_active_handle: MegatronCpuCompat | None = None
_active_lock = threading.Lock()


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
        self._rng_filter: RngWarningFilter | None = None
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
        self._patch(cuda, "manual_seed", cpu_manual_seed)
        # The tracker's fork reads/writes the CUDA generator through these two; the original setter
        # queues a lazy CUDA call that never runs on a CPU-only build (and piles up).
        self._patch(_mcore_random, "_get_cuda_rng_state", cpu_get_rng_state)
        self._patch(_mcore_random, "_set_cuda_rng_state", cpu_set_rng_state)
        # Custom autograd functions allocate on "cuda" in backward. See NOTE [ Device mode in backward ].
        engine_run_backward = engine_run_backward_with_mode(torch.autograd.graph._engine_run_backward, lambda: self._mode)
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
            splits_to_numpy_on_cpu(_mcore_token_dispatcher.maybe_move_tensor_to_cpu),
        )

        # gloo's isend reads the buffer after it returns; Megatron frees a sent output at once
        # (`deallocate_output_tensor`). See NOTE [ Sends own their buffer ].
        safe_isend = isend_owning_buffer(torch.distributed.distributed_c10d.isend)
        self._patch(torch.distributed.distributed_c10d, "isend", safe_isend)
        self._patch(torch.distributed, "isend", safe_isend)

        self._rng_filter = RngWarningFilter()
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
