"""Shapes and helpers shared by the tensor-policy tests: run a function as an (optionally offloaded)
module and compare outputs and gradients exactly.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch

from chunk_offload import OffloadManager
from tests.core._models import Fn

B, T, H = 2, 8, 32
N = B * T
F32 = 4
SPAN_ALIGN = 16  # the group code aligns a copied span's start down to 16 bytes


def scope(manager: OffloadManager | None, cm: str):
    if manager is None:
        return contextlib.nullcontext()
    return manager.iteration() if cm == "iteration" else manager.chunk(microbatch=0)


def grads_of(fn: Callable, inputs: Sequence[torch.Tensor], cotangent_seed: int, manager: OffloadManager | None, name: str = "g"):
    """Run ``fn`` as an (optionally offloaded) module on fresh leaf copies of ``inputs``."""
    module = Fn(fn)
    if manager is not None:
        manager.offload_module(module, name)
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    with scope(manager, "iteration"):
        with scope(manager, "chunk"):
            out = module(*leaves)
        g = torch.Generator().manual_seed(cotangent_seed)
        cot = torch.randn(out.shape, generator=g, dtype=out.dtype)
        out.backward(cot)
    return out.detach(), [x.grad for x in leaves if x.requires_grad]


def assert_same(a, b) -> None:
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert torch.equal(out_a, out_b)
    assert len(grads_a) == len(grads_b)
    for i, (x, y) in enumerate(zip(grads_a, grads_b)):
        assert x is not None and y is not None, f"gradient {i} missing"
        assert torch.equal(x, y), f"gradient {i} differs"
