"""Megatron-core integration: offload chosen submodules of GPTModel chunks under Megatron's schedules.

    manager = attach(model_chunks, ["core_attn", "qkv_linear"], config=OffloadConfig(min_offload_bytes=1 << 20))
    forward_backward = manager.wrap(get_forward_backward_func())

or, where the training loop calls ``get_forward_backward_func()`` itself (Megatron-LM's
``pretrain``), ``attach(..., iterations="auto")`` and no wrap.

`chunk_offload.devkit.cpu_compat` runs megatron-core on a CPU-only host (tests, CPU development); import it
explicitly, it is not imported here because importing megatron-core is slow.
"""

from .args import add_arguments
from .attach import MegatronOffloadManager, attach
from .auto import ITERATION_MODES
from .from_args import attach_from_args, check_args
from .modules import ALIASES, OFFLOAD_MODULE_NAMES, canonical_names

__all__ = [
    "ALIASES",
    "ITERATION_MODES",
    "MegatronOffloadManager",
    "OFFLOAD_MODULE_NAMES",
    "add_arguments",
    "attach",
    "attach_from_args",
    "canonical_names",
    "check_args",
]
