"""Helpers shared by the tests/core/test_edge_cases_*.py and test_tensor_filter_*.py files: one function
run as an (optionally offloaded) module through the shared driver, and exact comparisons of what runs produce."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from chunk_offload import OffloadManager
from tests._driver import Step, drive
from tests.core._models import Fn, make_stack, register


B, T, H = 2, 8, 32
N = B * T
F32 = 4
SPAN_ALIGN = 16  # the group code aligns a copied span's start down to 16 bytes


def _spread(module: nn.Module, leaves: Sequence[torch.Tensor], step: Step) -> torch.Tensor:
    return module(*leaves)


def _as_is(out: torch.Tensor) -> torch.Tensor:
    return out


def run_fn(
    fn: Callable, inputs: Sequence[torch.Tensor], mgr: OffloadManager | None, *, seed: int = 0, name: str = "g"
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """``fn`` as an (optionally offloaded) module on fresh leaf copies of ``inputs`` (floating ones
    require grad), one forward and a backward of a random cotangent seeded ``seed``; its output and
    the leaves' gradients."""
    module = Fn(fn)
    if mgr is not None:
        mgr.offload_module(module, name)
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]

    def backward(step: Step, out: torch.Tensor) -> None:
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype))

    params = [x for x in leaves if x.requires_grad]
    run = drive(module, inputs=[leaves], manager=mgr, forward=_spread, loss=_as_is, backward=backward, params=params, lr=None)
    return run.losses[0], run.grads[0]


def assert_same(a: Any, b: Any) -> None:
    """Two `run_fn` results: the same output and every gradient present and bit-identical."""
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
