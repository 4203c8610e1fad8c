"""The device half of `cpu_compat`, in plain torch: CUDA device arguments rewritten to ``cpu``,
and synchronous stand-ins for CUDA streams and events (a CPU-only host runs one stream).

Internal to `chunk_offload.devkit.cpu_compat`, which installs them while its handle is enabled.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CPU", "CpuEvent", "CpuStream", "CudaToCpuMode", "cuda_type_name", "is_accelerator_device"]

# --------------------------------------------------------------------------------------------
# Synchronous stand-ins for CUDA streams and events.
# --------------------------------------------------------------------------------------------


class CpuEvent:
    """Stands in for ``torch.cuda.Event``; CPU work is done when the call returns, so it is always complete."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, external: bool = False
    ):
        # ``external`` (torch >= 2.9): megatron-core 0.19's activation offloading asks for it.
        self.enable_timing = enable_timing
        self._recorded_at: float | None = None

    def record(self, stream: Any = None) -> None:
        self._recorded_at = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: CpuEvent) -> float:
        """Milliseconds between this event's record and ``end_event``'s, as ``torch.cuda.Event`` reports."""
        if self._recorded_at is None or end_event._recorded_at is None:
            raise ChunkOffloadError(
                "chunk_offload: elapsed_time() needs both events recorded; call record() on each first"
            )
        return (end_event._recorded_at - self._recorded_at) * 1000.0


class CpuStream:
    """Stands in for ``torch.cuda.Stream``; every wait is already satisfied because CPU ops run in order."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any):
        self.device = torch.device("cpu")
        self.priority = priority

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: CpuEvent | None = None) -> CpuEvent:
        event = CpuEvent() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<cpu_compat stream {id(self):#x}>"


# --------------------------------------------------------------------------------------------
# The device rewrite.
# --------------------------------------------------------------------------------------------

CPU = torch.device("cpu")

# NOTE [ Tensor type names ]
# megatron's optimizers pick the tensor kind by its legacy type name, `param.type()`:
# `Float16OptimizerWithFloat16Params` and the distributed optimizer accept only
# 'torch.cuda.FloatTensor', 'torch.cuda.HalfTensor' and 'torch.cuda.BFloat16Tensor' and raise on
# anything else, and `clip_grad_by_total_norm_fp32` asserts `param.grad.type() ==
# 'torch.cuda.FloatTensor'`. The device mode therefore answers the no-argument `Tensor.type()` of
# a CPU tensor with the name it would have on the GPU (dtype unchanged, only `cuda.` inserted).
# Conversions (`t.type(torch.float16)`, `t.type("torch.FloatTensor")`) pass through unchanged;
# `Tensor.is_cuda` and `Tensor.device` still say cpu.


def is_accelerator_device(device: Any) -> bool:
    """True for ``"cuda"``, ``"cuda:1"``, ``torch.device("cuda", 0)`` and bare indices (``0`` means ``cuda:0``)."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.split(":", 1)[0] == "cuda"
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of torch calls to ``cpu``; counts the rewrites."""

    def __init__(self) -> None:
        super().__init__()
        self.rewrites = 0
        self.type_names = 0

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None):
        kwargs = {} if kwargs is None else kwargs
        if func is torch.Tensor.cuda:
            self.rewrites += 1
            return args[0].clone()  # a device move makes a new tensor; see below
        if func is torch.Tensor.pin_memory:
            return args[0].clone()  # pin_memory() copies; CPU-only hosts have no pinned allocator
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # See NOTE [ Tensor type names ]: the no-argument form names the type, as on a GPU.
            self.type_names += 1
            return cuda_type_name(func(*args))
        moved = False
        if "device" in kwargs and is_accelerator_device(kwargs["device"]):
            moved = True
            kwargs = {**kwargs, "device": CPU}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.to and any(is_accelerator_device(a) for a in args[1:]):
            # Tensor.to(device, ...) takes the device positionally, also as a bare index.
            moved = True
            args = (args[0], *(CPU if is_accelerator_device(a) else a for a in args[1:]))
        if not moved:
            return func(*args, **kwargs)
        self.rewrites += 1
        result = func(*args, **kwargs)
        # On a GPU, moving a host tensor to the device never aliases it, and callers rely on that
        # (a host staging buffer is refilled right after its upload). `.to("cpu")` of a CPU tensor
        # returns the tensor itself, so copy to keep the GPU's semantics.
        if func is torch.Tensor.to and result is args[0]:
            result = result.clone()
        return result


def cuda_type_name(name: str) -> str:
    """``"torch.FloatTensor"`` -> ``"torch.cuda.FloatTensor"``: the name the tensor would have on a GPU."""
    if name.startswith("torch.") and not name.startswith("torch.cuda."):
        return "torch.cuda." + name[len("torch.") :]
    return name
