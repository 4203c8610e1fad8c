"""`bench/_inline_streams.py`: the overhead bench's backend that runs each copy at once.

Offloading through it must train exactly as without offload (it really copies: bytes go to host
and back) and leave nothing behind, or the ``offload_inline`` mode would time something else.
"""

from __future__ import annotations

import contextlib

import torch

from chunk_offload import OffloadConfig, OffloadManager

from ._scripts import load_bench_script


def _grads(model: torch.nn.Module, x: torch.Tensor, manager: OffloadManager | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward (in the manager's iteration and chunk, with one): the loss and every gradient."""
    model.zero_grad(set_to_none=True)
    with manager.iteration() if manager else contextlib.nullcontext():
        with manager.chunk(microbatch=0) if manager else contextlib.nullcontext():
            loss = model(x).sum()
        loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_offload_through_inline_streams_copies_and_is_bit_identical() -> None:
    overhead = load_bench_script("overhead")
    inline = load_bench_script("_inline_streams")
    device = torch.device("cpu")
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    plain_loss, plain = _grads(overhead.build(6, 16, device), x, None)

    model = overhead.build(6, 16, device)
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1, measure_time=False), streams=inline.InlineStreams(device))
    try:
        overhead.register(manager, model, 1)
        for _ in range(2):  # the second iteration reuses the pool's host buffers
            loss, grads = _grads(model, x, manager)
            assert torch.equal(loss, plain_loss)
            assert grads.keys() == plain.keys() and all(torch.equal(grads[k], plain[k]) for k in plain)
        stats = manager.stats()
    finally:
        manager.close()
    layer = stats.groups["layer"]
    assert layer.bytes_offloaded > 0 and layer.bytes_reloaded == layer.bytes_offloaded
    assert stats.resident_bytes == 0 and stats.host_bytes == 0 and stats.pool.in_use_bytes == 0
