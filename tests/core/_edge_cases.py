"""Helpers shared by the tests/core/test_edge_cases_*.py files: one computation run with and without
an `OffloadManager`, and exact comparisons of what the runs produce."""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
from torch import nn

from chunk_offload import OffloadManager
from tests.core._models import Fn, make_stack, register


B, T, H = 2, 8, 32
N = B * T
F32 = 4


def _iteration(mgr: OffloadManager | None):
    return mgr.iteration() if mgr is not None else contextlib.nullcontext()


def _chunk(mgr: OffloadManager | None, microbatch: int = 0, vp_stage: int = 0):
    return mgr.chunk(microbatch=microbatch, vp_stage=vp_stage) if mgr is not None else contextlib.nullcontext()


def _run_fn(fn: Callable, inputs: Sequence[torch.Tensor], mgr: OffloadManager | None, *, seed: int = 0, name: str = "g"):
    """``fn`` as an (optionally offloaded) module on fresh leaves; output and input grads."""
    module = Fn(fn)
    if mgr is not None:
        mgr.offload_module(module, name)
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    with _iteration(mgr):
        with _chunk(mgr):
            out = module(*leaves)
        cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
        out.backward(cot)
    return out.detach(), [x.grad for x in leaves]


def _assert_same(a, b) -> None:
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert torch.equal(out_a, out_b), "outputs differ"
    assert len(grads_a) == len(grads_b)
    for i, (x, y) in enumerate(zip(grads_a, grads_b)):
        assert x is not None and y is not None, f"gradient {i} missing"
        assert torch.equal(x, y), f"gradient {i} differs"


def _span_bytes(offset: int, size: Sequence[int], stride: Sequence[int], itemsize: int = F32) -> int:
    extent = 1 + sum((n - 1) * s for n, s in zip(size, stride))
    start = offset * itemsize // 16 * 16
    return (offset + extent) * itemsize - start


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _model_and_reference(mgr: OffloadManager, layers: int = 2, seed: int = 0):
    model = make_stack(layers, seed=seed)
    reference = make_stack(layers, seed=seed)
    register(mgr, model)
    return model, reference


def _assert_grads_equal(model: nn.Module, reference: nn.Module) -> None:
    for i, (p, q) in enumerate(zip(model.parameters(), reference.parameters())):
        assert (p.grad is None) == (q.grad is None), f"gradient {i} present in only one run"
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), f"gradient {i} differs"
