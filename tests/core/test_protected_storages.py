"""`ProtectedStorages` through `TensorFilter.refresh`: after every kind of change to a protected
module tree, the tensor filter decides exactly as a fresh one would, drops the storages the tree no
longer has, and leaves no process-wide hook behind (NOTE [Exact refresh])."""

from __future__ import annotations

import gc
import weakref
from typing import Callable

import pytest
import torch
from torch import nn

from chunk_offload import OffloadConfig, OffloadManager
from chunk_offload.core import TensorFilter

class Tree(nn.Module):
    """Containers, a plain submodule, a buffer: every place a change to the protected set can hide."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.blocks = nn.ModuleList([nn.Linear(4, 4)])
        self.lin = nn.Linear(4, 4)
        self.register_buffer("running", torch.randn(4, 4))


def _new_param() -> nn.Parameter:
    return nn.Parameter(torch.randn(4, 4))


def _swap_weight(tree: Tree) -> None:
    torch.utils.swap_tensors(tree.lin.weight, _new_param())


def _empty_buffer(tree: Tree) -> None:
    tree.running.resize_(0)  # the same storage, now behind an empty tensor: no longer collected


# name -> (change, whether it drops storages the tree had)
TREE_CHANGES: dict[str, tuple[Callable[[Tree], None], bool]] = {
    "setattr_parameter": (lambda t: setattr(t.lin, "weight", _new_param()), True),
    "param_data": (lambda t: setattr(t.lin.weight, "data", torch.randn(4, 4)), True),
    "buffer_replaced": (lambda t: setattr(t, "running", torch.randn(4, 4)), True),
    "setattr_submodule": (lambda t: setattr(t, "extra", nn.Linear(4, 4)), False),
    "modulelist_append": (lambda t: t.blocks.append(nn.Linear(4, 4)), False),
    "modulelist_insert": (lambda t: t.blocks.insert(0, nn.Linear(4, 4)), False),
    "del_sequential_item": (lambda t: t.seq.__delitem__(0), True),
    "delattr_submodule": (lambda t: delattr(t, "lin"), True),
    "direct_parameter_write": (lambda t: t.lin._parameters.__setitem__("weight", _new_param()), True),
    "register_buffer_on_a_leaf": (lambda t: t.lin.register_buffer("scale", torch.randn(4, 4)), False),
    "direct_buffer_write": (lambda t: t.seq[1]._buffers.__setitem__("scale", torch.randn(4, 4)), False),
    "direct_module_write": (lambda t: t.seq._modules.__setitem__("0", nn.Linear(4, 4)), True),
    "parameters_dict_rebound": (lambda t: setattr(t.lin, "_parameters", {"weight": _new_param(), "bias": t.lin.bias}), True),
    "to_dtype": (lambda t: t.to(torch.float64), True),
    "swap_tensors": (_swap_weight, True),
    "emptied_in_place": (_empty_buffer, False),
    "storage_resized": (lambda t: t.running.untyped_storage().resize_(0), False),  # same StorageImpl: no change
}


def _aliases(module: nn.Module) -> list[torch.Tensor]:
    """A detached alias of every parameter and buffer: plain tensors that only storage identity keeps."""
    return [t.detach() for t in (*module.parameters(), *module.buffers())]


@pytest.mark.parametrize("change", list(TREE_CHANGES))
def test_refresh_decides_as_a_fresh_policy_after_each_kind_of_change(change):
    apply, drops = TREE_CHANGES[change]
    tree = Tree()
    tensor_filter = TensorFilter(min_offload_bytes=1, device_type="cpu")
    tensor_filter.protect(tree)
    tensor_filter.protect(tree.seq)  # nested roots, as a model chunk and its offloaded submodules are
    tensor_filter.refresh()
    tensor_filter.refresh()  # the check of an unchanged tree, then the change
    old_storages = [weakref.ref(t.untyped_storage()) for t in (*tree.parameters(), *tree.buffers())]
    probes = _aliases(tree)
    apply(tree)
    probes += _aliases(tree)
    stale = [tensor_filter.should_offload(p) for p in probes]

    tensor_filter.refresh()
    fresh = TensorFilter(min_offload_bytes=1, device_type="cpu")
    fresh.protect(tree)
    fresh.protect(tree.seq)
    expected = [fresh.should_offload(p) for p in probes]
    assert [tensor_filter.should_offload(p) for p in probes] == expected
    assert (stale != expected) == (change != "storage_resized"), "the change must matter to the decisions"

    del probes, fresh
    gc.collect()
    alive = sum(ref() is not None for ref in old_storages)
    if drops:
        assert alive < len(old_storages), "a refresh must drop storages the tree no longer has"
    else:
        assert alive == len(old_storages)


@pytest.mark.parametrize("change", [name for name, (_, drops) in TREE_CHANGES.items() if drops])
def test_dropped_storages_are_held_until_the_next_refresh(change):
    tree = Tree()
    tensor_filter = TensorFilter(min_offload_bytes=1, device_type="cpu")
    tensor_filter.protect(tree)
    tensor_filter.refresh()
    old = [weakref.ref(t.untyped_storage()) for t in (*tree.parameters(), *tree.buffers())]
    TREE_CHANGES[change][0](tree)
    gc.collect()
    assert all(ref() is not None for ref in old), "a listed storage was freed before the next refresh"
    tensor_filter.refresh()
    gc.collect()
    now = [t.untyped_storage() for t in (*tree.parameters(), *tree.buffers())]
    survivors = [ref() for ref in old if ref() is not None]
    assert len(survivors) < len(old)
    assert all(any(s is n for n in now) for s in survivors), "a storage the tree no longer has outlived the refresh"


def test_refresh_sees_the_inner_tensors_of_a_wrapper_subclass_replaced():
    """A wrapper subclass (DTensor's kind) keeps its data in inner tensors that can be replaced
    without any trace in the module: re-examined at every refresh."""
    from torch.testing._internal.two_tensor import TwoTensor

    module = nn.Module()
    module.register_buffer("pair", TwoTensor(torch.randn(4, 4), torch.randn(4, 4)))
    tensor_filter = TensorFilter(min_offload_bytes=1, device_type="cpu")
    tensor_filter.protect(module)
    tensor_filter.refresh()
    old_a = module.pair.a.detach()
    assert tensor_filter.should_offload(old_a) is False
    module.pair.a = torch.randn(4, 4)
    new_a = module.pair.a.detach()
    assert tensor_filter.should_offload(new_a) is True  # not known yet
    old_ref = weakref.ref(old_a.untyped_storage())
    tensor_filter.refresh()
    assert tensor_filter.should_offload(new_a) is False
    assert tensor_filter.should_offload(old_a) is True
    assert tensor_filter.should_offload(module.pair.b.detach()) is False
    del old_a
    gc.collect()
    assert old_ref() is None


def test_managers_leave_no_global_module_hooks_behind():
    """The tensor_filter registers nothing process-wide: creating, using and dropping managers leaves
    torch's global module registration hook dicts as they were, and the managers are collected."""
    from torch.nn.modules import module as torch_module

    hook_dicts = (
        torch_module._global_module_registration_hooks,
        torch_module._global_parameter_registration_hooks,
        torch_module._global_buffer_registration_hooks,
    )
    before = [len(d) for d in hook_dicts]
    refs = []
    for _ in range(10):
        manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
        lin = nn.Linear(4, 4)
        manager.offload_module(lin, "lin")
        with manager.iteration():
            with manager.chunk(microbatch=0):
                out = lin(torch.randn(2, 4, requires_grad=True))
            out.sum().backward()
        manager.close()
        refs.append((weakref.ref(manager), weakref.ref(manager.tensor_filter)))
        del manager, lin, out
    gc.collect()
    assert [len(d) for d in hook_dicts] == before
    assert all(m() is None and p() is None for m, p in refs), "a closed, dropped manager or its tensor_filter was kept alive"


def test_protect_between_refreshes_adds_at_once_and_keeps_the_rest():
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    tensor_filter = TensorFilter(min_offload_bytes=1, device_type="cpu")
    tensor_filter.protect(first)
    tensor_filter.refresh()
    assert tensor_filter.should_offload(second.weight.detach()) is True
    tensor_filter.protect(second)
    probes = [t.detach() for t in (*first.parameters(), *second.parameters())]
    assert [tensor_filter.should_offload(p) for p in probes] == [False] * 4
    tensor_filter.refresh()
    assert [tensor_filter.should_offload(p) for p in probes] == [False] * 4
    assert tensor_filter.should_offload(torch.randn(4, 4)) is True
