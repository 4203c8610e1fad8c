"""In-place modification of a saved tensor is detected with and without offload (offloaded, kept,
offload disabled); an in-place update of an unsaved module output keeps exact grads.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from chunk_offload import OffloadManager
from tests._driver import chunk_scope, iteration_scope
from tests.core._edge_cases import H, N

# ----------------------------------------------------------------------------- in-place checks


class SinModule(nn.Module):
    def forward(self, y):
        return y.sin()


def _inplace_after_save(manager: OffloadManager | None, *, modify_inside_chunk: bool, shape=(N, H)):
    module = SinModule()
    if manager is not None:
        manager.offload_module(module, "sin")
    x = torch.randn(shape, requires_grad=True)
    with iteration_scope(manager):
        with chunk_scope(manager):
            y = x * 2
            out = module(y)
            if modify_inside_chunk:
                y.mul_(3)
        if not modify_inside_chunk:
            y.mul_(3)
        out.sum().backward()


def test_inplace_modification_is_detected_without_offload():
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _inplace_after_save(None, modify_inside_chunk=False)


@pytest.mark.parametrize("inside", [False, True], ids=["after_chunk", "inside_chunk"])
def test_inplace_modification_of_an_offloaded_saved_tensor_raises(make_manager, inside):
    """Inside the chunk the original is still held; after it, only a probe of its version counter and,
    the storage being copied as this view (NOTE [Direct copies]), the shape the message names."""
    manager = make_manager(min_offload_bytes=1)
    with pytest.raises(RuntimeError, match=rf"modified by an inplace operation: saved tensor of shape \[{N}, {H}\] in offload group 'sin'"):
        _inplace_after_save(manager, modify_inside_chunk=inside)


def test_inplace_modification_of_a_kept_saved_tensor_raises(make_manager):
    manager = make_manager(min_offload_bytes=1 << 20)  # the default: the saved (N, H) tensor is kept by the tensor filter
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _inplace_after_save(manager, modify_inside_chunk=False)
    assert manager.stats().groups["sin"].tensors_kept == 1


def test_inplace_modification_with_offload_disabled_raises(make_manager):
    manager = make_manager(min_offload_bytes=1, offload=False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _inplace_after_save(manager, modify_inside_chunk=False)


def test_inplace_on_an_unsaved_module_output_keeps_exact_grads(make_manager):
    def run(manager):
        torch.manual_seed(0)
        lin = nn.Linear(H, H)  # its output is not needed for its own backward
        if manager is not None:
            manager.offload_module(lin, "lin")
        x = torch.randn(N, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with iteration_scope(manager):
            with chunk_scope(manager):
                out = lin(x * 1)
                out.add_(1)
                out = out.tanh()
            out.sum().backward()
        return [out.detach(), x.grad, lin.weight.grad, lin.bias.grad]

    ref = run(None)
    manager = make_manager(min_offload_bytes=1)
    got = run(manager)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert manager.stats().groups["lin"].tensors_offloaded == 1
