"""A closed `OffloadManager` holds nothing of the model: `close` removes every module's hooks and
forgets the protected modules, so that a manager kept afterwards (a list of results, a notebook
variable) keeps no model, parameter or gradient alive, and the model runs as without offload."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from chunk_offload import CpuStreams, OffloadConfig, OffloadManager


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)])


def test_a_closed_manager_kept_after_its_model_keeps_no_model_alive() -> None:
    model = _model()
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1), streams=CpuStreams())
    registrations = [manager.offload_module(layer, f"layer{i}") for i, layer in enumerate(model)]
    manager.protect_module(model)
    x = torch.randn(4, 16, requires_grad=True)
    with manager.iteration():
        with manager.chunk(microbatch=0):
            loss = model(x).sum()
        loss.backward()
    del loss, registrations
    manager.close()
    assert manager.module_offloads == ()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    refs = [weakref.ref(model), *(weakref.ref(p) for p in model.parameters())]
    assert all(p.grad is not None for p in model.parameters())  # the gradients die with them
    del model
    gc.collect()
    assert [ref() for ref in refs] == [None] * len(refs)
    assert manager.closed and manager.last_iteration is not None  # what it recorded stays


def test_close_releases_the_host_pools_buffers() -> None:
    """A closed manager kept by its caller (for its records) holds no host memory either."""
    model = _model()
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1), streams=CpuStreams())
    for i, layer in enumerate(model):
        manager.offload_module(layer, f"layer{i}")
    with manager.iteration():
        with manager.chunk(microbatch=0):
            loss = model(torch.randn(4, 16, requires_grad=True)).sum()
        loss.backward()
    held = manager.pool.stats().allocated_bytes
    assert held > 0 and manager.pool.stats().in_use_bytes == 0
    manager.close()
    stats = manager.pool.stats()
    assert stats.allocated_bytes == 0 and stats.freed_bytes == held
