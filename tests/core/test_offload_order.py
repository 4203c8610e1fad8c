"""NOTE [Offload order] (core/copies.py): byte views of what a group copies are made on compute
before the copy stream's wait, so no compute access to an offloaded storage follows that wait.

PyTorch's CUDA sanitizer counts the ``aten::set_`` that makes a byte view as a compute-stream
write; the CPU happens-before checker sees the same access through the view's compute mark,
which the offload requires (R1). The order the first GPU run flagged (views made after the
wait) is rebuilt here and must raise.
"""

from __future__ import annotations

import pytest
import torch

from chunk_offload import HappensBeforeError
from chunk_offload.core import copies

from ._models import Fn, manager_skipping_waits


def _offload_one_group(manager) -> tuple[torch.Tensor, torch.Tensor]:
    module = Fn(lambda z: (z * 1.0).exp())
    manager.offload_module(module, "exp")
    x = torch.randn(8, 8, requires_grad=True)
    with manager.iteration():
        with manager.chunk(microbatch=0):
            loss = module(x).sum()
        loss.backward()
    return x, x.grad


def test_byte_views_made_after_the_copy_streams_wait_are_a_race(monkeypatch) -> None:
    view_device_bytes = copies.view_device_bytes

    def wait_then_view(ctx, name, storages):
        ctx.streams.d2h.wait_stream(ctx.streams.compute)  # the old order: the copy stream waits first ...
        return view_device_bytes(ctx, name, storages)  # ... and compute makes the byte views after it

    monkeypatch.setattr(copies, "view_device_bytes", wait_then_view)
    manager = manager_skipping_waits(("offload_after_compute",))  # its wait is the one moved above
    try:
        with pytest.raises(HappensBeforeError) as info:
            _offload_one_group(manager)
    finally:
        manager.close()
    assert info.value.rule == "R1" and "byte view" in str(info.value)


def test_the_engine_order_passes_the_checker() -> None:
    manager = manager_skipping_waits(())
    try:
        x, grad = _offload_one_group(manager)
        copied = manager.stats().groups["exp"].bytes_offloaded
    finally:
        manager.close()
    assert copied == x.numel() * x.element_size()
    assert torch.equal(grad, x.detach().exp())
